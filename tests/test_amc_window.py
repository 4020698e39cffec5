"""AMC's decode window: decode tokens wait exact and are tiered FLUSH at a time in one
batched step. At every flush the tiers hold, bit for bit, what a step of one token each
(the per-token rule, written out below) would have put there; a prompt chunk flushes the
window first; attention reads the held rows; state round-trips them."""

import types

import mlx.core as mx
import numpy as np
import pytest

from test_amc import amc, kv
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import AMCOptions
from veloxquant_mlx.methods.amc.cache import FIT_TOKENS, FLUSH, AMCCache
from veloxquant_mlx.methods.amc.tiering import thresholds


def per_token_step(cache, k, v):
    """A decode token stored the way a step of one token stores it: the fit at its token,
    its tier by the thresholds before it, its saliency into the window, the thresholds
    moved, the nearest tier with room (ties toward the finer one), written at the count."""
    if cache.store is None:
        cache._build(k.shape[-1], cache.rotary)
    o, store = cache.config.options, cache.store
    start = store.length
    if cache.mu is None and start + 1 >= FIT_TOKENS:
        cache._fit_with_history(k, v)
    if cache.mu is None:
        store.commit(k, v, *cache._all_high(k))
        return
    s_int = cache._intrinsic(cache._unrotated(k, start))
    s = s_int
    if cache.window_int is not None:
        s = (cache.window_int[..., : cache.seen] < s_int).astype(mx.float32).mean(axis=-1, keepdims=True)
    wanted = mx.where(s >= cache.theta[..., :1], 0, mx.where(s >= cache.theta[..., 1:], 1, 2))
    cache._remember(s, s_int)
    if o.amc_adaptive_thresholds and cache.seen >= 2:
        new = thresholds(cache.window[..., : cache.seen], o.amc_k_high, o.amc_k_mid)
        cache.theta = new if o.amc_gamma == 1 else mx.where(
            new == cache.theta, cache.theta, (1 - o.amc_gamma) * cache.theta + o.amc_gamma * new)
    (caps,) = store.step_capacities(1)
    held = [mx.zeros(wanted.shape[:2], mx.int32) if t.counts is None else t.counts for t in store.k_tiers]
    room = mx.stack([c < cap - 1 for c, cap in zip(held, caps)], axis=-1)
    order = mx.arange(3)
    cost = 2 * mx.abs(order - wanted) + (order > wanted)
    taken = mx.argmin(mx.where(room, cost, 12), axis=-1, keepdims=True).astype(mx.uint8)
    store._write(k, v, taken, [1, 1, 1], caps)


def rotary_context():
    from tiny_models import tiny_model

    return types.SimpleNamespace(model_args=tiny_model("llama").args)


def made(context=None, **options):
    return AMCCache(KVCacheConfig(method="amc", options=AMCOptions(**options)), context, 0)


def chunk(cache, k, v, start, stop, seed=0):
    keys, values = k[:, :, start:stop], v[:, :, start:stop]
    cache.update_and_fetch(keys, values)
    q = mx.random.normal((1, 2 * k.shape[1], stop - start, k.shape[3]), key=mx.random.key(seed + start))
    return cache.attend(q, keys, values, scale=k.shape[3] ** -0.5, mask="causal" if stop - start > 1 else None)


