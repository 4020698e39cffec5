import os
from pathlib import Path

# The tests bound float32 rounding; MLX's CUDA back-end multiplies float32 in TF32 unless told
# not to (a2ats', kvtc's and nestedkv's decode-read tests failed so, passed without:
# benchmarks/results/h200_s66). Set before MLX loads; the package itself leaves it to the user.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import veloxquant_mlx  # noqa: E402,F401  first: it may load an optimized BLAS before mlx
import pytest  # noqa: E402

# Tests run on the CPU: CI has no GPU, and MLX's CPU back-end is the reference.
os.environ.setdefault("MLX_DEFAULT_DEVICE", "cpu")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def repo_root() -> Path:
    return ROOT


@pytest.fixture
def unimplemented(monkeypatch) -> str:
    """A listed method made to look unimplemented: every method of the spec has an
    implementation now, and the path for one that has none must keep working."""
    import dataclasses

    from veloxquant_mlx.registry import METHODS

    key = "minicache"
    monkeypatch.setitem(METHODS, key, dataclasses.replace(METHODS[key], implementation=None))
    return key
