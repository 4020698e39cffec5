"""Attention probabilities for scoring: what a query pays each key, per KV head.

The fused SDPA that computes a layer's output returns no weights, so a score that needs
them recomputes ``softmax(q Kᵀ · scale)`` here, in float32, for the queries it asks for.
Keys are masked by position (a query sees the tokens at or before its own position), so
the helpers are right however the kept tokens are laid out. Query heads that share a KV
head (GQA) are averaged, never the keys repeated.
"""

from __future__ import annotations

import mlx.core as mx

QUERY_BLOCK = 256  # queries scored at a time, at most
# Logits one block of queries may hold (32 MiB in float32). A block's weights take about
# 3.3x that while it is scored (logits, masked logits, softmax: measured on the CPU), about
# 110 MiB, below an 8B layer's MLP transient (2,048 tokens x 14,336 x 3 in float16), so
# scoring never sets a prefill's peak. Larger blocks launch fewer kernels on a GPU.
SCORE_ELEMENTS = 2**23


def query_block(queries, n_keys: int, elements: int | None = None) -> int:
    """Queries per block: at most ``QUERY_BLOCK``, and at most ``elements`` logits
    (``SCORE_ELEMENTS`` when None)."""
    b, hq = queries.shape[:2]
    elements = SCORE_ELEMENTS if elements is None else elements
    return max(1, min(QUERY_BLOCK, elements // max(1, b * hq * n_keys)))


def reduce_query_blocks(queries, n_keys: int, block_fn, combine=mx.add, elements=None) -> mx.array:
    """``combine`` of ``block_fn(q, start, stop)`` over blocks of ``query_block`` queries.

    MLX evaluates independent blocks side by side, so a lazy loop held every block's
    logits at once (a 2,048-token chunk against 32k keys: 8 GiB). Each block's queries
    here depend on the previous blocks' reduction (``mx.depends``): one block's scores
    exist at a time, with no host sync.
    """
    n_queries = queries.shape[2]
    block = query_block(queries, n_keys, elements)
    total = None
    for start in range(0, n_queries, block):
        stop = min(n_queries, start + block)
        q = queries[:, :, start:stop]
        if total is not None:
            q = mx.depends(q, total)
        part = block_fn(q, start, stop)
        total = part if total is None else combine(total, part)
    return total


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
    (B, Hkv, n) float32. Queries are taken in blocks (``reduce_query_blocks``).
    """
    def block(q, start, stop):
        qp = None if q_positions is None else (
            q_positions[start:stop] if q_positions.ndim == 1 else q_positions[..., start:stop])
        weights = attention_weights(q, keys, scale, qp, k_positions, dtype)
        if query_weights is not None:
            weights = weights * query_weights[start:stop, None]
        return weights.sum(axis=3).mean(axis=2)

    return reduce_query_blocks(queries, keys.shape[2], block)
