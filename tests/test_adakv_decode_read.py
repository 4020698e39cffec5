"""AdaKV's decode read (issue 30): the planes dequantized over their buffers' room in one
compiled pass (the sources and weights broadcast, the scales viewed in the codes' layout,
views kept between flushes), the stored rows and the window's joined, one unmasked
attention. Over 40 decode steps with flushes among them it gives what attention over the
dequantized history gives, to float32 reassociation, on the CPU's path and the GPU's."""

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import AdaKVOptions
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.adakv.cache import AdaKVCache

EPS = float(mx.finfo(mx.float32).eps)


def adakv(residual, **options):
    return AdaKVCache(KVCacheConfig(method="adakv", options=AdaKVOptions(**options), residual_window=residual), None, 0)


def keys_values(b, h, t, d, seed):
    k = mx.random.normal((b, h, t, d), key=mx.random.key(seed)) * (1 + 6 * (mx.arange(d) % 9 == 0))
    k = k * (1 + mx.arange(h).reshape(1, h, 1, 1))  # heads of different importance
    v = mx.random.normal((b, h, t, d), key=mx.random.key(seed + 1))
    return k, v


def reassociation_bound(q, k_hat, v_hat, scale):
    """Each score a sum of D products (moved by at most D eps times the sum of their
    magnitudes, moving every softmax weight by a relative 2 max|ds|), the mix a sum of T
    products (T eps max|v|); twice that, for the steps around them."""
    b, hq, _, d = q.shape
    h = k_hat.shape[1]
    qg = (q.reshape(b, h, hq // h, d) * scale).astype(mx.float32)
    ds = d * EPS * float((mx.abs(qg) @ mx.abs(k_hat).swapaxes(-1, -2)).max())
    return 2 * float(mx.abs(v_hat).max()) * (2 * ds + k_hat.shape[2] * EPS)


@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's path, the GPU's
@pytest.mark.parametrize("residual, options", [
    (32, dict(adakv_group_size=32)),
    (0, dict(adakv_group_size=32)),  # no window: steps right after a flush read the planes alone
    (16, dict(adakv_group_size=64, adakv_target_avg_bits=3.0)),
])
def test_forty_decode_steps_match_attention_over_the_dequantized_history(residual, options, pure_path,
                                                                         monkeypatch):
    monkeypatch.setattr(kd, "_pure_path", lambda: pure_path)
    b, h, gqa, d, t0, steps = 2, 4, 2, 64, 180, 40
    keys, values = keys_values(b, h, t0 + steps, d, seed=11 + residual)
    cache, scale = adakv(residual, **options), d**-0.5
    cache.update_and_fetch(keys[:, :, :t0], values[:, :, :t0])
    q0 = mx.random.normal((b, h * gqa, t0, d), key=mx.random.key(3))
    cache.attend(q0, keys[:, :, :t0], values[:, :, :t0], scale=scale, mask="causal")
    stored = set()
    for i in range(t0, t0 + steps):
        k, v = keys[:, :, i : i + 1], values[:, :, i : i + 1]
        q = mx.random.normal((b, h * gqa, 1, d), key=mx.random.key(100 + i))
        cache.update_and_fetch(k, v)
        out = cache.attend(q, k, v, scale=scale, mask=None)
        stored.add(cache.store.stored)
        k_hat, v_hat = cache.dequantized(mx.float32)
        assert k_hat.shape[2] == i + 1
        ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=scale)
        err, bound = float(mx.abs(out - ref).max()), reassociation_bound(q, k_hat, v_hat, scale)
        assert err <= bound, (i, err, bound)
    assert len(stored) > 1  # the steps crossed flushes
    widths = cache.store.block_widths()
    assert int(widths.max()) > int(widths.min())  # heads at different widths


def test_the_reads_views_are_kept_between_flushes():
    keys, values = keys_values(1, 4, 200, 64, seed=2)
    cache = adakv(32, adakv_group_size=32)
    cache.update_and_fetch(keys[:, :, :150], values[:, :, :150])
    cache.attend(mx.zeros((1, 8, 150, 64)), keys[:, :, :150], values[:, :, :150], scale=0.125, mask="causal")
    seen = []
    for i in range(150, 154):
        cache.update_and_fetch(keys[:, :, i : i + 1], values[:, :, i : i + 1])
        mx.eval(cache.attend(mx.ones((1, 8, 1, 64)), keys[:, :, i : i + 1], values[:, :, i : i + 1], scale=0.125,
                             mask=None))
        seen.append(cache.store._read_views())
    assert all(x is seen[0] for x in seen)
