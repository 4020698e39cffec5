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

from ...quant.packed import field_arrays, index_bits, runs_layout
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
    """What ``read_codes`` reads codes ``[first, end)`` of a row (counted over every field) with,
    built in numpy once (slices of the whole row's arrays would be operations in every read):
    ``quant/packed.py``'s unpacking arrays shaped for rows (B, H, n, words), indexing the words
    ``[lo, hi)`` that hold the codes; ``index_bits`` of their word indices (CUDA's selects); the
    span of words, None for all of them; the offsets added to the codes."""
    arrays, n_words = field_arrays(np.concatenate([np.full(n, b, dtype=np.int64) for n, b in layout]))
    word, next_word, *rest = (a[first:end] for a in arrays)
    lo, hi = int(word.min()), int(next_word.max()) + 1
    word, next_word = word - lo, next_word - lo

    def bits(index):
        return tuple(mx.array(c.reshape(1, 1, 1, -1)) for c in index_bits(index, hi - lo))

    reader = tuple(mx.array(a.reshape(1, 1, 1, -1)) for a in (word, next_word, *rest))
    span = None if (lo, hi) == (0, n_words) else (lo, hi)
    offset = None if offsets is None else mx.array(np.asarray(offsets, dtype=np.uint32).reshape(1, 1, 1, -1))
    return reader, (bits(word), bits(next_word)), span, offset


def read_codes(words: mx.array, layout: tuple[tuple[int, int], ...], first: int, end: int,
               offsets: tuple[int, ...] | None = None) -> mx.array:
    """uint32 codes ``[first, end)`` of rows (B, H, n, words), each plus its entry of
    ``offsets`` (one per code) if given: one field or several, the rest of the row left packed
    (only the words that hold them read)."""
    reader, bits, span, offset = _code_reader(tuple(layout), first, end, offsets)
    codes = unpack_codes(words if span is None else words[..., span[0] : span[1]], *reader, bits=bits)
    return codes if offset is None else codes + offset
