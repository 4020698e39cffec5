"""PyramidKV's card invariants, by brute force on synthetic keys, values and queries.

Every layer's cache shares one model context, and each update goes through the layers in
order (update_and_fetch, then attention through the cache), the way mlx-lm drives them.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import PyramidKVOptions, SnapKVOptions
from veloxquant_mlx.cache.context import ModelContext
from veloxquant_mlx.methods.pyramidkv import WINDOW, PyramidKVCache, schedule
from veloxquant_mlx.methods.snapkv import SnapKVCache

HKV, GROUP, D = 2, 2, 16
SCALE = D**-0.5


def layer_data(n_layers, n, seed=0):
    """Per layer: keys with varied norms, values, queries (1, H, n, D)."""
    out = []
    for layer in range(n_layers):
        s = seed + 10 * layer
        k = mx.random.normal((1, HKV, n, D), key=mx.random.key(s))
        k = k * mx.random.uniform(0.2, 3.0, (1, HKV, n, 1), key=mx.random.key(s + 1))
        v = mx.random.normal((1, HKV, n, D), key=mx.random.key(s + 2))
        q = mx.random.normal((1, HKV * GROUP, n, D), key=mx.random.key(s + 3))
        out.append((k, v, q))
    return out


def caches_for(options, n_layers, cls=PyramidKVCache):
    config = KVCacheConfig(options=options)
    context = ModelContext(config, n_layers, tuple(range(n_layers)))
    return [cls(config, context, layer) for layer in range(n_layers)]


def feed(caches, data, a, b):
    """Tokens [a, b) through every layer in order: one chunk, or one step when b == a + 1."""
    outs = []
    for cache, (k, v, q) in zip(caches, data):
        keys, values = cache.update_and_fetch(k[:, :, a:b], v[:, :, a:b])
        outs.append(cache.attend(q[:, :, a:b], keys, values, scale=SCALE,
                                 mask="causal" if b - a > 1 else None))
    return outs


def run(caches, data, n_prompt, chunk=64, start=0, stop=None):
    """The prompt in chunks, its last token alone, then the rest (to ``stop``) one at a time."""
    stop = data[0][0].shape[2] if stop is None else stop
    outs = []
    while start < n_prompt - 1:
        outs += feed(caches, data, start, min(start + chunk, n_prompt - 1))
        start = min(start + chunk, n_prompt - 1)
    for t in range(n_prompt - 1, stop):
        outs += feed(caches, data, t, t + 1)
    return outs


# -- the schedule ----------------------------------------------------------------------------
@pytest.mark.parametrize("layers", [2, 5, 32])
@pytest.mark.parametrize("budget, beta", [(64, 2.0), (256, 20.0), (512, 3.5), (100, 1.5)])
def test_schedule_sums_to_the_layers_total_and_decreases_with_depth(layers, budget, beta):
    room = budget - WINDOW
    for n in (2 * room, 2 * room + 17, 4096, None):
        kept = schedule(n, layers, budget, beta, n_sink=4)
        assert sum(kept) == layers * budget
        assert all(a >= b for a, b in zip(kept, kept[1:]))
        assert min(kept) >= WINDOW + 4  # the sinks fit in every layer
        lo, hi = room / beta, 2 * room - room / beta
        if n is not None and hi >= n - WINDOW:  # clamped: the bottom layer keeps all there is
            assert kept[0] == n
        elif lo < 4:  # the top layers were raised to their sinks
            assert kept[0] > kept[-1] == WINDOW + 4
        else:  # each share within 1 of its fraction: bottom/top ratio 2 beta - 1
            assert kept[0] > kept[-1]
            assert abs(kept[0] - WINDOW - hi) < 1 and abs(kept[-1] - WINDOW - lo) < 1
            assert abs((kept[0] - WINDOW) - (2 * beta - 1) * (kept[-1] - WINDOW)) <= 2 * beta


def test_schedule_regimes_and_clamp():
    assert schedule(40, 4, 64, 2.0) == [64] * 4  # n < B: nothing to compress
    assert schedule(63, 4, 64, 2.0) == [64] * 4  # n < 2 (B - w): uniform
    assert schedule(4096, 6, 256, 1.0) == [256] * 6  # beta 1: SnapKV's budget everywhere
    # Clamp: the bottom layer cannot ask for more than the n - w prefix tokens there are
    # (room 88, lo 22, hi 154 > 180 - 32): hi = 148, lo = 176 - 148 = 28, step 40.
    assert schedule(180, 4, 120, 4.0) == [180, 140, 100, 60]
    # The top layers are raised to the sinks, taken from the bottom ones.
    kept = schedule(None, 4, 48, 100.0, n_sink=6)
    assert min(kept) == WINDOW + 6 and sum(kept) == 4 * 48


# -- the cache --------------------------------------------------------------------------------
def test_beta_one_is_snapkv_bit_for_bit():
    data = layer_data(3, 220)
    pyramid = caches_for(PyramidKVOptions(pyramid_budget=60, pyramid_beta=1.0), 3)
    snap = caches_for(SnapKVOptions(snap_budget=60), 3, SnapKVCache)
    a, b = run(pyramid, data, 200), run(snap, data, 200)
    assert all(mx.array_equal(x, y) for x, y in zip(a, b))
    for p, s in zip(pyramid, snap):
        assert p.stored_length == s.stored_length == 60 + 20
        assert mx.array_equal(p.kept_positions, s.kept_positions)


def test_each_layer_keeps_what_snapkv_keeps_at_that_layers_budget():
    layers, n = 4, 300
    data = layer_data(layers, n + 6)
    caches = caches_for(PyramidKVOptions(pyramid_budget=64, pyramid_beta=3.0), layers)
    run(caches, data, n)
    expected = schedule(n, layers, 64, 3.0, n_sink=4)
    assert caches[0].resolved_budgets == expected == [c.budget for c in caches]
    assert caches[0].context.layer_budgets == dict(enumerate(expected))
    assert [c.stored_length for c in caches] == [b + 6 for b in expected]  # decode appends
    for layer, (cache, budget) in enumerate(zip(caches, expected)):
        snap = caches_for(SnapKVOptions(snap_budget=budget), layers, SnapKVCache)
        run(snap, data, n)
        assert mx.array_equal(cache.kept_positions, snap[layer].kept_positions)
        kept = set(cache.kept_positions[0, 0].tolist())
        assert set(range(4)) | set(range(n - WINDOW, n + 6)) <= kept  # sinks and window


def test_budgets_are_resolved_once_per_prefill_by_the_first_layer(monkeypatch):
    calls = []
    original = PyramidKVCache.layer_budgets
    monkeypatch.setattr(PyramidKVCache, "layer_budgets",
                        lambda self, n: (n and calls.append((self.layer, n))) or original(self, n))
    data = layer_data(3, 400)
    caches = caches_for(PyramidKVOptions(pyramid_budget=64, pyramid_beta=2.0), 3)
    assert [c.budget for c in caches] == schedule(None, 3, 64, 2.0)  # a long prompt's, until one comes
    assert caches[0].resolved_budgets is None
    run(caches, data, 40, stop=42)  # a short prompt and two steps: uniform, nothing evicted
    assert calls == [(0, 40)] and caches[0].resolved_budgets == [64] * 3
    assert all(c.stored_length == c.offset == 42 for c in caches)
    # The exchange continues with a long prompt: resolved again at its end, from its length.
    run(caches, data, 301, start=42, stop=301)
    assert calls == [(0, 40), (0, 301)]
    assert [c.stored_length for c in caches] == schedule(301, 3, 64, 2.0)


def test_an_explicit_list_is_obeyed_and_a_wrong_one_refused():
    data = layer_data(4, 210)
    budgets = (90, 37, 70, 50)  # any shape, as long as each holds the sinks and window
    caches = caches_for(PyramidKVOptions(pyramid_budget=64, pyramid_resolved_budget=budgets), 4)
    assert [c.budget for c in caches] == list(budgets)
    run(caches, data, 210)
    assert [c.stored_length for c in caches] == list(budgets)
    assert caches[0].resolved_budgets == list(budgets)
    with pytest.raises(ValueError, match=r"pyramid_resolved_budget=\(90, 60, 50\) has 3 budgets; "
                                         r"allowed: one per compressed layer of this model, 4"):
        caches_for(PyramidKVOptions(pyramid_resolved_budget=(90, 60, 50)), 4)
    with pytest.raises(ValueError, match=r"pyramid_resolved_budget=\(90, 36\) holds a budget below 37"):
        caches_for(PyramidKVOptions(pyramid_resolved_budget=(90, 36)), 2)
    with pytest.raises(ValueError, match="pyramid_budget must exceed pyramid_n_sink"):
        PyramidKVOptions(pyramid_budget=36)


def test_a_prompt_within_the_budget_is_kept_whole():
    data = layer_data(3, 70)
    caches = caches_for(PyramidKVOptions(pyramid_budget=64), 3)
    full = caches_for(SnapKVOptions(snap_budget=4096), 3, SnapKVCache)
    assert all(mx.array_equal(x, y) for x, y in zip(run(caches, data, 64), run(full, data, 64)))
    assert [c.stored_length for c in caches] == [70] * 3


def test_a_loaded_cache_keeps_its_layers_budget(tmp_path):
    data = layer_data(3, 260)
    caches = caches_for(PyramidKVOptions(pyramid_budget=64), 3)
    run(caches, data, 256)
    path = str(tmp_path / "pyramid.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert [c.budget for c in loaded] == [c.budget for c in caches] == schedule(256, 3, 64, 2.0)
