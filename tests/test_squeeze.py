"""SqueezeAttention's card invariants: budgets from the measured similarity, by brute force.

Synthetic tests drive the layers' caches the way mlx-lm and the hook do (per update and
layer: update_and_fetch, attention through the cache, then ``observe_hidden`` with the
residual stream before attention and the attention output); model tests check the hook.
"""

from __future__ import annotations

import random

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import KVCache

from conformance import config
from tiny_models import char_tokenizer, prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache, patch_model_kv_cache, unpatch_model_kv_cache
from veloxquant_mlx.cache.options import SqueezeAttentionOptions
from veloxquant_mlx.cache.context import ModelContext
from veloxquant_mlx.evict.base import EVICT_EVERY
from veloxquant_mlx.methods.squeeze import SqueezeAttentionCache, squeeze_budgets, three_means

HKV, GROUP, D, MODEL_DIM = 2, 2, 16, 24
SCALE = D**-0.5


def layer_data(n_layers, n, spread, seed=0):
    """Per layer: keys, values, queries (1, H, n, D) and the residual stream before and
    after attention (1, n, MODEL_DIM); ``spread[l]`` sets how much attention changes it."""
    out = []
    for layer in range(n_layers):
        keys = [mx.random.key(seed + 10 * layer + i) for i in range(5)]
        k = mx.random.normal((1, HKV, n, D), key=keys[0])
        v = mx.random.normal((1, HKV, n, D), key=keys[1])
        q = mx.random.normal((1, HKV * GROUP, n, D), key=keys[2])
        before = mx.random.normal((1, n, MODEL_DIM), key=keys[3])
        after = before + spread[layer] * mx.random.normal((1, n, MODEL_DIM), key=keys[4])
        out.append((k, v, q, before, after))
    return out


def caches_for(options, n_layers):
    cfg = KVCacheConfig(options=options)
    context = ModelContext(cfg, n_layers, tuple(range(n_layers)))
    return [SqueezeAttentionCache(cfg, context, layer) for layer in range(n_layers)]


def run(caches, data, n_prompt, chunk=64, after_each=None):
    """The prompt in chunks, its last token alone, then one token at a time."""
    bounds, start = [], 0
    while start < n_prompt - 1:
        bounds.append((start, min(start + chunk, n_prompt - 1)))
        start = bounds[-1][1]
    bounds += [(t, t + 1) for t in range(n_prompt - 1, data[0][0].shape[2])]
    for a, b in bounds:
        for cache, (k, v, q, before, after) in zip(caches, data):
            keys, values = cache.update_and_fetch(k[:, :, a:b], v[:, :, a:b])
            cache.attend(q[:, :, a:b], keys, values, scale=SCALE, mask="causal" if b - a > 1 else None)
            cache.observe_hidden(before[:, a:b], after[:, a:b] - before[:, a:b])
        if after_each and b - a == 1:
            after_each(caches, b)


def mean_cosine(before, after):
    """Brute force, in float64 on the host: the mean over tokens of cos(before, after)."""
    total = 0.0
    for x, y in zip(before.tolist()[0], after.tolist()[0]):
        dot = sum(a * b for a, b in zip(x, y))
        total += dot / (sum(a * a for a in x) ** 0.5 * sum(b * b for b in y) ** 0.5)
    return total / before.shape[1]


# -- clustering and budgets ------------------------------------------------------------------
def test_the_squeezed_cluster_is_the_highest_and_contiguous():
    rng = random.Random(0)
    assert three_means([0.1, 0.12, 0.5, 0.52, 0.9, 0.91, 0.93]) == [False] * 4 + [True] * 3
    for _ in range(200):
        values = [rng.random() for _ in range(rng.randint(3, 40))]
        squeezed = three_means(values)
        assert any(squeezed) and not all(squeezed)
        assert min(v for v, s in zip(values, squeezed) if s) > max(v for v, s in zip(values, squeezed) if not s)


