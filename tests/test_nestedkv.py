"""NestedKV's card invariants, checked by brute force on synthetic keys and on tiny models.

Caches are driven the way mlx-lm drives them (update_and_fetch, then attention through the
cache); the prompt's last token comes alone and ends the prefill. The brute force follows
the card's steps with plain loops in float64.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import conformance
from feeding import feed, run_prompt
from test_conformance import _reference_check, drive
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import NestedKVOptions
from veloxquant_mlx.methods.nestedkv import (NestedKVCache, mixing_weights, rank_normalize,
                                             split_budget, surprise_gate)

HKV, GROUP, D = 2, 2, 16
SCALE = D**-0.5
UNEVEN = dict(nestedkv_beta=0.0, nestedkv_tau=1.0, nestedkv_kappa=50.0)  # z = mean rank: heads differ


def synthetic(n, seed=0, batch=1):
    """Head 0: keys around one direction, off it by a per-token amount (every scale agrees,
    so its mixed ranks spread over [0, 1]); head 1: isotropic keys (the scales disagree)."""
    noise = mx.random.normal((batch, HKV, n, D), key=mx.random.key(seed))
    amount = mx.random.uniform(0.05, 2.0, (batch, 1, n, 1), key=mx.random.key(seed + 1))
    k = mx.concatenate([mx.eye(D)[0] * 3.0 + amount * noise[:, :1], noise[:, 1:]], axis=1)
    v = mx.random.normal((batch, HKV, n, D), key=mx.random.key(seed + 2))
    q = mx.random.normal((batch, HKV * GROUP, n, D), key=mx.random.key(seed + 3))
    return k, v, q


def make(**kw):
    return NestedKVCache(KVCacheConfig(method="nestedkv", options=NestedKVOptions(**kw)))


def kept(cache, b=0):
    """Kept positions per head (padding dropped)."""
    return [set(p for p in cache.kept_positions[b, h].tolist() if p >= 0) for h in range(HKV)]


# -- the card's steps, by brute force -------------------------------------------------------
def brute_force(keys, n_sink, window, beta, tau, kappa):
    """z (H, n), NaN off the candidates, and the three anomalies, for one sequence's keys
    (H, n, D) at positions 0..n-1: loops over the card's steps 1-5 in float64."""
    k = np.array(keys, dtype=np.float64)
    heads, n, _ = k.shape
    u = k / np.linalg.norm(k, axis=-1, keepdims=True)
    cand = [i for i in range(n) if n_sink <= i < n - window]

    def anomaly(h, i, members):
        members = [j for j in members if j >= n_sink]
        a = u[h, members].sum(0) if members else np.zeros(u.shape[-1])
        norm = np.linalg.norm(a)
        return 1.0 - (u[h, i] @ a / norm if norm > 0 else 0.0)

    z, s_all = np.full((heads, n), np.nan), np.zeros((3, heads, n))
    for h in range(heads):
        for i in range(n):
            start = i // window * window
            before = [j for j in range(max(0, i - window), i) if j >= n_sink]
            s_all[0, h, i] = anomaly(h, i, range(n))
            s_all[1, h, i] = anomaly(h, i, range(start, min(n, start + window)))
            s_all[2, h, i] = anomaly(h, i, before) if before else 1.0 - u[h, i] @ u[h, i]
        ranks = np.zeros((3, n))
        for x in range(3):
            order = sorted(cand, key=lambda i: (s_all[x, h, i], i))
            for r, i in enumerate(order):
                ranks[x, i] = r / (len(cand) - 1)
        spread = np.array([s_all[x, h, cand].std() for x in range(3)])
        sd = spread.std()
        c = (spread - spread.mean()) / sd if sd > 1e-12 else np.zeros(3)
        w = np.exp(beta * c) / np.exp(beta * c).sum()
        m = (w[:, None] * ranks).sum(0)
        g = 1.0 / (1.0 + np.exp(-kappa * (ranks[2] - tau)))
        z[h, cand] = ((1 - g) * m + g * ranks[2])[cand]
    return z, s_all


