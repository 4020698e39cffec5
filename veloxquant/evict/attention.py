"""Attention probabilities for scoring: what a query pays each key, per KV head.

The fused SDPA that computes a layer's output returns no weights, so a score that needs
them recomputes ``softmax(q Kᵀ · scale)`` here, in float32, for the queries it asks for.
Keys are masked by position (a query sees the tokens at or before its own position), so
the helpers are right however the kept tokens are laid out. Query heads that share a KV
head (GQA) are averaged, never the keys repeated.
"""

from __future__ import annotations

import mlx.core as mx

from . import fused_mass_kernel, mass_kernel

QUERY_BLOCK = 256  # queries scored at a time, at most
# Logits one block of queries may hold (32 MiB in float32), through MLX's ops or the
# prompt-mass kernels alike. A block's scoring holds about 3.3x that at its peak on the CPU
# (tests/test_prefill_scores.py), below an 8B layer's MLP transient. On CUDA a whole
# prefill's peak grows with the block far beyond one block's size: the kernels' blocks of
# 2^25 logits took h2o's 4k prefill to 1.89x mlx-lm's KVCache's peak, 2^23 keeps it at 0.85x
# (benchmarks/notes/prefill.md).
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
    (B, Hkv, n) float32. Queries are taken in blocks (``reduce_query_blocks``). The keys
    are cast once; a KV group's query heads are one product's rows (no batch broadcast over
    the group); the weighted sum over a block's rows is one product with the softmax (no
    weighted copy of the block). The terms are ``attention_weights``'s, summed in another
    order. On a GPU whose kernels passed their check, a block's mask, softmax and weighted
    sum are two launches over its logits (``mass_kernel.py``); unless ``VQ_FUSED_MASS=0``,
    float16 and bfloat16 queries and keys are scored in two launches that never write a
    logit (``fused_mass_kernel.py``).
    """
    b, hq, nq, d = queries.shape
    hkv, n = keys.shape[1], keys.shape[2]
    g = hq // hkv
    dtype = keys.dtype if dtype is None else dtype
    fused = fused_mass_kernel.kernel_backend(queries, keys) if dtype in (mx.float32, keys.dtype) else None
    if fused is not None:  # every query at once: no logit is written
        w = mx.full((nq,), 1.0 / g, mx.float32) if query_weights is None else query_weights / g
        return fused_mass_kernel.fused_mass(fused, queries, keys, scale, q_positions, k_positions, w)
    keys_t = keys.astype(dtype).swapaxes(-1, -2)
    k = None if k_positions is None else k_positions[:, :, None, None, :]
    kernels = mass_kernel.kernel_backend(dtype)

    def block(q, start, stop):
        m = stop - start
        rows = q.reshape(b, hkv, g * m, d).astype(dtype)  # row i * m + j: head i's query j
        logits = (rows * scale) @ keys_t
        qp = None if k is None else (q_positions[start:stop] if q_positions.ndim == 1
                                     else q_positions[..., start:stop])
        w = mx.full((m,), 1.0 / g, mx.float32) if query_weights is None else query_weights[start:stop] / g
        if kernels is not None:  # the mask, the softmax and the weighted sum in two launches
            return mass_kernel.block_mass(kernels, logits, qp, k_positions, w)
        logits = logits.reshape(b, hkv, g, m, n)
        if k is not None:  # the mask is shared by a group's heads: (B, Hkv, 1, m, n)
            qp = qp[None, None, None, :, None] if qp.ndim == 1 else qp[:, :, None, :, None]
            logits = mx.where((k >= 0) & (k <= qp), logits, -float("inf"))
        weights = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True).reshape(b, hkv, g * m, n)
        return (mx.tile(w, (g,))[None, None, None] @ weights)[:, :, 0]

    return reduce_query_blocks(queries, n, block)
