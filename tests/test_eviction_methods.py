"""The invariants each eviction method's card states, checked by brute force.

Caches are driven directly with synthetic keys, values and queries, the way mlx-lm
calls them: update_and_fetch, then attention through the cache (the hook's job).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from feeding import feed, prompt_then_steps, synthetic_kvq
from paper_rule import evict_every_step, no_recent_floor  # noqa: F401  (fixtures)
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import H2OOptions, L2NormOptions, TOVAOptions
from veloxquant_mlx.methods.h2o import H2OCache
from veloxquant_mlx.methods.knorm import L2NormCache
from veloxquant_mlx.methods.tova import TOVACache

# these tests replay the papers' rules: a token leaves at every decode step
pytestmark = pytest.mark.usefixtures("evict_every_step")

HKV, GROUP, D = 2, 3, 16
SCALE = D**-0.5


def synthetic(n, seed=0):
    """Keys with very different norms per token, values, queries: (1, H, n, D) each."""
    return synthetic_kvq(n, HKV, GROUP, D, norm_range=(0.2, 3.0), seed=seed)


def prompt_then_decode(cache, k, v, q, n_prompt, chunk, after_each=None):
    prompt_then_steps(cache, k, v, q, n_prompt, chunk, after_each=after_each)


def kept_sets(cache):
    return [set(cache.kept_positions[0, h].tolist()) for h in range(HKV)]


# -- knorm ------------------------------------------------------------------------------
@pytest.mark.parametrize("keep", ["low", "high"])
@pytest.mark.usefixtures("no_recent_floor")
def test_knorm_kept_norms_beat_every_evicted_candidate(keep):
    n, budget, sink, recent = 300, 40, 4, 6
    k, v, q = synthetic(n)
    norms = mx.sqrt(mx.square(k).sum(-1))[0]  # (H, n)
    config = KVCacheConfig(options=L2NormOptions(knorm_budget=budget, knorm_n_sink=sink,
                                                 knorm_recent=recent, knorm_keep=keep))
    cache = L2NormCache(config)

    def check(cache, seen):
        assert cache.stored_length == min(seen, budget)
        for h, kept in enumerate(kept_sets(cache)):
            protected = set(range(sink)) | set(range(seen - recent, seen))
            assert protected <= kept
            cand_kept = [norms[h, j].item() for j in kept - protected]
            evicted = [norms[h, j].item() for j in set(range(seen)) - kept - protected]
            if keep == "low":
                assert max(cand_kept) <= min(evicted)
            else:
                assert min(cand_kept) >= max(evicted)

    prompt_then_decode(cache, k, v, q, 200, chunk=64, after_each=check)


def test_knorm_compresses_after_every_chunk_so_a_prompt_never_holds_more_than_budget_plus_a_chunk():
    k, v, q = synthetic(400)
    cache = L2NormCache(KVCacheConfig(options=L2NormOptions(knorm_budget=50)))
    for start in range(0, 384, 64):
        feed(cache, k, v, q, start, start + 64)
        assert cache.stored_length == 50
        assert cache.store.arrays["keys"].capacity <= 50 + 64 + 1


def test_knorm_selection_ignores_key_scale_and_rotation():
    k, v, q = synthetic(160)
    config = KVCacheConfig(options=L2NormOptions(knorm_budget=30, knorm_n_sink=0))
    theta = mx.random.uniform(0, 6.28, (D // 2,), key=mx.random.key(9))
    c, s = mx.cos(theta), mx.sin(theta)
    k1, k2 = k[..., : D // 2], k[..., D // 2 :]
    rotated = mx.concatenate([k1 * c - k2 * s, k1 * s + k2 * c], axis=-1)  # RoPE-like, any angle
    sets = []
    for keys in (k, 3.5 * k, rotated):
        cache = L2NormCache(config)
        prompt_then_decode(cache, keys, v, q, 160, chunk=48)
        sets.append(kept_sets(cache))
    # equal up to floating-point ties: at most one swap per head
    for other in sets[1:]:
        assert all(len(a ^ b) <= 2 for a, b in zip(sets[0], other))


# -- tova -----------------------------------------------------------------------------------
def _head_averaged_last_row(keys, query):
    """Brute force: softmax(q K^T) of one query, averaged over every query head: (n,)."""
    qh = query.reshape(1, HKV, GROUP, 1, D).astype(mx.float32)
    logits = (qh * SCALE) @ keys[:, :, None].astype(mx.float32).swapaxes(-1, -2)
    return mx.softmax(logits, axis=-1)[0, :, :, 0].mean(axis=(0, 1))


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.usefixtures("no_recent_floor")
def test_tova_keeps_what_the_last_query_attends_to_most_and_drops_its_argmin(backend):
    n_prompt, budget, sink = 120, 32, 2
    k, v, q = synthetic(170, seed=5)
    config = KVCacheConfig(options=TOVAOptions(tova_budget=budget, tova_n_sink=sink, tova_backend=backend))
    cache = TOVACache(config)
    for start in range(0, n_prompt - 1, 50):  # all but the last prompt token
        feed(cache, k, v, q, start, min(start + 50, n_prompt - 1))
    # the prompt's end: top-budget of the last prompt query's head-averaged attention
    w = _head_averaged_last_row(k[:, :, :n_prompt], q[:, :, n_prompt - 1 : n_prompt])
    w = mx.where(mx.arange(n_prompt) < sink, float("inf"), w)
    expected = set(mx.argsort(-w)[:budget].tolist())
    feed(cache, k, v, q, n_prompt - 1, n_prompt)
    assert kept_sets(cache) == [expected] * HKV
    for t in range(n_prompt, 170):  # each step drops the argmin over budget + 1 tokens
        before = sorted(kept_sets(cache)[0])
        rows = mx.array(before + [t])
        w = _head_averaged_last_row(k[:, :, rows], q[:, :, t : t + 1])
        w = mx.where(rows < sink, float("inf"), w)
        victim = int(rows[mx.argmin(w)])
        feed(cache, k, v, q, t, t + 1)
        assert cache.stored_length == budget
        assert kept_sets(cache) == [set(before + [t]) - {victim}] * HKV  # every head the same


# -- h2o ------------------------------------------------------------------------------------
def _naive_mass(k, q, decay, n):
    """S_h[j] = sum_i decay^(n-1-i) * mean_g softmax(q_i K^T)[j], causal, float32: (H, n)."""
    qh = q[:, :, :n].reshape(1, HKV, GROUP, n, D)
    logits = (qh * SCALE) @ k[:, :, None, :n].swapaxes(-1, -2)
    logits = mx.where(mx.arange(n)[None] <= mx.arange(n)[:, None], logits, -float("inf"))
    a = mx.softmax(logits, axis=-1).mean(axis=2)[0]  # (H, n_q, n_k)
    weights = decay ** mx.arange(n - 1, -1, -1, dtype=mx.float32)
    return (a * weights[None, :, None]).sum(axis=1)


@pytest.mark.parametrize("decay", [1.0, 0.9])
@pytest.mark.parametrize("chunk", [1, 37, 300])
def test_h2o_mass_is_the_decayed_column_sum_however_the_prompt_is_chunked(decay, chunk):
    n = 150
    k, v, q = synthetic(n, seed=2)
    cache = H2OCache(KVCacheConfig(options=H2OOptions(h2o_budget=512, h2o_decay=decay)))
    for start in range(0, n, chunk):
        feed(cache, k, v, q, start, min(n, start + chunk))
    mass = cache.store.view("mass")[0]
    assert mx.allclose(mass, _naive_mass(k, q, decay, n), atol=1e-5, rtol=1e-4)
    if decay == 1.0:  # every query's softmax row sums to one
        assert mx.allclose(mass.sum(-1), mx.full((HKV,), float(n)), rtol=1e-5)


@pytest.mark.parametrize("sink,grace,decay", [(0, 0, 1.0), (3, 5, 0.98), (2, 0, 0.9)])
def test_h2o_matches_a_step_by_step_simulation(sink, grace, decay):
    """One token per call, simulated naively per head: attention of the step's query over
    the kept tokens plus itself, S <- decay * S + a, then the argmin of S among tokens that
    are neither sinks nor in the grace window is dropped."""
    budget, n = 24, 90
    k, v, q = synthetic(n, seed=3)
    cache = H2OCache(KVCacheConfig(options=H2OOptions(
        h2o_budget=budget, h2o_n_sink=sink, h2o_grace=grace, h2o_decay=decay)))
    kept = [[] for _ in range(HKV)]
    mass = [{} for _ in range(HKV)]
    for t in range(n):
        feed(cache, k, v, q, t, t + 1)
        for h in range(HKV):
            rows = kept[h] + [t]
            qh = q[0, h * GROUP : (h + 1) * GROUP, t].astype(mx.float32)  # (G, D)
            a = mx.softmax((qh * SCALE) @ k[0, h, mx.array(rows)].T, axis=-1).mean(0)
            mass[h] = {j: decay * mass[h].get(j, 0.0) + a[i].item() for i, j in enumerate(rows)}
            if len(rows) > budget:
                free = [j for j in rows if j >= sink and j < t + 1 - grace]
                victim = min(free, key=lambda j: mass[h][j])
                rows.remove(victim)
                del mass[h][victim]
            kept[h] = rows
        assert kept_sets(cache) == [set(r) for r in kept] if t >= budget else cache.kept_positions is None
    assert cache.stored_length == budget


def test_h2o_first_eviction_equals_a_full_attention_simulation():
    """gamma = 1, no sinks, no grace: the first decode-time victim is the argmin of the
    plain column sums over the budget + 1 tokens, computed from the full attention matrix."""
    budget = 40
    k, v, q = synthetic(budget + 1, seed=4)
    cache = H2OCache(KVCacheConfig(options=H2OOptions(h2o_budget=budget, h2o_n_sink=0, h2o_grace=0, h2o_decay=1.0)))
    for t in range(budget):  # prompt ends with a single token (prefill end): under budget
        feed(cache, k, v, q, t, t + 1)
    feed(cache, k, v, q, budget, budget + 1)
    naive = _naive_mass(k, q, 1.0, budget + 1)  # (H, budget + 1)
    for h, kept in enumerate(kept_sets(cache)):
        assert set(range(budget + 1)) - kept == {int(mx.argmin(naive[h]))}
