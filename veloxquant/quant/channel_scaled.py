"""Channel-separable token-wise quantization: a per-channel scale, then per-token groups.

Keys and values have outlier channels; a per-token group (along head_dim) that holds
one spends its levels on it. Dividing every channel by a scale ``c_j`` first
(ZipCache's ``c_j = sqrt(max_t |x_tj|)``, kept per layer and KV head) flattens the
outliers, so that the rows ``x / c`` quantize well token by token; the reconstruction is
``c * x_hat``. A token is quantized alone, so tokens of any subset (a precision class)
can be stored in any order, and appended one by one.

- ``channel_scale``: the scale of a block of rows, ``(B, H, D)`` float32;
- ``TokenGroups``: min-max per token in groups of ``group`` channels, at any width 1-8
  and any group that divides head_dim: ``mx.quantize``'s arithmetic and code order
  (``quant/affine.py``), the MLX routines where MLX has them (widths 1-6 and 8, groups
  32/64/128), the same by hand elsewhere (7 bits, other groups). A codec in the
  ``GroupAffine`` interface, so ``PackedTokens`` stores it;
- ``ChannelScaledRows``: such rows read by the pure-MLX decode path (the ``PackedScores``
  protocol of ``kernels/decode.py``) in one pass over the packed form: keys
  ``q Kᵀ = (q * c) K'ᵀ``, one ``quantized_matmul`` (transpose=True: the rows are a
  quantized weight matrix) on the CPU; values ``p V = (p V') * c``; where MLX has no
  routine for the width or group (or no kernel for these shapes: a GPU) the valid rows
  are dequantized in float32 and multiplied. ``c = None`` reads plain per-token rows;
- ``PlainRows``: full-precision rows in the same protocol (values kept unquantized).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..kernels import kivi_decode as kd
from .affine import SUPPORTED_BITS, _MIN_SCALE, pack_codes, quantize, unpack_codes
from .packed import AffineLayout

MLX_GROUPS = (32, 64, 128)  # the group sizes mx.quantize / mx.dequantize take
SCALE_FLOOR = 1e-3  # a channel's max |x| is floored at this fraction of the head's largest


def channel_scale(x: mx.array) -> mx.array:
    """``sqrt(max_t |x_tj|)`` per (batch, head, channel) of ``x`` (B, H, n, D), float32.

    A channel that is (nearly) zero over the block would get a scale near 0 and blow up
    later rows: its max is floored at ``SCALE_FLOOR`` times the head's largest (1 for an
    all-zero head)."""
    peak = mx.abs(x.astype(mx.float32)).max(axis=2)  # (B, H, D)
    top = peak.max(axis=-1, keepdims=True)
    floor = mx.where(top > 0, top * SCALE_FLOOR, 1.0)
    return mx.sqrt(mx.maximum(peak, floor))


def packs(head_dim: int, bits: int) -> bool:
    """Whether rows of ``head_dim`` codes of ``bits`` bits fill whole uint32 words the
    way ``pack_codes`` lays them out."""
    return head_dim % (32 // bits) == 0 if 32 % bits == 0 else head_dim % 32 == 0


def _mlx_has(bits: int, group: int) -> bool:
    return bits in SUPPORTED_BITS and group in MLX_GROUPS


@dataclass(frozen=True)
class TokenGroups:
    """Min-max quantization of each token in groups of ``group`` channels at ``bits``."""

    bits: int
    group: int
    axis: str = "token"  # the GroupAffine interface: PackedTokens lays tokens along axis 2

    @property
    def append_axis(self) -> int:
        return 2

    def encode(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if self.bits in SUPPORTED_BITS:
            return quantize(x, self.group, self.bits)
        *lead, n = x.shape  # 7 bits: affine.quantize's arithmetic, packed as one bit stream
        groups = x.reshape(*lead, n // self.group, self.group).astype(mx.float32)
        low, high = groups.min(axis=-1, keepdims=True), groups.max(axis=-1, keepdims=True)
        levels = (1 << self.bits) - 1
        scale = mx.maximum((high - low) / levels, _MIN_SCALE).astype(x.dtype)
        low = low.astype(x.dtype)
        codes = mx.round((groups - low.astype(mx.float32)) / scale.astype(mx.float32))
        codes = mx.clip(codes, 0, levels).reshape(*lead, n)
        return pack_codes(codes, self.bits), scale.squeeze(-1), low.squeeze(-1)

    encode_one = encode

    def decode(self, codes, scales, biases, dtype=None) -> mx.array:
        if _mlx_has(self.bits, self.group):
            if dtype == mx.float32:  # float32 out: no rounding to the scales' dtype on the way
                scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
            out = mx.dequantize(codes, scales, biases, group_size=self.group, bits=self.bits)
        else:
            q = unpack_codes(codes, self.bits).astype(mx.float32)
            s = mx.repeat(scales.astype(mx.float32), self.group, axis=-1)
            b = mx.repeat(biases.astype(mx.float32), self.group, axis=-1)
            out = q * s + b
        return out if dtype is None else out.astype(dtype)


@dataclass(frozen=True)
class ChannelScaledRows:
    """Per-token rows ``x / c`` in a ``TokenGroups`` codec (``layout``: whole buffers,
    ``count`` valid rows), read as keys (``scores``) or values (``mix``); ``channel``
    ``(B, H, D)`` float32 or None (plain rows)."""

    layout: AffineLayout
    channel: mx.array | None

    @property
    def count(self) -> int:
        return self.layout.count

    @property
    def n_heads(self) -> int:
        return self.layout.codes.shape[1]

    def _valid(self):
        x, n = self.layout, self.layout.count
        return x.codes[:, :, :n], x.scales[:, :, :n], x.biases[:, :, :n]

    def _qmm(self) -> bool:
        x = self.layout
        return _mlx_has(x.bits, x.group) and kd._pure_path() == "qmm"

    def rows(self) -> mx.array:
        """The valid rows ``x / c`` (B, H, count, D) in float32 (transient)."""
        x = self.layout
        return TokenGroups(x.bits, x.group).decode(*self._valid(), mx.float32)

    def scores(self, q: mx.array) -> mx.array:
        """float32 ``q Kᵀ`` (B, H, R, count) for scaled float32 queries (B, H, R, D)."""
        if self.channel is not None:
            q = q * self.channel[:, :, None, :]
        x = self.layout
        if self._qmm():
            return mx.quantized_matmul(q, *self._valid(), transpose=True, group_size=x.group, bits=x.bits)
        return q @ self.rows().swapaxes(-1, -2)

    def mix(self, p: mx.array) -> mx.array:
        """float32 ``p V`` (B, H, R, D) for probabilities (B, H, R, count)."""
        x = self.layout
        if self._qmm():
            out = mx.quantized_matmul(p, *self._valid(), transpose=False, group_size=x.group, bits=x.bits)
        else:
            out = p @ self.rows()
        return out if self.channel is None else out * self.channel[:, :, None, :]


@dataclass(frozen=True)
class PlainRows:
    """Full-precision rows (B, H, capacity, D) of which ``count`` are valid, in the
    ``PackedScores`` protocol (values kept unquantized beside quantized keys)."""

    rows: mx.array
    count: int

    @property
    def n_heads(self) -> int:
        return self.rows.shape[1]

    def scores(self, q: mx.array) -> mx.array:
        return q @ self.rows[:, :, : self.count].astype(mx.float32).swapaxes(-1, -2)

    def mix(self, p: mx.array) -> mx.array:
        return p @ self.rows[:, :, : self.count].astype(mx.float32)
