"""xquant: the cache and the helpers only it uses."""

from .cache import XQuantCache

__all__ = ["XQuantCache"]
