"""kvtc: the cache and the helpers only it uses."""

from .cache import KVTCCache

__all__ = ["KVTCCache"]
