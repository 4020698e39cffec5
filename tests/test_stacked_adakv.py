"""AdaKV stacked (cache/stacked.py): each row of a cache fed B rows keeps its own importance
and bit widths, so the row is stored and attended exactly as alone; a state saved before the
importance had a batch axis still loads."""

import random

import mlx.core as mx
import pytest

from batching import run_rows, saved_state
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.base import CacheStateError
from veloxquant_mlx.cache.options import AdaKVOptions
from veloxquant_mlx.methods.adakv.cache import AdaKVCache, allocate_bits
from veloxquant_mlx.methods.adakv.heads import greedy_on_device, spare_bits

H, D = 4, 64


def adakv(residual=32, **options):
    config = KVCacheConfig(method="adakv", options=AdaKVOptions(**options), residual_window=residual)
    return AdaKVCache(config, None, 0)


def rows(n, seed):
    """(2, H, n, D) keys whose norms vary in a different head for each row (row 0: head 1,
    row 1: head 3), so that the rows' allocations differ; values and queries."""
    x = mx.random.normal((2, H, n, D), key=mx.random.key(seed))
    x = x / mx.linalg.norm(x, axis=-1, keepdims=True)
    noisy = mx.array([1, 3])[:, None, None, None] == mx.arange(H)[None, :, None, None]
    keys = mx.where(noisy, x * (1 + 3 * mx.random.uniform(shape=(2, H, n, 1), key=mx.random.key(seed + 1))), x)
    values = mx.random.normal((2, H, n, D), key=mx.random.key(seed + 2))
    queries = mx.random.normal((2, 2 * H, n, D), key=mx.random.key(seed + 3))
    return keys, values, queries


def test_a_two_row_cache_computes_each_row_as_that_row_alone():
    """Importance, widths of every block, stored arrays and outputs of each row of a 2-row
    cache are those of the row's own cache, bit for bit, through prefill chunks, scheduled
    re-estimates and decode-step flushes; the rows' widths differ (a pooled importance would
    give both the same)."""
    keys, values, queries = rows(230, seed=21)
    options = dict(adakv_update_interval=9, adakv_obs_window=16)
    both = adakv(**options)
    out_both = run_rows(both, keys, values, queries, 150, 64)
    for r in range(2):
        alone = adakv(**options)
        take = slice(r, r + 1)
        out_alone = run_rows(alone, keys[take], values[take], queries[take], 150, 64)
        for step, (x, y) in enumerate(zip(out_both, out_alone)):
            assert mx.array_equal(x[take], y), (r, step)
        assert both.importance.shape == (2, H)
        assert mx.array_equal(both.importance[take], alone.importance)
        widths, arrays = both.store.block_widths(), both.state["arrays"]
        assert widths.shape[0] == 2 and not mx.array_equal(widths[0], widths[1])
        assert mx.array_equal(widths[take], alone.store.block_widths())
        for name, a in alone.state["arrays"].items():
            assert mx.array_equal(arrays[name][take], a), name


def test_the_device_greedy_allocates_each_row_on_its_own():
    """(B, H) importances: each row's widths are the row's alone (its own budget, its own
    lifted zeros) and the host reference's."""
    rnd = random.Random(8)
    for levels, target, h in (((2, 3, 4), 2.5, 4), ((2, 4, 8), 3.7, 8), ((1, 2, 3), 2.0, 3)):
        imp = [[rnd.choice([0.0, float("nan"), rnd.lognormvariate(0, 2)]) if rnd.random() < 0.3
                else rnd.lognormvariate(0, 2) for _ in range(h)] for _ in range(5)]
        imp[1] = [0.0] * h  # a row of zeros next to others: its lift is its own
        greedy = greedy_on_device(levels, spare_bits(levels, target, h), h)
        together = greedy(mx.array(imp))
        assert together.shape == (5, h)
        for r, row in enumerate(imp):
            assert mx.array_equal(together[r : r + 1], greedy(mx.array([row])))
            assert tuple(together[r].tolist()) == allocate_bits(row, levels, target), (levels, row)


def test_a_state_saved_with_one_importance_per_head_loads_and_continues_identically():
    """The layout before the batch axis saved the importance as (H,): it loads as (1, H), and
    the cache goes on (new estimates, flushes) exactly as one restored from today's state."""
    keys, values, queries = rows(260, seed=31)
    keys, values, queries = keys[:1], values[:1], queries[:1]
    cache = adakv(residual=0, adakv_update_interval=5, adakv_obs_window=8)
    run_rows(cache, keys[:, :, :170], values[:, :, :170], queries[:, :, :170], 150, 64)
    state = saved_state(cache)
    assert state["arrays"]["importance"].shape == (1, H)
    old = saved_state(cache)
    old["arrays"]["importance"] = state["arrays"]["importance"][0]
    restored_old = AdaKVCache.from_state(old)
    restored = AdaKVCache.from_state(state)
    assert restored_old.importance.shape == (1, H)
    assert mx.array_equal(restored_old.importance, restored.importance)
    rest = [x[:, :, 170:] for x in (keys, values, queries)]
    out_old, out_new = run_rows(restored_old, *rest, 0, 1), run_rows(restored, *rest, 0, 1)
    assert restored.store.k_planes.length > cache.store.k_planes.length  # flushes after the load
    assert all(mx.array_equal(x, y) for x, y in zip(out_old, out_new))
    after_old, after_new = restored_old.state["arrays"], restored.state["arrays"]
    assert all(mx.array_equal(after_old[n], after_new[n]) for n in after_new)


def test_a_state_whose_importance_has_other_rows_than_the_batch_is_refused():
    """One row of importance for a 2-row state would be every row's allocation (rows mixed)."""
    keys, values, queries = rows(40, seed=41)
    cache = adakv()
    run_rows(cache, keys, values, queries, 40, 40)
    state = saved_state(cache)
    state["arrays"]["importance"] = state["arrays"]["importance"][:1]
    with pytest.raises(CacheStateError, match=r"importance is \(1, 4\), expected a row a sequence, \(2, 4\)"):
        AdaKVCache.from_state(state)
    assert AdaKVCache.from_state(saved_state(cache)).importance.shape == (2, H)
