"""anchorkv: the cache and the helpers only it uses."""

from .cache import AnchorKVCache

__all__ = ["AnchorKVCache"]
