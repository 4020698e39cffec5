"""kitty: the cache and the helpers only it uses."""

from .cache import KittyCache

__all__ = ["KittyCache"]
