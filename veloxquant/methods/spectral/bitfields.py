"""Rows of fields of different widths, packed into one little-endian bit stream per row.

A codec whose coordinates do not share one width (a few leading coordinates at one
width, the rest at another, plus sign bits) keeps each row as the concatenation of its
fields' bits, least significant bit first, padded to whole uint32 words: a row of fields
``(n_i, b_i)`` takes ``ceil(sum n_i b_i / 32)`` words, so the padding is under 32 bits a
row whatever the widths: the layout of ``quant/packed.py``'s ``FieldLayout`` (kvtc's per-component
widths), which reads them.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from ...quant.packed import field_arrays, runs_layout
from ...quant.packed import unpack_fields as unpack_codes


def row_words(layout: tuple[tuple[int, int], ...]) -> int:
    """uint32 words of one row whose fields are ``(count, bits)``."""
    return -(-sum(n * b for n, b in layout) // 32)


_SHIFTS = mx.arange(32, dtype=mx.uint32)


def pack_fields(fields: list[tuple[mx.array, int]]) -> mx.array:
    """Fields (..., n_i) of codes below ``2**b_i`` -> (..., words) uint32, in order. Every
    bit is spread out and summed into its word: the rows packed at once are few (a decode
    step's token), where this takes fewer operations than placing each code."""
    bits = []
    for codes, width in fields:
        planes = (codes.astype(mx.uint32)[..., None] >> mx.arange(width, dtype=mx.uint32)) & 1
        bits.append(planes.reshape(*codes.shape[:-1], -1))
    stream = mx.concatenate(bits, axis=-1) if len(bits) > 1 else bits[0]
    *lead, n = stream.shape
    pad = -(-n // 32) * 32 - n
    if pad:
        stream = mx.pad(stream, [(0, 0)] * len(lead) + [(0, pad)])
    stream = stream.reshape(*lead, -1, 32)
    return (stream << _SHIFTS).sum(axis=-1).astype(mx.uint32)  # disjoint bits: a sum is an or


def unpack_fields(words: mx.array, layout: tuple[tuple[int, int], ...]) -> list[mx.array]:
    """Inverse of ``pack_fields``: (..., words) -> the fields (..., n_i) as float32 codes."""
    codes = runs_layout(tuple(layout), words.ndim).unpack(words).astype(mx.float32)
    out, at = [], 0
    for n, _ in layout:
        out.append(codes[..., at : at + n])
        at += n
    return out


@functools.lru_cache(maxsize=None)
def _code_reader(layout: tuple[tuple[int, int], ...], first: int, end: int, offsets: tuple[int, ...] | None):
    """``quant/packed.py``'s unpacking arrays for codes ``[first, end)`` of a row (counted over
    every field), shaped for rows (B, H, n, words), and the offsets added to them: built in
    numpy once (slices of the whole row's arrays would be operations in every read)."""
    arrays, _ = field_arrays(np.concatenate([np.full(n, b, dtype=np.int64) for n, b in layout]))
    reader = tuple(mx.array(a[first:end].reshape(1, 1, 1, -1)) for a in arrays)
    return reader, None if offsets is None else mx.array(np.asarray(offsets, dtype=np.uint32).reshape(1, 1, 1, -1))


def read_codes(words: mx.array, layout: tuple[tuple[int, int], ...], first: int, end: int,
               offsets: tuple[int, ...] | None = None) -> mx.array:
    """uint32 codes ``[first, end)`` of rows (B, H, n, words), each plus its entry of
    ``offsets`` (one per code) if given: one field or several, the rest of the row left packed."""
    reader, offset = _code_reader(tuple(layout), first, end, offsets)
    codes = unpack_codes(words, *reader)
    return codes if offset is None else codes + offset
