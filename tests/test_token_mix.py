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
    monkeypatch.setattr(kd, "_splits_tokens", lambda: True)


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


# kivi itself is read by its fused kernel on a GPU (its pure reference is a check)
SPLIT_READERS = ["kitty", "skvq", "zipcache", "kvquant", "palu", "vecinfer", "amc", "kvtc",
                 "turboquant", "spectral"]


@pytest.mark.parametrize("method", SPLIT_READERS)
def test_a_decode_through_the_split_equals_the_one_product(method, monkeypatch):
    """Whole-model greedy decode on a tiny llama, the GPU's pure path (no
    quantized_matmul; this CPU runs no kernel; compile off so the split is chosen at each call): with the split forced at 16-token entries,
    each method's history product goes through it (counted) and the log-probabilities
    equal the one product's to float32 rounding of the reordered sums."""
    from conformance import PROMPT, config, profile
    from tiny_models import prompt, tiny_model
    from veloxquant_mlx import make_prompt_cache

    model, tokens = tiny_model(), prompt(PROMPT)
    cfg = config(method, profile(method).compressing)

    def run():
        cache = make_prompt_cache(model, cfg)
        logits = model(tokens[None], cache=cache)[:, -1]
        out = []
        for _ in range(6):
            y = mx.argmax(logits, axis=-1)
            out.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
            logits = model(y[:, None], cache=cache)[:, -1]
        return mx.stack(out)

    monkeypatch.setattr(kd, "_pure_path", lambda: "reference")  # the GPU's: no quantized_matmul
    mx.disable_compile()
    try:
        plain = run()
        splits = []
        monkeypatch.setattr(kd, "SPLIT_TOKENS", 16)
        monkeypatch.setattr(kd, "_splits_tokens", lambda: splits.append(1) or True)
        split = run()
    finally:
        mx.enable_compile()
    assert splits, f"{method}: no history product went through token_mix"
    # log-probabilities of ~ln(256) in float32 (an ulp ~5e-7), sums reordered: a few ulps
    assert mx.abs(split - plain).max().item() <= 1e-5


def test_the_gpus_pure_path_dequantizes_float16_scales_straight_to_float32(monkeypatch):
    """Without quantized_matmul (a GPU), packed keys and values are dequantized with their
    scales and biases in float32: rows come out in float32 (no float16 rounding of each
    value, no second pass to cast them)."""
    monkeypatch.setattr(kd, "_pure_path", lambda: "reference")
    t, d, g = 256, 64, 32
    w, v = weights_and_rows(t, lead=(1, 2))
    codes, scales, biases = mx.quantize(v, group_size=g, bits=4)
    scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
    exact = mx.dequantize(codes, scales.astype(mx.float32), biases.astype(mx.float32), group_size=g, bits=4)
    mixed = kd.affine_value_mix(w, codes, scales, biases, t, 4, g)
    assert mx.abs(mixed - w @ exact).max().item() <= 1e-6
    q = mx.random.normal((1, 2, 4, d), key=mx.random.key(5))
    k_codes, k_scales, k_biases = mx.quantize(v.swapaxes(-1, -2), group_size=g, bits=4)  # per channel
    k_scales, k_biases = k_scales.astype(mx.float16), k_biases.astype(mx.float16)
    keys_t = mx.dequantize(k_codes, k_scales.astype(mx.float32), k_biases.astype(mx.float32), group_size=g, bits=4)
    scores = kd.affine_key_scores(q, k_codes, k_scales, k_biases, t, 4, g)
    assert mx.abs(scores - q @ keys_t).max().item() <= 1e-5
