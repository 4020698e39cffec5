"""MorphKV's card invariants, by brute force on synthetic K/V/Q.

Caches are driven the way mlx-lm drives them: update_and_fetch, then attention through
the cache (the hook's job); the last prompt token comes alone, then one token a step.
The simulation is written in the official order: at the step of token t, the previous W
queries (t - W .. t - 1) vote, one token older than the W + 1 newest is dropped, and t
attends over what is left.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from feeding import feed, synthetic_kvq
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import MorphKVOptions
from veloxquant_mlx.evict.base import ScoreInputs
from veloxquant_mlx.methods.morphkv import MorphKVCache, window_logits
from paper_rule import evict_every_step  # noqa: F401  (a fixture)

# these tests replay the papers' rules: a token leaves at every decode step
pytestmark = pytest.mark.usefixtures("evict_every_step")

HKV, D = 2, 16
SCALE = D**-0.5


def synthetic(n, group=3, seed=0):
    return synthetic_kvq(n, HKV, group, D, q_scale=1.5, norm_range=(0.2, 3.0), seed=seed)


def morph(fusion="sum", **options):
    cache = MorphKVCache(KVCacheConfig(options=MorphKVOptions(**options)))
    cache.fusion = fusion
    return cache


def kept_sets(cache):
    if cache.kept_positions is None:
        return [set(range(cache.offset))] * HKV
    return [set(cache.kept_positions[0, h].tolist()) for h in range(HKV)]


def fused(kn, qn, h, group, rows, cands, fusion="sum"):
    """Brute force, float64: softmax over ``cands`` of the group-summed logits of each
    query row, fused over the rows; {candidate: score}."""
    qs = qn[h * group : (h + 1) * group][:, rows]  # (G, W, D)
    logits = np.einsum("gwd,jd->wj", qs, kn[h][cands]) * SCALE
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    f = p.sum(0) if fusion == "sum" else p.max(0)
    return dict(zip(cands, f))


def attention(kn, vn, qn, h_q, group, t, kept):
    rows = sorted(kept)
    x = kn[h_q // group][rows] @ qn[h_q, t] * SCALE
    w = np.exp(x - x.max())
    return (w / w.sum()) @ vn[h_q // group][rows]


@pytest.mark.parametrize("budget,sink,window,group,chunk",
                         [(40, 4, 8, 3, 37), (24, 0, 1, 1, 50), (30, 3, 5, 3, 200), (20, 2, 17, 2, 64)])
def test_each_step_drops_the_argmin_of_the_fused_window_profile_and_attends_to_the_rest(
        budget, sink, window, group, chunk):
    n_prompt, n = 90, 150
    k, v, q = synthetic(n, group=group, seed=budget)
    kn, vn, qn = (np.array(a[0], dtype=np.float64) for a in (k, v, q))
    cache = morph(morphkv_budget=budget, morphkv_n_sink=sink, morphkv_window=window)
    for start in range(0, n_prompt - 1, chunk):
        feed(cache, k, v, q, start, min(start + chunk, n_prompt - 1))
    out = feed(cache, k, v, q, n_prompt - 1, n_prompt)  # the prefill end: everything attended
    assert np.allclose(np.array(out[0, :, 0]), [attention(kn, vn, qn, h, group, n_prompt - 1, range(n_prompt))
                                                for h in range(HKV * group)], atol=1e-5)
    kept = [set(range(n_prompt)) for _ in range(HKV)]
    for t in range(n_prompt, n):
        protected = set(range(sink)) | set(range(t - window, t))
        for h in range(HKV):  # before token t: the previous W queries vote on the older tokens
            if len(kept[h]) > budget:
                score = fused(kn, qn, h, group, list(range(t - window, t)), sorted(kept[h] - protected))
                ranked = sorted(score, key=score.get)  # the prompt keeps its best, a step drops one
                kept[h] -= set(ranked[: len(kept[h]) - budget])
        assert kept_sets(cache) == kept  # what the cache kept after the previous attention
        assert cache.stored_length == budget  # constant after the prompt
        kept = [s | {t} for s in kept]
        out = feed(cache, k, v, q, t, t + 1)
        expected = [attention(kn, vn, qn, hq, group, t, kept[hq // group]) for hq in range(HKV * group)]
        assert np.allclose(np.array(out[0, :, 0]), expected, atol=1e-5)


def test_the_size_is_constant_after_the_prompt_and_sinks_and_the_window_stay():
    budget, sink, window = 32, 3, 6
    k, v, q = synthetic(160, seed=7)
    cache = morph(morphkv_budget=budget, morphkv_n_sink=sink, morphkv_window=window)
    feed(cache, k, v, q, 0, 99)
    assert cache.stored_length == 99 and cache.kept_positions is None  # no pruning mid-prompt
    for t in range(99, 160):
        feed(cache, k, v, q, t, t + 1)
        seen = t + 1
        assert cache.stored_length == budget and cache.offset == seen
        for kept in kept_sets(cache):
            assert set(range(sink)) | set(range(seen - window, seen)) <= kept
        assert mx.all(cache.kept_positions[..., 1:] > cache.kept_positions[..., :-1])


def test_under_budget_nothing_is_evicted_and_attention_is_exact():
    k, v, q = synthetic(60, seed=3)
    cache = morph(morphkv_budget=64)
    outs = [feed(cache, k, v, q, 0, 40)] + [feed(cache, k, v, q, t, t + 1) for t in range(40, 60)]
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask="causal")
    assert cache.stored_length == 60 and cache.kept_positions is None
    assert mx.allclose(mx.concatenate(outs, axis=2), ref, atol=1e-5)


def test_the_logit_buffer_is_minus_inf_exactly_after_each_rows_query():
    window = 8
    k, v, q = synthetic(120, seed=11)
    for budget, stop in ((512, 80), (30, 120)):  # before any eviction, and with reused slots
        cache = morph(morphkv_budget=budget, morphkv_window=window)
        feed(cache, k, v, q, 0, 60)
        for t in range(60, stop):
            feed(cache, k, v, q, t, t + 1)
        inputs = ScoreInputs(cache, q[:, :, stop - 1 : stop], SCALE)
        positions = inputs.positions
        q_pos = mx.arange(cache.offset - window, cache.offset)
        a = window_logits(inputs.window_queries, inputs.keys, SCALE, q_pos, positions)
        assert a.shape == (1, HKV * 3, window, cache.store.rows)
        later = positions[:, :, None, :] > q_pos[:, None]  # (1, Hkv, W, rows)
        later = mx.repeat(later, 3, axis=1)
        assert mx.array_equal(mx.isneginf(a), later)
        # the finite entries are q.k * scale of the right query and key
        qw = mx.array(np.array(q[0, :, stop - window : stop]))
        keys = mx.repeat(inputs.keys, 3, axis=1)[0]
        brute = (qw @ keys.swapaxes(-1, -2)) * SCALE
        assert mx.allclose(mx.where(later[0], 0.0, a[0]), mx.where(later[0], 0.0, brute), atol=1e-5)
        if budget < stop:
            assert cache.store.free is not None  # slots were reused: not in token order


def test_sum_and_max_fusion_agree_for_one_query_and_differ_for_several():
    k, v, q = synthetic(140, seed=5)
    for window, same in ((1, True), (6, False)):
        caches = [morph(f, morphkv_budget=24, morphkv_n_sink=2, morphkv_window=window) for f in ("sum", "max")]
        differ = False
        for c in caches:
            feed(c, k, v, q, 0, 79)
        for t in range(79, 140):
            for c in caches:
                feed(c, k, v, q, t, t + 1)
            differ |= kept_sets(caches[0]) != kept_sets(caches[1])
        assert differ != same


def test_one_query_one_head_keeps_the_top_logits_of_the_last_query():
    """g = 1, W = 1: softmax is monotone, so each step drops the candidate with the lowest
    q_t . k among the tokens older than the newest one."""
    k, v, q = synthetic(130, group=1, seed=9)
    kn, qn = np.array(k[0]), np.array(q[0])
    cache = morph(morphkv_budget=20, morphkv_n_sink=0, morphkv_window=1)
    feed(cache, k, v, q, 0, 60)
    feed(cache, k, v, q, 60, 61)
    for t in range(61, 130):
        before = kept_sets(cache)
        feed(cache, k, v, q, t, t + 1)
        for h, kept in enumerate(kept_sets(cache)):
            cands = sorted(before[h] | {t} - {t})
            assert kept == (before[h] | {t}) - {cands[int(np.argmin(kn[h][cands] @ qn[h, t]))]}


def test_selection_ignores_a_constant_added_to_each_rows_logits():
    """k + u for every key adds q_r . u to all of row r's logits: the softmax, and so the
    kept tokens, are unchanged."""
    k, v, q = synthetic(140, seed=13)
    u = 2.0 * mx.random.normal((1, HKV, 1, D), key=mx.random.key(99))
    sets = []
    for keys in (k, k + u):
        cache = morph(morphkv_budget=28, morphkv_window=5)
        feed(cache, keys, v, q, 0, 69)
        for t in range(69, 140):
            feed(cache, keys, v, q, t, t + 1)
        sets.append(kept_sets(cache))
    assert sets[0] == sets[1]


def test_the_window_queries_are_what_is_kept_and_counted():
    k, v, q = synthetic(100, seed=1)
    cache = morph(morphkv_budget=40, morphkv_window=8)
    feed(cache, k, v, q, 0, 70)
    for t in range(70, 100):
        feed(cache, k, v, q, t, t + 1)
    assert mx.array_equal(cache.window_queries, q[:, :, 92:100])  # the last W, this step's included
    store = sum(a.nbytes for a in cache.store.arrays.values()) + cache.store.free.nbytes
    assert cache.nbytes == store + cache.window_queries.nbytes
