"""H2O's and Keyformer's decode steps add their query's (noisy) attention to each slot's
score in one compiled pass over the keys' whole room, plain or (Keyformer) packed store
(H2O's over packed slots adds attention's own weights instead:
test_quantized_slots_decode_read.py): the same
log-probabilities, bit for bit, and the same score on every kept slot to float32 rounding,
as the reference (``attention_mass`` / ``gumbel_mass`` over the kept keys), through
evictions, in float32 and float16."""

import pytest

import veloxquant_mlx  # noqa: F401  (before mlx)
import mlx.core as mx
import numpy as np

from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import H2OOptions, KeyformerOptions, KIVIOptions
from veloxquant_mlx.evict.base import ScoredEvictionCache
from veloxquant_mlx.methods import h2o, keyformer

STEPS = 70  # two evictions (every 32 steps) after the prompt's


PASSES = {"h2o": (h2o, "_decode_mass", "mass"), "keyformer": (keyformer, "_decode_score", "score")}


def _decode(config, dtype, compiled: bool, monkeypatch):
    module, pass_name, state = PASSES[config.method]
    calls = []
    if not compiled:
        monkeypatch.setattr(ScoredEvictionCache, "key_room", lambda self: None)
    else:
        real = getattr(module, pass_name)

        def counted(*args):
            calls.append(args)
            return real(*args)

        monkeypatch.setattr(module, pass_name, counted)
    model = tiny_model("llama")
    model.set_dtype(dtype)
    cache = make_prompt_cache(model, config)
    tokens = prompt(120)
    for start in range(0, 119, 64):
        model(tokens[start:min(start + 64, 119)][None], cache=cache)
        mx.eval([c.state for c in cache])
    y, logprobs = tokens[-1:], []
    for _ in range(STEPS):
        logits = model(y[None], cache=cache)[:, -1, :].astype(mx.float32)
        y = mx.argmax(logits, axis=-1)
        logprobs.append(np.array(logits - mx.logsumexp(logits, keepdims=True)))
    masses = [np.array(c.store.view(state)) for c in cache]
    monkeypatch.undo()
    return np.stack(logprobs), masses, len(calls)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("settings", [
    dict(options=H2OOptions(h2o_budget=40)),
    dict(options=H2OOptions(h2o_budget=36, h2o_decay=0.9, h2o_n_sink=2, h2o_grace=4)),
    dict(options=KeyformerOptions(keyformer_budget=40)),
    dict(options=KeyformerOptions(keyformer_budget=36, keyformer_anneal_steps=50, keyformer_n_sink=2,
                                  keyformer_recent=6, keyformer_seed=7)),
    dict(options=KeyformerOptions(keyformer_budget=40), storage=KIVIOptions(kivi_group_size=32), kv_bits=4),
], ids=["h2o", "h2o-decay", "keyformer", "keyformer-anneal", "keyformer-kivi4"])
def test_the_compiled_score_equals_the_reference_bit_for_bit(settings, dtype, monkeypatch):
    config = KVCacheConfig(**settings)
    lp_ref, mass_ref, _ = _decode(config, dtype, compiled=False, monkeypatch=monkeypatch)
    lp, mass, calls = _decode(config, dtype, compiled=True, monkeypatch=monkeypatch)
    # every layer's every decode step took the compiled pass (a packed store: all but the
    # prompt's last token, which attends before the store is packed)
    assert calls >= (STEPS - 1) * len(mass)
    np.testing.assert_array_equal(lp, lp_ref)
    # the scores are float32 sums of 70 steps' probabilities: bit for bit on the Intel CPUs
    # this was written on; on an AMD EPYC the compiled pass's exponentials round apart from
    # the plain ones' by an ulp here and there (largest 1.6e-7 relative), so within 8 ulps
    for m, ref in zip(mass, mass_ref):
        np.testing.assert_allclose(m, ref, rtol=8 * np.finfo(np.float32).eps, atol=0)


def test_keyformers_row_hashes_stay_right_past_each_table_of_positions(monkeypatch):
    """A decode step's row hashes come from a table of the next positions', made on the
    host: with a table of 7 positions, 70 steps refill it ten times and still score as
    the reference (a stale or shifted table would draw other noise)."""
    monkeypatch.setattr(keyformer, "ROW_HASH_BLOCK", 7)
    config = KVCacheConfig(options=KeyformerOptions(keyformer_budget=40, keyformer_seed=3))
    lp_ref, mass_ref, _ = _decode(config, mx.float32, compiled=False, monkeypatch=monkeypatch)
    monkeypatch.setattr(keyformer, "ROW_HASH_BLOCK", 7)  # _decode undoes the patches
    lp, mass, calls = _decode(config, mx.float32, compiled=True, monkeypatch=monkeypatch)
    assert calls >= (STEPS - 1) * len(mass)
    np.testing.assert_array_equal(lp, lp_ref)
    for m, ref in zip(mass, mass_ref):
        np.testing.assert_allclose(m, ref, rtol=8 * np.finfo(np.float32).eps, atol=0)
