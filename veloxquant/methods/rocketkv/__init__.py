"""rocketkv: the cache and the helpers only it uses."""

from .cache import RocketKVCache

__all__ = ["RocketKVCache"]
