"""amc: the cache and the helpers only it uses."""

from .cache import AMCCache

__all__ = ["AMCCache"]
