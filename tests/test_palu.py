"""Palu: exact at full rank unquantized, group latents (not per-head K/V) stored, the
folded-query attention against attention over the reconstruction, hi/lo channels, value
latents in full precision, memory against the card's formula, and the group check."""

import math

import mlx.core as mx
import numpy as np
import pytest

from test_kivi import feed
from test_svdq import kv, prompt_then_decode, rel_err
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import PALUOptions
from veloxquant_mlx.methods.palu import PALUCache
from feeding import stored_decode_attention


def palu(**options):
    return PALUCache(KVCacheConfig(method="palu", options=PALUOptions(**options)), None, 0)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_full_rank_unquantized_is_exact(groups):
    keys, values = kv(300, h=4, d=32)
    cache = palu(palu_rank=4096, palu_hi_bit=16, palu_lo_bit=16, palu_n_head_groups=groups)
    prompt_then_decode(cache, keys, values, 250)
    k_hat, v_hat = cache.dequantized(mx.float32)
    assert cache.store.keys.basis.shape == (1, groups, 128 // groups, 128 // groups)
    assert mx.allclose(k_hat, keys, atol=1e-5, rtol=1e-5) and mx.allclose(v_hat, values, atol=1e-5, rtol=1e-5)


def test_a_group_stores_latents_of_its_heads_side_by_side():
    keys, values = kv(256, h=4, d=32)
    cache = palu(palu_rank=40, palu_n_head_groups=2, palu_hi_fraction=0.25)
    prompt_then_decode(cache, keys, values, 255)
    for latent in (cache.store.keys, cache.store.values):
        assert latent.basis.shape == (1, 2, 64, 40) and latent.mean.shape == (1, 2, 1, 64)
        hi, lo = latent.tokens.packed[0], latent.tokens.packed[1]  # [n_groups, r, T] codes
        assert (hi.codec.bits, lo.codec.bits) == (4, 2)
        assert hi.codes.view().shape == (1, 2, 10, 256 * 4 // 32)  # floor(0.25 * 40) hi channels
        assert lo.codes.view().shape == (1, 2, 30, 256 * 2 // 32)
    assert not any(n.endswith("pend") and a is not None for n, a in cache.state["arrays"].items())


def test_folded_query_attention_equals_attention_over_the_reconstruction():
    keys, values = kv(230, h=4, d=32)
    cache = palu(palu_n_head_groups=2)
    prompt_then_decode(cache, keys, values, 200)  # 224 quantized latents, 6 buffered
    k_hat, v_hat = cache.dequantized(mx.float32)
    for gqa in (1, 3):
        q = mx.random.normal((1, 4 * gqa, 1, 32), key=mx.random.key(gqa))
        ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=32**-0.5)
        assert mx.allclose(stored_decode_attention(cache, q, 32**-0.5), ref, atol=1e-5, rtol=1e-4)
    assert 0.01 < rel_err(k_hat, keys) < 0.8
    # the parts' own scores and mixes are q K_hatᵀ and p V_hat themselves (the mean term
    # included, which a lone part's softmax would not notice but a merge with others does)
    (part,) = cache.store.decode_parts(mx.zeros((0,)))
    q = mx.random.normal((1, 4, 3, 32), key=mx.random.key(5))
    assert mx.allclose(part.keys.scores(q), q @ k_hat.swapaxes(-1, -2), atol=1e-4, rtol=1e-4)
    p = mx.softmax(mx.random.normal((1, 4, 3, 230), key=mx.random.key(6)), axis=-1)
    assert mx.allclose(part.values.mix(p), p @ v_hat, atol=1e-5, rtol=1e-4)


def test_the_hi_channels_are_the_first_by_singular_value_and_the_finer_ones():
    keys, values = kv(257, h=2, d=32)
    cache = palu(palu_rank=32, palu_n_head_groups=2, palu_hi_bit=8, palu_lo_bit=2, palu_hi_fraction=0.3)
    prompt_then_decode(cache, keys, values, 256)
    store = cache.store.keys
    assert [(s.start, s.stop, s.bits) for s in store.tokens.segments] == [(0, 9, 8), (9, 32, 2)]  # floor(9.6)
    exact = np.array((keys[:, :, :256] - store.mean) @ store.basis).reshape(1, 2, 8, 32, 32)
    err = np.abs(np.array(store.tokens.dense()[:, :, :256]).reshape(exact.shape) - exact).max(axis=3)
    span = exact.max(axis=3) - exact.min(axis=3)
    assert (err[..., :9] <= span[..., :9] / 255 / 2 + 1e-5).all()
    assert (err[..., 9:] <= span[..., 9:] / 3 / 2 + 1e-5).all() and (err[..., 9:] > span[..., 9:] / 255).any()


def test_value_latents_in_full_precision_lose_only_the_truncation():
    keys, values = kv(260, h=2, d=32, seed=4)
    cache = palu(palu_rank=20, palu_n_head_groups=1, palu_quantize_values=False)
    prompt_then_decode(cache, keys, values, 200)  # decode tokens too: their error is out-of-subspace
    store = cache.store.values
    assert not store.tokens.packed and list(store.tokens.exact) == [0]
    grouped = mx.concatenate([values[:, 0], values[:, 1]], axis=-1)[:, None]  # heads side by side
    projected = (grouped - store.mean) @ store.basis @ store.basis.swapaxes(-1, -2) + store.mean
    v_hat = cache.dequantized(mx.float32)[1]
    assert mx.allclose(mx.concatenate([v_hat[:, 0], v_hat[:, 1]], axis=-1)[:, None], projected, atol=1e-5)
    assert rel_err(v_hat, values) > 0.1  # rank 20 of 64 is a real truncation


def test_memory_is_the_cards_formula():
    t, d, h, s, groups, r = 512, 32, 4, 4, 2, 48
    keys, values = kv(t, h=h, d=d)
    cache = palu(palu_rank=r, palu_n_head_groups=groups, palu_hi_fraction=0.25)
    prompt_then_decode(cache, keys, values, t - 1, chunk=256)
    r_hi = math.floor(0.25 * r)
    per_token = groups * (r_hi * 4 / 8 + (r - r_hi) * 2 / 8 + r * 2 * s / 32)  # a tensor
    n = h // groups * d
    bases = groups * (n * r + n) * s
    moments = groups * (n * n + 2 * n) * 4  # float32 Gram, sum and shift, for the refits
    room = groups * 32 * r * s  # the decode buffer's room, a quantization group, kept across flushes
    assert cache.nbytes == 2 * (t * per_token + bases + moments + room)
    assert per_token == groups * 27  # 6 + 9 code bytes + 12 of scales a group, against 512 in float32


def test_head_groups_must_divide_the_kv_heads():
    keys, values = kv(8, h=4, d=32)
    with pytest.raises(ValueError, match=r"palu_n_head_groups=3 must divide the model's 4 KV heads; allowed here: \[1, 2, 4\]"):
        feed(palu(palu_n_head_groups=3), keys, values, 8)
    cache = palu(palu_n_head_groups=6)  # more groups than heads: one head a group
    prompt_then_decode(cache, *kv(40, h=4, d=32), 39)
    assert cache.store.keys.basis.shape[1:3] == (4, 32)


@pytest.mark.parametrize("options", [{}, {"palu_rank": 24}, {"palu_quantize_values": False}])
def test_a_layers_keys_and_values_are_fitted_as_one_batch_with_their_own_bases(monkeypatch, options):
    """The first fit takes both tensors' Gram matrices through one batch of eigenproblems
    (one host read of both ranks, not a wait for the device a tensor), and each tensor gets
    the basis, mean and rank its own fit gives, bit for bit (each matrix decomposed alone)."""
    from veloxquant_mlx.lowrank import latent

    keys, values = kv(200, h=4, d=32, seed=3)
    values = values * mx.linspace(2.0, 0.05, 32)  # a spectrum of their own: the values' rank differs
    calls = []
    real = latent.gram_basis
    monkeypatch.setattr(latent, "gram_basis", lambda x, *a: calls.append(x.shape) or real(x, *a))
    cache = palu(palu_n_head_groups=2, **options)
    feed(cache, keys, values, 200)
    assert calls == [(2, 1, 2, 200, 64)]
    o = cache.config.options
    for lat, x in ((cache.store.keys, keys), (cache.store.values, values)):
        grouped = x.reshape(1, 2, 2, 200, 32).swapaxes(2, 3).reshape(1, 2, 200, 64)
        mean, basis = latent.fit_basis(grouped, o.palu_rank, o.palu_energy_threshold)
        assert mx.array_equal(lat.basis, basis).item() and mx.array_equal(lat.mean, mean).item()
    if not options:
        assert cache.store.keys.basis.shape[-1] != cache.store.values.basis.shape[-1]
