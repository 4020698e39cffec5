"""gear: the cache and the helpers only it uses."""

from .cache import GEARCache

__all__ = ["GEARCache"]
