"""minicache: the cache and the helpers only it uses."""

from .cache import MiniCacheCache

__all__ = ["MiniCacheCache"]
