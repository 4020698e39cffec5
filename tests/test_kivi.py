"""KIVI: exact residual windows, bounded error on quantized tokens, real memory savings."""

import functools

import mlx.core as mx
import pytest

from feeding import feed_chunks, stored_decode_attention
from test_methods_exactness import run
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import KIVIOptions
from veloxquant_mlx.methods.kivi import KIVICache


# queries from MLX's global generator, as these tests always drew them
feed = functools.partial(feed_chunks, seed=None)


def kivi(bits=2, group=32, residual=128, **kw):
    config = KVCacheConfig(method="kivi", options=KIVIOptions(kivi_group_size=group), kv_bits=bits, residual_window=residual, **kw)
    return KIVICache(config, None, 0)


@pytest.mark.parametrize("t, chunk", [(100, 100), (128, 64), (300, 64), (517, 200), (517, 1)])
def test_residual_windows_are_bit_exact(t, chunk):
    mx.random.seed(t)
    keys = mx.random.normal((1, 2, t, 64)).astype(mx.float16)
    values = mx.random.normal((1, 2, t, 64)).astype(mx.float16)
    cache = kivi()
    feed(cache, keys, values, chunk)
    r = 128
    n_key_res, n_val_res = t % r, min(t, r)
    if chunk == 1:  # decode steps pack values 32 at a time: R to R + 31 stay exact
        n_val_res = t if t < r + 32 else r + (t - r) % 32
    rows = lambda x: 0 if x is None else x.shape[2]  # noqa: E731 - an empty window holds no array
    assert rows(cache.store.k_res) == n_key_res and rows(cache.store.v_res) == n_val_res
    assert cache.n_quantized_keys == t - n_key_res and cache.n_quantized_values == t - n_val_res
    k_hat, v_hat = cache.dequantized(mx.float16)
    assert k_hat.shape == keys.shape and v_hat.shape == values.shape
    assert mx.array_equal(k_hat[:, :, t - n_key_res :], keys[:, :, t - n_key_res :])
    assert mx.array_equal(v_hat[:, :, t - n_val_res :], values[:, :, t - n_val_res :])


def test_short_context_is_returned_unchanged():
    keys = mx.random.normal((1, 2, 100, 64))
    cache = kivi()
    feed(cache, keys, keys, 100)
    k_hat, v_hat = cache.dequantized(mx.float32)
    assert mx.array_equal(k_hat, keys) and mx.array_equal(v_hat, keys)


@pytest.mark.parametrize("bits, bound", [(2, 0.45), (4, 0.10)])
def test_error_within_the_card_bounds(bits, bound):
    mx.random.seed(bits)
    keys = mx.random.normal((1, 2, 640, 128))
    values = mx.random.normal((1, 2, 640, 128))
    cache = kivi(bits=bits)
    feed(cache, keys, values, 256)
    k_hat, v_hat = cache.dequantized(mx.float32)
    nq = cache.n_quantized_keys
    # Per element: |x_hat - x| <= scale / 2 (round to nearest code) + float rounding.
    scales = mx.repeat(cache.store.keys.scales.view(), 32, axis=-1).swapaxes(-1, -2)  # (B,H,T,D)
    assert mx.all(scales > 0)
    err = mx.abs(k_hat[:, :, :nq] - keys[:, :, :nq])
    assert mx.all(err <= mx.abs(scales) / 2 + 1e-5)
    v_scales = mx.repeat(cache.store.values.scales.view(), 32, axis=-1)
    nv = cache.n_quantized_values
    v_err = mx.abs(v_hat[:, :, :nv] - values[:, :, :nv])
    assert mx.all(v_err <= mx.abs(v_scales) / 2 + 1e-5)
    for x_hat, x, n in ((k_hat, keys, nq), (v_hat, values, nv)):
        rel = mx.linalg.norm((x_hat - x)[:, :, :n].flatten()) / mx.linalg.norm(x[:, :, :n].flatten())
        assert float(rel) < bound


