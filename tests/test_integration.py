"""Everything mlx-lm offers keeps working with our caches: generate, stream_generate,
prompt-cache save/load, the server's cache handling; batching refuses clearly."""

import copy

import mlx.core as mx
import mlx_lm
import mlx_lm.models.llama as llama_module
import pytest
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache as mlx_make_prompt_cache
from mlx_lm.models.cache import save_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_sampler

from test_methods_exactness import run
from tiny_models import char_tokenizer, prompt, tiny_model
from veloxquant_mlx import (
    KVCacheConfig,
    make_prompt_cache,
    patch_model_kv_cache,
    patched_kv_cache,
    unpatch_model_kv_cache,
)
from veloxquant_mlx.cache.base import AttentionHookMissing
from veloxquant_mlx.cache.options import KIVIOptions, SnapKVOptions, StreamingLLMOptions
from veloxquant_mlx.cache import attention_hook
from veloxquant_mlx.cache.attention_hook import ORIGINAL_SDPA
from veloxquant_mlx.cache.context import ModelContext
from veloxquant_mlx.methods.snapkv import SnapKVCache

CONFIGS = {
    "full": KVCacheConfig(),
    "streaming_llm": KVCacheConfig(options=StreamingLLMOptions(stream_n_sink=4, stream_window_size=60)),
    "snapkv": KVCacheConfig(options=SnapKVOptions(snap_budget=80, snap_obs_window=16)),
    "kivi": KVCacheConfig(method="kivi", kv_bits=4, residual_window=64),
}
TEXT = "The quick brown fox jumps over the lazy dog. " * 6


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.mark.parametrize("method", CONFIGS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_generate_and_stream_generate_use_our_caches(arch, method, tokenizer):
    model = tiny_model(arch)
    built = []
    with patched_kv_cache(model, CONFIGS[method]):
        original = model.make_cache
        model.make_cache = lambda: built.append(original()) or built[-1]
        text = mlx_lm.generate(model, tokenizer, TEXT, max_tokens=12)
        chunks = list(mlx_lm.stream_generate(model, tokenizer, TEXT, max_tokens=12))
    assert len(text) > 0 and "".join(c.text for c in chunks) == text
    assert len(built) == 2 and built[0][0] is not built[1][0]  # fresh caches per generation
    cache = built[0][0]
    assert cache.config.method == method
    assert cache.offset == len(tokenizer.encode(TEXT)) + 12  # mlx-lm computes one step ahead


@pytest.mark.parametrize("method", CONFIGS)
def test_unpatch_restores_bit_identical_behaviour(method, tokenizer):
    model = tiny_model("llama")
    sampler = make_sampler(temp=0.0)
    before_attrs = set(model.__dict__)
    before = mlx_lm.generate(model, tokenizer, TEXT, max_tokens=16, sampler=sampler)
    logits_before = model(prompt(50)[None])
    patch_model_kv_cache(model, CONFIGS[method])
    assert llama_module.scaled_dot_product_attention is not ORIGINAL_SDPA
    mlx_lm.generate(model, tokenizer, TEXT, max_tokens=4)
    unpatch_model_kv_cache(model)
    assert set(model.__dict__) == before_attrs
    assert type(mlx_make_prompt_cache(model)[0]).__name__ == "KVCache"
    assert mlx_lm.generate(model, tokenizer, TEXT, max_tokens=16, sampler=sampler) == before
    assert mx.array_equal(model(prompt(50)[None]), logits_before)


def test_unpatch_removes_the_hook_when_no_model_needs_it():
    import mlx_lm.models.qwen3 as qwen3_module

    from veloxquant_mlx.integrations import mlx_lm as integration

    model = tiny_model("qwen3")
    was_sticky = "mlx_lm.models.qwen3" in attention_hook.HOOKS
    with patched_kv_cache(model, CONFIGS["kivi"]):
        assert qwen3_module.scaled_dot_product_attention is attention_hook.hooked_sdpa
    if not was_sticky:
        assert qwen3_module.scaled_dot_product_attention is ORIGINAL_SDPA


@pytest.mark.parametrize("method", CONFIGS)
def test_save_load_continue_gives_the_same_tokens(method, tmp_path):
    model = tiny_model("llama")
    tokens = prompt(150)
    reference = run(model, make_prompt_cache(model, CONFIGS[method]), tokens, chunk=64, decode=10)

    cache = make_prompt_cache(model, CONFIGS[method])
    head = run(model, cache, tokens, chunk=64, decode=4)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache, metadata={"method": method})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"method": method}
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    assert [c.offset for c in loaded] == [c.offset for c in cache]
    assert loaded[0].config == cache[0].config
    # continue from the loaded cache exactly where the other run went on
    outs = [head]
    y = mx.argmax(head[:, -1], axis=-1)
    for _ in range(10 - 4):
        logits = model(y[:, None], cache=loaded)[:, -1:]
        outs.append(logits)
        y = mx.argmax(logits[:, -1], axis=-1)
    continued = mx.concatenate(outs, axis=1)
    assert mx.array_equal(mx.argmax(continued, -1), mx.argmax(reference, -1))
    assert mx.allclose(continued, reference, atol=1e-5)


