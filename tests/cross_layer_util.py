"""Cross-layer caches driven without a model: one context, layers updated in order."""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.context import ModelContext
from veloxquant_mlx.registry import METHODS


def layered(method: str, n_layers: int, config_fields=None, **options) -> list:
    """``n_layers`` caches of ``method`` sharing one context, as make_prompt_cache builds them."""
    info = METHODS[method]
    config = KVCacheConfig.from_dict({"method": method, "options": options, **(config_fields or {})})
    context = ModelContext(config, n_layers, tuple(range(n_layers)))
    cls = info.load_implementation()
    context.layers = [cls(config, context, i) for i in range(n_layers)]
    return list(context.layers)


def kv(t, n_layers, h=2, d=32, seed=0, dtype=mx.float32, related=None):
    """Keys and values (B=1, h, t, d) per layer; ``related(x0, i)`` derives layer i's from
    layer 0's (default: independent draws with uneven channels)."""
    ks, vs = [], []
    for i in range(n_layers):
        key = mx.random.key(seed + 10 * i)
        k = mx.random.normal((1, h, t, d), key=key) * (1 + mx.arange(d) % 5)
        v = mx.random.normal((1, h, t, d), key=mx.random.key(seed + 10 * i + 1))
        if related is not None and i:
            k, v = related(ks[0], i), related(vs[0], i)
        ks.append(k.astype(dtype))
        vs.append(v.astype(dtype))
    return ks, vs


def feed(caches, ks, vs, chunk, start=0, stop=None, seed=5):
    """Tokens [start, stop) through every layer in order, ``chunk`` at a time (update then
    attend, as the attention hook does); returns each call's outputs per layer."""
    stop = ks[0].shape[2] if stop is None else stop
    outs = [[] for _ in caches]
    i = start
    while i < stop:
        n = min(chunk, stop - i)
        for layer, c in enumerate(caches):
            k, v = ks[layer][:, :, i : i + n], vs[layer][:, :, i : i + n]
            c.update_and_fetch(k, v)
            q = mx.random.normal((1, k.shape[1] * 2, n, k.shape[3]), key=mx.random.key(seed + i + 100 * layer))
            outs[layer].append(c.attend(q.astype(k.dtype), k, v, scale=k.shape[3] ** -0.5,
                                        mask="causal" if n > 1 else None))
        i += n
    return outs


def reference_attention(q, keys, values, scale):
    """Causal attention of the last ``q.shape[2]`` tokens over ``keys``/``values`` (float32)."""
    n, t = q.shape[2], keys.shape[2]
    mask = mx.arange(t)[None] <= mx.arange(t - n, t)[:, None]
    return mx.fast.scaled_dot_product_attention(q.astype(mx.float32), keys.astype(mx.float32),
                                                values.astype(mx.float32), scale=scale, mask=mask)
