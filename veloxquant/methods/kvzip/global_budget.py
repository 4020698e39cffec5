"""One budget for a whole model: the best tokens over every layer and KV head at once.

A method that ranks globally (KVzip's default, AdaKV-style allocations) scores every
token of every layer and head, keeps the ``total`` best of them per sequence, and lets
each head keep as many as it won. ``global_top_k`` does the ranking; the per-head counts
are ``chosen.sum(-1)``, which the eviction base takes as per-head budgets (a head under
its layer's largest count keeps padding slots, counted in ``nbytes``).
"""

from __future__ import annotations

import mlx.core as mx


def global_top_k(scores: list[mx.array], total: int) -> list[mx.array]:
    """Masks of the ``total`` largest entries over all of ``scores``, per sequence.

    ``scores``: one (B, H_l, T_l) array per layer; returns one bool array of the same
    shape each. Exactly ``min(total, entries)`` are chosen in each sequence (ties at the
    threshold are broken by the sort's order, never by choosing more).
    """
    b = scores[0].shape[0]
    flat = mx.concatenate([s.reshape(b, -1).astype(mx.float32) for s in scores], axis=1)
    n = flat.shape[1]
    total = max(0, min(total, n))
    chosen = mx.zeros((b, n), mx.bool_)
    if total:
        best = mx.argpartition(-flat, kth=total - 1, axis=-1)[:, :total]
        chosen = mx.put_along_axis(chosen, best, mx.ones(best.shape, mx.bool_), axis=-1)
    out, start = [], 0
    for s in scores:
        size = s.size // b
        out.append(chosen[:, start : start + size].reshape(s.shape))
        start += size
    return out
