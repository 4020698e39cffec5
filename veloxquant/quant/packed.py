"""Codecs and the packed storage they fill, token block by token block.

A codec turns a block of keys or values ``(B, H, n, D)`` into what is stored and back.
``GroupAffine`` is min-max quantization in groups (``quant/affine.py``), along head_dim
("token": one token's channels share a scale) or along the tokens of one channel
("channel": stored transposed, the layout KIVI gives keys). ``PackedTokens`` keeps one
codec's output for a growing run of tokens, in growing buffers, and hands the fused
decode kernels its ``AffineLayout`` (codes, scales, biases, count, bits, group, axis).
Other codecs (codebooks, outlier tables, low-rank factors) implement the same small
protocol: ``encode``, ``decode``, ``append_axis``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from ..cache.buffers import GrowingArray
from .affine import (
    dequantize_per_channel,
    dequantize_per_token,
    packed_length,
    quantize_per_channel,
    quantize_per_token,
)

GROWTH_TOKENS = 256  # room added to packed storage at a time, in tokens


@dataclass(frozen=True)
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

    def append(self, x: mx.array, one_token: bool = False) -> None:
        """Encode ``x`` (B, H, n, D) and store it after the tokens already kept;
        ``one_token``: a decode step's single token, through the compiled encoder."""
        codes, scales, biases = (self.codec.encode_one(x) if one_token else self.codec.encode(x))
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

        def whole(g: GrowingArray):
            return g.buffer if g.buffer is not None else empty

        c = self.codec
        return AffineLayout(whole(self.codes), whole(self.scales), whole(self.biases),
                            self.count, c.bits, c.group, c.axis)

    def arrays(self, prefix: str) -> dict[str, GrowingArray]:
        return {f"{prefix}_codes": self.codes, f"{prefix}_scales": self.scales,
                f"{prefix}_biases": self.biases}
