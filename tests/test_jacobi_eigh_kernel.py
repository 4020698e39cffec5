"""The Jacobi eigensolver (``kernels/jacobi_eigh.py``): its CUDA source run on the CPU by
emulation against float64 LAPACK, and its dispatch.

Bounds, from float32 backward stability (a Jacobi rotation is orthogonal to within a few
eps, and the sweeps apply O(n) of them to each entry): eigenvalues within 8 n eps ||A||_2
of float64's, residuals ||A v - w v|| within 8 n eps ||A||_2, and V^T V within 8 n eps of I.
A wrong rotation (a sign, a pair missed by the ordering) leaves errors of order ||A||."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401  (before mlx binds its CPU BLAS)
from veloxquant_mlx.kernels import jacobi_eigh as je

EPS = 2.0 ** -24


def emulate(a: mx.array, workdir) -> tuple[np.ndarray, np.ndarray]:
    """One launch of the CUDA source as C++ threads on the CPU: (work, vecs) as it leaves them."""
    from test_kernel_kivi_decode import emulate_kernel_args

    out = emulate_kernel_args(je.CUDA_SOURCE, ["a"], je.launch_args(a), ["work", "vecs"], workdir)
    return out["work"], out["vecs"]


def symmetric(b: int, n: int, seed: int, spectrum=None) -> mx.array:
    """Random symmetric matrices (B, n, n) in float32: a Gram of Gaussian rows, or Q diag Q^T
    with a given ``spectrum``."""
    rng = np.random.default_rng(seed)
    if spectrum is None:
        x = rng.standard_normal((b, 3 * n, n))
        return mx.array((x.swapaxes(-1, -2) @ x).astype(np.float32))
    q = np.linalg.qr(rng.standard_normal((b, n, n)))[0]
    return mx.array((q * np.asarray(spectrum)[None, None, :] @ q.swapaxes(-1, -2)).astype(np.float32))


def check(a: mx.array, w: np.ndarray, v: np.ndarray) -> None:
    a64 = np.array(a, np.float64)
    n = a64.shape[-1]
    w64 = np.linalg.eigvalsh(a64)
    scale = np.abs(w64).max(axis=-1, keepdims=True)
    bound = 8 * n * EPS * scale
    assert (np.abs(w - w64) <= bound).all(), np.abs(w - w64).max()
    residual = np.linalg.norm(a64 @ v - v * w[:, None, :], axis=-2)  # per eigenpair
    assert (residual <= bound).all(), residual.max()
    ortho = np.abs(v.swapaxes(-1, -2).astype(np.float64) @ v - np.eye(n)).max()
    assert ortho <= 8 * n * EPS, ortho


@pytest.mark.parametrize("b,n,spectrum", [
    (2, 16, None),                                  # two Grams, one block each
    (1, 64, None),                                  # 2,016 pairs in 63 rounds a sweep
    (1, 32, [0.0] * 20 + list(range(1, 13))),       # a rank-12 Gram: 20 zero eigenvalues
    (1, 8, [1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 5.0, 5.0]),  # repeated eigenvalues
])
def test_the_cuda_source_diagonalises_symmetric_matrices(tmp_path, b, n, spectrum):
    from test_kernel_kivi_decode import skip_without_emulation

    skip_without_emulation()
    a = symmetric(b, n, seed=n, spectrum=spectrum)
    work, vecs = emulate(a, str(tmp_path))
    w, v = je.ordered(mx.array(work), mx.array(vecs))
    check(a, np.array(w), np.array(v))


def test_a_diagonal_matrix_is_left_as_it_is(tmp_path):
    """Nothing to rotate: the first sweep rotates nothing and stops; V is I exactly."""
    from test_kernel_kivi_decode import skip_without_emulation

    skip_without_emulation()
    a = mx.array(np.diag(np.arange(8, 0, -1)).astype(np.float32))[None]
    work, vecs = emulate(a, str(tmp_path))
    assert (work == np.array(a)).all() and (vecs == np.eye(8, dtype=np.float32)).all()


def test_on_the_cpu_and_off_the_gpu_sizes_it_is_lapacks_eigh():
    """Where the kernel does not apply (no GPU, or an n past ``GPU_MAX_N``: every n until the
    device's timings are in), ``symmetric_eigh`` is the CPU stream's ``eigh`` bit for bit."""
    a = symmetric(3, 12, seed=1)
    w, v = je.symmetric_eigh(a)
    w_ref, v_ref = mx.linalg.eigh(a, stream=mx.cpu)
    assert mx.array_equal(w, w_ref).item() and mx.array_equal(v, v_ref).item()


def test_the_kernel_applies_only_to_even_sizes_up_to_the_limit(monkeypatch):
    monkeypatch.setattr(je, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(je, "GPU_MAX_N", 256)
    assert [je.kernel_applies(n) for n in (2, 7, 128, 256, 258)] == [None, None, "cuda", "cuda", None]
    monkeypatch.setattr(je, "gpu_backend", lambda: None)
    assert je.kernel_applies(128) is None


def test_on_a_gpu_the_kernel_agrees_with_lapack(monkeypatch):
    if je.gpu_backend() is None:
        pytest.skip("SKIPPED LOUDLY: no GPU: the Jacobi kernel is NOT run here (its CUDA source "
                    "is emulated above)")
    monkeypatch.setattr(je, "GPU_MAX_N", 256)
    for n, b in ((128, 16), (256, 8)):
        a = symmetric(b, n, seed=n)
        w, v = je.symmetric_eigh(a)
        check(a, np.array(w), np.array(v))
