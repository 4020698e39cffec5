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

# MLX's CPU back-end compiles each new fused kernel of ``mx.compile`` with g++ at its first use,
# and every such source includes MLX's preamble, whose parsing is most of the 0.6 s a kernel
# takes. The suite meets about 1,900 of them: on a fresh 2-core machine (an empty kernel cache,
# as CI's) that was 13.5 minutes against 9 with the cache warm. A precompiled preamble beside
# the header, which g++ takes in place of it where the flags match, makes a kernel 0.13-0.17 s.
# Built for MLX's two command lines (with and without AVX2) in a ``.gch`` folder, once a run
# in the controlling process, and removed at its end (it is only valid for this MLX).
_PCH_VARIANTS = {"plain": [], "avx2": ["-mavx2", "-mfma", "-mf16c"]}
_made_pch: list = []


def _build_jit_preamble() -> None:
    import shutil
    import subprocess
    import tempfile

    import mlx.core as mx

    include = Path(mx.__file__).parent / "include"
    header = include / "mlx" / "backend" / "cpu" / "compiled_preamble.h"
    target = header.with_name(header.name + ".gch")
    if not header.exists() or target.exists() or shutil.which("g++") is None:
        return
    try:
        staging = Path(tempfile.mkdtemp(prefix=".gch-", dir=header.parent))
    except OSError:  # a read-only install: the kernels compile as they did
        return
    base = ["g++", "-std=c++17", "-O3", "-Wall", "-fPIC", "-I", str(include), "-x", "c++-header", str(header)]
    jobs = [subprocess.Popen([*base, *flags, "-o", str(staging / name)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for name, flags in _PCH_VARIANTS.items()]
    if all(job.wait() == 0 for job in jobs):
        try:
            staging.rename(target)
            _made_pch.append(target)
            return
        except OSError:  # another run made it meanwhile
            pass
    shutil.rmtree(staging, ignore_errors=True)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller: before any worker compiles
        _build_jit_preamble()


def pytest_unconfigure(config):
    import shutil

    for path in _made_pch:
        shutil.rmtree(path, ignore_errors=True)


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
