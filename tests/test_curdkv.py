"""CurDKV's card invariants, checked by brute force on synthetic K/V and on tiny models.

Caches are driven the way mlx-lm drives them (update_and_fetch, then attention through the
cache); the keys handed over are post-RoPE, made from known pre-RoPE keys.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from mlx_lm.models.rope_utils import initialize_rope

from feeding import feed, run_prompt
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import CurDKVOptions
from veloxquant_mlx.evict.base import ScoreInputs
from veloxquant_mlx.cache.rope import Rotary, derotate
from veloxquant_mlx.methods.curdkv import SWEPT_MAX_RANK, CurDKVCache, leverage_scores, local_share

HKV, GROUP, D = 2, 2, 16
SCALE = D**-0.5


def synthetic(n, seed=0):
    """Pre-RoPE keys with token norms spread out and a dominant subspace, values, queries."""
    k = mx.random.normal((1, HKV, n, D), key=mx.random.key(seed)) * mx.linspace(3.0, 0.2, D)
    k = k * mx.random.uniform(0.3, 2.0, (1, HKV, n, 1), key=mx.random.key(seed + 1))
    v = mx.random.normal((1, HKV, n, D), key=mx.random.key(seed + 2)) * mx.linspace(0.5, 2.0, D)
    q = mx.random.normal((1, HKV * GROUP, n, D), key=mx.random.key(seed + 3))
    return k, v, q


def config(**kw):
    return KVCacheConfig(method="curdkv", options=CurDKVOptions(**kw))


def brute_force_scores(k_pre, v, layer, rank_cap):
    """Per head (H, n): leverage from a QR of the sketch (G seeded by the layer), shares over
    16-token windows, key share x value share, normalised to sum 1."""
    r = min(rank_cap, D)
    if r < D:
        g = mx.random.normal((D, r), key=mx.random.key(layer)) / math.sqrt(r)
        k_pre, v = k_pre @ g, v @ g
    out = []
    for h in range(HKV):
        shares = []
        for x in (k_pre[0, h], v[0, h]):
            basis, _ = mx.linalg.qr(x, stream=mx.cpu)
            lev = mx.square(basis).sum(-1).tolist()
            shares.append([lev[i] / sum(lev[i // 16 * 16 : i // 16 * 16 + 16]) for i in range(len(lev))])
        s = [a * b for a, b in zip(*shares)]
        out.append([x / sum(s) for x in s])
    return mx.array(out)


def assert_top(kept, scores, budget, protected, rtol=1e-4):
    """``kept`` is the ``protected`` tokens plus the top others by ``scores`` up to the budget,
    up to near-ties at the boundary."""
    others = [(s, j) for j, s in enumerate(scores.tolist()) if j not in protected]
    cut = sorted(others, reverse=True)[budget - len(protected) - 1][0]
    assert protected <= kept and len(kept) == budget
    for s, j in others:
        if s > cut * (1 + rtol):
            assert j in kept
        elif s < cut * (1 - rtol):
            assert j not in kept


# -- leverage --------------------------------------------------------------------------------
def test_leverage_scores_sum_to_the_rank_and_are_row_norms_of_an_orthonormal_basis():
    x = mx.random.normal((3, 200, 12), key=mx.random.key(0)) * mx.linspace(5.0, 0.1, 12)
    lev = leverage_scores(x)
    assert mx.allclose(lev.sum(-1), mx.full((3,), 12.0), rtol=1e-4)
    basis, _ = mx.linalg.qr(x[1], stream=mx.cpu)
    assert mx.allclose(lev[1], mx.square(basis).sum(-1), atol=1e-5)
    low = mx.random.normal((200, 5), key=mx.random.key(1)) @ mx.random.normal((5, 12), key=mx.random.key(2))
    assert abs(leverage_scores(low).sum().item() - 5.0) < 1e-3  # rank 5 of 12 columns
    assert mx.all(leverage_scores(low) <= 1 + 1e-5)
    assert leverage_scores(mx.zeros((10, 4))).sum().item() == 0.0


def _pinv_leverage(x):
    """float64 x_i^T (x^T x)^+ x_i, the pseudo-inverse cut at 1e-6 of the largest eigenvalue."""
    x = np.asarray(x, dtype=np.float64)
    w, v = np.linalg.eigh(x.swapaxes(-1, -2) @ x)
    inv = np.where(w > 1e-6 * w.max(-1, keepdims=True), 1 / np.where(w > 0, w, 1), 0.0)
    return ((x @ v) ** 2 * inv[..., None, :]).sum(-1)


def test_leverage_takes_no_eigenproblem_and_matches_the_pseudo_inverse_at_every_rank(monkeypatch):
    """Issue 31: the leverage was an ``eigh`` on the CPU stream, a round trip from the GPU at
    every layer's prompt end (3.9 ms a layer on the H200). Now pivots swept on the device.
    Heads of one batch at full rank, rank 5 of 16 (a product), a repeated and a zero column,
    and fewer tokens than columns (every token's leverage 1)."""
    def no_eigh(*a, **k):
        raise AssertionError("an eigenproblem in curdkv's leverage")

    monkeypatch.setattr(mx.linalg, "eigh", no_eigh)
    full = mx.random.normal((300, 16), key=mx.random.key(4)) * mx.linspace(4.0, 0.2, 16)
    low = mx.random.normal((300, 5), key=mx.random.key(5)) @ mx.random.normal((5, 16), key=mx.random.key(6))
    repeated = mx.concatenate([full[:, :8], full[:, :1], mx.zeros((300, 1)), full[:, 8:14]], axis=1)
    x = mx.stack([full, low, repeated])
    lev = leverage_scores(x)
    want = _pinv_leverage(x)
    assert np.allclose(np.array(lev), want, atol=2e-4)
    assert mx.allclose(lev.sum(-1), mx.array([16.0, 5.0, 14.0]), atol=2e-3)
    few = leverage_scores(full[:9])  # 9 tokens, 16 columns: rank 9, each token spans itself
    assert mx.allclose(few, mx.ones(9), atol=1e-4)
    monkeypatch.undo()
    wide = mx.random.normal((300, SWEPT_MAX_RANK + 8), key=mx.random.key(7))  # the CPU's eigh
    assert np.allclose(np.array(leverage_scores(wide)), _pinv_leverage(wide), atol=2e-4)


def test_local_shares_sum_to_one_per_window_and_the_score_to_one():
    x = mx.random.uniform(0.1, 1.0, (2, 3, 70), key=mx.random.key(3))
    share = local_share(x)
    starts = list(range(0, 70, 16))  # the last window holds 6 tokens
    for a in starts:
        assert mx.allclose(share[..., a : a + 16].sum(-1), mx.ones((2, 3)), atol=1e-6)
    n = 150
    k_pre, v, q = synthetic(n)
    cache = CurDKVCache(config(curdkv_budget=40), None, 0)
    keys = nn.RoPE(D, base=10000.0)(k_pre)
    feed(cache, keys, v, q, 0, n)  # one chunk: nothing evicted yet
    scores = cache.score(ScoreInputs(cache, q, SCALE))
    assert scores.shape == (1, HKV, n) and mx.allclose(scores.sum(-1), mx.ones((1, HKV)), atol=1e-5)


# -- selection ---------------------------------------------------------------------------------
@pytest.mark.parametrize("rank_cap", [4, 16, 64])  # a sketch; exact (r = head_dim); capped at it
@pytest.mark.parametrize("sink,base", [(4, 10000.0), (0, 500000.0)])
def test_keeps_sinks_and_the_top_budget_by_leverage_of_the_derotated_keys(rank_cap, sink, base):
    n, budget, layer = 203, 64, 3
    k_pre, v, q = synthetic(n + 4, seed=rank_cap)
    keys = nn.RoPE(D, base=base)(k_pre)  # what mlx-lm hands the cache
    cache = CurDKVCache(config(curdkv_budget=budget, curdkv_n_sink=sink, curdkv_rank_cap=rank_cap,
                               curdkv_rope_base=base), None, layer)
    run_prompt(cache, keys, v, q, n)
    expected = brute_force_scores(k_pre[:, :, :n], v[:, :, :n], layer, rank_cap)
    kept = cache.kept_positions[0]
    assert cache.stored_length == budget
    protected = set(range(sink)) | set(range(n - 32, n))  # sinks and the prompt's tail
    for h in range(HKV):
        assert_top(set(kept[h].tolist()), expected[h], budget, protected)
    assert kept[0].tolist() != kept[1].tolist()  # per KV head
    assert mx.all(kept[:, 1:] > kept[:, :-1])
    for t in range(n, n + 4):  # decode only appends
        feed(cache, keys, v, q, t, t + 1)
    assert cache.stored_length == budget + 4
    assert mx.array_equal(cache.kept_positions[0, :, :budget], kept)


def test_the_prompts_tail_is_kept_within_what_the_sinks_leave_of_the_budget():
    n = 150
    k_pre, v, q = synthetic(n, seed=9)
    v = mx.where((mx.arange(n) >= n - 5)[None, None, :, None], 0.0, v)  # the tail scores zero
    for budget, tail in [(60, 32), (10, 6)]:
        cache = CurDKVCache(config(curdkv_budget=budget, curdkv_n_sink=4), None, 0)
        run_prompt(cache, nn.RoPE(D)(k_pre), v, q, n)
        assert cache.recent == tail and cache.stored_length == budget
        for h in range(HKV):
            assert set(range(4)) | set(range(n - tail, n)) <= set(cache.kept_positions[0, h].tolist())


def test_a_prompt_within_the_budget_is_kept_whole_and_attended_exactly():
    n = 100
    k_pre, v, q = synthetic(n)
    cache = CurDKVCache(config(curdkv_budget=n), None, 0)
    out = run_prompt(cache, k_pre, v, q, n)
    assert cache.kept_positions is None and cache.stored_length == n
    assert mx.array_equal(out, mx.fast.scaled_dot_product_attention(q[:, :, -1:], k_pre, v, scale=SCALE))


def test_scaling_keys_or_values_leaves_the_selection_unchanged():
    n = 180
    k_pre, v, q = synthetic(n, seed=5)
    keys = nn.RoPE(D)(k_pre)
    sets = []
    for kk, vv in [(keys, v), (3.7 * keys, v), (keys, 0.05 * v)]:
        cache = CurDKVCache(config(curdkv_budget=50), None, 0)
        run_prompt(cache, kk, vv, q, n)
        sets.append([set(cache.kept_positions[0, h].tolist()) for h in range(HKV)])
    for other in sets[1:]:
        assert all(len(a ^ b) <= 2 for a, b in zip(sets[0], other))  # up to one near-tie swap


def test_a_zero_value_row_scores_zero_and_goes_first_unless_it_is_a_sink():
    n = 120
    k_pre, v, q = synthetic(n, seed=6)
    dead = (mx.arange(n) == 2) | (mx.arange(n) == 57)  # 2 is a sink
    v = mx.where(dead[None, None, :, None], 0.0, v)
    cache = CurDKVCache(config(curdkv_budget=n - 1), None, 0)
    run_prompt(cache, nn.RoPE(D)(k_pre), v, q, n)
    assert [set(range(n)) - set(cache.kept_positions[0, h].tolist()) for h in range(HKV)] == [{57}] * HKV


def test_the_sketch_is_seeded_by_the_layer_so_runs_repeat():
    n = 160
    k_pre, v, q = synthetic(n, seed=8)
    keys = nn.RoPE(D)(k_pre)
    kept = {}
    for run, layer in [(0, 1), (1, 1), (2, 2)]:
        cache = CurDKVCache(config(curdkv_budget=40, curdkv_rank_cap=4), None, layer)
        run_prompt(cache, keys, v, q, n)
        kept[run] = cache.kept_positions
    assert mx.array_equal(kept[0], kept[1])
    assert not mx.array_equal(kept[0], kept[2])  # another layer, another G
    one = CurDKVCache(config(curdkv_rank_cap=4), None, 1)
    assert mx.array_equal(one.sketch(D), CurDKVCache(config(curdkv_rank_cap=4), None, 1).sketch(D))
    assert one.sketch(D).shape == (D, 4) and one.sketch(4) is None  # r >= head_dim: no sketch


# -- the model's rotary settings against curdkv_rope_base --------------------------------------------
def test_the_models_rope_theta_is_used_and_a_contradicting_field_is_refused_naming_both():
    model = tiny_model("llama", rope_theta=500000.0, rope_traditional=True)
    cache = make_prompt_cache(model, config())  # the field's default defers to the model
    assert all(c.rotary == Rotary(500000.0, True) for c in cache)
    assert make_prompt_cache(model, config(curdkv_rope_base=500000.0))[0].rotary.base == 500000.0
    with pytest.raises(ValueError, match=r"curdkv_rope_base=20000\.0 .* rope_theta=500000\.0"):
        make_prompt_cache(model, config(curdkv_rope_base=20000.0))
    assert CurDKVCache(config(curdkv_rope_base=20000.0), None, 0).rotary == Rotary(20000.0)  # no model
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        Rotary.from_model_args(SimpleNamespace(rope_theta=1e6, rope_scaling={"type": "yarn", "factor": 4.0}))


def test_the_rotary_settings_travel_with_a_saved_cache(tmp_path):
    model = tiny_model("llama", rope_theta=500000.0)
    cache = make_prompt_cache(model, config(curdkv_budget=48))
    tokens = prompt(120)
    model(tokens[:-1][None], cache=cache)
    model(tokens[-1:][None], cache=cache)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache)
    assert [c.rotary for c in load_prompt_cache(path)] == [Rotary(500000.0)] * len(cache)


SCALINGS = [None, {"type": "linear", "factor": 4.0},
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 512}]


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "linear", "llama3"])
def test_derotate_undoes_mlx_lms_rope_at_any_positions(traditional, scaling):
    rope = initialize_rope(32, 500000.0, traditional, scaling, 8192)
    rotary = Rotary.from_model_args(SimpleNamespace(rope_theta=500000.0, rope_traditional=traditional,
                                                    rope_scaling=scaling))
    x = mx.random.normal((1, 2, 5, 32), key=mx.random.key(4))
    where = [3, 17, 100, 1999, 4000]  # kept positions need not be contiguous
    rotated = mx.concatenate([rope(x[:, :, i : i + 1], offset=p) for i, p in enumerate(where)], axis=2)
    positions = mx.broadcast_to(mx.array(where), (1, 2, 5))
    assert mx.allclose(derotate(rotated, positions, rotary), x, atol=1e-3)  # float32 angles at 4000
    if scaling is not None:  # the scaling matters: plain theta does not undo it
        assert not mx.allclose(derotate(rotated, positions, Rotary(500000.0, traditional)), x, atol=1e-2)
