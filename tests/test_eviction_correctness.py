"""After eviction, attention equals attention over the kept tokens at their original positions.

The reference keeps every token (a full cache) and masks, per query and per KV head,
exactly the positions the method claims to keep. Chunks straddle the evictions.
"""

import mlx.core as mx
import pytest

from test_methods_exactness import run
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import SnapKVOptions, StreamingLLMOptions
from veloxquant_mlx.methods.full import FullCache


class MaskedFullCache(FullCache):
    """Keeps everything; attends only where ``visible(query_positions, n_keys)`` allows.

    ``visible`` returns a bool array broadcastable to (B, Hkv, Nq, n_keys).
    """

    visible = None

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        n_q, n_k = queries.shape[2], keys.shape[2]
        allowed = self.visible(mx.arange(self.offset - n_q, self.offset), n_k)
        b, hq = queries.shape[:2]
        hkv = keys.shape[1]
        allowed = mx.broadcast_to(allowed, (b, hkv, n_q, n_k))
        allowed = mx.repeat(allowed, hq // hkv, axis=1)  # query heads of a KV head share it
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=allowed)


def streaming_visible(n_sink, window):
    def visible(q_pos, n_keys):
        k = mx.arange(n_keys)[None]
        q = q_pos[:, None]
        n_q = q_pos.shape[0]
        if n_q == 1:
            recent = k > q - window
        else:  # the chunk sees the last W - S older tokens and itself, causally
            c0 = int(q_pos[0])
            recent = k >= c0 - max(0, window - n_q)
        return ((k < n_sink) | recent) & (k <= q)

    return visible


def reference_caches(model, visible_per_layer):
    caches = make_prompt_cache(model, KVCacheConfig())  # installs the attention hook
    out = []
    for layer, c in enumerate(caches):
        ref = MaskedFullCache(c.config, c.context, layer)
        ref.visible = visible_per_layer(layer)
        out.append(ref)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("chunk", [32, 50])
def test_streaming_equals_attention_over_kept_positions(arch, chunk):
    model = tiny_model(arch)
    tokens = prompt(230)
    s, w = 4, 48
    config = KVCacheConfig(options=StreamingLLMOptions(stream_n_sink=s, stream_window_size=w))
    cache = make_prompt_cache(model, config)
    out = run(model, cache, tokens, chunk=chunk, decode=30)
    ref = run(model, reference_caches(model, lambda _: streaming_visible(s, w)), tokens, chunk=chunk, decode=30)
    assert mx.allclose(out, ref, atol=2e-5, rtol=1e-4), float(mx.abs(out - ref).max())
    assert cache[0].stored_length == s + w and cache[0].offset == 230 + 30
    assert cache[0].nbytes == (s + w) * 2 * 2 * 32 * 4  # K and V, 2 kv heads, head_dim 32, fp32


