"""Entropy coding of cachegen and kvtc costs each token one pass of the coder, however often
the coded form is read (``stored_nbytes``, a save), and a file holds the codes. ``state``
(mlx-lm reads it after every prefill chunk) codes nothing: tests/test_coded_state.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conformance import config
from tiny_models import prompt, tiny_model
from veloxquant_mlx import load_prompt_cache, make_prompt_cache, save_prompt_cache
from veloxquant_mlx.quant import coded_cache, entropy

SEGMENT = 64  # tokens a sealed segment needs in these tests (a multiple of cachegen's group)
CHUNKS = 4
CHUNK = 100  # a prefill chunk: past kvtc's sinks and window, at least one segment is new
SETTINGS = {
    "cachegen": {"cachegen_group_size": 32},
    "kvtc": {"residual_window": 32, "kvtc_bit_budget": 128},
}


@pytest.fixture
def coder_calls(monkeypatch):
    """Every call of the rANS coder: the number of symbols it coded."""
    calls = []
    original = entropy.encode

    def counting(symbols, freqs):
        calls.append(int(np.asarray(symbols).size))
        return original(symbols, freqs)

    monkeypatch.setattr(entropy, "encode", counting)
    monkeypatch.setattr(coded_cache, "SEGMENT_TOKENS", SEGMENT, raising=False)
    return calls


def _symbols_held(cache) -> int:
    """Symbols the coded form of the cache holds: each token's once."""
    total = 0
    for c in cache:
        for run in (c.store.keys, c.store.values):
            if c.config.method == "cachegen":
                b, h, n, _ = run.scales.view().shape
                total += b * h * run.count * c.kv_shape[2]  # deltas (anchors' zeros left out) + anchors
            else:
                total += run.codes.view().shape[0] * run.count * run.codec.bits.size
    return total


def _prefill_as_mlx_lm(method, n_chunks=CHUNKS, chunk=CHUNK):
    """mlx-lm's prefill (``state`` evaluated after each chunk), the coded size read after
    each chunk too (the most often anything reads the coded form)."""
    model = tiny_model("llama", num_hidden_layers=2)
    cache = make_prompt_cache(model, config(method, SETTINGS[method]))
    tokens = prompt(n_chunks * chunk + 1)
    for i in range(n_chunks):
        model(tokens[i * chunk : (i + 1) * chunk][None], cache=cache)
        mx.eval([c.state for c in cache])
        assert all(c.stored_nbytes > 0 for c in cache)
    return model, cache, tokens


@pytest.mark.parametrize("method", ["cachegen", "kvtc"])
def test_a_prefill_read_chunk_by_chunk_codes_each_token_once(method, coder_calls):
    _, cache, _ = _prefill_as_mlx_lm(method)
    assert sum(coder_calls) == _symbols_held(cache) > 0
    calls = len(coder_calls)
    mx.eval([c.stored_arrays() for c in cache])
    assert len(coder_calls) == calls  # a second read codes nothing


@pytest.mark.parametrize("method", ["cachegen", "kvtc"])
def test_reading_the_coded_form_twice_codes_nothing_the_second_time(method, coder_calls):
    """A short history (an open segment) is coded once too, until the cache grows."""
    _, cache, _ = _prefill_as_mlx_lm(method, n_chunks=1, chunk=80)
    calls = len(coder_calls)
    assert calls > 0
    first = [c.stored_arrays() for c in cache]
    second = [c.stored_arrays() for c in cache]
    assert len(coder_calls) == calls
    for a, b in zip(first, second):
        assert a.keys() == b.keys()
        assert all(mx.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("method", ["cachegen", "kvtc"])
def test_a_saved_cache_of_several_segments_loads_to_the_same_codes_and_saves_again_unchanged(
        method, coder_calls, tmp_path):
    model, cache, tokens = _prefill_as_mlx_lm(method)
    model(tokens[-1:][None], cache=cache)  # a decode step: the open segment after the sealed ones
    path, again = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    calls = len(coder_calls)
    save_prompt_cache(again, loaded)
    assert len(coder_calls) == calls  # the loaded segments are saved as read
    assert open(path, "rb").read() == open(again, "rb").read()
    for a, b in zip(cache, loaded):
        assert a.stored_arrays()["k_segments"].shape[0] >= 2
        for x, y in ((a.store.keys, b.store.keys), (a.store.values, b.store.values)):
            assert x.count == y.count and mx.array_equal(x.codes.view(), y.codes.view())
        ka, va = a.dequantized(mx.float32)
        kb, vb = b.dequantized(mx.float32)
        assert mx.array_equal(ka, kb) and mx.array_equal(va, vb)
