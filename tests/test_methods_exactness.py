"""Exactness: where the math allows it, our caches equal mlx-lm's own, bit for bit.

Prompts run the way mlx-lm's generate runs them: chunks, then the last prompt token
alone, then single-token decode steps.
"""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import SnapKVOptions, StreamingLLMOptions


def run(model, cache, tokens, chunk=64, decode=6):
    """Logits of the last prompt token and of each greedy decode step: (1, 1+decode, V)."""
    x = tokens
    while x.shape[0] > 1:
        n = min(chunk, x.shape[0] - 1)
        model(x[:n][None], cache=cache)
        x = x[n:]
    outs = [model(x[None], cache=cache)[:, -1:]]
    for _ in range(decode):
        y = mx.argmax(outs[-1][:, -1], axis=-1)
        outs.append(model(y[:, None], cache=cache)[:, -1:])
    return mx.concatenate(outs, axis=1)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize(
    "config",
    [
        KVCacheConfig(),
        KVCacheConfig(options=StreamingLLMOptions(stream_n_sink=4, stream_window_size=400)),
        KVCacheConfig(options=SnapKVOptions(snap_budget=400)),
    ],
    ids=["full", "streaming_llm", "snapkv"],
)
def test_budget_covering_the_context_equals_mlx_lm_kvcache(arch, config):
    model = tiny_model(arch)
    tokens = prompt(200)
    ref = run(model, [KVCache() for _ in model.layers], tokens)
    out = run(model, make_prompt_cache(model, config), tokens)
    assert mx.array_equal(out, ref)


def test_full_cache_equals_mlx_lm_kvcache_in_float16():
    model = tiny_model("llama", dtype=mx.float16)
    tokens = prompt(300)
    ref = run(model, [KVCache() for _ in model.layers], tokens, chunk=128)
    cache = make_prompt_cache(model, KVCacheConfig())
    out = run(model, cache, tokens, chunk=128)
    assert mx.array_equal(out, ref)
    kv = [KVCache() for _ in model.layers]
    run(model, kv, tokens, chunk=128)
    assert [c.nbytes for c in cache] == [c.nbytes for c in kv]


def test_streaming_decode_matches_rotating_kv_cache():
    # A prompt that fits, then decoding far past the capacity: each step keeps the sinks
    # and the last W - 1 tokens plus the new one, exactly like RotatingKVCache(keep=s).
    model = tiny_model("llama")
    s, w = 4, 28
    tokens = prompt(20)
    ref = run(model, [RotatingKVCache(max_size=s + w, keep=s) for _ in model.layers], tokens, decode=40)
    config = KVCacheConfig(options=StreamingLLMOptions(stream_n_sink=s, stream_window_size=w))
    out = run(model, make_prompt_cache(model, config), tokens, decode=40)
    assert mx.allclose(out, ref, atol=1e-4, rtol=1e-4)
