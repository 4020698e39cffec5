"""Q-Filters' card invariants, by brute force on synthetic K/V/Q.

Caches are driven the way mlx-lm drives them: update_and_fetch, then attention through
the cache (the hook's job); the last prompt token comes alone. Reference filters come
from numpy's SVD, independently of the cache's MLX one.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

from feeding import feed, prompt_then_steps
from paper_rule import no_recent_floor  # noqa: F401  (a fixture)
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import QFiltersOptions
from veloxquant_mlx.evict.base import EVICT_EVERY
from veloxquant_mlx.evict import attention as attention_module
from veloxquant_mlx.methods.qfilters import (
    _report_low_retention,
    LowRetentionError,
    LowRetentionWarning,
    QFiltersCache,
    calibration_stride,
    oriented,
    query_filters,
    retention,
    top_right_vectors,
)

HKV, GROUP, D = 2, 3, 16
SCALE = D**-0.5


def directions(seed=0):
    e = np.random.default_rng(seed).normal(size=(HKV, D))
    return e / np.linalg.norm(e, axis=-1, keepdims=True)  # one unit direction per KV head


def synthetic(n, seed=0, along=4.0, positive=0.95):
    """Queries q = a e_h + noise, a > 0 for ``positive`` of them; keys with spread-out
    projections on e_h; values. (1, H, n, D) each."""
    rng = np.random.default_rng(seed)
    e = directions(seed)
    sign = np.where(rng.random((HKV, GROUP, n)) < positive, 1.0, -1.0)
    a = along * sign * rng.uniform(0.5, 1.5, (HKV, GROUP, n))
    q = a[..., None] * e[:, None, None] + 0.5 * rng.normal(size=(HKV, GROUP, n, D))
    k = rng.normal(size=(HKV, n, D)) + rng.normal(size=(HKV, n, 1)) * e[:, None]
    v = rng.normal(size=(HKV, n, D))
    to = lambda x: mx.array(x.astype(np.float32))[None]
    return to(k), to(v), to(q.reshape(HKV * GROUP, n, D)), e


def run(cache, k, v, q, n_prompt, chunk, stop=None, after_each=None):
    """``prompt_then_steps``; the cache."""
    prompt_then_steps(cache, k, v, q, n_prompt, chunk, stop, after_each)
    return cache


def qfilters(**options):
    options.setdefault("qfilters_on_low_retention", "ignore")
    return QFiltersCache(KVCacheConfig(options=QFiltersOptions(**options)))


def kept_sets(cache):
    return [set(cache.kept_positions[0, h].tolist()) for h in range(HKV)]


def numpy_filters(q, positions):
    """The card's calibration: per query head, an uncentred SVD of its queries at
    ``positions``, v oriented by the majority sign of U[:, 0]; mean over each group."""
    qn = np.array(q[0], np.float64)[:, positions]  # (Hq, N, D)
    per_head = []
    for h in range(qn.shape[0]):
        u, _, vt = np.linalg.svd(qn[h], full_matrices=False)
        per_head.append(vt[0] if (u[:, 0] > 0).mean() > 0.5 else -vt[0])
    per_head = np.array(per_head)
    return per_head, per_head.reshape(HKV, GROUP, D).mean(axis=1)


def calibration_positions(n_prompt, sink, calib):
    """Where the card's calibration queries are: min(T - n_sink, calib) of them, evenly
    spread over the ones the buffer holds (every stride-th after the sinks)."""
    seen = n_prompt - sink
    stride = calibration_stride(seen, 2 * calib)
    held = -(-seen // stride)
    n = min(seen, calib)
    return [sink + stride * (i * held // n) for i in range(n)], stride


def test_the_sign_fix_makes_the_filter_independent_of_the_svds_sign():
    rng = np.random.default_rng(1)
    u = mx.array(rng.normal(size=(4, 31)).astype(np.float32))  # odd length: no ties
    v = mx.array(rng.normal(size=(4, D)).astype(np.float32))
    assert mx.array_equal(oriented(u, v), oriented(-u, -v))
    assert not mx.array_equal(oriented(u, v), oriented(u, -v))
    # unit filters on which most of each head's queries project positively
    _, _, q, _ = synthetic(101, seed=1)
    f = query_filters(q)
    assert mx.allclose(mx.linalg.norm(f, axis=-1), mx.ones((1, HKV * GROUP)), atol=1e-5)
    assert float(((q @ f[..., None])[..., 0] > 0).astype(mx.float32).mean(-1).min()) > 0.5
    assert mx.allclose(query_filters(-q), -f, atol=1e-5)  # the filter follows the queries


@pytest.mark.parametrize("recent", [0, 6])
@pytest.mark.usefixtures("no_recent_floor")
def test_the_filter_finds_the_shared_query_direction_and_the_top_projections_are_kept(recent):
    n_prompt, budget, sink = 160, 40, 4
    k, v, q, e = synthetic(n_prompt, seed=2)
    cache = run(qfilters(qfilters_budget=budget, qfilters_n_sink=sink, qfilters_recent=recent),
                k, v, q, n_prompt, chunk=50)
    f = np.array(cache.filter[0])
    cosine = (f * e).sum(-1) / np.linalg.norm(f, axis=-1)
    assert cosine.min() > 0.99
    protected = set(range(sink)) | set(range(n_prompt - recent, n_prompt))
    kn = np.array(k[0])
    for h, kept in enumerate(kept_sets(cache)):
        assert protected <= kept and len(kept) == budget
        candidates = [j for j in range(n_prompt) if j not in protected]
        by_filter = sorted(candidates, key=lambda j: -kn[h, j] @ f[h])[: budget - len(protected)]
        assert kept - protected == set(by_filter)
        by_e = sorted(candidates, key=lambda j: -kn[h, j] @ e[h])[: budget - len(protected)]
        assert len(set(by_e) & set(by_filter)) >= 0.9 * len(by_filter)


@pytest.mark.parametrize("n_prompt,calib,chunk", [(1000, 32, 37), (1000, 32, 300), (60, 128, 25)])
def test_the_filter_is_the_cards_svd_of_queries_strided_across_the_prompt(n_prompt, calib, chunk):
    """min(T - n_sink, calib) queries after the sinks, evenly strided, whatever the chunking;
    per query head the oriented top right singular vector, their unnormalised group mean."""
    sink = 4
    k, v, q, _ = synthetic(n_prompt, seed=3)
    cache = run(qfilters(qfilters_budget=40, qfilters_n_sink=sink, qfilters_calib_tokens=calib),
                k, v, q, n_prompt, chunk=chunk)
    positions, stride = calibration_positions(n_prompt, sink, calib)
    n = min(n_prompt - sink, calib)
    assert len(set(positions)) == n and positions[-1] > n_prompt - 2 * stride - 1  # spans the prompt
    per_head, per_kv = numpy_filters(q, positions)
    assert np.allclose(np.linalg.norm(per_head, axis=-1), 1.0)
    assert np.linalg.norm(per_kv, axis=-1).max() < 0.9999  # a mean of unit vectors, left as is
    assert np.allclose(np.array(cache.filter[0]), per_kv, atol=2e-4)
    assert cache.calib is None  # the buffer goes once the filter is fixed


def test_the_calibration_buffer_stays_within_twice_calib_tokens():
    k, v, q, _ = synthetic(700, seed=4)
    cache = qfilters(qfilters_budget=4096, qfilters_calib_tokens=16)
    for start in range(0, 700, 45):
        feed(cache, k, v, q, start, min(700, start + 45))
        seen = min(700, start + 45) - 4
        stride = calibration_stride(seen, 32)
        assert cache.calib.shape[2] == -(-seen // stride) <= 32
        assert mx.array_equal(cache.calib, q[:, :, 4::stride][:, :, : cache.calib.shape[2]])
    assert cache.filter is None and cache.stored_length == 700


@pytest.mark.usefixtures("no_recent_floor")
@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("recent", [0, 5])
def test_every_evict_every_steps_the_lowest_scores_leave_at_once(sign, recent):
    """Between evictions a decode step only writes its token; every ``EVICT_EVERY`` steps
    the tokens over the budget leave at once, each scoring no higher than any evictable
    token kept (the sinks and the ``recent`` newest never leave)."""
    n_prompt, budget, sink = 100, 30, 3
    n = n_prompt + 2 * EVICT_EVERY + 5
    k, v, q, _ = synthetic(n, seed=5)
    cache = run(qfilters(qfilters_budget=budget, qfilters_n_sink=sink, qfilters_recent=recent,
                         qfilters_sign=sign), k, v, q, n_prompt, chunk=40, stop=n_prompt)
    f = np.array(cache.filter[0])
    kn = np.array(k[0])
    evictions = 0
    for t in range(n_prompt, n):
        before = kept_sets(cache)
        feed(cache, k, v, q, t, t + 1)
        after = kept_sets(cache)
        assert cache.stored_length <= budget + EVICT_EVERY - 1
        if all(a == b | {t} for a, b in zip(after, before)):
            continue
        evictions += 1
        assert cache.stored_length == budget
        for h, kept in enumerate(after):
            pool = before[h] | {t}
            gone = pool - kept
            evictable = {j for j in pool if sink <= j < t + 1 - recent}
            assert kept <= pool and gone <= evictable
            score = {j: sign * kn[h, j] @ f[h] for j in evictable}
            assert max(score[j] for j in gone) <= min(score[j] for j in kept & evictable)
    assert evictions == 2


@pytest.mark.usefixtures("no_recent_floor")
def test_sign_minus_one_keeps_the_bottom_projections_with_the_same_filter():
    n_prompt, budget, sink = 120, 30, 2
    k, v, q, _ = synthetic(n_prompt, seed=6)
    up = run(qfilters(qfilters_budget=budget, qfilters_n_sink=sink), k, v, q, n_prompt, chunk=50)
    down = run(qfilters(qfilters_budget=budget, qfilters_n_sink=sink, qfilters_sign=-1),
               k, v, q, n_prompt, chunk=50)
    assert mx.array_equal(up.filter, down.filter)
    f, kn = np.array(up.filter[0]), np.array(k[0])
    for h, (hi, lo) in enumerate(zip(kept_sets(up), kept_sets(down))):
        order = sorted(range(sink, n_prompt), key=lambda j: kn[h, j] @ f[h])
        assert lo == set(range(sink)) | set(order[: budget - sink])
        assert hi == set(range(sink)) | set(order[-(budget - sink):])


def _retention_by_hand(k, q, positions, kept, n):
    """Causal softmax of each calibration query over the n prompt keys, numpy, float64:
    mass on ``kept`` per KV head, averaged over the queries and the group."""
    kn, qn = np.array(k[0], np.float64)[:, :n], np.array(q[0], np.float64)
    out = []
    for h in range(HKV):
        mass = []
        for g in range(GROUP):
            for p in positions:
                x = qn[h * GROUP + g, p] @ kn[h, : p + 1].T * SCALE
                w = np.exp(x - x.max())
                w /= w.sum()
                mass.append(sum(w[j] for j in kept[h] if j <= p))
        out.append(np.mean(mass))
    return np.array(out)


@pytest.mark.parametrize("action", ["warn", "raise", "ignore", None])
@pytest.mark.usefixtures("no_recent_floor")
def test_the_retention_check_fires_when_the_kept_tokens_miss_the_attention(action):
    """sign -1 keeps the keys the queries attend to least: its retention is low, sign +1's
    high; each measured as the card says (numpy), and acted on as asked."""
    n_prompt, budget, sink, calib = 140, 30, 4, 64
    k, v, q, _ = synthetic(n_prompt, seed=7, along=6.0)
    positions, stride = calibration_positions(n_prompt, sink, calib)
    assert stride == 2  # 136 queries after the sinks, a buffer of 128
    results = {}
    for sign in (1, -1):
        opts = dict(qfilters_budget=budget, qfilters_n_sink=sink, qfilters_calib_tokens=calib,
                    qfilters_sign=sign, qfilters_min_retention=None if action is None else 0.5,
                    qfilters_on_low_retention=action or "raise")
        cache = QFiltersCache(KVCacheConfig(options=QFiltersOptions(**opts)), layer=5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                run(cache, k, v, q, n_prompt, chunk=50)
                error = None
            except LowRetentionError as e:
                error = e
        caught = [w.message for w in caught if isinstance(w.message, LowRetentionWarning)]
        results[sign] = (cache, caught, error)
    cache, caught, error = results[1]
    assert not caught and error is None  # +1 keeps the attended keys
    hand = _retention_by_hand(k, q, positions, kept_sets(cache), n_prompt)
    assert hand.min() > 0.5
    low_cache, caught, error = results[-1]
    f, kn = np.array(cache.filter[0]), np.array(k[0])
    low_kept = [set(range(sink)) | set(sorted(range(sink, n_prompt), key=lambda j: kn[h, j] @ f[h])[: budget - sink])
                for h in range(HKV)]
    low = _retention_by_hand(k, q, positions, low_kept, n_prompt)
    assert low.max() < 0.5
    if action in (None, "ignore"):
        assert not caught and error is None and kept_sets(low_cache) == low_kept
        return
    report = caught[0] if action == "warn" else error
    assert (report.layer, report.head) == (5, int(np.argmin(low)))
    assert report.retention == pytest.approx(low.min(), abs=1e-4)
    assert "layer 5" in str(report) and f"KV head {report.head}" in str(report)
    assert "qfilters_min_retention=0.5" in str(report)
    if action == "warn":
        assert len(caught) == 1 and kept_sets(low_cache) == low_kept
    else:  # raised before anything was evicted or fixed
        assert low_cache.filter is None and low_cache.stored_length == low_cache.offset == n_prompt


@pytest.mark.parametrize("block", [256, 7])
def test_retention_is_the_kept_share_of_attention_and_one_when_every_token_is_kept(block, monkeypatch):
    monkeypatch.setattr(attention_module, "QUERY_BLOCK", block)  # 7: the queries in blocks
    k, v, q, _ = synthetic(50, seed=8)
    positions = mx.broadcast_to(mx.arange(50), (1, HKV, 50))
    every = mx.ones((1, HKV, 50), mx.bool_)
    r = retention(q[:, :, 10:], mx.arange(10, 50), k, positions, every, SCALE)
    assert mx.allclose(r, mx.ones((1, HKV)), atol=1e-6)
    some = [set(range(0, 50, 3)), set(range(5, 30))]
    mask = mx.array([[[j in some[h] for j in range(50)] for h in range(HKV)]])
    r = retention(q[:, :, 10:], mx.arange(10, 50), k, positions, mask, SCALE)
    assert np.allclose(np.array(r[0]), _retention_by_hand(k, q, range(10, 50), some, 50), atol=1e-5)


def test_under_budget_nothing_is_fixed_and_attention_is_exact():
    n = 90
    k, v, q, _ = synthetic(n, seed=9)
    cache = qfilters(qfilters_budget=n, qfilters_on_low_retention="raise")
    out = mx.concatenate([feed(cache, k, v, q, 0, 50)] + [feed(cache, k, v, q, t, t + 1) for t in range(50, n)], 2)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mx.arange(n)[None] <= mx.arange(n)[:, None])
    assert mx.allclose(out, ref, atol=1e-5)
    assert cache.filter is None and cache.kept_positions is None and cache.stored_length == n


def test_a_prompt_within_budget_calibrates_at_the_first_eviction_over_it():
    """Prompt of 30, budget 40: the filter is fixed at the first scheduled eviction with
    more than 40 tokens held, from the queries of positions 4 up to that step's (the decode
    steps' included), and that step evicts by it down to the budget."""
    k, v, q, _ = synthetic(30 + 2 * EVICT_EVERY, seed=10)
    cache = run(qfilters(qfilters_budget=40), k, v, q, 30, chunk=16, stop=30)
    t = 30
    while cache.filter is None:
        assert cache.stored_length == t
        feed(cache, k, v, q, t, t + 1)
        t += 1
    assert t - 1 > 40 and cache.stored_length == 40
    _, per_kv = numpy_filters(q, list(range(4, t)))
    assert np.allclose(np.array(cache.filter[0]), per_kv, atol=2e-4)


