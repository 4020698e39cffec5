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
    # after the step, the block is packed and the value window slid by one
    assert cache.n_quantized_keys == 2 * R and cache.n_quantized_values == t - R
    assert cache.store.k_res is None and cache.store.v_res.shape[2] == R
