"""KIVI attends before it flushes (issue 37): at the decode step that fills a key block,
the block's R keys, the step's own included, are read exact, as in the official decode;
they are packed after the step's attention."""

import mlx.core as mx
import pytest

from feeding import feed
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import KIVIOptions
from veloxquant_mlx.methods.kivi import KIVICache

R, H, GROUP, D = 128, 2, 2, 64


@pytest.mark.parametrize("bits", [2, 4])
def test_the_flush_step_attends_over_the_exact_window_then_packs_it(bits):
    t = 2 * R  # the prompt's 2R - 1 tokens, then the step that fills the second key block
    k = mx.random.normal((1, H, t, D), key=mx.random.key(1))
    v = mx.random.normal((1, H, t, D), key=mx.random.key(2))
    q = mx.random.normal((1, H * GROUP, t, D), key=mx.random.key(3))
    config = KVCacheConfig(method="kivi", options=KIVIOptions(kivi_group_size=32), kv_bits=bits,
                           residual_window=R)
    cache = KIVICache(config, None, 0)
    feed(cache, k, v, q, 0, t - 1)
    k_old, v_old = cache.dequantized(mx.float32)
    assert cache.n_quantized_keys == R and cache.n_quantized_values == t - 1 - R

    out = feed(cache, k, v, q, t - 1, t)

    keys = mx.concatenate([k_old[:, :, :R], k[:, :, R:]], axis=2)  # packed block + exact window
    values = mx.concatenate([v_old[:, :, : t - 1 - R], v[:, :, t - 1 - R :]], axis=2)
    expected = mx.fast.scaled_dot_product_attention(q[:, :, t - 1 :], keys, values, scale=D**-0.5)
    assert mx.allclose(out, expected, atol=1e-5, rtol=1e-5), mx.abs(out - expected).max().item()
    # after the step the key block is packed; values leave the window 32 at a time
    assert cache.n_quantized_keys == 2 * R and cache.n_quantized_values == t - 1 - R
    assert cache.store.k_res is None and cache.store.v_res.shape[2] == R + 1


def test_values_leave_the_window_32_at_a_time_with_the_codes_of_one_by_one():
    t = R + 40
    k = mx.random.normal((1, H, t + 32, D), key=mx.random.key(4))
    v = mx.random.normal((1, H, t + 32, D), key=mx.random.key(5))
    q = mx.random.normal((1, H * GROUP, t + 32, D), key=mx.random.key(6))
    config = KVCacheConfig(method="kivi", options=KIVIOptions(kivi_group_size=32), kv_bits=2,
                           residual_window=R)
    cache = KIVICache(config, None, 0)
    feed(cache, k, v, q, 0, t)  # the prompt: exactly R values exact
    assert cache.store.v_res.shape[2] == R
    held = []
    for i in range(t, t + 32):
        feed(cache, k, v, q, i, i + 1)
        held.append(cache.store.v_res.shape[2])
    assert held == list(range(R + 1, R + 32)) + [R]  # 31 steps write only their row
    # per-token groups: packing 32 values at once gives the codes of packing them one by one
    one_by_one = KIVICache(config, None, 0)
    feed(one_by_one, k, v, q, 0, t + 32)  # a prefill packs all but the newest R, in one call
    _, v_hat = cache.dequantized(mx.float32)
    _, v_ref = one_by_one.dequantized(mx.float32)
    assert mx.array_equal(v_hat, v_ref)
