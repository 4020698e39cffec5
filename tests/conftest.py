import os
from pathlib import Path

import veloxquant_mlx  # noqa: F401  first: it may load an optimized BLAS before mlx
import pytest

# Tests run on the CPU: CI has no GPU, and MLX's CPU back-end is the reference.
os.environ.setdefault("MLX_DEFAULT_DEVICE", "cpu")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def repo_root() -> Path:
    return ROOT
