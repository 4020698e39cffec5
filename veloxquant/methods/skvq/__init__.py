"""skvq: the cache and the helpers only it uses."""

from .cache import SKVQCache

__all__ = ["SKVQCache"]
