"""nsnquant: the cache and the helpers only it uses."""

from .cache import NSNQuantCache

__all__ = ["NSNQuantCache"]
