"""turboquant: the cache and the helpers only it uses."""

from .cache import TurboQuantCache

__all__ = ["TurboQuantCache"]
