"""Channel reordering: a permutation of each head's channels so that similar channels share
a quantization group, and the gathers that move rows in and out of that order.

``RangeOrder`` fits, per (batch row, KV head), the order of the head's channels by their
range (max - min) over the fitting tokens; cutting the reordered channels into groups of
G puts channels of like spread together (SKVQ's reorder, the card's MLX-friendly variant
of its KMeans on per-channel (min, max): equal groups, so the reordered rows stay
``mx.quantize``'s layout). ``pairs`` keeps rotary pairs whole: mlx-lm hands caches post-RoPE
keys, whose pairs (i, i + d/2) (``"half"``, ``mx.fast.rope``'s default) or (2i, 2i + 1)
(``"adjacent"``, ``traditional``) trade energy as the position turns, so a pair is sorted
by the range of both its channels and its two channels go into the same group.

The permutation never crosses heads, so attention can run in the reordered order:
``q . k`` is unchanged when q and k are permuted alike, and ``p V`` comes out in the values'
order, undone by the inverse permutation (``permute_heads``, GQA query heads through their
KV head's permutation). Permutations are (B, H, 1, D) uint32, ready for
``mx.take_along_axis`` along the last axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

PAIRINGS = ("half", "adjacent")


def rotary_pairs(dims: int, pairing: str) -> mx.array:
    """(dims / 2, 2) the channel pairs a rotary embedding rotates together."""
    if pairing not in PAIRINGS or dims % 2:
        raise ValueError(f"pairing={pairing!r} over {dims} channels: allowed {PAIRINGS} over an even count")
    first = mx.arange(dims // 2, dtype=mx.uint32)
    if pairing == "adjacent":
        return mx.stack([2 * first, 2 * first + 1], axis=-1)
    return mx.stack([first, first + dims // 2], axis=-1)


@dataclass(frozen=True)
class RangeOrder:
    """Channels sorted by their range over the fitting tokens (rotary pairs kept whole)."""

    pairs: str | None = None  # None | "half" | "adjacent"

    def fit(self, x: mx.array) -> mx.array:
        """(B, H, T, D) rows -> (B, H, 1, D) uint32: reordered channel j is channel perm[j]."""
        xf = x.astype(mx.float32)
        low, high = xf.min(axis=2), xf.max(axis=2)  # (B, H, D)
        if self.pairs is None:
            return mx.argsort(high - low, axis=-1).astype(mx.uint32)[:, :, None]
        pairs = rotary_pairs(x.shape[-1], self.pairs)
        a, b = pairs[:, 0], pairs[:, 1]
        spread = mx.maximum(high[..., a], high[..., b]) - mx.minimum(low[..., a], low[..., b])
        order = mx.argsort(spread, axis=-1)  # (B, H, D/2) pairs, narrowest first
        return pairs[order].reshape(*x.shape[:2], 1, x.shape[-1]).astype(mx.uint32)


def inverse(perm: mx.array) -> mx.array:
    """The permutation that undoes ``perm`` (same shape, uint32)."""
    return mx.argsort(perm, axis=-1).astype(mx.uint32)


def permute(x: mx.array, perm: mx.array) -> mx.array:
    """Rows (B, H, T, D) in the order ``perm`` (B, H, 1, D): out[..., j] = x[..., perm[j]]."""
    return mx.take_along_axis(x, perm, axis=-1)


def permute_heads(x: mx.array, perm: mx.array) -> mx.array:
    """Query-head rows (B, Hq, L, D) through their KV head's ``perm`` (B, H, 1, D),
    ``Hq`` a multiple of ``H`` (grouped-query attention)."""
    b, hq, n, d = x.shape
    h = perm.shape[1]
    rows = x.reshape(b, h, hq // h * n, d)
    return mx.take_along_axis(rows, perm, axis=-1).reshape(b, hq, n, d)


def is_permutation(perm: mx.array) -> bool:
    """Every row of ``perm`` holds each channel index exactly once."""
    return bool(mx.array_equal(mx.sort(perm, axis=-1), mx.broadcast_to(mx.arange(perm.shape[-1]), perm.shape)))
