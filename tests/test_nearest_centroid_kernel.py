"""The nearest-centroid kernel (``kernels/nearest_centroid.py``): its CUDA source run on the CPU
by emulation, its self-check, and ``vq.nearest`` through it on a GPU.

A chosen centroid must be a nearest one up to float32 rounding of the distances
(``distance_slack``: the expanded ``c.c - 2 x.c`` against the float64 distances), and ties go
to the lowest index, as ``mx.argmin``'s do."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401  (before mlx binds its CPU BLAS)
from veloxquant_mlx.kernels import nearest_centroid as nc
from veloxquant_mlx.quant import vq


def emulate(rows: mx.array, centroids: mx.array, workdir) -> np.ndarray:
    """One launch of the CUDA source as C++ threads on the CPU: the indices it writes."""
    from test_kernel_kivi_decode import emulate_kernel_args

    args = nc.launch_args(rows, centroids)
    out = emulate_kernel_args(nc.CUDA_SOURCE, ["rows", "centroids", "params"], args, ["out"], workdir)["out"]
    return out.reshape(rows.shape[:-1])


def float64_excess(rows, centroids, idx) -> np.ndarray:
    """Per row, the chosen centroid's squared distance above the least, in float64."""
    x = np.array(rows, np.float64)[..., None, :]
    c = np.array(centroids, np.float64)
    c = c if c.ndim == 2 else c[:, None]
    d = ((x - c) ** 2).sum(axis=-1)
    return np.take_along_axis(d, np.array(idx, np.int64)[..., None], axis=-1)[..., 0] - d.min(axis=-1)


@pytest.mark.parametrize("m,k,s,books", [
    (300, 600, 4, 2),    # two rows of a batch, a codebook each; a tile and a part; rows past a block
    (257, 1030, 8, 1),   # one codebook (K, s) for every row: a block of one live row
    (70, 9, 2, 0),       # a codebook (1, K, s) that serves both rows of the batch (stride 0)
])
def test_the_cuda_source_finds_a_nearest_centroid_of_every_row(tmp_path, m, k, s, books):
    from test_kernel_kivi_decode import skip_without_emulation

    skip_without_emulation()
    key = mx.random.split(mx.random.key(m), 2)
    b = max(books, 1) if books else 2
    rows = mx.random.normal((b, m, s), key=key[0]) if books != 1 else mx.random.normal((m, s), key=key[0])
    shape = (k, s) if books == 1 else ((books, k, s) if books else (1, k, s))
    centroids = mx.random.normal(shape, key=key[1])
    idx = emulate(rows, centroids, str(tmp_path))
    assert idx.max() < k, "a row left unwritten or pointing past the codebook"
    excess = float64_excess(rows, centroids, idx)
    slack = np.array(nc.distance_slack(rows, centroids))
    assert (excess <= slack).all(), excess.max()
    # away from rounding ties the choice is the float64 argmin itself
    reference = np.array(vq.nearest(rows, centroids))
    assert (idx == reference).mean() > 0.999


def test_ties_go_to_the_lowest_index(tmp_path):
    """Every centroid repeated: a tile apart and next to each other; each row must take the
    first copy, as ``mx.argmin`` does. A ``<=`` in place of the kernel's ``<`` takes the last."""
    from test_kernel_kivi_decode import skip_without_emulation

    skip_without_emulation()
    base = mx.random.normal((300, 4), key=mx.random.key(1))
    centroids = mx.concatenate([base, base[::-1], base], axis=0)  # 900: past a tile of 512
    rows = base[mx.arange(0, 300, 7)] + 0.0
    idx = emulate(rows, centroids, str(tmp_path))
    assert (idx == np.arange(0, 300, 7)).all()


def test_the_self_check_refuses_a_kernel_that_picks_wrong_centroids(monkeypatch):
    """A launch that answers centroid 0 for every row fails the check (the slack does not
    hide it); the right indices, from every distance formed, pass it."""
    monkeypatch.setattr(nc, "_launch", lambda backend, rows, books: mx.zeros(rows.shape[:-1], mx.uint32))
    assert "further than rounding" in nc._check_problem("cuda", 4)
    monkeypatch.setattr(nc, "_launch", lambda backend, rows, books: mx.argmin(
        ((rows[..., None, :] - books[:, None]) ** 2).sum(axis=-1), axis=-1).astype(mx.uint32))
    assert nc._check_problem("cuda", 4) is None


def test_a_kernel_that_fails_its_check_leaves_nearest_on_the_products(monkeypatch):
    from veloxquant_mlx.kernels import kivi_decode as kd

    monkeypatch.setattr(nc, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(kd, "_gpu_kind", lambda: "cuda")  # the process's back-end, which the check asks
    monkeypatch.setattr(nc, "_CHECKED", {})
    monkeypatch.setattr(nc, "_check_problem", lambda backend, s: "broken")
    rows = mx.random.normal((10, 4), key=mx.random.key(2))
    with pytest.warns(RuntimeWarning, match="failed its self-check: broken"):
        assert nc.nearest_rows(rows, rows) is None
    assert nc.nearest_rows(rows, rows) is None  # warned once, remembered


def test_nearest_returns_the_kernels_indices_in_the_rows_shape(monkeypatch):
    """Where the kernel answers, ``nearest`` returns its indices in x's leading shape."""
    monkeypatch.setattr(vq, "nearest_rows", lambda flat, c: mx.arange(flat.shape[-2], dtype=mx.uint32)
                        if flat.ndim == 2 else None)
    x = mx.zeros((2, 3, 5, 4))
    assert mx.array_equal(vq.nearest(x, mx.zeros((16, 4))), mx.arange(30, dtype=mx.uint32).reshape(2, 3, 5))


def test_nearest_on_a_gpu_takes_the_kernel_and_agrees_with_the_products():
    if nc.gpu_backend() is None:
        pytest.skip("SKIPPED LOUDLY: no GPU: the nearest-centroid kernel is NOT run here "
                    "(its CUDA source is emulated above)")
    key = mx.random.split(mx.random.key(3), 2)
    x = mx.random.normal((2, 8, 700, 32, 4), key=key[0])  # vecinfer's keys: (B, H, T, D / s, s)
    books = mx.random.normal((2, 4096, 4), key=key[1])
    got = vq.nearest(x, books)
    assert nc._CHECKED.get((nc.gpu_backend(), 4), "unchecked") is None
    flat = x.reshape(2, -1, 4)
    with mx.stream(mx.cpu):
        excess = nc.excess_distance(flat, books, got.reshape(2, -1))
        assert (excess <= nc.distance_slack(flat, books)).all().item()
