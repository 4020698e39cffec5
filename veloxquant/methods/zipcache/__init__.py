"""zipcache: the cache and the helpers only it uses."""

from .cache import ZipCacheKVCache

__all__ = ["ZipCacheKVCache"]
