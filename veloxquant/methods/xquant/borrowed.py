"""Tokens stored as another layer's codes with this layer's own scale and zero (XQuant).

A reuse layer keeps no codes of its own: for each block of tokens it flushes, it reads
the anchor layer's codes of the same tokens (``source()``: the anchor's
``PackedTokens``, reached through the model context) and keeps, per quantization group
of its own data, its own min-max scale and zero, so ``x_hat = q_anchor * s_own + z_own``.
Min-max codes are invariant under a positive affine map of a group, so where a layer is
such a map of the anchor the borrowed codes are the ones it would have computed. An
optional residual ``x - x_hat`` is kept at its own bit width (``PackedTokens`` of the same
layout) and added back.

``BorrowedCodes`` has ``PackedTokens``' interface (append, count, decode, layout, arrays),
so the quantized store's flush policy runs unchanged (``BorrowedStore``); anchor and
reuse layers flush the same token ranges because they see the same tokens in the same
calls. Decode reads ``AffineLayout(anchor codes, own scales, own zeros)``, which the
fused kernel serves as it is (2, 4, 8 bits); with a residual, ``ResidualScores`` adds the
residual's scores and mixes (pure-MLX path).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from ...cache.buffers import GrowingArray
from ...quant.affine import _MIN_SCALE, packed_length, unpack_codes
from ...quant.packed import GROWTH_TOKENS, AffineLayout, GroupAffine, PackedTokens
from ...quant.residual import ResidualScores
from ...quant.store import QuantizedKVStore
from ...quant.token_rows import ReadViews


class BorrowedCodes:
    def __init__(self, codec: GroupAffine, residual: GroupAffine | None,
                 source: Callable[[], PackedTokens], step_tokens: int = GROWTH_TOKENS):
        self.codec, self.source = codec, source
        step = step_tokens // codec.group if codec.axis == "channel" else step_tokens
        self.scales = GrowingArray(axis=codec.append_axis, step=step)
        self.biases = GrowingArray(axis=codec.append_axis, step=step)
        self.residual = None if residual is None else PackedTokens(residual, step_tokens)
        self._views = ReadViews()  # the decode layout, kept until a buffer or a count changes

    @property
    def count(self) -> int:
        n = self.scales.length
        return n * self.codec.group if self.codec.axis == "channel" else n

    def _codes(self, start: int, stop: int) -> mx.array:
        """The anchor's packed codes of tokens [start, stop)."""
        src = self.source()
        if src.count < stop:
            raise RuntimeError(
                f"the anchor layer holds codes for {src.count} tokens, a reuse layer needs "
                f"tokens up to {stop}: layers must be updated in order (anchor first)")
        c = src.codes.buffer
        if self.codec.axis == "channel":
            return c[..., packed_length(start, self.codec.bits):packed_length(stop, self.codec.bits)]
        return c[:, :, start:stop]

    def append(self, x: mx.array, decoding: bool = False) -> None:
        c = self.codec
        start, n = self.count, x.shape[2]
        q = unpack_codes(self._codes(start, start + n), c.bits).astype(mx.float32)
        data = x.swapaxes(-1, -2) if c.axis == "channel" else x  # groups along the last axis
        shape = (*data.shape[:-1], data.shape[-1] // c.group, c.group)
        groups = data.astype(mx.float32).reshape(shape)
        low = groups.min(axis=-1, keepdims=True)
        scale = mx.maximum((groups.max(axis=-1, keepdims=True) - low) / ((1 << c.bits) - 1), _MIN_SCALE)
        scale, low = scale.astype(x.dtype), low.astype(x.dtype)
        self.scales.append(scale.squeeze(-1))
        self.biases.append(low.squeeze(-1))
        if self.residual is not None:
            x_hat = (q.reshape(shape) * scale.astype(mx.float32) + low.astype(mx.float32)).reshape(data.shape)
            if c.axis == "channel":
                x_hat = x_hat.swapaxes(-1, -2)
            self.residual.append((x.astype(mx.float32) - x_hat).astype(x.dtype), decoding)

    def _base(self, empty: mx.array) -> AffineLayout:
        src = self.source()
        c = self.codec
        whole = [g.buffer if g.buffer is not None else empty for g in (src.codes, self.scales, self.biases)]
        return AffineLayout(*whole, self.count, c.bits, c.group, c.axis)

    def decode(self, dtype) -> mx.array | None:
        if not self.count:
            return None
        c, n = self.codec, self.count
        codes = self._codes(0, n)
        x = c.decode(codes, self.scales.view(), self.biases.view(), mx.float32)
        if self.residual is not None:
            x = x + self.residual.decode(mx.float32)
        return x.astype(dtype)

    def layout(self, empty: mx.array):
        """What a decode step reads: whole buffers (their objects, which writes in place
        keep), so it is built again only when a buffer is replaced or a count changes."""
        codes, r = self.source().codes, self.residual
        key = (codes.buffer, self.scales.buffer, self.biases.buffer, self.scales.length, empty)
        if r is not None:
            key += (r.codes.buffer, r.scales.buffer, r.biases.buffer, r.codes.length, r.scales.length)
        return self._views.get(self, key, lambda: self._layout(empty))

    def _layout(self, empty: mx.array):
        base = self._base(empty)
        if self.residual is None:
            return base
        return ResidualScores(base, (ResidualScores(self.residual.layout(empty), ()),))

    def arrays(self, prefix: str) -> dict[str, GrowingArray]:
        out = {f"{prefix}_scales": self.scales, f"{prefix}_biases": self.biases}
        if self.residual is not None:
            out.update(self.residual.arrays(f"{prefix}_residual"))
        return out


class BorrowedStore(QuantizedKVStore):
    """The quantized store with borrowed keys and values (same windows, same flushes)."""

    def __init__(self, keys: BorrowedCodes, values: BorrowedCodes, window: int, key_block: int,
                 step_tokens: int, attend_then_flush: bool = False, value_flush: int = 1):
        super().__init__(keys.codec, values.codec, window, key_block, step_tokens,
                         attend_then_flush=attend_then_flush, value_flush=value_flush)
        self.keys, self.values = keys, values

    def layout_problems(self, head_dims):
        for packed, name, dim in ((self.keys, "key", head_dims[0]), (self.values, "value", head_dims[1])):
            c, scales = packed.codec, packed.scales.view()
            if scales is None:
                continue
            expected = (dim, packed.count // c.group) if c.axis == "channel" else (packed.count, dim // c.group)
            if tuple(scales.shape[2:]) != expected:
                yield f"{name} scales", tuple(scales.shape[2:]), f"{expected} (groups of {c.group})"
            if packed.residual is not None and packed.residual.count != packed.count:
                yield f"{name} residual tokens", packed.residual.count, f"the {packed.count} borrowed tokens"
