"""Prompts shorter than a method's window or first chunk: the cache holds only
full-precision rows (or a single token), and must still save, load and continue."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from conformance import config, profile
from tiny_models import prompt, tiny_model
from veloxquant_mlx import make_prompt_cache
from veloxquant_mlx.registry import implemented_methods

METHOD_KEYS = implemented_methods()


@pytest.mark.parametrize("method", METHOD_KEYS)
@pytest.mark.parametrize("n_prompt", [1, 2, 19])
def test_a_short_prompt_saves_loads_and_continues_with_the_same_logits(method, n_prompt, tmp_path):
    model = tiny_model("llama")
    tokens = prompt(n_prompt + 4)
    cache = make_prompt_cache(model, config(method, profile(method).compressing))
    model(tokens[:n_prompt][None], cache=cache)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert [(c.offset, c.stored_length) for c in loaded] == [(c.offset, c.stored_length) for c in cache]
    a = mx.concatenate([model(t.reshape(1, 1), cache=cache)[:, -1] for t in tokens[n_prompt:]])
    b = mx.concatenate([model(t.reshape(1, 1), cache=loaded)[:, -1] for t in tokens[n_prompt:]])
    # The same values; a loaded cache is sized exactly where the original has spare room, so
    # sums may run in another order: equal to float32 rounding over a few hundred terms.
    assert mx.array_equal(mx.argmax(a, -1), mx.argmax(b, -1))
    assert mx.allclose(a, b, atol=1e-5, rtol=1e-5), float(mx.abs(a - b).max())
