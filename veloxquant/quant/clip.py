"""Clipped min-max group quantization, and the search of its clip ratio on data.

Per group of ``group`` consecutive elements along the last axis (one token's channels),
SKVQ's clipped dynamic quantization: the group's minimum and maximum are scaled by a clip
ratio alpha, ``m = alpha * min``, ``M = alpha * max`` (towards 0, as the official code does,
not towards the group's centre), ``scale = (M - m) / (2^bits - 1)``, ``code = clip(round((x -
m) / scale), 0, 2^bits - 1)``, ``x_hat = scale * code + m``. Elements beyond the scaled range
saturate at the end codes; in exchange every other element lies on a finer grid. The
stored layout is ``affine.quantize``'s (codes packed as one little-endian bit stream, scales
and minima in the input's dtype, codes rounded against the stored values), so
``mx.dequantize`` and the decode paths read it as they are; alpha = 1 gives
``affine.quantize``'s codes bit for bit. Widths 1-8: the 7-bit stream (no ``mx.quantize``
width) is packed the same way and read with ``affine.unpack_codes``.

Alpha is one number per (batch row, KV head), an array (B, H). ``search_clip`` picks it
from a grid (``CLIP_GRID``: 1.00, 0.99, ..., 0.85, the card's) as the value of least
squared reconstruction error over the fitting rows, ties to the larger alpha (the grid's
order): the error at the chosen alpha is never above the error at 1.0 when 1.0 is in the
grid.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from .affine import _MIN_SCALE, SUPPORTED_BITS, pack_codes, unpack_codes
from .packed import GROWTH_TOKENS, GroupAffine, PackedTokens

CLIP_GRID = tuple(round(1.0 - 0.01 * i, 2) for i in range(16))  # 1.00 ... 0.85
WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8)
FIT_ROWS = 512  # rows the search reads at most: evenly strided past that (its cost, a long prompt)


def _grid(x: mx.array, group: int, bits: int, alpha: mx.array):
    """The float32 groups (..., n/group, group), stored-dtype scales and minima, float32 codes."""
    if bits not in WIDTHS:
        raise ValueError(f"bits={bits} is not supported; allowed: {WIDTHS}")
    *lead, n = x.shape
    if n % group or n % 32:
        raise ValueError(f"{n} channels per row: need a multiple of group={group} and of 32")
    groups = x.reshape(*lead, n // group, group).astype(mx.float32)
    a = alpha.astype(mx.float32).reshape(*alpha.shape, *([1] * (len(lead) - alpha.ndim + 2)))
    low = groups.min(axis=-1, keepdims=True) * a
    high = groups.max(axis=-1, keepdims=True) * a
    levels = (1 << bits) - 1
    scale = mx.maximum((high - low) / levels, _MIN_SCALE).astype(x.dtype)
    low = low.astype(x.dtype)
    codes = mx.round((groups - low.astype(mx.float32)) / scale.astype(mx.float32))
    return groups, scale, low, mx.clip(codes, 0, levels)


def quantize_clipped(x: mx.array, alpha: mx.array, group: int, bits: int):
    """(B, H, T, D) rows, alpha (B, H) -> (codes (B, H, T, D*bits/32), scales, minima (B, H, T, D/group))."""
    _, scale, low, codes = _grid(x, group, bits, alpha)
    return pack_codes(codes.reshape(x.shape), bits), scale.squeeze(-1), low.squeeze(-1)


@functools.lru_cache(maxsize=None)
def compiled_quantizer(group: int, bits: int):
    """``quantize_clipped`` of one token as one compiled graph (a decode step's host time)."""
    return mx.compile(functools.partial(quantize_clipped, group=group, bits=bits))


def dequantize_rows(codes, scales, minima, group: int, bits: int, dtype=None) -> mx.array:
    """Inverse of ``quantize_clipped`` (any width 1-8), along the last axis."""
    if bits in SUPPORTED_BITS:
        out = mx.dequantize(codes, scales, minima, group_size=group, bits=bits)
    else:
        q = unpack_codes(codes, bits).astype(mx.float32)
        q = q.reshape(*scales.shape, group)
        out = (q * scales[..., None].astype(mx.float32) + minima[..., None].astype(mx.float32))
        out = out.reshape(*codes.shape[:-1], -1).astype(scales.dtype)
    return out if dtype is None else out.astype(dtype)


def clip_errors(x: mx.array, group: int, bits: int, grid=CLIP_GRID) -> mx.array:
    """(len(grid), B, H) squared reconstruction error of rows (B, H, T, D) at each alpha."""
    *lead, n = x.shape
    groups = x.reshape(*lead, n // group, group).astype(mx.float32)
    low0, high0 = groups.min(axis=-1, keepdims=True), groups.max(axis=-1, keepdims=True)
    levels, errors = (1 << bits) - 1, []
    for alpha in grid:
        low = (low0 * alpha).astype(x.dtype).astype(mx.float32)  # as stored
        scale = mx.maximum((high0 * alpha - low0 * alpha) / levels, _MIN_SCALE).astype(x.dtype).astype(mx.float32)
        codes = mx.clip(mx.round((groups - low) / scale), 0, levels)
        errors.append(mx.square(codes * scale + low - groups).sum(axis=(2, 3, 4)))
    return mx.stack(errors)


def search_clip(x: mx.array, group: int, bits: int, grid=CLIP_GRID, max_rows: int = FIT_ROWS) -> mx.array:
    """(B, H) float32: the alpha of ``grid`` of least error on rows (B, H, T, D), ties to the
    earlier (larger) one; past ``max_rows`` rows, on every k-th row (at most ``max_rows``)."""
    if len(grid) == 1:
        return mx.full(x.shape[:2], float(grid[0]), mx.float32)
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
        super().__init__(GroupAffine(bits, group, "token"), step_tokens)
        for rows in (self.codes, self.scales, self.biases):
            rows.limit = limit  # room never grows past ``limit`` rows while they fit

    def append(self, x: mx.array, alpha: mx.array, one_token: bool = False) -> None:
        c = self.codec
        quantize = compiled_quantizer(c.group, c.bits) if one_token else functools.partial(
            quantize_clipped, group=c.group, bits=c.bits)
        codes, scales, biases = quantize(x, alpha)
        self.codes.append(codes)
        self.scales.append(scales)
        self.biases.append(biases)

    def decode(self, dtype) -> mx.array | None:
        if not self.count:
            return None
        c = self.codec
        return dequantize_rows(self.codes.view(), self.scales.view(), self.biases.view(), c.group, c.bits, dtype)
