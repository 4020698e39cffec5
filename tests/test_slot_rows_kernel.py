"""Packed slots' rows kernel (``evict/slot_rows_kernel.py``): its CUDA source run on the CPU
by emulation against the compiled MLX pass it replaces (``quantized_slots._rows_pass``, cut
to the count, in float32 then rounded once to the dtype, as the kernel computes): every
slot's key and value rows, a ring token's from the ring by position, the others
dequantized; and its dispatch."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401  (before mlx binds its CPU BLAS)
from veloxquant_mlx.evict import slot_rows_kernel as sk
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.kernels.checks import within_a_rounding


def emulate(args: dict, workdir) -> dict:
    from test_kernel_kivi_decode import emulate_kernel_args

    return emulate_kernel_args(sk.CUDA_SOURCE, sk._INPUTS, sk.launch_args(**args), sk._OUTPUTS, workdir,
                               header=sk.PACKED_INDEX_CUDA)


@pytest.mark.parametrize("bits, group, dtype, count, window", [
    (4, 32, mx.float16, 80, 16),   # kivi-4bit's layout, the slots held fewer than the room
    (2, 32, mx.float16, 96, 16),   # 2 bits, the whole room (H2O's weights read it)
    (8, 64, mx.float32, 80, 16),   # 8 bits, float32
    (3, 32, mx.float16, 80, 8),    # codes that straddle words
    (4, 32, mx.float16, 80, 0),    # no ring
])
def test_the_cuda_source_gives_the_mlx_passs_rows(tmp_path, bits, group, dtype, count, window):
    from test_kernel_kivi_decode import skip_without_emulation

    skip_without_emulation()
    with mx.stream(mx.cpu):
        args, ref_k, ref_v = sk.check_case(dtype, bits, group, count=count, window=window or 16)
        if not window:  # no ring: every slot dequantized
            args.update(k_ring=None, v_ring=None)
            ref_k, ref_v = sk.reference_rows(**args)
        in_ring = np.array(args["positions"][:, :, :count]) >= args["ring_start"]
        assert (in_ring.any() and not in_ring.all()) if window else True
        got = emulate(args, str(tmp_path))
        for name, ref in (("out_k", ref_k), ("out_v", ref_v)):
            assert got[name].shape == ref.shape
            assert within_a_rounding(mx.array(got[name]), ref), (name, np.abs(
                got[name].astype(np.float64) - np.array(ref.astype(mx.float32), np.float64)).max())


def test_a_test_that_takes_a_gpus_paths_on_the_cpu_gets_the_mlx_pass(monkeypatch):
    if kd._gpu_kind() is not None:
        pytest.skip("a GPU back-end is here: its kernel runs, there is no stand-in to test")
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(sk, "_CHECKED", {})
    assert sk.kernel_backend(mx.float16) is None and sk._CHECKED == {}


def test_on_a_gpu_the_kernel_gives_the_mlx_passs_rows():
    if kd.gpu_backend() is None:
        pytest.skip("SKIPPED LOUDLY: no GPU: the slot-rows kernel is NOT run here (its CUDA source is "
                    "emulated above)")
    backend = sk.kernel_backend(mx.float16)
    assert backend is not None
    args, ref_k, ref_v = sk.check_case(mx.float16, room=2100, count=2048, window=32)
    out_k, out_v = sk.slot_rows(backend, **args)
    assert within_a_rounding(out_k, ref_k) and within_a_rounding(out_v, ref_v)
