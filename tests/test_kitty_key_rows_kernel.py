"""kitty's key-rows kernel (``methods/kitty/kernel.py``): its CUDA source run on the CPU by
emulation against the compiled MLX pass it replaces (``PromotedKeys.room_rows``, cut to the
count), and its dispatch. The emulation does not fuse ``code * scale + min``, so its keys
equal the pass's bit for bit."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401  (before mlx binds its CPU BLAS)
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.kitty import kernel as kk


def emulate(args: dict, workdir) -> np.ndarray:
    from test_kernel_kivi_decode import emulate_kernel_args

    return emulate_kernel_args(kk.CUDA_SOURCE, kk._INPUTS, args, ["keys"], workdir, header=kk.PACKED_INDEX_CUDA)["keys"]


@pytest.mark.parametrize("lo,hi,fraction,tokens,dtype", [
    (2, 4, 0.25, 96, mx.float16),   # the defaults' planes: three blocks, a quarter of the channels promoted
    (1, 8, 0.5, 64, mx.float32),    # 1-bit lo plane, 7-bit up plane: fields that cross words
    (3, 8, 0.25, 64, mx.float16),   # a lo width that does not divide 32
    (4, 8, 0.0, 64, mx.float16),    # nothing promoted: the lo plane alone
])
def test_the_cuda_source_gives_the_mlx_passs_keys(tmp_path, lo, hi, fraction, tokens, dtype):
    from test_kernel_kivi_decode import skip_without_emulation

    skip_without_emulation()
    with mx.stream(mx.cpu):  # the MLX reference as the CPU computes it (a GPU's fused ops may contract)
        keys, ref = kk.check_case(dtype, lo, hi, fraction, tokens)
        assert (keys.up.buffer is not None) == (fraction > 0)
        got = emulate(kk.launch_args(*keys.kernel_inputs(), codec=keys.codec, count=keys.count, dtype=dtype),
                      str(tmp_path))
        assert got.dtype == np.array(ref).dtype and (got == np.array(ref)).all(), \
            np.abs(got.astype(np.float64) - np.array(ref, np.float64)).max()


def test_a_test_that_takes_a_gpus_paths_on_the_cpu_gets_the_mlx_pass(monkeypatch):
    if kd._gpu_kind() is not None:
        pytest.skip("a GPU back-end is here: its kernel runs, there is no stand-in to test")
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(kk, "_CHECKED", {})
    assert kk.kernel_backend(mx.float16) is None and kk._CHECKED == {}


def test_on_a_gpu_the_kernel_gives_the_mlx_passs_keys():
    if kd.gpu_backend() is None:
        pytest.skip("SKIPPED LOUDLY: no GPU: kitty's key-rows kernel is NOT run here (its CUDA "
                    "source is emulated above)")
    from veloxquant_mlx.kernels.checks import within_a_rounding

    backend = kk.kernel_backend(mx.float16)
    assert backend is not None
    keys, ref = kk.check_case(mx.float16, tokens=2048)
    got = kk.key_rows(backend, *keys.kernel_inputs(), codec=keys.codec, count=keys.count, dtype=mx.float16)
    assert within_a_rounding(got, ref)