def test_per_channel_keys_beat_per_token_on_outlier_channels():
    mx.random.seed(3)
    # Real key outliers are channels of consistently large magnitude, not of large spread.
    keys = mx.random.normal((1, 1, 256, 128)) + mx.where(mx.arange(128) < 4, 20.0, 0.0)
    cache = kivi(bits=2, residual=128)
    feed(cache, keys, keys, 256)
    k_hat, v_hat = cache.dequantized(mx.float32)  # keys per channel, values per token
    n = cache.n_quantized_values
    per_channel = mx.linalg.norm((k_hat - keys)[:, :, :n].flatten())
    per_token = mx.linalg.norm((v_hat - keys)[:, :, :n].flatten())
    assert float(per_channel) < 0.5 * float(per_token)


def test_quantized_blocks_never_change_and_fetching_twice_is_identical():
    keys = mx.random.normal((1, 2, 300, 64))
    cache = kivi()
    feed(cache, keys, keys, 64)
    before = [mx.array(a) for a in (cache.store.keys.codes.view(), cache.store.values.codes.view())]
    snapshot = cache.dequantized(mx.float32)
    assert all(mx.array_equal(a, b) for a, b in zip(snapshot, cache.dequantized(mx.float32)))
    feed(cache, mx.random.normal((1, 2, 200, 64)), mx.random.normal((1, 2, 200, 64)), 1)
    assert mx.array_equal(cache.store.keys.codes.view()[..., : before[0].shape[-1]], before[0])
    assert mx.array_equal(cache.store.values.codes.view()[:, :, : before[1].shape[2]], before[1])


def test_memory_at_4k_two_bits_group_32():
    """At most 0.25x of the full cache, plus the residual window, measured from nbytes."""
    t, h, d = 4096, 2, 128
    keys = mx.random.normal((1, h, t, d)).astype(mx.float16)
    cache = kivi(bits=2, group=32, residual=128)
    feed(cache, keys, keys, 2048)
    full = 2 * t * h * d * 2
    residual = 2 * 128 * h * d * 2
    assert cache.nbytes <= 0.25 * full + residual
    # Codes + scales + biases only: 2 bits + 2 x 16 bits per 32 elements, K and V.
    quantized = (cache.n_quantized_keys + cache.n_quantized_values) * h * d * (2 / 8 + 4 / 32)
    assert cache.nbytes >= quantized + 2 * 128 * h * d * 2 * 0.5


def test_decode_attention_matches_dequantized_reference():
    model = tiny_model("llama")
    tokens = prompt(300)
    cache = make_prompt_cache(model, KVCacheConfig(method="kivi", kv_bits=4))
    run(model, cache, tokens, chunk=128, decode=3)
    c = cache[0]
    q = mx.random.normal((1, 4, 1, 32))
    out = stored_decode_attention(c, q, 32**-0.5)
    k_hat, v_hat = c.dequantized(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=32**-0.5)
    assert mx.allclose(out, ref, atol=1e-5)


def test_group_size_must_divide_head_dim():
    model = tiny_model("llama")  # head_dim 32
    with pytest.raises(ValueError, match="kivi_group_size=64 must divide head_dim=32"):
        cache = make_prompt_cache(model, KVCacheConfig(method="kivi", options=KIVIOptions(kivi_group_size=64)))
        model(prompt(8)[None], cache=cache)


@pytest.mark.parametrize("fused", [True, False])
def test_fused_attention_option_reaches_the_kernel_dispatcher(fused, monkeypatch):
    import veloxquant_mlx.kernels.kivi_decode as kd

    seen = []
    real = kd.kivi_decode_attention

    def spy(*args, **kwargs):
        seen.append(kwargs["use_kernel"])
        return real(*args, **kwargs)

    monkeypatch.setattr(kd, "kivi_decode_attention", spy)
    cache = kivi(fused_attention=fused)
    keys = mx.random.normal((1, 2, 40, 64))
    feed(cache, keys, keys, 39)
    assert seen == [fused]
