"""Make MLX's CPU back-end use an optimized BLAS on Linux when one is installed.

MLX's Linux CPU wheels (``mlx[cpu]``) link the reference (netlib) BLAS. Measured on a
2-core x86 machine: a (2048x256)·(256x1024) float32 matmul takes ~0.6 s there against
~0.02 s with OpenBLAS, and a 2048-token causal SDPA ~10.7 s against ~0.9 s. Loading an
installed OpenBLAS into the global symbol scope *before* MLX is first imported makes
MLX's BLAS calls bind to it (the results match to float rounding).

Set ``VELOXQUANT_SYSTEM_BLAS=0`` to keep MLX's own. On macOS MLX uses Accelerate and
nothing is done. Debian/Ubuntu: ``apt-get install libopenblas0-pthread``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

loaded: str | None = None


def use_optimized_blas() -> str | None:
    """Load OpenBLAS globally if possible; return its name, or None when not done."""
    global loaded
    if loaded or sys.platform != "linux" or os.environ.get("VELOXQUANT_SYSTEM_BLAS") == "0":
        return loaded
    if "mlx.core" in sys.modules:  # too late: MLX's symbols are already bound
        return None
    name = ctypes.util.find_library("openblas")
    if name is None:
        return None
    try:
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    loaded = name
    return loaded
