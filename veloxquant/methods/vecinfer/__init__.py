"""vecinfer: the cache and the helpers only it uses."""

from .cache import VecInferCache

__all__ = ["VecInferCache"]
