"""Shared eviction machinery: pooling scores, choosing tokens, gathering them."""

from __future__ import annotations

import mlx.core as mx


def max_pool_same(scores: mx.array, kernel: int) -> mx.array:
    """Max over a centred window of ``kernel`` along the last axis ("same" length)."""
    if kernel <= 1:
        return scores
    left, right = (kernel - 1) // 2, kernel // 2
    n = scores.shape[-1]
    pad = [(0, 0)] * (scores.ndim - 1) + [(left, right)]
    padded = mx.pad(scores, pad, constant_values=-float("inf"))
    out = padded[..., 0:n]
    for i in range(1, kernel):
        out = mx.maximum(out, padded[..., i : i + n])
    return out


def top_k_sorted(scores: mx.array, k: int) -> mx.array:
    """Indices of the ``k`` largest scores along the last axis, in increasing order."""
    idx = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
    return mx.sort(idx, axis=-1)


def gather_tokens(x: mx.array, idx: mx.array) -> mx.array:
    """``x[b, h, idx[b, h, j], :]`` for ``x`` of shape (B, H, T, D), idx (B, H, K)."""
    return mx.take_along_axis(x, idx[..., None], axis=2)


def group_mean(scores: mx.array, n_kv_heads: int) -> mx.array:
    """(B, Hq, ...) -> (B, Hkv, ...): mean over the query heads sharing a KV head (GQA)."""
    b, hq = scores.shape[:2]
    return scores.reshape(b, n_kv_heads, hq // n_kv_heads, *scores.shape[2:]).mean(axis=2)
