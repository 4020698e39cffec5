"""VeloxQuant: KV-cache compression methods for MLX and mlx-lm, behind one config object.

Import it before anything imports MLX (``mlx``, ``mlx_lm``): on Linux it points MLX's CPU
back-end at an installed OpenBLAS, which only works before MLX is loaded (``_blas.py``).

``REFERENCE_MODEL`` is the folder of the embedded byte-level reference model (the bench's
default), ``REFERENCE_SUBWORD_MODEL`` the one with subword tokens (the leaderboard's and
the README's); each loads offline with ``mlx_lm.load(str(folder))``.

>>> from veloxquant_mlx import KVCacheConfig
>>> from veloxquant_mlx.cache.options import StreamingLLMOptions
>>> KVCacheConfig(method="streaming_llm", options=StreamingLLMOptions()).stream_window_size
512
"""

from ._blas import use_optimized_blas

use_optimized_blas()  # before anything imports mlx (see _blas.py)

from .cache import KVCacheConfig, VeloxQuantDeprecationWarning  # noqa: E402
from .diagnostics import (  # noqa: E402
    SlowBLASWarning,
    UnimplementedMethodWarning,
    VeloxQuantWarning,
)
from .integrations.cache_classes import register_cache_classes  # noqa: E402

register_cache_classes()  # saved prompt caches load after `import veloxquant_mlx` alone

from .reference import REFERENCE_MODEL, REFERENCE_SUBWORD_MODEL  # noqa: E402

# The mlx-lm integration imports mlx-lm (slow); load it on first use.
_LAZY = {
    "make_prompt_cache": "veloxquant_mlx.integrations.mlx_lm",
    "patch_model_kv_cache": "veloxquant_mlx.integrations.mlx_lm",
    "unpatch_model_kv_cache": "veloxquant_mlx.integrations.mlx_lm",
    "patched_kv_cache": "veloxquant_mlx.integrations.mlx_lm",
    "load_prompt_cache": "veloxquant_mlx.integrations.saved",
    "save_prompt_cache": "veloxquant_mlx.integrations.saved",
}

__all__ = [
    "KVCacheConfig",
    "REFERENCE_MODEL",
    "REFERENCE_SUBWORD_MODEL",
    "SlowBLASWarning",
    "UnimplementedMethodWarning",
    "VeloxQuantDeprecationWarning",
    "VeloxQuantWarning",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'veloxquant_mlx' has no attribute {name!r}")
