"""AdaKV's plane-rows kernel (``methods/adakv/kernel.py``): its CUDA source run on the CPU by
emulation against the compiled MLX pass it replaces (``heads.check_case``: per-head widths of
2, 3 and 4 bits in one block, two sequences with different widths, a partial last block),
and its dispatch. The emulation does not fuse ``code * scale + min``, so its rows equal the
pass's bit for bit."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401  (before mlx binds its CPU BLAS)
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.adakv import kernel as ak
from veloxquant_mlx.methods.adakv.heads import check_case


def emulate(args: dict, workdir) -> tuple[np.ndarray, np.ndarray]:
    from test_kernel_kivi_decode import emulate_kernel_args

    out = emulate_kernel_args(ak.CUDA_SOURCE, ak._INPUTS, args, ["keys", "values"], workdir)
    return out["keys"], out["values"]


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_the_cuda_source_gives_the_mlx_passs_rows(tmp_path, dtype):
    from test_kernel_kivi_decode import skip_without_emulation

    skip_without_emulation()
    with mx.stream(mx.cpu):  # the MLX reference as the CPU computes it (a GPU's fused ops may contract)
        store, (k_ref, v_ref) = check_case(dtype)
        assert store.stored == 96 and len(set(np.array(store.widths()).ravel().tolist())) == 3
        keys, values = emulate(ak.launch_args(*store.plane_inputs(), stored=store.stored, group=store.group, dtype=dtype),
                               str(tmp_path))
        assert keys.dtype == np.array(k_ref).dtype
        assert (keys == np.array(k_ref)).all() and (values == np.array(v_ref)).all()


def test_a_test_that_takes_a_gpus_paths_on_the_cpu_gets_the_mlx_pass(monkeypatch):
    if kd._gpu_kind() is not None:
        pytest.skip("a GPU back-end is here: its kernel runs, there is no stand-in to test")
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(ak, "_CHECKED", {})
    store, _ = check_case(mx.float16)
    assert ak.plane_rows(store.plane_inputs, stored=store.stored, group=store.group, dtype=mx.float16) is None
    assert ak._CHECKED == {}


def test_on_a_gpu_the_kernel_gives_the_mlx_passs_rows():
    if kd.gpu_backend() is None:
        pytest.skip("SKIPPED LOUDLY: no GPU: AdaKV's plane-rows kernel is NOT run here (its CUDA "
                    "source is emulated above)")
    from veloxquant_mlx.kernels.checks import within_a_rounding

    store, (k_ref, v_ref) = check_case(mx.float16)
    rows = ak.plane_rows(store.plane_inputs, stored=store.stored, group=store.group, dtype=mx.float16)
    assert rows is not None
    assert within_a_rounding(rows[0], k_ref) and within_a_rounding(rows[1], v_ref)
