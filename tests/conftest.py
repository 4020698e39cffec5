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


@pytest.fixture
def unimplemented(monkeypatch) -> str:
    """A listed method made to look unimplemented: every method of the spec has an
    implementation now, and the path for one that has none must keep working."""
    import dataclasses

    from veloxquant_mlx.registry import METHODS

    key = "minicache"
    monkeypatch.setitem(METHODS, key, dataclasses.replace(METHODS[key], implementation=None))
    return key
