"""age_tiered: the cache and the helpers only it uses."""

from .cache import AgeTieredKVCache

__all__ = ["AgeTieredKVCache"]