def assert_split(kept_sets, z, budget, n_sink, window, alpha, n):
    """The card's split: protected kept, sum = H x budget, every head its safeguard, each head
    its own top by z, and the pooled slots the best z left across heads (up to 1e-5 ties)."""
    heads = len(kept_sets)
    share = budget - n_sink - window
    g = math.floor(alpha * share + 1e-9)
    protected = set(range(n_sink)) | set(range(n - window, n))
    counts = [len(s) for s in kept_sets]
    assert sum(counts) == heads * budget
    pooled_in, pooled_out = [], []
    for h, s in enumerate(kept_sets):
        assert protected <= s and counts[h] >= n_sink + window + g
        cands = [i for i in range(n) if i not in protected]
        inside = sorted((z[h, i] for i in s - protected), reverse=True)
        outside = [z[h, i] for i in cands if i not in s]
        assert inside[-1] >= max(outside) - 1e-5  # the head keeps its best
        pooled_in += inside[g:]
        pooled_out += outside
    if pooled_in:
        assert min(pooled_in) >= max(pooled_out) - 1e-5  # the pool went to the best across heads
    return counts


@pytest.mark.parametrize("beta,tau,kappa", [(0.0, 1.0, 50.0), (3.0, 0.6, 10.0), (1.0, 0.3, 2.0)])
def test_scores_and_the_split_match_the_cards_steps_by_brute_force(beta, tau, kappa):
    n, budget, sink, window, alpha = 157, 40, 3, 8, 0.25
    k, v, q = synthetic(n)
    cache = make(nestedkv_budget=budget, nestedkv_n_sink=sink, nestedkv_window=window,
                 nestedkv_beta=beta, nestedkv_tau=tau, nestedkv_kappa=kappa,
                 nestedkv_safeguard_alpha=alpha)
    captured = {}
    original = cache.ensemble
    cache.ensemble = lambda inputs: captured.setdefault("e", original(inputs))
    run_prompt(cache, k, v, q, n)
    z, s = brute_force(k[0], sink, window, beta, tau, kappa)
    e = captured["e"]
    assert np.allclose(np.array(e.anomalies[:, 0]), s, atol=2e-5)
    cand = ~np.isnan(z)
    assert np.allclose(np.array(e.scores[0])[cand], z[cand], atol=2e-5)
    counts = assert_split(kept(cache), z, budget, sink, window, alpha, n)
    if beta == 0.0:
        assert counts[0] > counts[1] + 4  # the head whose scales agree takes more of the pool
    assert cache.stored_length == max(counts) and cache.store.rows == max(counts)


@pytest.mark.parametrize("alpha,counts", [(0.0, [48, 32]), (0.8, [46, 34]), (1.0, [40, 40])])
def test_the_safeguard_guarantees_each_head_its_share(alpha, counts):
    n, budget, sink, window = 157, 40, 3, 8
    k, v, q = synthetic(n)
    cache = make(nestedkv_budget=budget, nestedkv_n_sink=sink, nestedkv_window=window,
                 nestedkv_safeguard_alpha=alpha, **UNEVEN)
    run_prompt(cache, k, v, q, n)
    z, _ = brute_force(k[0], sink, window, 0.0, 1.0, 50.0)
    assert assert_split(kept(cache), z, budget, sink, window, alpha, n) == counts
    if alpha == 0.8:  # binding: the poorer head holds exactly its guarantee
        assert counts[1] == sink + window + math.floor(0.8 * (budget - sink - window))


def test_every_sequence_of_a_batch_splits_its_own_total():
    n, budget = 140, 36
    k, v, q = synthetic(n, seed=4, batch=2)
    k = mx.concatenate([k[:1], k[1:, ::-1]])  # the second sequence's heads swapped
    cache = make(nestedkv_budget=budget, nestedkv_window=8, **UNEVEN)
    run_prompt(cache, k, v, q, n)
    per_seq = []
    for b in range(2):
        z, _ = brute_force(k[b], 4, 8, 0.0, 1.0, 50.0)
        per_seq.append(assert_split(kept(cache, b), z, budget, 4, 8, 0.2, n))
    assert per_seq[0] == per_seq[1][::-1] and per_seq[0][0] != per_seq[0][1]


