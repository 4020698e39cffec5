"""Attention probabilities for scoring: what a query pays each key, per KV head.

The fused SDPA that computes a layer's output returns no weights, so a score that needs
them recomputes ``softmax(q Kᵀ · scale)`` here, in float32, for the queries it asks for.
Keys are masked by position (a query sees the tokens at or before its own position), so
the helpers are right however the kept tokens are laid out. Query heads that share a KV
head (GQA) are averaged, never the keys repeated.
"""

from __future__ import annotations

import mlx.core as mx

QUERY_BLOCK = 256  # queries scored at a time: bounds the transient (G, block, n) weights


def attention_weights(queries, keys, scale, q_positions, k_positions, dtype=mx.float32) -> mx.array:
    """Softmax attention of each query over the keys it may see: (B, Hkv, G, N, n), float32.

    queries (B, Hq, N, D); keys (B, Hkv, n, D); q_positions (N,) or (B, Hkv, N);
    k_positions (B, Hkv, n), or both None: every key visible (a decode query over a store
    with no padding, which holds only earlier tokens: no mask to build). ``dtype`` is the dtype of the logits' matmul (None: the
    keys' own, which moves fewer bytes than upcasting them; the softmax is float32 either way).
    """
    dtype = keys.dtype if dtype is None else dtype
    b, hq, nq, d = queries.shape
    hkv = keys.shape[1]
    q = queries.reshape(b, hkv, hq // hkv, nq, d).astype(dtype)
    logits = (q * scale) @ keys[:, :, None].astype(dtype).swapaxes(-1, -2)
    if k_positions is not None:
        if q_positions.ndim == 1:
            q_positions = q_positions[None, None]
        k = k_positions[:, :, None, None, :]
        visible = (k >= 0) & (k <= q_positions[:, :, None, :, None])  # -1: a padding slot
        logits = mx.where(visible, logits, -float("inf"))
    return mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)


def attention_mass(
    queries, keys, scale, q_positions, k_positions, query_weights=None, dtype=mx.float32
) -> mx.array:
    """Attention each key receives, summed over the queries, averaged over a KV group.

    ``query_weights`` (N,) weighs the queries (H2O's decay); None sums them. Returns
    (B, Hkv, n) float32. Long query sets are taken in blocks of ``QUERY_BLOCK``.
    """
    n_queries = queries.shape[2]
    total = None
    for start in range(0, n_queries, QUERY_BLOCK):
        stop = min(n_queries, start + QUERY_BLOCK)
        qp = None if q_positions is None else (
            q_positions[start:stop] if q_positions.ndim == 1 else q_positions[..., start:stop])
        weights = attention_weights(queries[:, :, start:stop], keys, scale, qp, k_positions, dtype)
        if query_weights is not None:
            weights = weights * query_weights[start:stop, None]
        mass = weights.sum(axis=3).mean(axis=2)
        total = mass if total is None else total + mass
    return total
