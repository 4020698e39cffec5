"""SVDq: exact at full rank, the bit schedule (0 drops a direction), the per-head basis
fitted once enough tokens are held, the singular-value-mass rank rule, decode over the latents
against attention over the reconstruction, and memory against the card's formula."""

import mlx.core as mx
import numpy as np
import pytest

from test_kivi import feed
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import SVDqOptions
from veloxquant_mlx.lowrank.factors import energy_rank
from veloxquant_mlx.lowrank.latent import split_channels
from veloxquant_mlx.methods.svdq import SVDqCache
from feeding import stored_decode_attention


def svdq(**options):
    return SVDqCache(KVCacheConfig(method="svdq", options=SVDqOptions(**options)), None, 0)


def kv(t, d=64, h=2, seed=0, rank=None):
    """Keys with a decaying spectrum (or of exactly ``rank``), their own subspace per head."""
    rng = np.random.default_rng(seed)
    r = rank or d
    a = rng.normal(size=(1, h, t, r)) * (0.7 ** np.arange(r) if rank is None else 1.0)
    b = np.linalg.qr(rng.normal(size=(h, d, d)))[0][..., :r]  # a different basis per head
    k = a @ b.swapaxes(-1, -2)[None] + rng.normal(size=(1, h, 1, d))
    v = rng.normal(size=(1, h, t, d))
    return mx.array(k, mx.float32), mx.array(v, mx.float32)


def prompt_then_decode(cache, keys, values, n_prompt, chunk=100):
    feed(cache, keys[:, :, :n_prompt], values[:, :, :n_prompt], chunk)
    feed(cache, keys[:, :, n_prompt:], values[:, :, n_prompt:], 1)


def rel_err(a, b):
    return float(mx.sqrt(((a - b) ** 2).sum()) / mx.sqrt((b**2).sum()))


def test_full_rank_unquantized_is_exact_and_values_are_untouched():
    keys, values = kv(300)
    cache = svdq(svdq_rank=4096, svdq_bit_schedule=(16,) * 8)
    prompt_then_decode(cache, keys, values, 250)
    k_hat, v_hat = cache.dequantized(mx.float32)
    assert cache.store.keys.basis.shape == (1, 2, 64, 64)  # clipped to head_dim
    assert mx.allclose(k_hat, keys, atol=1e-5, rtol=1e-5)
    assert mx.array_equal(v_hat, values)
    basis = cache.store.keys.basis
    assert mx.allclose(basis.swapaxes(-1, -2) @ basis, mx.eye(64), atol=1e-5)  # V_rᵀ V_r = I


def test_the_basis_waits_for_as_many_tokens_as_its_rows_and_is_fitted_on_all_of_them():
    """Fewer tokens than head_dim (64) stay exact; the chunk that brings the count there
    fits the basis on every token held, however they were chunked."""
    keys, values = kv(200)
    whole, chunked = svdq(), svdq()
    feed(whole, keys[:, :, :80], values[:, :, :80], 80)
    feed(chunked, keys[:, :, :40], values[:, :, :40], 20)
    assert not chunked.store.fitted  # too few tokens: kept exactly
    assert mx.array_equal(chunked.dequantized(mx.float32)[0], keys[:, :, :40])
    feed(chunked, keys[:, :, 40:80], values[:, :, 40:80], 40)
    assert chunked.store.fitted and whole.store.fitted  # compressed at the end of the prefill
    for c in (whole, chunked):
        feed(c, keys[:, :, 80:], values[:, :, 80:], 1)
    a, b = whole.state["arrays"], chunked.state["arrays"]
    assert a.keys() == b.keys() and all(mx.array_equal(a[n], b[n]) for n in a if a[n] is not None)


def test_each_head_has_its_own_basis():
    keys, values = kv(128, rank=6)  # two heads, each exactly rank 6 in its own subspace
    cache = svdq(svdq_rank=6, svdq_bit_schedule=(16,))
    prompt_then_decode(cache, keys, values, 127)
    assert rel_err(cache.dequantized(mx.float32)[0], keys) < 1e-5  # one basis for both would fail
    shared = np.abs(np.array(cache.store.keys.basis[0, 0]).T @ np.array(cache.store.keys.basis[0, 1]))
    assert shared.max() < 0.9


def test_zero_bits_drop_their_directions_and_store_nothing():
    keys, values = kv(257)
    cache = svdq(svdq_rank=64, svdq_bit_schedule=(16, 0))
    prompt_then_decode(cache, keys, values, 256)
    latents = cache.store.keys.tokens
    assert [(s.start, s.stop, s.bits) for s in latents.segments] == [(0, 32, 16), (32, 64, 0)]
    assert list(latents.exact) == [0] and not latents.packed  # nothing kept for the dropped half
    dense = latents.dense()
    assert mx.array_equal(dense[..., :256, 32:], mx.zeros_like(dense[..., :256, 32:]))
    mean, basis = cache.store.keys.mean, cache.store.keys.basis
    kept = basis[..., :32]
    projected = (keys[:, :, :256] - mean) @ kept @ kept.swapaxes(-1, -2) + mean
    assert mx.allclose(cache.dequantized(mx.float32)[0][:, :, :256], projected, atol=1e-5)
    # the newest token (one buffered latent, a group not yet full) still has every direction
    assert mx.allclose(cache.dequantized(mx.float32)[0][:, :, 256:], keys[:, :, 256:], atol=1e-5)