def test_beta_zero_weighs_the_scales_equally_and_beta_favours_the_widest_spread():
    spreads = mx.array([0.1, 1.0, 0.5])[:, None, None, None]
    s = mx.random.uniform(0, 1, (3, 1, 2, 50), key=mx.random.key(0)) * spreads
    cand = mx.ones((1, 2, 50), mx.bool_)
    assert mx.allclose(mixing_weights(s, cand, 0.0), mx.full((3, 1, 2), 1 / 3), atol=1e-7)
    w = mixing_weights(s, cand, 3.0)
    assert mx.all(w[1] > w[2]) and mx.all(w[2] > w[0]) and mx.allclose(w.sum(0), mx.ones((1, 2)))
    same = mx.broadcast_to(s[:1], s.shape)  # equal spreads: equal weights at any beta
    assert mx.allclose(mixing_weights(same, cand, 50.0), mx.full((3, 1, 2), 1 / 3), atol=1e-6)


def test_a_hard_gate_off_leaves_the_mixed_rank_and_on_takes_the_fast_rank():
    n = 130
    k, v, q = synthetic(n, seed=2)
    u = mx.linspace(0, 1, 11)
    assert mx.all(surprise_gate(u[:-1], 1.0, 1e4) < 1e-30) and surprise_gate(u, 1.0, 1e4)[-1] == 0.5
    for tau, expect in [(1.0, "mixed"), (0.0, "fast")]:
        cache = make(nestedkv_budget=40, nestedkv_window=8, nestedkv_tau=tau, nestedkv_kappa=1e4)
        captured = {}
        original = cache.ensemble
        cache.ensemble = lambda inputs: captured.setdefault("e", original(inputs))
        run_prompt(cache, k, v, q, n)
        e = captured["e"]
        mixed = (e.weights[..., None] * e.ranks).sum(0)
        target = mixed if expect == "mixed" else e.ranks[2]
        edge = e.ranks[2] == (1.0 if expect == "mixed" else 0.0)  # the one token at u = tau
        where = e.candidate & ~edge
        assert mx.allclose(mx.where(where, e.scores, 0), mx.where(where, target, 0), atol=1e-6)


def test_ranks_lie_in_0_1_ties_go_by_position_and_anomalies_in_0_2():
    s = mx.array([[[0.5, 0.2, 0.5, 0.9, 0.2, 0.5, 0.0]]])
    cand = mx.array([[[True, True, True, True, True, True, False]]])
    r = rank_normalize(s, cand)
    # ascending (anomaly, position): 1, 4, 0, 2, 5, 3 -> ranks 0..5 over 5
    assert mx.array_equal(r[0, 0], mx.array([2, 0, 3, 5, 1, 4, 0]) / 5)
    n = 150
    k, v, q = synthetic(n, seed=3)
    cache = make(nestedkv_budget=40, nestedkv_window=8)
    captured = {}
    original = cache.ensemble
    cache.ensemble = lambda inputs: captured.setdefault("e", original(inputs))
    run_prompt(cache, k, v, q, n)
    e = captured["e"]
    assert mx.all(e.anomalies >= 0) and mx.all(e.anomalies <= 2)
    assert mx.all(e.ranks >= 0) and mx.all(e.ranks <= 1)
    assert mx.all(e.scores >= 0) and mx.all(e.scores <= 1)
    count = int(e.candidate[0, 0].sum())
    grid = mx.sort(mx.where(e.candidate, e.ranks, -1), axis=-1)[..., -count:] * (count - 1)
    assert mx.array_equal(mx.round(grid), mx.broadcast_to(mx.arange(count), grid.shape))  # a permutation


def test_split_budget_gives_the_safeguard_then_the_pool_and_fewer_where_fewer_remain():
    z = mx.array([[[0.9, 0.8, 0.7, 0.6, 0.5], [0.1, 0.2, 0.3, 0.05, 0.0]]])
    cand = mx.ones((1, 2, 5), mx.bool_)
    assert split_budget(z, cand, 0, 4).tolist() == [[4, 0]]
    assert split_budget(z, cand, 1, 3).tolist() == [[4, 1]]
    assert split_budget(z, cand, 2, 2).tolist() == [[4, 2]]
    few = cand & (mx.arange(5) < 2)  # two candidates a head: everything is kept, no more
    assert split_budget(z, few, 3, 10).tolist() == [[2, 2]]


# -- when it scores, and what it keeps -----------------------------------------------------------
def test_key_only_queries_and_values_do_not_change_what_is_kept():
    n = 150
    k, v, q = synthetic(n, seed=5)
    sets = []
    for vv, qq in [(v, q), (2 * v + 1, q[:, ::-1] * 5), (v, mx.zeros_like(q))]:
        cache = make(nestedkv_budget=40, nestedkv_window=8)
        run_prompt(cache, k, vv, qq, n)
        sets.append(cache.kept_positions)
    assert all(mx.array_equal(sets[0], s) for s in sets[1:])