@pytest.mark.parametrize("ratio", [0.3, 0.9, 0.99])
def test_the_top_right_vector_by_products_is_the_svds(ratio):
    """Matrices whose top two singular values stand at sqrt(ratio) of each other: the
    vector found by squaring the Gram matrix and two power steps is numpy's SVD's, to
    float32 precision, down to an eigenvalue ratio of 0.99."""
    rng = np.random.default_rng(7)
    n, d, heads = 128, D, 6
    u = np.linalg.qr(rng.normal(size=(heads, n, d)))[0]
    v = np.linalg.qr(rng.normal(size=(heads, d, d)))[0]
    sigma = np.concatenate([[10.0, 10.0 * np.sqrt(ratio)], rng.uniform(0.1, 9.0 * np.sqrt(ratio), d - 2)])
    x = (u * sigma) @ v.swapaxes(-1, -2)
    found = np.array(top_right_vectors(mx.array(x.astype(np.float32))))
    _, _, vt = np.linalg.svd(x)
    assert np.abs((found * vt[:, 0]).sum(-1)).min() > 1 - 1e-6


def test_calibration_runs_no_lapack(monkeypatch):
    """The filter is fitted by matrix products on the default device: no SVD or eigensolver
    on the CPU stream (a GPU would wait for it once a layer)."""
    def refused(*args, **kwargs):
        raise AssertionError("a LAPACK routine ran in the calibration")

    for name in ("svd", "eigh", "qr"):
        monkeypatch.setattr(mx.linalg, name, refused)
    k, v, q, _ = synthetic(300, seed=5)
    cache = run(qfilters(qfilters_budget=40), k, v, q, 300, chunk=64)
    assert cache.filter is not None


