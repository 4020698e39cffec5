"""Group-wise asymmetric (min-max) quantization in the two layouts KV caches need.

Per group of ``group_size`` consecutive elements: ``scale = (max - min) / (2^bits - 1)``,
``code = round((x - min) / scale)``, ``x_hat = scale * code + min``, so every element is
within ``scale / 2`` of its value (KIVI's quantizer; ``mx.quantize`` instead moves the
grid to make zero exact, which can clip a group's far end). Scales and minima are stored
in the input's dtype and codes are rounded against the stored values. Codes are packed
into uint32 words as one little-endian bit stream, ``mx.quantize``'s order at every width
it has (1-6 and 8 bits), so ``mx.dequantize``, ``mx.quantized_matmul`` and our kernels
(2, 4 and 8 bits) read them as they are.

- per token: groups run along head_dim (``(B, H, T, D)`` -> codes ``(B, H, T, D*bits/32)``);
- per channel: groups run along the tokens of one channel, stored transposed
  (``(B, H, T, D)`` -> codes ``(B, H, D, T*bits/32)``), so appending a block of tokens
  appends along the last axis and ``q @ K^T`` is a plain ``quantized_matmul``.
"""

from __future__ import annotations

import functools
import math
import os

import mlx.core as mx

from ..kernels import kivi_decode as kd
from ..kernels.compiled import code_shifts

SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 8)  # what mx.quantize / mx.dequantize pack
_MIN_SCALE = 1e-6  # a constant group gets this scale and codes 0: x_hat == x exactly