def test_it_scores_once_at_the_prompts_end_and_decode_appends():
    n, budget = 170, 40
    k, v, q = synthetic(n + 6, seed=6)
    cache = make(nestedkv_budget=budget, nestedkv_window=8, **UNEVEN)
    for s in range(0, n - 1, 50):  # chunks hold every token: nothing is scored yet
        feed(cache, k, v, q, s, min(s + 50, n - 1))
        assert cache.kept_positions is None and cache.stored_length == min(s + 50, n - 1)
    feed(cache, k, v, q, n - 1, n)
    before = kept(cache)
    assert sum(map(len, before)) == HKV * budget
    for t in range(n, n + 6):
        feed(cache, k, v, q, t, t + 1)
    after = kept(cache)
    assert all(a == b | set(range(n, n + 6)) for a, b in zip(after, before))


def test_a_prompt_within_the_budget_is_kept_whole_and_attended_exactly():
    n = 120
    k, v, q = synthetic(n, seed=7)
    cache = make(nestedkv_budget=n, nestedkv_window=8)
    out = run_prompt(cache, k, v, q, n)
    assert cache.kept_positions is None and cache.stored_length == n and not cache.padded
    assert mx.array_equal(out, mx.fast.scaled_dot_product_attention(q[:, :, -1:], k, v, scale=SCALE))


def test_scaling_a_heads_keys_leaves_the_selection_unchanged():
    n = 160
    k, v, q = synthetic(n, seed=8)
    sets = []
    for c0, c1 in [(1.0, 1.0), (4.0, 0.25), (3.7, 0.013)]:
        cache = make(nestedkv_budget=40, nestedkv_window=8)
        run_prompt(cache, k * mx.array([c0, c1])[None, :, None, None], v, q, n)
        sets.append(kept(cache))
    assert sets[1] == sets[0]  # powers of two: bit-identical unit keys
    assert all(len(a ^ b) <= 2 for a, b in zip(sets[0], sets[2]))  # up to one near-tie swap


def test_alpha_one_keeps_the_budget_in_every_head_with_no_padding():
    n, budget = 150, 40
    k, v, q = synthetic(n, seed=9)
    cache = make(nestedkv_budget=budget, nestedkv_window=8, nestedkv_safeguard_alpha=1.0, **UNEVEN)
    run_prompt(cache, k, v, q, n)
    z, _ = brute_force(k[0], 4, 8, 0.0, 1.0, 50.0)
    assert not cache.padded and cache.store.rows == budget
    assert assert_split(kept(cache), z, budget, 4, 8, 1.0, n) == [budget] * HKV


def test_it_is_deterministic():
    n = 150
    k, v, q = synthetic(n, seed=10)
    runs = []
    for _ in range(2):
        cache = make(nestedkv_budget=40, nestedkv_window=8, **UNEVEN)
        run_prompt(cache, k, v, q, n)
        runs.append(cache.kept_positions)
    assert mx.array_equal(runs[0], runs[1])


# -- per-head budgets: padding stored, counted, masked -------------------------------------------
TINY = {"nestedkv_budget": 48, "nestedkv_window": 16, "nestedkv_beta": 0.0, "nestedkv_kappa": 0.1}


def test_on_a_model_the_padding_is_counted_in_nbytes_and_never_attended():
    model = tiny_model("llama")
    cache = make_prompt_cache(model, conformance.config("nestedkv", TINY))
    _reference_check("nestedkv", model, cache, prompt(208), chunk=40)  # attention = over kept
    for c in cache:
        counts = (c.kept_positions >= 0).sum(-1)[0].tolist()
        assert sum(counts) == 2 * (48 + 8) and counts[0] != counts[1]  # 8 decoded tokens each
        assert c.store.rows == max(counts) == c.stored_length  # the short head's padding is stored
        assert c.nbytes == conformance.arrays_held(c)
        per_row = 2 * (2 * 32 * 4) + 2 * 4  # K and V (2 heads x 32 float32), positions (int32)
        assert c.nbytes >= c.store.rows * per_row


