"""a2ats: the cache and the helpers only it uses."""

from .cache import A2ATSCache

__all__ = ["A2ATSCache"]
