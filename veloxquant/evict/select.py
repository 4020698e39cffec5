"""Shared eviction machinery: pooling scores, choosing tokens, gathering them."""

from __future__ import annotations

import math

import mlx.core as mx

from ..cache.buffers import take_rows


def max_pool_same(scores: mx.array, kernel: int) -> mx.array:
    """Max over a centred window of ``kernel`` along the last axis ("same" length).

    Maxima over windows of 1, 2, 4, ... w tokens (w the largest power of two up to the
    kernel), each from two of the previous; the kernel's window is then the maximum of
    the two w-windows at its ends, which overlap. About log2(kernel) operations instead of
    kernel - 1 (rocketkv's 63: 6 instead of 62), the same values: a maximum is exact.
    """
    if kernel <= 1:
        return scores
    left, right = (kernel - 1) // 2, kernel // 2
    n = scores.shape[-1]
    pad = [(0, 0)] * (scores.ndim - 1) + [(left, right)]
    window = mx.pad(scores, pad, constant_values=-float("inf"))  # entry i: max over [i, i + w)
    w = 1
    while 2 * w <= kernel:
        window = mx.maximum(window[..., :-w], window[..., w:])
        w *= 2
    return mx.maximum(window[..., :n], window[..., kernel - w : kernel - w + n])


def top_k_sorted(scores: mx.array, k: int) -> mx.array:
    """Indices of the ``k`` largest scores along the last axis, in increasing order."""
    idx = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
    return mx.sort(idx, axis=-1)


def gather_tokens(x: mx.array, idx: mx.array) -> mx.array:
    """``x[b, h, idx[b, h, j], :]`` for ``x`` of shape (B, H, T, D), idx (B, H, K)."""
    return take_rows(x, idx)


def group_mean(scores: mx.array, n_kv_heads: int) -> mx.array:
    """(B, Hq, ...) -> (B, Hkv, ...): mean over the query heads sharing a KV head (GQA)."""
    b, hq = scores.shape[:2]
    return scores.reshape(b, n_kv_heads, hq // n_kv_heads, *scores.shape[2:]).mean(axis=2)


def top_k_chunks(scores: mx.array, chunk_ids: mx.array, n_chunks: int, k: int, keep: mx.array) -> mx.array:
    """Indices (..., K), increasing, of the ``keep`` tokens and of every token of the ``k``
    chunks whose summed score is largest (ChunkKV's selection).

    ``scores`` (..., n), ``chunk_ids`` (..., n) in [0, n_chunks) and ``keep`` (..., n) bool;
    a kept token's chunk id is ignored. Chunks that hold no token rank last. K is the
    largest count over the leading axes: a row whose chosen chunks hold fewer tokens (a
    short last chunk among them) takes the first tokens of its next chunk to match.
    """
    lead, n = scores.shape[:-1], scores.shape[-1]
    rows, spare = math.prod(lead), n_chunks  # kept tokens go to a spare chunk, dropped after
    ids = mx.where(keep, spare, chunk_ids).reshape(rows, n).astype(mx.int32)
    flat = (mx.arange(rows, dtype=mx.int32)[:, None] * (n_chunks + 1) + ids).reshape(-1)
    room = mx.zeros((rows * (n_chunks + 1),), mx.float32)
    total = room.at[flat].add(scores.reshape(-1).astype(mx.float32)).reshape(rows, -1)[:, :n_chunks]
    members = room.at[flat].add(1.0).reshape(rows, -1)[:, :n_chunks]
    total = mx.where(members > 0, total, -float("inf"))
    order = mx.argsort(-total, axis=-1)
    rank = mx.put_along_axis(mx.zeros_like(order), order,
                             mx.broadcast_to(mx.arange(n_chunks, dtype=order.dtype), order.shape), axis=-1)
    token_rank = mx.take_along_axis(rank, mx.minimum(ids, n_chunks - 1), axis=-1)
    kept = keep.reshape(rows, n)
    count = int((kept | (token_rank < k)).sum(axis=-1).max())
    key = mx.where(kept, float("inf"), -token_rank.astype(mx.float32))  # better chunks first, whole
    return top_k_sorted(key, count).reshape(*lead, count)