def assert_same_tiers(got, want):
    """Thresholds, saliency window, flags, host counters, and every tier's rows held by
    each head (codes, scales, biases, positions) and counts: equal bit for bit."""
    for name in ("theta", "window", "window_int", "seen", "at"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if isinstance(a, mx.array):
            assert np.array_equal(np.array(a), np.array(b)), name
        else:
            assert a == b, name
    gs, ws = got.store, want.store
    assert np.array_equal(np.array(gs.flags.view()), np.array(ws.flags.view()))
    assert gs.expected == ws.expected
    for tiers in ("k_tiers", "v_tiers"):
        for t, (g, w) in enumerate(zip(getattr(gs, tiers), getattr(ws, tiers))):
            assert (g.capacity, g.bound) == (w.capacity, w.bound), (tiers, t)
            counts = np.array(w.counts)
            assert np.array_equal(np.array(g.counts), counts), (tiers, t)
            for field in ("codes", "scales", "biases", "positions"):
                a, b = getattr(g, field), getattr(w, field)
                assert (a is None) == (b is None), (tiers, t, field)
                if a is None:
                    continue
                a, b = np.array(a), np.array(b)
                for i, j in np.ndindex(*counts.shape):
                    n = counts[i, j]
                    assert np.array_equal(a[i, j, :n], b[i, j, :n]), (tiers, t, field, i, j)


SETTINGS = {
    "frozen": {},
    "adaptive, window 8": {"amc_adaptive_thresholds": True, "amc_threshold_window": 8, "amc_gamma": 0.25},
    "adaptive, window 48, gamma 1": {"amc_adaptive_thresholds": True, "amc_threshold_window": 48, "amc_gamma": 1.0},
    "query saliency, window 8": {"amc_use_query_saliency": True, "amc_adaptive_thresholds": True,
                                 "amc_threshold_window": 8},
    "query saliency, window 100": {"amc_use_query_saliency": True, "amc_adaptive_thresholds": True,
                                   "amc_threshold_window": 100, "amc_gamma": 0.5},
    "crowded tiers": {"amc_k_high": 0.05, "amc_k_mid": 0.05, "amc_adaptive_thresholds": True,
                      "amc_threshold_window": 16},
}


@pytest.mark.parametrize("rotary", [False, True], ids=["post-RoPE", "pre-RoPE"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_flush_stores_what_steps_of_one_token_store(name, rotary):
    """96 decode tokens after a 100-token prompt: after each flush the two caches hold the
    same tiers, bit for bit; the window holds what came since."""
    k, v = kv(100 + 3 * FLUSH + 5, seed=21)
    context = rotary_context() if rotary else None
    got, want = made(context, **SETTINGS[name]), made(context, **SETTINGS[name])
    assert (got.rotary is None) == (not rotary)
    for cache in (got, want):
        chunk(cache, k, v, 0, 100)
    for i in range(100, k.shape[2]):
        chunk(got, k, v, i, i + 1)
        want.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        want._take_chunk(None)
        per_token_step(want, k[:, :, i : i + 1], v[:, :, i : i + 1])
        if (i + 1 - 100) % FLUSH == 0:
            assert got.pending_k.length == 0 and got.store.length == i + 1
            assert_same_tiers(got, want)
    assert got.pending_k.length == 5 and got.stored_length == k.shape[2]
    assert np.array_equal(np.array(got.pending_k.view()), np.array(k[:, :, -5:]))


@pytest.mark.parametrize("n_prompt", [1, 40, FIT_TOKENS - 1])
def test_tokens_before_the_fit_then_the_fit_at_its_token_as_steps_of_one_token_do(n_prompt):
    k, v = kv(n_prompt + 4 * FLUSH - (n_prompt == 1), seed=22)  # a 1-token prompt is a decode step
    got, want = (made(amc_adaptive_thresholds=True, amc_threshold_window=8) for _ in range(2))
    first = 0 if n_prompt == 1 else n_prompt
    for cache in (got, want):
        if first:
            chunk(cache, k, v, 0, n_prompt)
    for i in range(first, k.shape[2]):
        chunk(got, k, v, i, i + 1)
        want.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        want._take_chunk(None)
        per_token_step(want, k[:, :, i : i + 1], v[:, :, i : i + 1])
    assert got.pending_k.length == 0 and got.mu is not None
    assert np.array_equal(np.array(got.mu), np.array(want.mu))
    assert_same_tiers(got, want)


def test_a_prompt_chunk_flushes_the_window_first_in_order():
    k, v = kv(200, seed=23)
    got, want = amc(), amc()
    for cache in (got, want):
        chunk(cache, k, v, 0, 100)
    for i in range(100, 110):
        chunk(got, k, v, i, i + 1)
        want.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        want._take_chunk(None)
        per_token_step(want, k[:, :, i : i + 1], v[:, :, i : i + 1])
    assert got.pending_k.length == 10
    for cache in (got, want):
        chunk(cache, k, v, 110, 150)
    assert got.pending_k.length == 0 and got.store.length == 150
    assert_same_tiers(got, want)


def test_a_decode_step_attends_over_the_tiers_and_the_held_rows_exactly():
    k, v = kv(150, seed=24)
    cache = amc(amc_threshold_window=8)
    chunk(cache, k, v, 0, 120)
    for i in range(120, 149):
        chunk(cache, k, v, i, i + 1)
    k_hat, v_hat = cache.dequantized(mx.float32)
    assert cache.pending_k.length == 29
    assert mx.array_equal(k_hat[:, :, 120:], k[:, :, 120:149])  # the window is exact
    cache.update_and_fetch(k[:, :, 149:], v[:, :, 149:])
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(25))
    out = cache.attend(q, k[:, :, 149:], v[:, :, 149:], scale=0.125, mask=None)
    want = mx.fast.scaled_dot_product_attention(q, mx.concatenate([k_hat, k[:, :, 149:]], axis=2),
                                                mx.concatenate([v_hat, v[:, :, 149:]], axis=2), scale=0.125, mask=None)
    assert cache.pending_k.length == 30
    assert mx.allclose(out, want, atol=1e-5)


def test_the_window_is_counted_saved_and_checked():
    k, v = kv(170, seed=26)
    cache = amc()
    chunk(cache, k, v, 0, 120)
    for i in range(120, 133):
        chunk(cache, k, v, i, i + 1)
    room = cache.pending_k.capacity
    assert 13 <= room <= FLUSH and cache.pending_k.buffer.shape == (1, 2, room, 64)
    without = sum(a.nbytes for name, a in cache._arrays().items() if a is not None and "pending" not in name)
    assert cache.nbytes - without == 2 * 2 * room * 64 * 4  # keys and values, 2 heads, float32
    for held in (13, 0):  # a window holding rows, and one emptied by its flush (its room kept)
        loaded = AMCCache.from_state(cache.state)
        assert loaded.nbytes == cache.nbytes and loaded.stored_length == cache.stored_length
        assert loaded.pending_k.length == cache.pending_k.length == held
        for i in range(cache.offset, cache.offset + 7):
            a, b = chunk(cache, k, v, i, i + 1), chunk(loaded, k, v, i, i + 1)
            assert mx.array_equal(a, b)
        if held:
            for i in range(cache.offset, 152):
                chunk(cache, k, v, i, i + 1)
            assert cache.pending_k.length == 0 and cache.pending_k.capacity == FLUSH
    state = cache.state
    state["meta"]["offset"] = cache.offset - 1
    with pytest.raises(Exception, match="tokens stored"):
        AMCCache.from_state(state)