def test_a_models_retention_warnings_wait_for_its_last_layer_and_take_one_host_read():
    """Issue 31: each layer's retention check read its values on the host at the prompt's end
    (three reads a layer), so the device waited for every layer in turn. Warnings now wait
    for the last layer, which reads every layer's at once; each layer still gets its own
    warning, in layer order, with its own worst head."""
    from decode_steps import recording_host_reads
    from tiny_models import prompt, tiny_model
    from veloxquant_mlx import make_prompt_cache

    model = tiny_model(num_hidden_layers=4)
    config = KVCacheConfig(options=QFiltersOptions(qfilters_budget=40, qfilters_sign=-1,
                                                   qfilters_min_retention=0.999))
    tokens = prompt(200)

    def prompt_end():
        cache = make_prompt_cache(model, config)
        model(tokens[None, :199], cache=cache)
        mx.eval([c.state for c in cache])
        with warnings.catch_warnings(record=True) as caught, recording_host_reads() as reads:
            warnings.simplefilter("always")
            mx.eval(model(tokens[None, 199:], cache=cache))
        caught = [w.message for w in caught if isinstance(w.message, LowRetentionWarning)]
        return [r.call for r in reads if "qfilters.py" in r.where], [(w.layer, w.head, w.retention) for w in caught]

    reads, warned = prompt_end()
    assert reads == ["tolist"]
    assert [layer for layer, _, _ in warned] == [0, 1, 2, 3]
    with pytest.MonkeyPatch.context() as m:  # each layer checked at once, as before
        m.setattr(QFiltersCache, "_wait_to_check", lambda self, per_head, threshold: _report_low_retention(
            self.layer, per_head.tolist(), threshold, "warn"))
        reads_each, warned_each = prompt_end()
    assert reads_each == ["tolist"] * 4 and warned == warned_each
