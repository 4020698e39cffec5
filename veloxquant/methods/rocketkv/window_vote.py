"""SnapKV's vote with the pooling kernel as a parameter: the observation window's
attention on each kept token, max-pooled over its neighbours in token order.

``window_vote(inputs, kernel)`` is the number ``SnapKVCache.score`` computes (batched
scoring, float32 logits) when ``kernel`` is SnapKV's 7, which a test checks; methods that
score the same way with another kernel (RocketKV's stage 1: 63) call it.
"""

from __future__ import annotations

import mlx.core as mx

from ...evict.attention import attention_mass
from ...evict.select import max_pool_same


def window_vote(inputs, kernel: int, dtype=mx.float32) -> mx.array:
    """(B, Hkv, rows): the attention the window queries pay each token (softmax over all
    keys, causal inside the window, summed over the window, mean over a KV group's query
    heads), max-pooled with ``kernel`` over the tokens before the window (0 in the window)."""
    queries, keys, positions = inputs.window_queries, inputs.keys, inputs.positions
    w = queries.shape[2]
    q_positions = inputs.query_positions[-1] + 1 - w + mx.arange(w)
    mass = attention_mass(queries, keys, inputs.scale, q_positions, positions, dtype=dtype)
    order = mx.argsort(positions, axis=-1)
    prefix = keys.shape[2] - w
    pooled = max_pool_same(mx.take_along_axis(mass, order, axis=-1)[..., :prefix], kernel)
    pooled = mx.pad(pooled, [(0, 0), (0, 0), (0, keys.shape[2] - prefix)])
    return mx.put_along_axis(mx.zeros_like(pooled), order, pooled, axis=-1)
