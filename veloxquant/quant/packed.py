"""Codecs and the packed storage they fill, token block by token block.

A codec turns a block of keys or values ``(B, H, n, D)`` into what is stored and back.
``GroupAffine`` is min-max quantization in groups (``quant/affine.py``), along head_dim
("token": one token's channels share a scale) or along the tokens of one channel
("channel": stored transposed, the layout KIVI gives keys). ``PackedTokens`` keeps one
codec's output for a growing run of tokens, in growing buffers, and hands the fused
decode kernels its ``AffineLayout`` (codes, scales, biases, count, bits, group, axis).
Other codecs (codebooks, outlier tables, low-rank factors) implement the same small
protocol: ``encode``, ``decode``, ``append_axis``.

``FieldLayout`` packs codes of different widths one after the other into uint32 words,
least significant bit first (a code that crosses a word boundary keeps its high bits at
the bottom of the next word: ``ceil(sum(bits) / 32)`` words a row); reading is two
gathers (on CUDA, where the reader asks, two trees of selects: ``unpack_fields``), two shifts
and a mask per code, with no intermediate of the words' 32 bits each (a decode step reads
every row of the history: benchmarks/notes/decode_kernels.md).
kvtc packs its per-component widths this way, spectral its fields.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..cache.buffers import GrowingArray
from .affine import (
    dequantize_per_channel,
    dequantize_per_token,
    packed_length,
    quantize_per_channel,
    quantize_per_token,
)
from ..kernels import kivi_decode as kd

GROWTH_TOKENS = 256  # room added to packed storage at a time, in tokens


# -- a short last axis read by index (a row's words, a codebook's levels) ------------------------
# A decode step reads the whole history's words and codebook levels by index. On CUDA MLX's
# axis gather (``take_along_axis``) is slow at these shapes: 138 us for kvquant's 16-entry
# tables at 4k, where selects fused into the compiled read took 60
# (benchmarks/notes/decode_kernels.md); spectral's word reads were 85 us a gather
# (benchmarks/results/h200_s77). Selects cost an operation an entry and the gather does not, so
# past SELECT_MOST_ENTRIES the gather stays; on the CPU the selects were 10x slower, so the
# gather stays there.

# kvquant's 16 entries took 0.44x the gather's time; about twice that is where selects
# would stop paying (inferred, not measured)
SELECT_MOST_ENTRIES = 32


def selects_here(entries: int) -> bool:
    """Whether ``taken_along_last`` reads an axis of ``entries`` entries by selects: on CUDA
    (asked through the dispatcher's module at each call, so the CPU guards' CUDA stub reaches
    it), up to ``SELECT_MOST_ENTRIES``."""
    return entries <= SELECT_MOST_ENTRIES and kd.gpu_backend() == "cuda"


def index_bits(index, entries: int) -> tuple:
    """The conditions of ``selected_along_last``'s tree for ``index`` (an array, or numpy for
    a constant index, whose conditions its owner builds once: computed in every read they are
    kernels of their own), over ``entries`` entries: per level, whether the index's bit is set."""
    return tuple(((index >> b) & 1) == 1 for b in range((entries - 1).bit_length()))


def selected_along_last(x: mx.array, index: mx.array, bits: tuple | None = None) -> mx.array:
    """``mx.take_along_axis(x, index, axis=-1)`` exactly (``x`` and ``index`` broadcast over
    the other axes), by ``mx.where`` over the entries of ``x``'s last axis: a tree, each level
    choosing between neighbours by one bit of the index (``bits``: ``index_bits``, built ahead),
    so that it is as deep as the index has bits (a chain, one entry a level, was cut into
    several kernels by MLX's compile, which fuses at most 11 operations deep). Every index
    must lie in ``[0, x.shape[-1])``."""
    n = x.shape[-1]
    level = mx.split(x, n, axis=-1) if n > 1 else [x]  # one node, not a slice an entry
    for odd in index_bits(index, n) if bits is None else bits:
        level = [mx.where(odd, level[i + 1], level[i]) if i + 1 < len(level) else level[i]
                 for i in range(0, len(level), 2)]
    return mx.broadcast_to(level[0], mx.broadcast_shapes(x.shape[:-1] + (1,), index.shape))


def taken_along_last(x: mx.array, index: mx.array, bits: tuple | None = None) -> mx.array:
    """``mx.take_along_axis(x, index, axis=-1)``, by selects where ``selects_here``."""
    if selects_here(x.shape[-1]):
        return selected_along_last(x, index, bits)
    return mx.take_along_axis(x, index, axis=-1)


# not frozen: a decode step builds one a packed run, and a frozen dataclass takes about five times as long to make
@dataclass(eq=False, slots=True)
class AffineLayout:
    """Group-affine packed tokens as the kernels read them (buffers may have spare room).

    axis "channel": codes (B, H, D, words), scales/biases (B, H, D, groups), tokens along
    the last axis; axis "token": codes (B, H, rows, D*bits/32), scales/biases
    (B, H, rows, D/group). ``count`` tokens are valid.
    """

    codes: mx.array
    scales: mx.array
    biases: mx.array
    count: int
    bits: int
    group: int
    axis: str