def test_prompt_cache_reuse_copy_and_trim():
    """What the server's LRU prompt cache does with caches: deep copies and trims."""
    model = tiny_model("llama")
    tokens = prompt(90)
    cache = make_prompt_cache(model, KVCacheConfig())
    run(model, cache, tokens, decode=0)
    clone = copy.deepcopy(cache)
    assert trim_prompt_cache(clone, 10) == 10
    assert clone[0].offset == 80 and cache[0].offset == 90
    ref = make_prompt_cache(model, KVCacheConfig())
    run(model, ref, tokens[:80], decode=0)
    nxt = tokens[80:81][None]
    # Different prefill chunkings round differently: equal to float precision.
    assert mx.allclose(model(nxt, cache=clone), model(nxt, cache=ref), atol=1e-5)
    # After eviction a streaming cache can no longer be trimmed.
    stream = make_prompt_cache(model, CONFIGS["streaming_llm"])
    run(model, stream, tokens, decode=0)
    assert not stream[0].is_trimmable() and trim_prompt_cache(stream, 5) == 0


def test_one_context_per_prompt_cache_shared_by_its_layers():
    model = tiny_model("llama", num_hidden_layers=3)
    a = make_prompt_cache(model, KVCacheConfig())
    b = make_prompt_cache(model, KVCacheConfig())
    assert isinstance(a[0].context, ModelContext)
    assert all(c.context is a[0].context for c in a) and a[0].context is not b[0].context
    assert a[0].context.compressed_layers == (0, 1, 2) and [c.layer for c in a] == [0, 1, 2]
    a[0].context.shared["note"] = 1
    assert a[2].context.shared == {"note": 1} and b[0].context.shared == {}


def test_gemma2_full_and_streaming_work_hook_methods_refuse():
    """gemma2 computes attention inline (softcapping): no hook is possible there."""
    model = tiny_model("gemma2")
    tokens = prompt(120)
    from mlx_lm.models.cache import KVCache

    ref = run(model, [KVCache() for _ in model.layers], tokens)
    assert mx.array_equal(run(model, make_prompt_cache(model, KVCacheConfig()), tokens), ref)
    s, w = 4, 200
    stream = KVCacheConfig(options=StreamingLLMOptions(stream_n_sink=s, stream_window_size=w))
    assert mx.array_equal(run(model, make_prompt_cache(model, stream), tokens), ref)
    for method in ("snapkv", "kivi"):
        with pytest.raises(ValueError, match="'gemma2' architecture does not call mlx-lm's scaled_dot_product_attention"):
            make_prompt_cache(model, CONFIGS[method])
        with pytest.raises(ValueError, match="methods that work here: full, streaming_llm"):
            patch_model_kv_cache(model, CONFIGS[method])


def test_a_cache_that_needs_the_hook_refuses_an_inline_attention_model_at_once():
    model = tiny_model("gemma2")
    cache = [SnapKVCache(CONFIGS["snapkv"], None, i) for i in range(len(model.layers))]
    with pytest.raises(AttentionHookMissing, match="mlx_lm.models.gemma2 computes attention inline"):
        model(prompt(8)[None], cache=cache)


def test_a_cache_updated_outside_a_model_detects_a_missing_attend():
    cache = SnapKVCache(CONFIGS["snapkv"], None, 0)
    k = mx.zeros((1, 2, 8, 32))
    cache.update_and_fetch(k, k)
    with pytest.raises(AttentionHookMissing, match="did not go through the VeloxQuant hook"):
        cache.update_and_fetch(k, k)


def test_kivi_group_size_128_on_head_dim_128_generates(tokenizer):
    model = tiny_model("qwen3", head_dim=128)
    config = KVCacheConfig(method="kivi", options=KIVIOptions(kivi_group_size=128), residual_window=128)
    with patched_kv_cache(model, config):
        assert len(mlx_lm.generate(model, tokenizer, TEXT * 2, max_tokens=8)) > 0


def test_gemma3_keeps_its_sliding_window_layers_and_compresses_the_global_ones(tokenizer):
    """Sliding-window layers keep mlx-lm's RotatingKVCache; global layers get ours."""
    from mlx_lm.models.cache import RotatingKVCache

    model = tiny_model("gemma3_text")
    tokens = prompt(120)
    ref = run(model, model.make_cache(), tokens)
    cache = make_prompt_cache(model, KVCacheConfig())
    assert [type(c).__name__ for c in cache] == ["RotatingKVCache", "FullCache"] * 2
    assert mx.array_equal(run(model, cache, tokens), ref)
    kivi = make_prompt_cache(model, CONFIGS["kivi"])
    assert isinstance(kivi[0], RotatingKVCache) and kivi[1].config.method == "kivi"
    run(model, kivi, tokens)
    assert kivi[1].stored_length == 120 + 6 and kivi[1].n_quantized_keys == 64
    with patched_kv_cache(model, CONFIGS["snapkv"]):
        assert len(mlx_lm.generate(model, tokenizer, TEXT, max_tokens=6)) > 0
