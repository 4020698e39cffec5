"""The codebook-rows kernel (``kernels/codebook_rows.py``): its CUDA source run on the CPU by
emulation, bit for bit against the gathers (``reference``, what ``vq_store._gathered`` does
without it), and its dispatch."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401  (before mlx binds its CPU BLAS)
from veloxquant_mlx.kernels import codebook_rows as cr
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.quant.vq import pack_indices


def emulate(words, books, n, bits, book_rows, count, workdir) -> np.ndarray:
    from test_kernel_kivi_decode import emulate_kernel_args

    args = cr.launch_args(words, books, n, bits, book_rows, count)
    return emulate_kernel_args(cr.CUDA_SOURCE, ["words", "books", "params"], args, ["out"], workdir,
                               header=cr.PACKED_INDEX_CUDA)["out"]


def coded(b, h, room, n, bits, book_rows, seed, dtype):
    """A code buffer of ``room`` tokens' packed indices and codebooks laid end to end."""
    key = mx.random.split(mx.random.key(seed), 2)
    idx = mx.random.randint(0, 1 << bits, (b, h, room, n), key=key[0]).astype(mx.uint32)
    books = mx.random.normal((book_rows * (1 << bits), 4), key=key[1]).astype(dtype)
    return pack_indices(idx, bits), books


@pytest.mark.parametrize("b,h,room,count,n,bits,book_rows,dtype", [
    (2, 3, 40, 37, 32, 12, 2, mx.float16),  # vecinfer's keys: 12-bit indices crossing words, a codebook a row
    (1, 2, 70, 70, 16, 8, 1, mx.float32),   # one codebook, a full buffer, indices within words
    (2, 1, 9, 5, 7, 5, 1, mx.float16),      # 5 bits: every other index crosses; tokens past the count
])
def test_the_cuda_source_gives_the_gathers_rows(tmp_path, b, h, room, count, n, bits, book_rows, dtype):
    from test_kernel_kivi_decode import skip_without_emulation

    skip_without_emulation()
    with mx.stream(mx.cpu):  # the MLX reference as the CPU computes it (a GPU's fused ops may contract)
        words, books = coded(b, h, room, n, bits, book_rows, seed=bits, dtype=dtype)
        got = emulate(words, books, n, bits, book_rows, count, str(tmp_path))
        ref = np.array(cr.reference(words, books, n, bits, book_rows, count))
        assert got.dtype == ref.dtype and (got == ref).all()


def test_a_test_that_takes_a_gpus_paths_on_the_cpu_gets_the_gathers(monkeypatch):
    """``kd.gpu_backend`` patched to CUDA on the CPU (the CUDA reads' tests): nothing to launch,
    so the rows come from the gathers, with no warning and no check recorded."""
    if kd._gpu_kind() is not None:
        pytest.skip("a GPU back-end is here: its kernel runs, there is no stand-in to test")
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(cr, "_CHECKED", {})
    words, books = coded(1, 2, 8, 4, 6, 1, seed=1, dtype=mx.float32)
    assert cr.codebook_rows(words, books, 4, 6, 1, 8) is None
    assert cr._CHECKED == {}


def test_the_self_check_refuses_a_kernel_that_reads_wrong_rows(monkeypatch):
    class Wrong:
        def __call__(self, **kw):
            return [mx.zeros(kw["output_shapes"][0], kw["output_dtypes"][0])]

    monkeypatch.setattr(cr, "_kernel", lambda backend: Wrong())
    assert cr._check_problem("cuda", mx.float16) == "rows differ from the gathers'"


def test_on_a_gpu_the_kernel_gives_the_gathers_rows():
    if kd.gpu_backend() is None:
        pytest.skip("SKIPPED LOUDLY: no GPU: the codebook-rows kernel is NOT run here (its CUDA "
                    "source is emulated above)")
    words, books = coded(2, 8, 300, 32, 12, 2, seed=3, dtype=mx.float16)
    got = cr.codebook_rows(words, books, 32, 12, 2, 257)
    assert got is not None
    assert mx.array_equal(got, cr.reference(words, books, 32, 12, 2, 257)).item()
