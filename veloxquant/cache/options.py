"""Per-method option dataclasses for KVCacheConfig (public home; generated from the spec)."""

from .._generated.options import *  # noqa: F401,F403 - the public re-export
from .._generated.options import __all__  # noqa: F401
