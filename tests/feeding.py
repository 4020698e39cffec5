"""Driving a cache the way mlx-lm drives it, on synthetic keys, values and queries.

mlx-lm calls ``update_and_fetch`` and then attention, which the hook hands to the cache's
``attend``; a prompt chunk attends with the causal mask, a single token without one. The
eviction tests feed given queries token range by token range (``feed``), the prompt but its
last token in chunks and that token alone (``run_prompt``: the prefill's end), then one
token at a time (``prompt_then_steps``); the quantization tests push keys and values
chunk by chunk with random queries (``feed_chunks``).
"""

from __future__ import annotations

import mlx.core as mx


def synthetic_kvq(n, heads, group, head_dim, *, q_scale=1.0, norm_range=None, seed=0, batch=1):
    """Keys and values (batch, heads, n, head_dim), queries (batch, heads * group, n,
    head_dim): standard normal draws from the keys seed, seed + 1, ... in the order keys,
    (with ``norm_range``) a per-token factor on the keys' norms uniform in that range,
    values, queries; the queries times ``q_scale``."""
    seeds = iter(range(seed, seed + 4))
    shape = (batch, heads, n, head_dim)
    k = mx.random.normal(shape, key=mx.random.key(next(seeds)))
    if norm_range is not None:
        k = k * mx.random.uniform(*norm_range, (batch, heads, n, 1), key=mx.random.key(next(seeds)))
    v = mx.random.normal(shape, key=mx.random.key(next(seeds)))
    q = mx.random.normal((batch, heads * group, n, head_dim), key=mx.random.key(next(seeds)))
    return k, v, (q if q_scale == 1 else q_scale * q)


def feed(cache, k, v, q, start, stop):
    """Tokens [start, stop) as one update (a chunk, or a step when stop == start + 1),
    attended at the usual scale head_dim ** -0.5; the attention output."""
    keys, values = cache.update_and_fetch(k[:, :, start:stop], v[:, :, start:stop])
    return cache.attend(q[:, :, start:stop], keys, values, scale=k.shape[-1] ** -0.5,
                        mask="causal" if stop - start > 1 else None)


def run_prompt(cache, k, v, q, n, chunk=64, start=0):
    """Tokens [start, n - 1) in chunks of ``chunk``, then token n - 1 alone (the end of
    the prefill); the last output."""
    for s in range(start, n - 1, chunk):
        feed(cache, k, v, q, s, min(s + chunk, n - 1))
    return feed(cache, k, v, q, n - 1, n)


def prompt_then_steps(cache, k, v, q, n_prompt, chunk, stop=None, after_each=None,
                      keep_outputs=False) -> list:
    """The prompt but its last token in chunks, then one token at a time up to ``stop``
    (every token when None), ``after_each(cache, tokens seen)`` after each step; the
    outputs of the single-token calls if ``keep_outputs`` (else []: an output kept holds
    its graph, and with it the buffers a later step would otherwise update in place)."""
    outs = []
    for s in range(0, n_prompt - 1, chunk):
        feed(cache, k, v, q, s, min(s + chunk, n_prompt - 1))
    for t in range(n_prompt - 1, k.shape[2] if stop is None else stop):
        out = feed(cache, k, v, q, t, t + 1)
        if keep_outputs:
            outs.append(out)
        if after_each:
            after_each(cache, t + 1)
    return outs


def feed_chunks(cache, keys, values, chunk, gqa=2, seed=5) -> None:
    """(B, H, T, D) keys and values through update_and_fetch + attend, ``chunk`` tokens a
    call, with standard normal queries of ``gqa`` heads per KV head in the keys' dtype,
    drawn from the key seed + the chunk's first token (from MLX's global generator when
    ``seed`` is None)."""
    t, i = keys.shape[2], 0
    while i < t:
        n = min(chunk, t - i)
        k, v = keys[:, :, i : i + n], values[:, :, i : i + n]
        cache.update_and_fetch(k, v)
        shape = (k.shape[0], k.shape[1] * gqa, n, k.shape[3])
        q = mx.random.normal(shape) if seed is None else mx.random.normal(shape, key=mx.random.key(seed + i))
        cache.attend(q.astype(k.dtype), k, v, scale=k.shape[3] ** -0.5, mask="causal" if n > 1 else None)
        i += n


def stored_decode_attention(cache, queries, scale):
    """A quantized cache's decode attention over what it stores, adding no token (the
    check of a store against attention over its dequantized tokens)."""
    from veloxquant_mlx.kernels.decode import decode_attention

    store, n_kv = cache.store, cache.kv_shape[1] if cache.kv_shape else None
    if hasattr(store, "attend"):  # a store that transforms queries and outputs itself
        return store.attend(queries, scale=scale, use_kernel=cache.use_kernel, n_kv_heads=n_kv)
    parts = store.decode_parts(mx.zeros((0,), queries.dtype))
    return decode_attention(queries, parts, scale=scale, use_kernel=cache.use_kernel, n_kv_heads=n_kv)


def peak_above_held(fn):
    """``fn()`` evaluated, and the peak memory it took above what was held before it."""
    import mlx.core as mx

    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = fn()
    mx.eval(out)
    return out, mx.get_peak_memory() - before
