"""Codes of different widths packed one after the other into uint32 words, least significant
bit first: the code of ``bits[i]`` bits starts where code ``i - 1`` ended, and a code that
crosses a word boundary keeps its high bits at the bottom of the next word. A row of codes
takes ``ceil(sum(bits) / 32)`` words, under 32 bits of padding whatever the widths.

``FieldLayout`` holds, per code, where it lies (its word, the next word, its shift, whether
it crosses, its mask). Reading is two gathers, two shifts and a mask per code, with no
intermediate of the words' 32 bits each (a decode step reads every row of the history:
benchmarks/notes/decode_kernels.md). kvtc packs its per-component widths this way;
spectral its fields (a few leading coordinates at one width, the rest at another, plus
sign bits).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class FieldLayout:
    """Where each code lies in a row's packed words. Each array is (1, ..., 1, k), shaped
    for words of the rank it was built for ((B, tokens, n_words) by default); ``_for``
    reshapes them for rows of other ranks."""

    word: mx.array  # (1, 1, k) int32, the word holding the code's low bits
    next_word: mx.array  # (1, 1, k) int32, the word holding its high bits (itself if none)
    shift: mx.array  # (1, 1, k) uint32, the code's low bit in its word
    high_shift: mx.array  # (1, 1, k) uint32, 32 - shift where the code crosses, else 0
    crosses: mx.array  # (1, 1, k) bool
    mask: mx.array  # (1, 1, k) uint32, 2**bits - 1
    n_words: int

    @classmethod
    def of(cls, bits: np.ndarray, ndim: int = 3) -> "FieldLayout":
        """The layout of codes of widths ``bits``, its arrays shaped for rows of ``ndim``
        dimensions (a reshape in every read otherwise)."""
        bits = np.asarray(bits, dtype=np.int64)
        start = np.cumsum(bits) - bits
        word, shift = start // 32, start % 32
        crosses = shift + bits > 32
        n_words = max(1, -(-int(bits.sum()) // 32))
        arrays = (word.astype(np.int32), np.minimum(word + 1, n_words - 1).astype(np.int32),
                  shift.astype(np.uint32), np.where(crosses, 32 - shift, 0).astype(np.uint32), crosses,
                  ((1 << bits) - 1).astype(np.uint32))
        return cls(*(mx.array(a.reshape((1,) * (ndim - 1) + (-1,))) for a in arrays), n_words)

    def arrays(self) -> tuple[mx.array, ...]:
        """What the layout holds (derived from the widths: counted, never saved)."""
        return self.word, self.next_word, self.shift, self.high_shift, self.crosses, self.mask

    def _for(self, ndim: int) -> tuple[mx.array, ...]:
        """The arrays shaped for rows of ``ndim`` dimensions (the last one the codes')."""
        if ndim == self.word.ndim:
            return self.arrays()
        return tuple(a.reshape((1,) * (ndim - 1) + (-1,)) for a in self.arrays())

    def pack(self, codes: mx.array) -> mx.array:
        """(..., k) codes -> (..., n_words) uint32."""
        c = codes.astype(mx.uint32)
        word, next_word, shift, high_shift, crosses, _ = self._for(c.ndim)
        low = c << shift
        high = mx.where(crosses, c >> high_shift, 0).astype(mx.uint32)
        words = mx.zeros((*c.shape[:-1], self.n_words), mx.uint32)
        # codes never overlap, so adding them is or-ing them
        return words.at[..., self.word.reshape(-1)].add(low).at[..., self.next_word.reshape(-1)].add(high)

    def unpack(self, words: mx.array) -> mx.array:
        """(..., n_words) uint32 -> (..., k) uint32 codes."""
        return unpack_fields(words, *self._for(words.ndim))


def unpack_fields(words, word, next_word, shift, high_shift, crosses, mask) -> mx.array:
    """``FieldLayout.unpack`` from its arrays (shaped for ``words``' dimensions)."""
    low = mx.take_along_axis(words, word, axis=-1) >> shift
    high = mx.where(crosses, mx.take_along_axis(words, next_word, axis=-1) << high_shift, 0)
    return (low | high.astype(mx.uint32)) & mask


@functools.lru_cache(maxsize=None)
def runs_layout(runs: tuple[tuple[int, int], ...], ndim: int) -> FieldLayout:
    """The layout of runs of equal widths ``((count, bits), ...)`` for rows of ``ndim``
    dimensions, built once per runs and rank."""
    return FieldLayout.of(np.concatenate([np.full(n, b, dtype=np.int64) for n, b in runs]), ndim)
