"""Decode-time eviction in batches (issue 30): methods whose papers evict a token at every
decode step let ``EVICT_EVERY`` tokens come, then keep their best ``budget`` at once, so a
step in between is one write, one attention and at most one score update."""

from __future__ import annotations

from dataclasses import replace

import pytest

from feeding import prompt_then_steps, synthetic_kvq
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import (
    CaMOptions,
    H2OOptions,
    KeyformerOptions,
    L2NormOptions,
    MorphKVOptions,
    TOVAOptions,
)
from veloxquant_mlx.evict.base import EVICT_EVERY
from veloxquant_mlx.methods.cam import CaMCache
from veloxquant_mlx.methods.h2o import H2OCache
from veloxquant_mlx.methods.keyformer import KeyformerCache
from veloxquant_mlx.methods.knorm import L2NormCache
from veloxquant_mlx.methods.morphkv import MorphKVCache
from veloxquant_mlx.methods.qfilters import QFiltersCache
from veloxquant_mlx.methods.tova import TOVACache

BUDGET, PROMPT = 48, 100
CASES = {
    "h2o": (H2OCache, H2OOptions(h2o_budget=BUDGET)),
    "tova": (TOVACache, TOVAOptions(tova_budget=BUDGET)),
    "knorm": (L2NormCache, L2NormOptions(knorm_budget=BUDGET)),
    "keyformer": (KeyformerCache, KeyformerOptions(keyformer_budget=BUDGET)),
    "morphkv": (MorphKVCache, MorphKVOptions(morphkv_budget=BUDGET)),
    "cam": (CaMCache, CaMOptions(cam_budget=BUDGET)),
}


def synthetic(n, seed=0):
    return synthetic_kvq(n, 2, 3, 16, norm_range=(0.2, 3.0), seed=seed)


@pytest.mark.parametrize("method", list(CASES))
def test_the_cache_holds_the_budget_plus_the_tokens_since_the_last_batched_eviction(method):
    cls, options = CASES[method]
    cache = cls(KVCacheConfig(options=options))
    k, v, q = synthetic(PROMPT + 2 * EVICT_EVERY + 5)
    held = []
    prompt_then_steps(cache, k, v, q, PROMPT, 64, after_each=lambda c, seen: held.append(c.stored_length))
    steps = range(len(held))  # held[0]: the prompt's end, then one entry a decode step
    assert held == [BUDGET + s % EVICT_EVERY for s in steps]


def test_with_a_fixed_score_a_batched_eviction_keeps_what_evicting_every_step_keeps():
    """knorm's score (a key's norm) never changes, so evicting the worst one at every step
    and the worst ``EVICT_EVERY`` at once leave the same tokens whenever the batch runs."""
    k, v, q = synthetic(PROMPT + 2 * EVICT_EVERY + 5, seed=3)
    options = L2NormOptions(knorm_budget=BUDGET, knorm_n_sink=2, knorm_recent=4)
    batched = L2NormCache(KVCacheConfig(options=options))
    every = L2NormCache(KVCacheConfig(options=options))
    every.schedule = replace(every.schedule, decode_every=1)
    kept = {}

    def record(name):
        def after_each(cache, seen):
            kept.setdefault(name, []).append([set(p.tolist()) for p in cache.kept_positions[0]])
        return after_each

    prompt_then_steps(batched, k, v, q, PROMPT, 64, after_each=record("batched"))
    prompt_then_steps(every, k, v, q, PROMPT, 64, after_each=record("every"))
    evictions = [s for s in range(len(kept["batched"])) if s % EVICT_EVERY == 0]
    assert len(evictions) == 3
    for s in evictions:
        assert kept["batched"][s] == kept["every"][s], s
    assert kept["batched"][1] != kept["every"][1]  # in between, the batched cache holds more


def test_keyformer_packed_with_an_annealed_temperature_equals_each_sequence_alone(monkeypatch):
    """Keyformer's packed batch: each sequence scores with its own query position, the noise
    it has alone and, annealing, its own temperature step (sequences that joined later are at
    other steps): tokens, log-probs and kept slots as each sequence alone."""
    import batching
    from veloxquant_mlx.methods import keyformer as keyformer_module

    model, make = batching.rowwise_setup("keyformer", {
        "keyformer_budget": BUDGET, "keyformer_anneal_steps": 12, "keyformer_tau_init": 2.0,
        "keyformer_tau_end": 0.5, "keyformer_recent": 4})
    prompts = [list(range(7, 7 + n)) for n in (30, 90, 64, 75)]
    max_tokens = (14, 9, 16, 11)
    alone = [batching.run_alone(model, make, t, m) for t, m in zip(prompts, max_tokens)]
    temperatures, packed = [], keyformer_module._packed_decode_score

    def recording(scale, noise):
        step = packed(scale, noise)
        return lambda *a: temperatures.append(a[5]) or step(*a)

    monkeypatch.setattr(keyformer_module, "_packed_decode_score", recording)
    got = batching.run_batched(model, prompts, max_tokens, join_at=3)
    # packed steps ran, some with one temperature per sequence (steps that differ)
    assert any(t.ndim == 5 and t.shape[0] > 1 for t in temperatures)
    batching.assert_batch_equals_alone(got, alone)