def test_a_padded_cache_saves_loads_and_continues(tmp_path):
    model = tiny_model("llama")
    cache = make_prompt_cache(model, conformance.config("nestedkv", TINY))
    tokens = prompt(220)
    drive(model, cache, tokens[:200], decode=4)
    assert all(c.padded for c in cache)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert all(mx.array_equal(a.kept_positions, b.kept_positions) for a, b in zip(cache, loaded))
    a = mx.concatenate([model(t.reshape(1, 1), cache=cache)[:, -1] for t in tokens[200:210]])
    b = mx.concatenate([model(t.reshape(1, 1), cache=loaded)[:, -1] for t in tokens[200:210]])
    assert mx.allclose(a, b, atol=1e-5)


def test_a_second_prompt_rescores_the_kept_tokens_and_sizes_its_own_padding():
    n1, n2, budget = 150, 260, 40
    k, v, q = synthetic(n2, seed=11)
    cache = make(nestedkv_budget=budget, nestedkv_window=8, **UNEVEN)
    run_prompt(cache, k, v, q, n1)
    first = [len(s) for s in kept(cache)]
    for t in range(n1, n1 + 5):
        feed(cache, k, v, q, t, t + 1)
    run_prompt(cache, k, v, q, n2, start=n1 + 5)  # a second prompt after decoding
    sets = kept(cache)
    counts = [len(s) for s in sets]
    assert sum(counts) == HKV * budget and counts != first
    assert cache.store.rows == max(counts)  # not the first split's largest head
    for s in sets:
        assert set(range(4)) | set(range(n2 - 8, n2)) <= s


# -- the options' ranges ---------------------------------------------------------------------
@pytest.mark.parametrize("field,value,allowed", [
    ("nestedkv_beta", float("inf"), "in [0, inf)"), ("nestedkv_beta", float("nan"), "in [0, inf)"),
    ("nestedkv_beta", -0.5, "in [0, inf)"), ("nestedkv_kappa", float("inf"), "in (0, inf)"),
    ("nestedkv_kappa", 0.0, "in (0, inf)"), ("nestedkv_tau", 1.01, "in [0, 1]"),
    ("nestedkv_tau", float("-inf"), "in [0, 1]"), ("nestedkv_safeguard_alpha", 1.5, "in [0, 1]"),
    ("nestedkv_safeguard_alpha", float("nan"), "in [0, 1]"), ("nestedkv_window", 0, "in [1, inf)"),
])
def test_out_of_range_options_are_refused_naming_the_field_value_and_range(field, value, allowed):
    with pytest.raises(ValueError) as info:
        NestedKVOptions(**{field: value})
    assert f"{field}={value!r}" in str(info.value) and allowed in str(info.value)


def test_a_budget_below_the_protected_tokens_is_refused():
    expected = (r"nestedkv_budget must be at least nestedkv_n_sink \+ nestedkv_window.*"
                r"nestedkv_budget=60, nestedkv_n_sink=4, nestedkv_window=64")
    with pytest.raises(ValueError, match=expected):
        NestedKVOptions(nestedkv_budget=60)


def test_the_anomalies_in_blocks_of_windows_equal_them_in_one_and_hold_a_block(monkeypatch):
    """The block and sliding anchors are built a few windows at a time (each block with
    the window before it; the last one short): every token's three anomalies are those
    of one pass, bit for bit, and the peak is a block's, not the whole prompt's several
    (n, D) anchors (one pass held 14 times the unit keys: 0.9 GB a layer at 16k, 8 heads)."""
    from feeding import peak_above_held
    from veloxquant_mlx.methods import nestedkv

    n, w, h, d = 4099, 32, 4, 64
    u = nestedkv.unit(mx.random.normal((1, h, n, d), key=mx.random.key(3)))
    member = mx.broadcast_to(mx.arange(n)[None, None] >= 4, (1, h, n))
    mx.eval(u, member)
    monkeypatch.setattr(nestedkv, "ANOMALY_ELEMENTS", 1 << 40)  # one block
    whole, whole_peak = peak_above_held(lambda: nestedkv.anomalies(u, member, w))
    monkeypatch.setattr(nestedkv, "ANOMALY_ELEMENTS", 4 * h * w * (d + 1))  # 4 windows a block
    blocked, peak = peak_above_held(lambda: nestedkv.anomalies(u, member, w))
    assert mx.array_equal(whole, blocked)
    assert peak < 4 * u.nbytes < whole_peak / 2, (peak, u.nbytes, whole_peak)
