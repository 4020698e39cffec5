"""Clipped min-max group quantization, and the search of its clip ratio on data.

Per group of ``group`` consecutive elements along the last axis (one token's channels),
SKVQ's clipped dynamic quantization: the group's minimum and maximum are scaled by a clip
ratio alpha, ``m = alpha * min``, ``M = alpha * max`` (towards 0, as the official code does,
not towards the group's centre), ``scale = (M - m) / (2^bits - 1)``, ``code = clip(round((x -
m) / scale), 0, 2^bits - 1)``, ``x_hat = scale * code + m``. Elements beyond the scaled range
saturate at the end codes; in exchange every other element lies on a finer grid. The
stored layout is ``affine.quantize``'s (codes packed as one little-endian bit stream, scales
and minima in the input's dtype, codes rounded against the stored values): the
per-token rows of ``token_rows.py`` (``quantize_rows`` with a ratio), which the decode
paths read as they are; alpha = 1 gives ``affine.quantize``'s codes bit for bit. Widths
1-8: the 7-bit stream (no ``mx.quantize`` width) is packed the same way.

Alpha is one number per (batch row, KV head), an array (B, H). ``search_clip`` picks it
from a grid (``CLIP_GRID``: 1.00, 0.99, ..., 0.85, the card's) as the value of least
squared reconstruction error over the fitting rows, ties to the larger alpha (the grid's
order): the error at the chosen alpha is never above the error at 1.0 when 1.0 is in the
grid.
"""

from __future__ import annotations

import mlx.core as mx

from ...quant.affine import _MIN_SCALE
from ...quant.packed import GROWTH_TOKENS, PackedTokens
from ...quant.token_rows import WIDTHS, TokenGroups, compiled_quantizer, quantize_rows

CLIP_GRID = tuple(round(1.0 - 0.01 * i, 2) for i in range(16))  # 1.00 ... 0.85
FIT_ROWS = 512  # rows the search reads at most: evenly strided past that (its cost, a long prompt)


def quantize_clipped(x: mx.array, alpha: mx.array, group: int, bits: int):
    """(B, H, T, D) rows, alpha (B, H) -> (codes (B, H, T, D*bits/32), scales, minima (B, H, T, D/group))."""
    return quantize_rows(x, group, bits, alpha)


def clip_errors(x: mx.array, group: int, bits: int, grid=CLIP_GRID) -> mx.array:
    """(len(grid), B, H) squared reconstruction error of rows (B, H, T, D) at each alpha: every
    ratio at once along a leading axis, a dozen operations in all rather than a dozen a
    ratio (on a GPU each is a launch: a loop over the 16 ratios was some 400 a layer)."""
    *lead, n = x.shape
    groups = x.reshape(*lead, n // group, group).astype(mx.float32)
    low0, high0 = groups.min(axis=-1, keepdims=True), groups.max(axis=-1, keepdims=True)
    levels = (1 << bits) - 1
    alpha = mx.array(grid, mx.float32).reshape(-1, *([1] * groups.ndim))
    low = (low0 * alpha).astype(x.dtype).astype(mx.float32)  # as stored
    scale = mx.maximum((high0 * alpha - low0 * alpha) / levels, _MIN_SCALE).astype(x.dtype).astype(mx.float32)
    codes = mx.clip(mx.round((groups - low) / scale), 0, levels)
    return mx.square(codes * scale + low - groups).sum(axis=(3, 4, 5))


def fixed_clip(shape: tuple[int, int], alpha: float) -> mx.array:
    """(B, H) float32: one ratio for every (batch row, KV head) (a grid of one value)."""
    return mx.full(shape, float(alpha), mx.float32)


def search_clip(x: mx.array, group: int, bits: int, grid=CLIP_GRID, max_rows: int = FIT_ROWS) -> mx.array:
    """(B, H) float32: the alpha of ``grid`` of least error on rows (B, H, T, D), ties to the
    earlier (larger) one; past ``max_rows`` rows, on every k-th row (at most ``max_rows``)."""
    if len(grid) == 1:
        return fixed_clip(x.shape[:2], grid[0])
    if x.shape[2] > max_rows:
        x = x[:, :, :: -(-x.shape[2] // max_rows)]
    best = mx.argmin(clip_errors(x, group, bits, grid), axis=0)  # argmin: the first minimum
    return mx.array(grid, mx.float32)[best]


class ClippedTokens(PackedTokens):
    """A growing run of per-token rows in clipped groups (the ``PackedTokens`` interface,
    ``layout`` an ``AffineLayout`` of axis "token"); each append brings its alpha (B, H)."""

    def __init__(self, bits: int, group: int, step_tokens: int = GROWTH_TOKENS, limit: int | None = None):
        if bits not in WIDTHS:
            raise ValueError(f"bits={bits} is not supported; allowed: {WIDTHS}")
        super().__init__(TokenGroups(bits, group), step_tokens)
        for rows in (self.codes, self.scales, self.biases):
            rows.limit = limit  # room never grows past ``limit`` rows while they fit

    def append(self, x: mx.array, alpha: mx.array, decoding: bool = False) -> None:
        c = self.codec
        quantize = compiled_quantizer(c.group, c.bits, clipped=True) if decoding else (
            lambda x, alpha: quantize_rows(x, c.group, c.bits, alpha))
        codes, scales, biases = quantize(x, alpha)
        self.codes.append(codes)
        self.scales.append(scales)
        self.biases.append(biases)