@pytest.mark.parametrize("strength", [0.5, 1.0, 1.99])
def test_budgets_follow_the_similarity_and_keep_the_total(strength):
    rng = random.Random(1)
    for _ in range(100):
        layers, budget, sinks = rng.randint(3, 40), rng.randint(8, 600), rng.randint(0, 6)
        similarity = [rng.random() for _ in range(layers)]
        budgets = squeeze_budgets(similarity, budget, strength, sinks)
        squeezed = three_means(similarity)
        assert sum(budgets) == layers * budget
        low = max(sinks + 1, int((1 - strength / 2) * budget + 0.5))
        assert all(b == low for b, s in zip(budgets, squeezed) if s)
        others = [b for b, s in zip(budgets, squeezed) if not s]
        assert min(others) >= budget and max(others) - min(others) <= 1
    assert squeeze_budgets([0.9, 0.2, 0.5, 0.3], 100, 0.0, 4) == [100] * 4  # strength 0: uniform
    assert squeeze_budgets([0.9, 0.2, 0.9, 0.2], 100, 1.0, 4) == [100] * 4  # < 3 distinct values
    assert squeeze_budgets([0.9, 0.2, 0.5, 0.3], 100, 1.0, 4) == [50, 117, 117, 116]


# -- the cache, driven with synthetic data -----------------------------------------------------
def kept_now(seen, n_prompt, budget, sinks):
    """The sinks and the newest tokens: ``budget`` of them at the prompt's end and every
    ``EVICT_EVERY`` decode steps after it, when the oldest leave together; every token
    since then besides."""
    evicted_at = n_prompt + (seen - n_prompt) // EVICT_EVERY * EVICT_EVERY
    return set(range(sinks)) | set(range(evicted_at - budget + sinks, seen))


def test_budgets_come_from_every_layers_measurement_of_the_prompt():
    spread = [0.2, 3.0, 0.25, 1.0, 2.5, 0.9]  # layers 0 and 2: attention changes little
    layers, n, budget, sinks = len(spread), 230, 40, 4
    data = layer_data(layers, n + 2 * EVICT_EVERY + 3, spread)  # two evictions after the prompt's
    caches = caches_for(SqueezeAttentionOptions(squeeze_budget=budget, squeeze_n_sink=sinks), layers)
    sizes = []

    def check(caches, seen):
        for cache, kept_budget in zip(caches, expected):
            kept = set(cache.kept_positions[0, 0].tolist())
            assert kept == kept_now(seen, n, kept_budget, sinks) and cache.stored_length == len(kept)
        sizes.append(caches[0].stored_length - expected[0])

    # The prompt's chunks are measured; its last token, at which budgets are fixed, is not.
    brute = [mean_cosine(before[:, : n - 1], after[:, : n - 1]) for *_, before, after in data]
    expected = squeeze_budgets(brute, budget, 1.0, sinks)
    assert expected[0] == expected[2] == 20 and sum(expected) == layers * budget
    run(caches, data, n, after_each=check)
    assert sizes == [*range(EVICT_EVERY), *range(EVICT_EVERY), 0, 1, 2, 3]  # tokens over the budget
    assert caches[0].similarity == pytest.approx(brute, abs=1e-5)
    assert caches[0].resolved_budgets == expected == [c.budget for c in caches]


def test_strength_zero_is_uniform_sinks_plus_recent():
    data = layer_data(4, 150, [0.2, 3.0, 0.5, 1.0])
    caches = caches_for(SqueezeAttentionOptions(squeeze_budget=30, squeeze_strength=0.0), 4)

    def check(caches, seen):
        for cache in caches:
            assert set(cache.kept_positions[0, 1].tolist()) == kept_now(seen, 140, 30, 4)

    run(caches, data, 140, after_each=check)
    assert caches[0].resolved_budgets == [30] * 4


