"""``kivi_decode.token_mix``: a decode step's ``p V`` over the token axis, cut into
SPLIT_TOKENS-token batch entries on CUDA (notes/decode_kernels.md). The cut must give the
one product's values to float32 rounding at every length (whole chunks, a remainder,
below the threshold), and the pure path's readers must go through it."""

import mlx.core as mx
import pytest

from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.quant.token_rows import PlainRows


@pytest.fixture
def on_cuda(monkeypatch):
    """token_mix as it runs on CUDA (the split), on this CPU."""
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")


def weights_and_rows(t, lead=(2, 3), r=4, d=64, seed=0):
    w = mx.softmax(mx.random.normal((*lead, r, t), key=mx.random.key(seed)) * 3, axis=-1)
    v = mx.random.normal((*lead, t, d), key=mx.random.key(seed + 1))
    return w, v


@pytest.mark.parametrize("t", [2 * kd.SPLIT_TOKENS, 2 * kd.SPLIT_TOKENS + 37, 5000])
def test_the_split_product_equals_the_one_product(on_cuda, t):
    w, v = weights_and_rows(t)
    got, want = kd.token_mix(w, v), w @ v
    assert got.shape == want.shape
    # a sum of t products of |w| <= 1 and |v| ~ 1, reordered: float32 rounding of ~t terms
    assert mx.abs(got - want).max().item() <= 1e-6 * (t ** 0.5)


def test_below_the_threshold_it_is_the_one_product(on_cuda):
    w, v = weights_and_rows(2 * kd.SPLIT_TOKENS - 1)
    assert mx.array_equal(kd.token_mix(w, v), w @ v)


def test_the_pure_paths_readers_take_the_split(on_cuda, monkeypatch):
    monkeypatch.setattr(kd, "_pure_path", lambda: "reference")  # the GPU's: no quantized_matmul
    calls = []
    real = kd.token_mix
    monkeypatch.setattr(kd, "token_mix", lambda w, v: calls.append(w.shape[-1]) or real(w, v))
    t = 3 * kd.SPLIT_TOKENS
    w, v = weights_and_rows(t, lead=(1, 2))
    rows = PlainRows(mx.concatenate([v, mx.zeros((1, 2, 5, 64))], axis=2), t)  # room past the count
    assert mx.abs(rows.mix(w) - w @ v).max().item() <= 1e-6 * t ** 0.5
    codes, scales, biases = mx.quantize(v, group_size=32, bits=4)
    mixed = kd.affine_value_mix(w, codes, scales, biases, t, 4, 32)
    assert mx.abs(mixed - w @ mx.dequantize(codes, scales, biases, group_size=32, bits=4)).max().item() <= 1e-6 * t ** 0.5
    assert calls == [t, t]
