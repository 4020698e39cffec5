"""spectral: the cache and the helpers only it uses."""

from .cache import SpectralQuantCache

__all__ = ["SpectralQuantCache"]