@dataclass(frozen=True)
class GroupAffine:
    """Min-max quantization of ``bits`` bits in groups of ``group`` along ``axis``."""

    bits: int
    group: int
    axis: str  # "token" | "channel"

    @property
    def append_axis(self) -> int:
        return -1 if self.axis == "channel" else 2

    def encode(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        quantize = quantize_per_channel if self.axis == "channel" else quantize_per_token
        return quantize(x, self.group, self.bits)

    def encode_one(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """``encode`` of one token, compiled: one graph node instead of about twenty (a
        decode step's host time), the same codes."""
        return _compiled_encoder(self)(x)

    def decode(self, codes, scales, biases, dtype) -> mx.array:
        dequantize = dequantize_per_channel if self.axis == "channel" else dequantize_per_token
        return dequantize(codes, scales, biases, self.group, self.bits, dtype)


@functools.lru_cache(maxsize=None)
def _compiled_encoder(codec: GroupAffine):
    return mx.compile(codec.encode)


class PackedTokens:
    """A growing run of tokens in one group-affine codec."""

    def __init__(self, codec: GroupAffine, step_tokens: int = GROWTH_TOKENS):
        self.codec = codec
        if codec.axis == "channel":  # tokens run along the last axis, a word holds several
            steps = packed_length(step_tokens, codec.bits), step_tokens // codec.group
        else:
            steps = step_tokens, step_tokens
        self.codes = GrowingArray(axis=codec.append_axis, step=steps[0])
        self.scales = GrowingArray(axis=codec.append_axis, step=steps[1])
        self.biases = GrowingArray(axis=codec.append_axis, step=steps[1])

    @property
    def count(self) -> int:
        if self.codec.axis == "channel":
            return self.scales.length * self.codec.group
        return self.codes.length

    def append(self, x: mx.array, decoding: bool = False) -> None:
        """Encode ``x`` (B, H, n, D) and store it after the tokens already kept.
        ``decoding``: a decode step's write (its token, or the block it flushes), whose
        shapes recur, so it goes through the compiled encoder (traced once a shape)."""
        codes, scales, biases = (self.codec.encode_one(x) if decoding else self.codec.encode(x))
        self.codes.append(codes)
        self.scales.append(scales)
        self.biases.append(biases)

    def expected_shapes(self, head_dim: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The trailing two dims of codes and scales that ``count`` tokens must have."""
        c, n = self.codec, self.count
        if c.axis == "channel":
            return (head_dim, packed_length(n, c.bits)), (head_dim, n // c.group)
        return (n, packed_length(head_dim, c.bits)), (n, head_dim // c.group)

    def decode(self, dtype) -> mx.array | None:
        """The valid tokens in ``dtype`` (transient: prefill chunks and tests)."""
        if not self.count:
            return None
        return self.codec.decode(self.codes.view(), self.scales.view(), self.biases.view(), dtype)

    def layout(self, empty: mx.array) -> AffineLayout:
        """What the decode kernels read: whole buffers (spare room included), no copy."""

        c, codes, scales, biases = self.codec, self.codes.buffer, self.scales.buffer, self.biases.buffer
        return AffineLayout(empty if codes is None else codes, empty if scales is None else scales,
                            empty if biases is None else biases, self.count, c.bits, c.group, c.axis)

    def arrays(self, prefix: str) -> dict[str, GrowingArray]:
        return {f"{prefix}_codes": self.codes, f"{prefix}_scales": self.scales,
                f"{prefix}_biases": self.biases}


def field_arrays(bits) -> tuple[tuple[np.ndarray, ...], int]:
    """``FieldLayout``'s arrays (word, next word, shift, high shift, crosses, mask), 1-D numpy,
    for codes of widths ``bits`` packed in order, and the words a row takes."""
    bits = np.asarray(bits, dtype=np.int64)
    start = np.cumsum(bits) - bits
    word, shift = start // 32, start % 32
    crosses = shift + bits > 32
    n_words = max(1, -(-int(bits.sum()) // 32))
    return (word.astype(np.int32), np.minimum(word + 1, n_words - 1).astype(np.int32),
            shift.astype(np.uint32), np.where(crosses, 32 - shift, 0).astype(np.uint32), crosses,
            ((1 << bits) - 1).astype(np.uint32)), n_words


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
        arrays, n_words = field_arrays(bits)
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


def unpack_fields(words, word, next_word, shift, high_shift, crosses, mask, bits=None) -> mx.array:
    """``FieldLayout.unpack`` from its arrays (shaped for ``words``' dimensions, or 1-D: one
    list of words for every row, taken as such, with no index broadcast over the rows).
    ``bits``: ``index_bits`` of ``word`` and ``next_word``, built ahead by a reader of short
    rows (spectral's), which then reads them by selects on CUDA; without them, gathers (a
    tree cut over several kernels added 4 launches a layer to kvtc's tiny-model prompt chunk,
    tests/test_compiled_prompt.py)."""
    if word.ndim == 1:
        low, high = mx.take(words, word, axis=-1), mx.take(words, next_word, axis=-1)
    elif bits is None:
        low, high = mx.take_along_axis(words, word, axis=-1), mx.take_along_axis(words, next_word, axis=-1)
    else:
        low, high = taken_along_last(words, word, bits[0]), taken_along_last(words, next_word, bits[1])
    return ((low >> shift) | mx.where(crosses, high << high_shift, 0).astype(mx.uint32)) & mask


@functools.lru_cache(maxsize=None)
def runs_layout(runs: tuple[tuple[int, int], ...], ndim: int) -> FieldLayout:
    """The layout of runs of equal widths ``((count, bits), ...)`` for rows of ``ndim``
    dimensions, built once per runs and rank."""
    return FieldLayout.of(np.concatenate([np.full(n, b, dtype=np.int64) for n, b in runs]), ndim)
