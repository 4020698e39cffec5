"""Make MLX's CPU back-end use an optimized BLAS on Linux when one is installed.

MLX's Linux CPU wheels (``mlx[cpu]``) link the reference (netlib) BLAS. Measured on a
2-core x86 machine: a (2048x256)·(256x1024) float32 matmul takes ~0.6 s there against
~0.02 s with OpenBLAS, and a 2048-token causal SDPA ~10.7 s against ~0.9 s. Loading an
installed OpenBLAS into the global symbol scope *before* MLX is first imported makes
MLX's BLAS calls bind to it (the results match to float rounding).

Import order matters and cannot be repaired afterwards: once ``mlx.core`` is loaded its
BLAS symbols resolve to the reference library already in the process (measured: loading
OpenBLAS after ``import mlx.core`` leaves that matmul at 0.18 s against 0.007 s when
loaded first). So import ``veloxquant_mlx`` before ``mlx`` / ``mlx_lm``, or start Python
with ``LD_PRELOAD=<path to libopenblas.so.0>``. When the fast BLAS cannot be used, a
``SlowBLASWarning`` says why, once.

Set ``VELOXQUANT_SYSTEM_BLAS=0`` to keep MLX's own (and silence the warning). On macOS
MLX uses Accelerate and nothing is done. Debian/Ubuntu: ``apt-get install
libopenblas0-pthread``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import warnings

from .diagnostics import SlowBLASWarning

loaded: str | None = None
_warned = False
INSTALL_HINT = "Debian/Ubuntu: apt-get install libopenblas0-pthread"
SILENCE_HINT = "VELOXQUANT_SYSTEM_BLAS=0 keeps MLX's own BLAS and silences this warning"


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        # Past this helper, use_optimized_blas and the package's __init__: the importing
        # line (warnings skips the import machinery's own frames).
        warnings.warn(f"{message}; {SILENCE_HINT}", SlowBLASWarning, stacklevel=4)


def _openblas_mapped() -> bool:
    """Whether a system OpenBLAS is already in the process (e.g. by LD_PRELOAD)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any("/libopenblas" in line for line in maps)
    except OSError:
        return False


def use_optimized_blas() -> str | None:
    """Load OpenBLAS globally if possible; return its name, or None when not done."""
    global loaded
    if loaded or sys.platform != "linux" or os.environ.get("VELOXQUANT_SYSTEM_BLAS") == "0":
        return loaded
    name = ctypes.util.find_library("openblas")
    if name is None:
        _warn_once(
            "no OpenBLAS is installed, so MLX's CPU back-end uses the reference BLAS "
            f"(matrix products ~30x slower); install one ({INSTALL_HINT})"
        )
        return None
    if "mlx.core" in sys.modules:  # too late: MLX's symbols are already bound
        if not _openblas_mapped():
            _warn_once(
                "mlx was imported before veloxquant_mlx, so MLX's CPU back-end keeps the "
                "reference BLAS (matrix products ~30x slower) although OpenBLAS is "
                f"installed ({name}); import veloxquant_mlx before mlx and mlx_lm, or "
                "start Python with LD_PRELOAD=<path to libopenblas.so.0>"
            )
        return None
    try:
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        _warn_once(f"OpenBLAS ({name}) is installed but could not be loaded: {exc}")
        return None
    loaded = name
    return loaded


def set_threads(count: int) -> int | None:
    """Set OpenBLAS's thread count for later calls; return the count it had, or None where
    no OpenBLAS in this process can be told (MLX's own BLAS, Accelerate)."""
    try:
        lib = ctypes.CDLL(loaded) if loaded else ctypes.CDLL(None)
        get, put = lib.openblas_get_num_threads, lib.openblas_set_num_threads
    except (OSError, AttributeError):
        return None
    before = int(get())
    put(int(count))
    return before
