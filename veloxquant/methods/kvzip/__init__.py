"""kvzip: the cache and the helpers only it uses."""

from .cache import KVzipCache

__all__ = ["KVzipCache"]
