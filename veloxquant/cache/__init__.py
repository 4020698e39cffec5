"""Cache configuration (``KVCacheConfig``) and the per-method options classes."""

from . import options
from .config import KVCacheConfig, VeloxQuantDeprecationWarning

__all__ = ["KVCacheConfig", "VeloxQuantDeprecationWarning", "options"]