@functools.lru_cache(maxsize=None)
def _bit_fields(bits: int):
    """Where each of 32 consecutive codes lies in its ``bits`` words (a little-endian bit
    stream, mx.quantize's order): word, shift, and whether it runs into the next word.
    Arrays made from lists: they hold their data, so a compiled pass takes them as
    constants, where ``mx.arange`` would be a kernel at every call."""
    start = [i * bits for i in range(32)]
    return (mx.array([s // 32 for s in start], mx.uint32), mx.array([s % 32 for s in start], mx.uint32),
            mx.array([s % 32 + bits > 32 for s in start]))




def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """(..., n) integer codes below ``2**bits`` -> (..., n * bits / 32) uint32 words."""
    codes = codes.astype(mx.uint32)
    if 32 % bits == 0:  # whole codes per word
        per_word = 32 // bits
        grouped = codes.reshape(*codes.shape[:-1], -1, per_word)
        return (grouped << code_shifts(bits)).sum(axis=-1).astype(mx.uint32)  # disjoint bit fields
    *lead, n = codes.shape
    # the leading axes as one: MLX turns the slices before an index array into index arrays
    # of their own, and its CUDA gather and scatter take 10 axes at most (index and source
    # together; kitty's 7-bit plane's 6 axes failed there, benchmarks/results/h200_s67)
    grouped = codes.reshape(math.prod(lead), n // 32, 32)
    word, shift, spills = _bit_fields(bits)
    low = grouped << shift  # the part that fits, shifted in place (high bits drop off)
    high = mx.where(spills, grouped >> (32 - shift), 0)  # the rest, at the next word's start
    words = mx.zeros((grouped.shape[0], n // 32, bits + 1), mx.uint32)
    words = words.at[..., word].add(low).at[..., word + 1].add(high)
    return words[..., :bits].reshape(*lead, n * bits // 32)


def unpack_codes(words: mx.array, bits: int) -> mx.array:
    """Inverse of ``pack_codes``: (..., W) uint32 -> (..., W * 32 / bits) uint32 codes."""
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        per_word = 32 // bits
        codes = (words[..., None] >> code_shifts(bits)) & mask
        return codes.reshape(*words.shape[:-1], words.shape[-1] * per_word)
    *lead, w = words.shape
    # the leading axes as one, as ``pack_codes`` does: the CUDA gather's 10 axes at most
    grouped = mx.pad(words.reshape(math.prod(lead), w // bits, bits), [(0, 0), (0, 0), (0, 1)])
    word, shift, spills = _bit_fields(bits)
    low = grouped[..., word] >> shift
    high = mx.where(spills, grouped[..., word + 1] << (32 - shift), 0)
    return ((low | high) & mask).reshape(*lead, w * 32 // bits)


def quantize(x: mx.array, group_size: int, bits: int):
    """Min-max quantization along the last axis -> (codes, scales, minima)."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported; allowed: {SUPPORTED_BITS}")
    *lead, n = x.shape
    if 32 % bits and n % 32:
        raise ValueError(f"{bits}-bit codes pack 32 at a time: {n} elements per row do not")
    return group_quantize(x, group_size, bits)


COMPILED_ENV = "VQ_COMPILED_QUANTIZER"  # "0": the operations one by one (A/B benchmarks)


def group_quantize(x: mx.array, group_size: int, bits: int, alpha: mx.array | None = None):
    """``quantize``'s codes, scales and minima, unchecked; ``alpha`` (float32, broadcasting
    against the groups (..., G, 1)): a clip ratio scaling each group's minimum and maximum
    (``token_rows.quantize_rows``)."""
    *lead, n = x.shape
    core = _group_codes(bits, group_size, alpha is not None, os.environ.get(COMPILED_ENV) != "0")
    groups = x.reshape(*lead, n // group_size, group_size)
    codes, scale, low = core(groups) if alpha is None else core(groups, alpha)
    if _in_their_words(bits, group_size):  # each code already at its place in its word: a word is their sum
        words = codes.reshape(*lead, n * bits // 32, 32 // bits).sum(axis=-1)  # uint32
    else:
        words = pack_codes(codes.reshape(*lead, n), bits)
    return words, scale.squeeze(-1), low.squeeze(-1)


def _in_their_words(bits: int, group_size: int) -> bool:
    """Whether whole codes fill a word and a group holds whole words."""
    return 32 % bits == 0 and group_size % (32 // bits) == 0


@functools.lru_cache(maxsize=None)
def _group_codes(bits: int, group_size: int, clipped: bool, compiled: bool = True):
    """Groups (..., G, group_size) in the input's dtype (and, ``clipped``, the ratio) ->
    (codes (..., G, group_size) uint32, scales and minima (..., G, 1) in that dtype), one
    compiled pass for any shape (shapeless: a prompt chunk's length traces nothing again)
    with its elementwise work fused: 7 kernels where the operations one by one made 20
    (``tests/test_quant_store.py``), the same codes. Where a group holds whole words
    (``_in_their_words``) each code comes shifted to its place in its word
    (``pack_codes``' little-endian order)."""
    levels = (1 << bits) - 1
    per_word = 32 // bits
    shifts = (mx.array([(i % per_word) * bits for i in range(group_size)], mx.uint32)
              if _in_their_words(bits, group_size) else None)

    def codes(groups, alpha=None):
        low = groups.min(axis=-1, keepdims=True)  # exact in the input's dtype: no float32 copy to reduce
        high = groups.max(axis=-1, keepdims=True)
        low32, high32 = low.astype(mx.float32), high.astype(mx.float32)
        if clipped:
            low32, high32 = low32 * alpha, high32 * alpha
        scale = mx.maximum((high32 - low32) / levels, _MIN_SCALE).astype(groups.dtype)
        if clipped:  # the minimum kept is the clipped one, rounded to the dtype
            low = low32.astype(groups.dtype)
            low32 = low.astype(mx.float32)
        q = mx.round((groups.astype(mx.float32) - low32) / scale.astype(mx.float32))
        q = mx.clip(q, 0, levels).astype(mx.uint32)
        return (q if shifts is None else q << shifts), scale, low

    # MLX 0.32's shapeless compile crashes on a reduction over an axis of one element
    # ("malloc(): invalid size"): groups of one channel (zipcache's lossless setting) run uncompiled
    return mx.compile(codes, shapeless=True) if compiled and group_size > 1 else codes


def dequantize(codes, scales, minima, group_size: int, bits: int, dtype=None):
    """The packed words' values along the last axis, in the scales' dtype (or ``dtype``):
    ``kivi_decode.dequantize`` (``mx.dequantize``, 1-bit words unpacked by our own code)."""
    out = kd.dequantize(codes, scales, minima, group_size, bits)
    return out if dtype is None else out.astype(dtype)


def quantize_per_token(x: mx.array, group_size: int, bits: int):
    return quantize(x, group_size, bits)


def dequantize_per_token(codes, scales, minima, group_size: int, bits: int, dtype=None):
    return dequantize(codes, scales, minima, group_size, bits, dtype)


def quantize_per_channel(x: mx.array, group_size: int, bits: int):
    return quantize(x.swapaxes(-1, -2), group_size, bits)


def dequantize_per_channel(codes, scales, minima, group_size: int, bits: int, dtype=None):
    return dequantize(codes, scales, minima, group_size, bits, dtype).swapaxes(-1, -2)


def packed_length(n: int, bits: int) -> int:
    """uint32 words that ``n`` codes of ``bits`` bits occupy."""
    return n * bits // 32