def test_each_group_is_quantized_at_its_width():
    keys, values = kv(257)
    schedule = (8, 4, 2, 1)
    cache = svdq(svdq_rank=64, svdq_bit_schedule=schedule, svdq_group_size=32)
    prompt_then_decode(cache, keys, values, 256)
    store = cache.store.keys
    exact = np.array((keys[:, :, :256] - store.mean) @ store.basis)  # (1, H, 256, 64)
    got = np.array(store.tokens.dense()[:, :, :256])
    errors = []
    for seg, bits in zip(split_channels(64, schedule), schedule):
        x = exact[..., seg.start:seg.stop].reshape(1, 2, 8, 32, -1)  # token groups of 32
        step = (x.max(axis=3) - x.min(axis=3)) / (2**bits - 1)  # per channel and group
        err = np.abs(got[..., seg.start:seg.stop].reshape(x.shape) - x).max(axis=3)
        assert (err <= step / 2 + 1e-5).all()  # min-max rounding at this width, no coarser
        errors.append(float((err / (x.max(axis=3) - x.min(axis=3))).max()))
    assert errors == sorted(errors)  # fewer bits, larger relative error


def test_the_rank_holds_the_singular_value_mass_largest_over_heads():
    keys, values = kv(300)
    sigmas = np.linalg.svd(np.array(keys - keys.mean(axis=2, keepdims=True)), compute_uv=False)  # (1, H, 64)
    ranks = []
    for f in (0.5, 0.8, 0.95, 0.99):
        cache = svdq(svdq_energy_threshold=f)
        prompt_then_decode(cache, keys, values, 299, chunk=299)
        mass = np.cumsum(sigmas, axis=-1) / sigmas.sum(axis=-1, keepdims=True)
        expected = int((np.argmax(mass >= f - 1e-6, axis=-1) + 1).max())
        ranks.append(cache.store.keys.basis.shape[-1])
        # the fit reads singular values from the float32 Gram matrix: the 50 directions of
        # this data below 1e-6 of the largest come out near 1e-3 of it, ~0.1% of the mass,
        # which may add one direction at 99%
        assert expected <= ranks[-1] <= expected + (f > 0.95)
    assert ranks == sorted(ranks) and ranks[0] < ranks[-1]
    sigma = mx.array([4.0, 2.0, 1.0, 1.0])  # mass 4/8 = 0.5 at r = 1; energy 16/22 at r = 1
    assert int(energy_rank(sigma, 0.6, power=1)) == 2 and int(energy_rank(sigma, 0.6)) == 1


def test_decode_over_latents_equals_attention_over_the_reconstruction():
    keys, values = kv(230)
    cache = svdq(svdq_group_size=32)
    prompt_then_decode(cache, keys, values, 200)  # 224 quantized, 6 buffered latents
    assert (cache.store.keys.tokens.flushed, cache.store.keys.tokens.buf.length) == (224, 6)
    k_hat, v_hat = cache.dequantized(mx.float32)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(3))
    ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=0.125)
    assert mx.allclose(stored_decode_attention(cache, q, 0.125), ref, atol=1e-5, rtol=1e-4)
    assert 0.001 < rel_err(k_hat, keys) < 0.5  # lossy, and far from useless


def test_memory_is_the_cards_formula():
    t, d, h, s = 512, 64, 2, 4  # 512 tokens fill the 256-token growth steps exactly
    keys, values = kv(t)
    schedule = (8, 4, 2, 1, 1, 0, 0, 0)
    cache = svdq(svdq_rank=64, svdq_bit_schedule=schedule, svdq_group_size=32)
    prompt_then_decode(cache, keys, values, t - 1, chunk=256)
    n_g = 64 // len(schedule)
    per_token = h * (sum(n_g * b / 8 for b in schedule) + sum(n_g * 2 * s / 32 for b in schedule if b))
    basis = h * (d * 64 + d) * s
    moments = h * (d * d + 2 * d) * 4  # float32 Gram, sum and shift, for the refits
    room = h * 32 * 64 * s  # the decode buffer's room, a quantization group, kept across flushes
    assert cache.nbytes == t * per_token + basis + moments + room + t * h * d * s  # keys, basis, exact values
    assert per_token == h * 26  # 16 code bytes + 10 of scales a head, against 256 in float32


def test_a_width_that_cannot_be_stored_is_refused_by_name():
    with pytest.raises(ValueError, match=r"svdq_bit_schedule=\(8, 7\).*width 7.*allowed: 0"):
        svdq(svdq_bit_schedule=(8, 7))


def test_a_cache_saved_with_one_entry_per_segment_loads_as_its_joined_span():
    """The default schedule's two 1-bit segments are stored as one span; a file written
    before that keeps them apart (each channel quantized alone, so the old arrays are the
    span's channel slices): it loads, and decodes as the cache that was saved."""
    keys, values = kv(400)
    cache = svdq(svdq_bit_schedule=(8, 4, 2, 1, 1, 0, 0, 0))
    prompt_then_decode(cache, keys, values, 300)
    tokens = cache.store.keys.runs[0].tokens
    (first, span), = [(i, s) for i, s in tokens.spans if s.bits == 1]
    old = [s for s in tokens.segments if s.bits == 1]
    assert len(old) == 2 and span.stop - span.start == sum(s.stop - s.start for s in old)
    state = cache.state
    arrays = dict(state["arrays"])
    for suffix in ("_codes", "_scales", "_biases"):
        joined = arrays.pop(f"k{first}{suffix}")
        at = 0
        for j, s in enumerate(old):
            width = s.stop - s.start
            arrays[f"k{first + j}{suffix}"] = joined[:, :, at:at + width]
            at += width
    loaded = SVDqCache.from_state({"arrays": arrays, "meta": state["meta"]})
    again = loaded.state["arrays"]
    assert again.keys() == state["arrays"].keys()
    assert all(mx.array_equal(again[n], state["arrays"][n])
               for n in again if again[n] is not None)
