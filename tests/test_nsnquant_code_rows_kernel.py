"""nsnquant's code-rows kernel (``methods/nsnquant/kernel.py``): its CUDA source run on the CPU
by emulation against ``nsn._code_rows`` (the MLX pass it replaces), and its dispatch.

The emulation compiles without contracting ``s2 y + o`` into a fused multiply-add, so its
rows equal the MLX pass's bit for bit; CUDA may contract, which the kernel's own check allows
(one float32 rounding before the cast, ``within_a_rounding``)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401  (before mlx binds its CPU BLAS)
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.kernels.checks import within_a_rounding
from veloxquant_mlx.methods.nsnquant import kernel as nk


def emulate(args, workdir) -> np.ndarray:
    from test_kernel_kivi_decode import emulate_kernel_args

    return emulate_kernel_args(nk.CUDA_SOURCE, nk._INPUTS, args, ["out"], workdir, header=nk.PACKED_INDEX_CUDA)["out"]


@pytest.mark.parametrize("bits,head_dim,sub_dim,index_bits,count,dtype", [
    (2, 64, 4, 8, 40, mx.float16),    # the defaults' layout: byte indices, two sign words, a chunk and a half past
    (2, 72, 4, 12, 33, mx.float32),   # indices crossing words; a head_dim that is not whole sign words
    (1, 64, 8, 10, 16, mx.float16),   # 1 bit: signed centroids, no sign words
])
def test_the_cuda_source_gives_the_mlx_passs_rows(tmp_path, bits, head_dim, sub_dim, index_bits, count, dtype):
    from test_kernel_kivi_decode import skip_without_emulation

    skip_without_emulation()
    with mx.stream(mx.cpu):  # the MLX reference as the CPU computes it (a GPU's fused ops may contract)
        chunk, room = 16, 48
        idx, sign, norms, means, codebook = nk.random_store(2, 2, room, head_dim, sub_dim, index_bits, chunk, seed=bits)
        sign = sign if bits == 2 else None
        if bits == 1:
            codebook = codebook * mx.where(mx.arange(codebook.shape[0])[:, None] % 2 == 0, 1.0, -1.0)
        got = emulate(nk.launch_args(idx, sign, norms, means, codebook, head_dim, chunk, count, dtype), str(tmp_path))
        ref = np.array(nk.reference(idx, sign, norms, means, codebook, bits, head_dim, chunk, count, dtype))
        assert got.dtype == ref.dtype and (got == ref).all(), np.abs(got.astype(np.float64) - ref).max()


def test_the_check_allows_one_rounding_and_no_more():
    ref = mx.array([1.0, -3.0, 1000.0], mx.float16)
    one_ulp = mx.array([1.0 + 2.0 ** -10, -3.0, 1000.0], mx.float16)
    two_ulp = mx.array([1.0 + 2.0 ** -9, -3.0, 1000.0], mx.float16)
    assert within_a_rounding(ref, ref) and within_a_rounding(one_ulp, ref)
    assert not within_a_rounding(two_ulp, ref)


def test_a_test_that_takes_a_gpus_paths_on_the_cpu_gets_the_mlx_pass(monkeypatch):
    if kd._gpu_kind() is not None:
        pytest.skip("a GPU back-end is here: its kernel runs, there is no stand-in to test")
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(nk, "_CHECKED", {})
    idx, sign, norms, means, codebook = nk.random_store(1, 1, 16, 32, 4, 8, 16, seed=0)
    assert nk.code_rows(idx, sign, norms, means, codebook, 32, 16, 16, mx.float16) is None
    assert nk._CHECKED == {}


def test_on_a_gpu_the_kernel_gives_the_mlx_passs_rows():
    if kd.gpu_backend() is None:
        pytest.skip("SKIPPED LOUDLY: no GPU: nsnquant's code-rows kernel is NOT run here (its CUDA "
                    "source is emulated above)")
    idx, sign, norms, means, codebook = nk.random_store(1, 8, 4096, 128, 4, 8, 64, seed=3)
    got = nk.code_rows(idx, sign, norms, means, codebook, 128, 64, 4000, mx.float16)
    assert got is not None
    ref = nk.reference(idx, sign, norms, means, codebook, 2, 128, 64, 4000, mx.float16)
    assert within_a_rounding(got, ref)