def test_overrides_of_the_decode_steps_pack_only_where_their_own_class_vouches_for_them():
    """QFilters overrides ``_evict``, ``is_trimmable`` and ``trim`` and says in its own body that
    they act as the base's once its filter is fixed (``same_at_decode``, ``packs_now``): it
    packs; a subclass that overrides ``_evict`` again has not said so, and does not."""
    from veloxquant_mlx.evict.batch import EvictionPacked
    from veloxquant_mlx.methods.qfilters import QFiltersCache

    class Again(QFiltersCache):
        def _evict(self, inputs, decode_step):
            return super()._evict(inputs, decode_step)

    class Inherits(QFiltersCache):
        pass

    assert EvictionPacked.accepts(QFiltersCache) and EvictionPacked.accepts(Inherits)
    assert not EvictionPacked.accepts(Again)
    cache = QFiltersCache(KVCacheConfig(method="qfilters"), None, 0)
    assert not cache.packs_now()  # no filter before the first eviction: it may still change


PACKED_EVICTING = {
    "cam": (CaMCache, {"cam_budget": BUDGET}),
    "keyformer": (KeyformerCache, {"keyformer_budget": BUDGET}),
    "morphkv": (MorphKVCache, {"morphkv_budget": BUDGET}),
    "h2o": (H2OCache, {"h2o_budget": BUDGET}),
    "qfilters": (QFiltersCache, {"qfilters_budget": BUDGET}),
}


@pytest.mark.parametrize("method", list(PACKED_EVICTING))
def test_a_packed_batch_evicts_at_each_sequences_own_steps_as_alone(method, monkeypatch):
    """Evicting every 4 decode steps (so that packed steps evict within a short run; the
    conformance batch test's runs end before the default EVICT_EVERY): sequences of
    different lengths, joining later, evict at their own steps, and each keeps what it
    keeps alone (CaM's merges into the kept rows included), tokens and kept arrays alike."""
    import batching
    from veloxquant_mlx.evict import batch as evict_batch

    cls, settings = PACKED_EVICTING[method]
    if cls is not None:
        monkeypatch.setattr(cls, "schedule", replace(cls.schedule, decode_every=4))
    model, make = batching.rowwise_setup(method, settings)
    # the first two start together with prompts of one length: due at the same steps, with
    # as many slots (CaM merges them as one group, each drawing its gate as alone)
    prompts = [list(range(s, s + n)) for s, n in ((7, 90), (3, 90), (11, 30), (5, 75))]
    max_tokens = (14, 9, 16, 11)
    alone = [batching.run_alone(model, make, t, m) for t, m in zip(prompts, max_tokens)]
    evicted, real = [], evict_batch.EvictionPacked._evict

    def counting(self, inputs, scoring):
        over = [i for i in scoring if self.rows[i] > self.shells[i].budget]
        evicted.append(len(over))
        return real(self, inputs, scoring)

    monkeypatch.setattr(evict_batch.EvictionPacked, "_evict", counting)
    got = batching.run_batched(model, prompts, max_tokens, join_at=3)
    assert max(evicted, default=0) >= 2, "no packed step evicted for several sequences"
    batching.assert_batch_equals_alone(got, alone)


@pytest.mark.parametrize("reuse", [1, 2])
def test_chunkkv_decodes_packed_as_alone(reuse):
    """ChunkKV evicts at the prompt's end only (per sequence, its layers sharing one choice
    when reuse > 1); its packed decode steps only append: tokens and kept arrays as alone."""
    import batching

    model, make = batching.rowwise_setup("chunkkv", {"chunkkv_budget": BUDGET, "chunkkv_chunk_size": 4,
                                                     "chunkkv_reuse_layers": reuse})
    prompts = [list(range(s, s + n)) for s, n in ((7, 90), (3, 120), (11, 30), (5, 75))]
    max_tokens = (14, 9, 16, 11)
    alone = [batching.run_alone(model, make, t, m) for t, m in zip(prompts, max_tokens)]
    modes = set()
    got = batching.run_batched(model, prompts, max_tokens, join_at=3,
                               check=lambda gen: modes.update(c.mode for c in batching.batch_caches(gen)))
    assert "packed" in modes
    batching.assert_batch_equals_alone(got, alone)


def test_nestedkv_decodes_packed_with_its_heads_padding_masked():
    """NestedKV's per-head budgets leave padding among a sequence's own slots; decode only
    appends, so a packed batch masks that padding as the slots after a shorter sequence's:
    tokens and kept arrays as alone."""
    import batching
    from veloxquant_mlx.evict import batch as evict_batch

    model, make = batching.rowwise_setup("nestedkv", {"nestedkv_budget": BUDGET, "nestedkv_safeguard_alpha": 0.25,
                                                      "nestedkv_window": 8})
    prompts = [list(range(s, s + n)) for s, n in ((7, 90), (3, 120), (11, 30), (5, 75))]
    max_tokens = (14, 9, 16, 11)
    alone = [batching.run_alone(model, make, t, m) for t, m in zip(prompts, max_tokens)]
    head_padded = []

    def check(gen):
        for c in batching.batch_caches(gen):
            if isinstance(c.packed, evict_batch.EvictionPacked):
                head_padded.extend(c.packed.head_padded)

    got = batching.run_batched(model, prompts, max_tokens, join_at=3, check=check)
    assert any(head_padded), "no packed batch held a sequence with per-head padding"
    batching.assert_batch_equals_alone(got, alone)