def test_an_explicit_list_bypasses_the_measurement(monkeypatch):
    monkeypatch.setattr(SqueezeAttentionCache, "similarity", property(lambda self: pytest.fail("measured")))
    data = layer_data(3, 120, [0.2, 3.0, 0.5])
    caches = caches_for(SqueezeAttentionOptions(squeeze_budget=30, squeeze_resolved_budget=(10, 50, 30)), 3)
    run(caches, data, 110)  # then 10 decode steps, none of them evicting
    assert caches[0].resolved_budgets == [10, 50, 30] == [c.stored_length - 10 for c in caches]
    assert "squeeze_similarity" not in caches[0].context.shared  # nothing was measured
    with pytest.raises(ValueError, match=r"squeeze_resolved_budget=\(10, 50\) has 2 budgets; "
                                         r"allowed: one per compressed layer of this model, 3"):
        caches_for(SqueezeAttentionOptions(squeeze_resolved_budget=(10, 50)), 3)


# -- the hook, on a model ------------------------------------------------------------------------
def residual_similarity(model, tokens):
    """Each layer's mean cos(h, h + attention) over ``tokens``, computed outside any cache."""
    h, sims = model.model.embed_tokens(tokens[None]), []
    for block in model.layers:
        after = h + block.self_attn(block.input_layernorm(h), "causal")
        sims.append(float(((h * after).sum(-1) / (mx.linalg.norm(h, axis=-1) * mx.linalg.norm(after, axis=-1))).mean()))
        h = after + block.mlp(block.post_attention_layernorm(after))
    return sims


def test_the_hook_measures_the_residual_stream_before_any_layer_evicts(monkeypatch):
    model = tiny_model("llama", num_hidden_layers=5)
    tokens = prompt(200)
    cache = make_prompt_cache(model, config("squeeze", {"squeeze_budget": 48}))
    measured_at_eviction = []
    original = SqueezeAttentionCache._evict
    monkeypatch.setattr(SqueezeAttentionCache, "_evict", lambda self, inputs, decode_step: (
        measured_at_eviction.append(self.similarity is not None), original(self, inputs, decode_step))[1])
    ref = [KVCache() for _ in model.layers]
    for a, b in ((0, 64), (64, 128), (128, 199)):  # prefill outputs are those of the full cache
        assert mx.array_equal(model(tokens[a:b][None], cache=cache), model(tokens[a:b][None], cache=ref))
    assert not measured_at_eviction
    assert mx.array_equal(model(tokens[199:][None], cache=cache), model(tokens[199:][None], cache=ref))
    assert measured_at_eviction == [True] * 5
    brute = residual_similarity(model, tokens[:199])
    assert cache[0].similarity == pytest.approx(brute, abs=1e-5)
    assert cache[0].resolved_budgets == squeeze_budgets(brute, 48, 1.0, 4) == [c.stored_length for c in cache]
    assert len(set(cache[0].resolved_budgets)) > 1


def test_the_hook_is_sticky_for_direct_caches_and_undone_by_unpatch():
    model = tiny_model("llama", num_hidden_layers=3)
    classes = [(type(b), type(b.self_attn)) for b in model.layers]
    x = prompt(40)[None]
    before, through_kv = model(x), model(x, cache=[KVCache() for _ in model.layers])
    patch_model_kv_cache(model, config("squeeze", {"squeeze_budget": 16}))
    mlx_lm.generate(model, char_tokenizer(), "Some text to start from.", max_tokens=3)
    assert all(type(b) is not cls for b, (cls, _) in zip(model.layers, classes))
    # Caches that do not observe pass straight through the observing classes.
    assert mx.array_equal(model(x, cache=[KVCache() for _ in model.layers]), through_kv)
    assert mx.array_equal(model(x), before)
    unpatch_model_kv_cache(model)
    assert [(type(b), type(b.self_attn)) for b in model.layers] == classes
    make_prompt_cache(model, config("squeeze", {}))  # direct: stays, through a later patch too
    patch_model_kv_cache(model, config("squeeze", {}))
    model.make_cache()
    unpatch_model_kv_cache(model)
    assert all(type(b) is not cls for b, (cls, _) in zip(model.layers, classes))
    assert mx.array_equal(model(x), before)
