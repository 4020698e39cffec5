"""H2O's decode step adds its query's attention to the mass in one compiled pass over the
keys' whole room, plain or packed store: the same log-probabilities and the same mass on
every kept slot, bit for bit, as the reference (``attention_mass`` over the kept keys),
through evictions, with and without decay, in float32 and float16."""

import pytest

import veloxquant_mlx  # noqa: F401  (before mlx)
import mlx.core as mx
import numpy as np

from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import H2OOptions, KIVIOptions
from veloxquant_mlx.methods import h2o

STEPS = 70  # two evictions (every 32 steps) after the prompt's


def _decode(config, dtype, compiled: bool, monkeypatch):
    calls = []
    if not compiled:
        monkeypatch.setattr(h2o.H2OCache, "_key_room", lambda self: None)
    else:
        real = h2o._decode_mass

        def counted(*args):
            calls.append(args)
            return real(*args)

        monkeypatch.setattr(h2o, "_decode_mass", counted)
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
    masses = [np.array(c.store.view("mass")) for c in cache]
    monkeypatch.undo()
    return np.stack(logprobs), masses, len(calls)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("settings", [
    dict(options=H2OOptions(h2o_budget=40)),
    dict(options=H2OOptions(h2o_budget=36, h2o_decay=0.9, h2o_n_sink=2, h2o_grace=4)),
    dict(options=H2OOptions(h2o_budget=40), storage=KIVIOptions(kivi_group_size=32), kv_bits=4),
], ids=["plain", "decay", "kivi4"])
def test_the_compiled_mass_equals_the_reference_bit_for_bit(settings, dtype, monkeypatch):
    config = KVCacheConfig(**settings)
    lp_ref, mass_ref, _ = _decode(config, dtype, compiled=False, monkeypatch=monkeypatch)
    lp, mass, calls = _decode(config, dtype, compiled=True, monkeypatch=monkeypatch)
    # every layer's every decode step took the compiled pass (a packed store: all but the
    # prompt's last token, which attends before the store is packed)
    assert calls >= (STEPS - 1) * len(mass)
    np.testing.assert_array_equal(lp, lp_ref)
    for m, ref in zip(mass, mass_ref):
        np.testing.assert_array_equal(m, ref)