def test_streaming_without_sinks_is_a_sliding_window():
    model = tiny_model("llama")
    tokens = prompt(120)
    config = KVCacheConfig(options=StreamingLLMOptions(stream_n_sink=0, stream_window_size=40))
    out = run(model, make_prompt_cache(model, config), tokens, chunk=30, decode=10)
    ref = run(model, reference_caches(model, lambda _: streaming_visible(0, 40)), tokens, chunk=30, decode=10)
    assert mx.allclose(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_snapkv_equals_attention_over_kept_positions(arch):
    model = tiny_model(arch)
    n, budget = 260, 96
    tokens = prompt(n)
    config = KVCacheConfig(options=SnapKVOptions(snap_budget=budget, snap_obs_window=16, snap_n_sink=4))
    cache = make_prompt_cache(model, config)
    out = run(model, cache, tokens, chunk=100, decode=12)
    kept = [c.kept_positions[..., :budget] for c in cache]  # the prompt's (decoded ones follow)

    def layer_visible(layer):
        def visible(q_pos, n_keys):
            k = mx.arange(n_keys)
            causal = k[None] <= q_pos[:, None]
            if q_pos.shape[0] > 1 or int(q_pos[0]) < n:  # prefill: everything, causally
                return causal
            chosen = mx.zeros((*kept[layer].shape[:2], n_keys), dtype=mx.bool_)
            chosen = mx.put_along_axis(chosen, kept[layer], mx.array(True), axis=-1)
            return (chosen[:, :, None] | (k >= n)) & causal

        return visible

    ref = run(model, reference_caches(model, layer_visible), tokens, chunk=100, decode=12)
    assert mx.array_equal(out[:, 0], ref[:, 0])  # the last prompt token saw everything
    assert mx.allclose(out, ref, atol=2e-5, rtol=1e-4), float(mx.abs(out - ref).max())
    for c in cache:
        pos = c.kept_positions[..., :budget]
        assert mx.array_equal(c.kept_positions[..., budget:], mx.broadcast_to(mx.arange(n, n + 12), (1, 2, 12)))
        assert mx.all(pos[..., 1:] > pos[..., :-1])  # strictly increasing
        assert mx.all(pos[..., :4] == mx.arange(4)) and mx.all(pos[..., -16:] == mx.arange(n - 16, n))
        assert c.stored_length == budget + 12


def test_different_stored_lengths_per_layer_with_array_masks(monkeypatch):
    """mlx-lm shares the first layer's mask across layers; each layer must get its own."""
    import mlx_lm.models.llama as llama

    original = llama.create_attention_mask
    monkeypatch.setattr(
        llama, "create_attention_mask", lambda h, cache=None, **kw: original(h, cache, return_array=True)
    )
    model = tiny_model("llama", num_hidden_layers=3)
    windows = [24, 40, 64]
    config = KVCacheConfig(options=StreamingLLMOptions(stream_n_sink=2, stream_window_size=24))
    cache = make_prompt_cache(model, config)
    for c, w in zip(cache, windows):
        c.window = w
    tokens = prompt(150)
    out = run(model, cache, tokens, chunk=40, decode=20)
    ref = run(model, reference_caches(model, lambda layer: streaming_visible(2, windows[layer])), tokens, chunk=40, decode=20)
    assert [c.stored_length for c in cache] == [2 + w for w in windows]
    assert mx.allclose(out, ref, atol=2e-5, rtol=1e-4), float(mx.abs(out - ref).max())


def _feed(cache, t, head_dim=64, chunk=2048):
    """A t-token prompt the way mlx-lm sends it: chunks, then the last token alone."""
    keys = mx.random.normal((1, 2, t, head_dim)).astype(mx.float16)
    start = 0
    while start < t:
        n = min(chunk, t - 1 - start) if start < t - 1 else 1
        k, v = cache.update_and_fetch(keys[:, :, start : start + n], keys[:, :, start : start + n])
        q = mx.random.normal((1, 8, n, head_dim)).astype(mx.float16)
        cache.attend(q, k, v, scale=head_dim**-0.5, mask="causal" if n > 1 else None)
        start += n


def test_memory_after_a_4k_prompt_is_what_the_method_promises():
    from veloxquant_mlx.methods.snapkv import SnapKVCache
    from veloxquant_mlx.methods.streaming_llm import StreamingLLMCache

    row = 2 * 64 * 2  # one token of one layer: 2 KV heads x head_dim 64, float16
    stream = StreamingLLMCache(KVCacheConfig(options=StreamingLLMOptions(stream_n_sink=4, stream_window_size=508)))
    _feed(stream, 4096)
    assert stream.stored_length == 512 and stream.offset == 4096
    assert stream.nbytes == 2 * 512 * row  # keys and values, sinks + window rows, nothing else
    snap = SnapKVCache(KVCacheConfig(options=SnapKVOptions(snap_budget=512)))
    _feed(snap, 4096)
    assert snap.stored_length == 512 and snap.window_queries is None
    assert snap.nbytes == 2 * 512 * row + snap.kept_positions.nbytes  # + the kept positions (int32)
