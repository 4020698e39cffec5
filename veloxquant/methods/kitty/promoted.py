"""Promoted channels: per-channel keys at a low bit width, a few channels per block at a high one.

For each block of ``block`` tokens and each (batch, KV head), the ``k`` channels with the
largest mean |x| over the block are *promoted*: quantized min-max in groups of ``group``
tokens at ``hi_bits``, the other channels at ``lo_bits`` (Kitty's dynamic channel-wise
precision boost). The block's own tokens alone choose its channels.

Storage is honest: every block is one uniform lo-bit plane plus a small plane for the
promoted channels, as the paper lays out a 4-bit channel as two 2-bit planes.

- **lo plane**: the per-channel group-affine layout (``AffineLayout``, axis "channel")
  over *all* channels: an ordinary channel holds its lo-bit code with its own scale and
  minimum; a promoted channel holds the low ``lo_bits`` of its hi-bit code with the
  *hi* scale and minimum.
- **up plane**: for the promoted channels only, the upper ``hi_bits - lo_bits`` bits of
  the code, per block ``(B, H, blocks, k, block * up_bits / 32)``, with the channel
  indices ``(B, H, blocks, k)`` (uint8; uint16 past 256 channels). Its scale is the lo
  plane's scale of that channel times ``2**lo_bits`` and its minimum 0, so it keeps no
  scales of its own: ``x_hat = lo plane + up plane`` is the hi-bit reconstruction
  ``scale * code + min`` (to float rounding: ``code = low + 2**lo_bits * up``).

Widths: the lo plane takes 1-6 or 8 bits, the up plane 1-7 (``hi_bits=8, lo_bits=1``
gives 7 upper bits, which mx.quantize cannot lay out: they are packed here as the same
little-endian bit stream, ``affine.pack_codes``, and unpacked by hand). With no channel
promoted (``k = 0``) the lo plane is plain per-channel quantization at ``lo_bits``
(KIVI's keys, bit for bit).

Attention: scores add over channels, so the up plane's term cannot be a part of its own
in the log-sum-exp merge; ``PromotedScores`` (the ``PackedScores`` protocol of
``kernels/decode.py``) adds it to the lo plane's scores and is read by the pure-MLX path
on every device, a GPU included (the fused kernel would need an extra score term per
promoted channel). Without promoted channels the store hands the lo plane's
``AffineLayout`` itself, which the fused kernel serves at 2, 4 and 8 bits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from ...cache.buffers import GrowingArray
from ...kernels import kivi_decode as kd
from ...quant.affine import _MIN_SCALE, SUPPORTED_BITS, dequantize, pack_codes, packed_length, unpack_codes
from ...quant.packed import GROWTH_TOKENS, AffineLayout


def n_promoted(head_dim: int, fraction: float) -> int:
    """Channels promoted per block: ``int(d * f)``, plus the repo's 1e-6 for products a hair
    below an integer (0.29 * 100 = 28.999...)."""
    return int(head_dim * fraction + 1e-6)


def top_channels(blocks: mx.array, k: int) -> mx.array:
    """(B, H, n, L, D) blocks -> (B, H, n, k) the k channels of largest mean |x| per block,
    increasing (uint8, or uint16 past 256 channels)."""
    score = mx.abs(blocks.astype(mx.float32)).mean(axis=3)
    top = mx.sort(mx.argsort(-score, axis=-1)[..., :k], axis=-1)
    return top.astype(mx.uint8 if blocks.shape[-1] <= 256 else mx.uint16)


@dataclass(frozen=True)
class PromotedChannels:
    """The codec: blocks of ``block`` tokens, ``fraction`` of the channels at ``hi_bits``."""

    lo_bits: int
    hi_bits: int
    group: int
    block: int
    fraction: float

    def __post_init__(self):
        if self.lo_bits not in SUPPORTED_BITS or not self.lo_bits < self.hi_bits <= 8:
            raise ValueError(f"lo_bits={self.lo_bits}, hi_bits={self.hi_bits}: allowed lo_bits "
                             f"in {SUPPORTED_BITS} and lo_bits < hi_bits <= 8")
        if self.block % self.group or self.block % 32:
            raise ValueError(f"block={self.block} must be a multiple of group={self.group} and of 32")

    @property
    def bits(self) -> int:
        """The uniform plane's width (what a per-channel layout of these keys is read at)."""
        return self.lo_bits

    @property
    def up_bits(self) -> int:
        return self.hi_bits - self.lo_bits

    def encode(self, x: mx.array):
        """(B, H, n*block, D) -> lo codes, scales, minima (the per-channel layout), up codes
        (B, H, n, k, block*up/32) and channel indices (B, H, n, k); every block on its own."""
        b, h, t, d = x.shape
        nb, k, lo = t // self.block, n_promoted(d, self.fraction), self.lo_bits
        index = top_channels(x.reshape(b, h, nb, self.block, d), k)
        promoted = mx.put_along_axis(mx.zeros((b, h, nb, d), mx.bool_), index.astype(mx.int32),
                                     mx.array(True), axis=-1)
        levels = mx.where(promoted, (1 << self.hi_bits) - 1, (1 << lo) - 1).astype(mx.float32)
        levels = mx.repeat(levels.swapaxes(-1, -2), self.block // self.group, axis=-1)[..., None]
        groups = x.swapaxes(-1, -2).reshape(b, h, d, t // self.group, self.group).astype(mx.float32)
        low, high = groups.min(axis=-1, keepdims=True), groups.max(axis=-1, keepdims=True)
        scale = mx.maximum((high - low) / levels, _MIN_SCALE).astype(x.dtype)  # as affine.quantize
        low = low.astype(x.dtype)
        codes = mx.round((groups - low.astype(mx.float32)) / scale.astype(mx.float32))
        codes = mx.clip(codes, 0, levels).astype(mx.uint32).reshape(b, h, d, t)
        lo_codes = pack_codes(codes & ((1 << lo) - 1), lo)
        up = None
        if k:
            per_block = codes.reshape(b, h, d, nb, self.block).transpose(0, 1, 3, 2, 4)
            up = mx.take_along_axis(per_block, index.astype(mx.int32)[..., None], axis=3) >> lo
            up = pack_codes(up, self.up_bits)
        return lo_codes, scale.squeeze(-1), low.squeeze(-1), up, index


@dataclass(frozen=True)
class PromotedScores:
    """Promoted-channel keys as the pure-MLX decode path reads them (``PackedScores``).

    ``lo``: the lo plane (whole buffers, ``count`` valid tokens); ``up``/``index``: the up
    plane's whole buffers (None when nothing is promoted)."""

    lo: AffineLayout
    up: mx.array | None
    index: mx.array | None
    block: int
    up_bits: int

    @property
    def count(self) -> int:
        return self.lo.count

    @property
    def n_heads(self) -> int:
        return self.lo.codes.shape[1]

    def up_values(self, index: mx.array | None = None) -> mx.array:
        """The valid blocks' up plane in float32: (B, H, blocks, k, block); ``index``: the
        valid blocks' channel indices as int32, if the caller has them."""
        nb, g = self.count // self.block, self.lo.group
        index = self.index[:, :, :nb].astype(mx.int32) if index is None else index
        scales, codes = self._up_scales(index), self.up[:, :, :nb]
        if self.up_bits in SUPPORTED_BITS:
            return dequantize(codes, scales, mx.zeros_like(scales), g, self.up_bits)
        return unpack_codes(codes, self.up_bits).astype(mx.float32) * mx.repeat(scales, g, axis=-1)

    def _up_scales(self, index: mx.array) -> mx.array:
        """The up plane's scales, float32 (B, H, blocks, k, block / group), for the valid
        blocks' channel indices ``index`` (int32)."""
        nb, g = index.shape[2], self.lo.group
        b, h, d, cap = self.lo.scales.shape  # scales of the promoted channels, from the lo plane
        offsets = mx.arange(nb)[:, None, None] * (self.block // g) + mx.arange(self.block // g)
        where = (index[..., None] * cap + offsets).reshape(b, h, -1)
        scales = mx.take_along_axis(self.lo.scales.reshape(b, h, d * cap), where, axis=-1)
        return scales.reshape(*index.shape, self.block // g).astype(mx.float32) * (1 << self.lo.bits)

    def scores(self, q: mx.array) -> mx.array:
        """float32 ``q Kᵀ`` (B, H, R, count): the lo plane's scores plus, per block, the
        promoted channels' queries against the up plane. Compiled per stored count (which
        changes once a block), over the whole buffers: a decode step's few dozen
        elementwise operations on the planes fuse into a handful."""
        lo = self.lo
        fn = _compiled_scores(lo.count, lo.bits, lo.group, self.block, self.up_bits, self.up is None)
        up, index = (q, q) if self.up is None else (self.up, self.index)
        return fn(q, lo.codes, lo.scales, lo.biases, up, index)

    def _scores(self, q: mx.array) -> mx.array:
        lo = self.lo
        s = kd.affine_key_scores(q, lo.codes, lo.scales, lo.biases, lo.count, lo.bits, lo.group)
        if self.up is None or not self.count:
            return s
        nb = self.count // self.block
        index = self.index[:, :, :nb].astype(mx.int32)
        q_up = mx.take_along_axis(q[:, :, None], index[:, :, :, None, :], axis=-1)  # (B, H, nb, R, k)
        if self.up_bits in SUPPORTED_BITS and kd._pure_path() == "qmm":
            # one product over the packed plane: dequantizing it first costs a step a few
            # dozen unpacking operations on the CPU
            scales = self._up_scales(index)
            s_up = mx.quantized_matmul(q_up, self.up[:, :, :nb], scales, mx.zeros_like(scales), transpose=False,
                                       group_size=self.lo.group, bits=self.up_bits)
        else:
            s_up = q_up @ self.up_values(index)
        s_up = s_up.transpose(0, 1, 3, 2, 4)  # (B, H, R, nb, block)
        return s + s_up.reshape(s.shape)


@functools.lru_cache(maxsize=16)
def _compiled_scores(count: int, bits: int, group: int, block: int, up_bits: int, no_up: bool):
    def scores(q, codes, scales, biases, up, index):
        lo = AffineLayout(codes, scales, biases, count, bits, group, "channel")
        view = PromotedScores(lo, None if no_up else up, None if no_up else index, block, up_bits)
        return view._scores(q)

    return mx.compile(scores)


class PromotedKeys:
    """A growing run of keys in ``PromotedChannels`` blocks (the ``PackedTokens`` interface)."""

    def __init__(self, codec: PromotedChannels, step_tokens: int = GROWTH_TOKENS):
        self.codec = codec
        step_blocks = max(1, step_tokens // codec.block)
        self.codes = GrowingArray(axis=-1, step=packed_length(step_tokens, codec.lo_bits))
        self.scales = GrowingArray(axis=-1, step=step_tokens // codec.group)
        self.biases = GrowingArray(axis=-1, step=step_tokens // codec.group)
        self.up = GrowingArray(axis=2, step=step_blocks)
        self.index = GrowingArray(axis=2, step=step_blocks)

    @property
    def count(self) -> int:
        return self.scales.length * self.codec.group

    def append(self, x: mx.array, decoding: bool = False) -> None:
        """Encode whole blocks ``x`` (B, H, n*block, D) after the keys already kept."""
        codes, scales, biases, up, index = self.codec.encode(x)
        self.codes.append(codes)
        self.scales.append(scales)
        self.biases.append(biases)
        if up is not None:
            self.up.append(up)
            self.index.append(index)

    def _view(self, empty: mx.array) -> PromotedScores:
        def whole(g: GrowingArray):
            return g.buffer if g.buffer is not None else empty

        c = self.codec
        lo = AffineLayout(whole(self.codes), whole(self.scales), whole(self.biases), self.count,
                          c.lo_bits, c.group, "channel")
        return PromotedScores(lo, self.up.buffer, self.index.buffer, c.block, c.up_bits)

    def layout(self, empty: mx.array):
        """What decode reads: the lo plane's ``AffineLayout`` when nothing is promoted and
        the shared readers take its width, else ``PromotedScores`` (whole buffers, no copy)."""
        view = self._view(empty)
        return view.lo if view.up is None and 32 % view.lo.bits == 0 else view

    def decode(self, dtype) -> mx.array | None:
        """The valid keys (B, H, count, D) in ``dtype`` (transient: prefill chunks and tests)."""
        if not self.count:
            return None
        c = self.codec
        keys = dequantize(self.codes.view(), self.scales.view(), self.biases.view(), c.group,
                          c.lo_bits, mx.float32)  # (B, H, D, count): the lo plane
        if self.up.buffer is not None:  # plus the up plane, scattered to its channels
            b, h, d, t = keys.shape
            index = self.index.view().astype(mx.int32)[..., None]
            dense = mx.zeros((b, h, t // c.block, d, c.block), mx.float32)
            dense = mx.put_along_axis(dense, index, self._view(None).up_values(), axis=3)
            keys = keys + dense.transpose(0, 1, 3, 2, 4).reshape(b, h, d, t)
        return keys.swapaxes(-1, -2).astype(dtype)

    def expected_shapes(self, head_dim: int):
        """The trailing two dims of the lo plane's codes and scales for ``count`` keys."""
        n = self.count
        return (head_dim, packed_length(n, self.codec.lo_bits)), (head_dim, n // self.codec.group)

    def plane_problems(self, head_dim: int):
        """(field, found, expected) where the up plane or the indices contradict the lo plane."""
        c, nb = self.codec, self.count // self.codec.block
        k = n_promoted(head_dim, c.fraction)
        want = (nb, k, packed_length(c.block, c.up_bits)) if k else None
        found = None if self.up.buffer is None else tuple(self.up.view().shape[2:])
        if found != want and (nb or found):
            yield "promoted-channel codes (blocks, channels, words)", found, want
        found = None if self.index.buffer is None else tuple(self.index.view().shape[2:])
        if found != (want and want[:2]) and (nb or found):
            yield "promoted-channel indices (blocks, channels)", found, want and want[:2]
        elif found and int(self.index.view().max()) >= head_dim:
            yield "promoted-channel index", int(self.index.view().max()), f"below head_dim {head_dim}"

    def arrays(self, prefix: str) -> dict[str, GrowingArray]:
        return {f"{prefix}_codes": self.codes, f"{prefix}_scales": self.scales,
                f"{prefix}_biases": self.biases, f"{prefix}_up": self.up, f"{prefix}_index": self.index}
