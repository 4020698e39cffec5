"""The latent-rows kernel (``lowrank/latent_rows_kernel.py``): its CUDA source run on the CPU by
emulation against the float32 pass (``reference``), svdq's layout at its defaults and an
unquantized span; the store's own rows; palu's CUDA step."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401  (before mlx binds its CPU BLAS)
from veloxquant_mlx.lowrank import latent_rows_kernel as lr
from veloxquant_mlx.lowrank.latent import LatentTokens, split_channels

SVDQ = lr.RowsLayout((lr.Span(0, 14, 8), lr.Span(14, 28, 4), lr.Span(28, 42, 2), lr.Span(42, 70, 1),
                      lr.Span(70, 110, 0)), 110, 32)  # [8, 4, 2, 1, 1, 0, 0, 0] over 110 channels
EXACT = lr.RowsLayout((lr.Span(0, 5, 16), lr.Span(5, 12, 4), lr.Span(12, 20, 0)), 20, 32)


def emulate(layout, args, workdir) -> np.ndarray:
    from test_kernel_kivi_decode import emulate_kernel_args

    return emulate_kernel_args(lr.source(layout), layout.input_names(), args, ["out"], workdir)["out"]


@pytest.mark.parametrize("layout,dtype,width,window_rows", [
    # every packed width, a dropped tail, the padding, a window one short of a group (palu's
    # layout, 4 and 2 bits to width 256, is the device check's: results/h200_s80/run59.sh)
    (SVDQ, mx.float16, 128, 31),
    (EXACT, mx.float32, 64, 0),   # an unquantized span, float32 rows, no window
])
def test_the_cuda_source_writes_the_float32_pass_rows(tmp_path, layout, dtype, width, window_rows):
    from test_kernel_kivi_decode import skip_without_emulation

    skip_without_emulation()
    window, start, arrays, flushed, count = lr.random_case(layout, dtype, lead=(2, 2), window_rows=window_rows)
    if not window_rows:
        window = None
    args = lr.launch_args(layout, window, start, arrays, flushed, count, width, dtype, (2, 2))
    got = mx.array(emulate(layout, args, str(tmp_path)))
    ref = lr.reference(layout, window, start, arrays, flushed, count, width, dtype, (2, 2))
    assert got.shape == ref.shape == (2, 2, count, width)
    assert lr.within_a_rounding(got, ref)
    assert mx.all(got[..., layout.rank:] == 0)  # the padding, written as zeros
    dropped = [s for s in layout.spans if s.bits == 0]
    for s in dropped:
        assert mx.all(got[:, :, :flushed, s.start:s.stop] == 0)


def test_the_check_allows_a_multiply_add_that_cancels_near_zero():
    """The kernel's dequantization is one multiply-add; MLX's rounds the product first. Where
    code x scale and the minimum cancel, the two differ by a rounding of the product, not of
    the result: the float32 layouts failed their self-check on CUDA for that (session 81)."""
    ref = mx.array([3.0e-8, -2.0, 1.5], mx.float32)
    fused = mx.array([3.0e-8 + 2.0 ** -24, -2.0, 1.5], mx.float32)  # the product's rounding (a term near 1)
    assert lr.within_a_rounding(fused, ref)
    wrong = mx.array([3.0e-8, -2.0, 1.5 + 2.0 ** -20], mx.float32)  # four roundings of the largest
    assert not lr.within_a_rounding(wrong, ref)
    half = mx.array([1.0, -3.0, 1000.0], mx.float16)  # the 16-bit dtypes' ulp rule still holds
    assert not lr.within_a_rounding(mx.array([1.0 + 2.0 ** -9, -3.0, 1000.0], mx.float16), half)


def test_a_store_s_tokens_give_the_rows_its_fused_read_takes():
    """``LatentTokens.kernel_arrays`` hands the kernel the buffers the MLX path reads: the
    float32 pass over them is the store's own rows, to a rounding of the dtype."""
    tokens = LatentTokens(split_channels(40, [8, 4, 2, 1, 0]), 32, 64, (1, 2))
    x = mx.random.normal((1, 2, 75, 40), key=mx.random.key(3))
    tokens.append(x[:, :, :70].astype(mx.float16))
    for t in range(70, 75):
        tokens.append(x[:, :, t : t + 1].astype(mx.float16))
    assert tokens.flushed == 64 and tokens.buf.length == 11
    layout, window, start, arrays = tokens.kernel_inputs()
    ref = lr.reference(layout, window, start, arrays, tokens.flushed, tokens.count, 64, mx.float16, (1, 2))
    mlx_rows = tokens.rows(mx.float16, 64, iter(tokens.read_inputs()))
    assert ref.shape == mlx_rows.shape
    assert np.allclose(np.array(ref, np.float32), np.array(mlx_rows, np.float32), rtol=2e-3, atol=2e-3)


def test_palus_cuda_step_writes_each_runs_rows_in_one_launch(monkeypatch):
    """Issue 30: on CUDA palu's fused read joined each run's latents through a dequantization
    a span, a cut, a join along the channels with zeros and one with the window (153 us of
    copies a layer and step on an H100). With the kernel switched on, its steady step writes
    the keys' and the values' rows with one launch each; off (the default), MLX's ops."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from decode_steps import decode_overlapped, prefilled, step, steps_as_on_cuda

    monkeypatch.setattr(lr, "_SWITCHED_ON", True)  # VQ_LATENT_ROWS_KERNEL=1: off until a device times it
    model, cache, token = prefilled("palu")
    y = decode_overlapped(model, cache, token, 4)
    calls = []
    real = lr.latent_rows
    monkeypatch.setattr(lr, "latent_rows", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    with steps_as_on_cuda():
        mx.eval(y)
        step(model, cache, y)
    assert len(calls) == 2 * len(model.layers)  # the keys' rows and the values' a layer
    assert all(layout.takes() for layout in calls)
    monkeypatch.setattr(lr, "_SWITCHED_ON", False)
    calls.clear()
    with steps_as_on_cuda():
        step(model, cache, y)
    assert not calls
