"""adakv: the cache and the helpers only it uses."""

from .cache import AdaKVCache

__all__ = ["AdaKVCache"]
