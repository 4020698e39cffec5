"""cachegen: the cache and the helpers only it uses."""

from .cache import CacheGenCache

__all__ = ["CacheGenCache"]
