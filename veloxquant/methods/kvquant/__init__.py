"""kvquant: the cache and the helpers only it uses."""

from .cache import KVQuantCache

__all__ = ["KVQuantCache"]
