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
(the fused kernel would need an extra score term per promoted channel). On CUDA a decode
step instead decodes the keys (``PromotedKeys.room_rows``: each promoted channel's two
planes joined into its hi-bit code, one affine step) for one fused attention
(``cache.KittyStore``). Without promoted channels the store hands the lo plane's
``AffineLayout`` itself, which the fused kernel serves at 2, 4 and 8 bits.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import mlx.core as mx

from ...cache.buffers import GrowingArray
from ...kernels import kivi_decode as kd
from ...quant.affine import _MIN_SCALE, SUPPORTED_BITS, dequantize, pack_codes, packed_length, unpack_codes
from ...quant.packed import GROWTH_TOKENS, AffineLayout
from ...quant.token_rows import KeptRead, held


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

    def _up_scales(self, index: mx.array, scales: mx.array) -> mx.array:
        """The up plane's scales, float32 (B, H, blocks, k, block / group): the lo plane's
        ``scales`` (B, H, D, blocks * block / group) of the channels ``index`` (B, H, blocks,
        k) promoted in each block, times ``2**lo_bits``. One gather over the scales viewed as
        (B, H, blocks, D, groups of a block)."""
        b, h, nb, _ = index.shape
        d, per_block = scales.shape[2], self.block // self.lo.group
        scales = scales[..., : nb * per_block]  # the buffer itself in a decode read
        by_block = scales.reshape(b, h, d, nb, per_block).swapaxes(2, 3)
        up = mx.take_along_axis(by_block, index[..., None], axis=3)
        return up.astype(mx.float32) * (1 << self.lo.bits)

    @property
    def capacity(self) -> int:
        """Tokens every buffer of the planes has room for (whole blocks): what the decode
        read computes over, so that its compiled pass is traced again only when the buffers
        grow (once per ``step_tokens``), not at every flushed block; what lies past ``count``
        is zeros (or finite rows of a restored state) and is cut off after the product."""
        lo = self.lo
        rooms = [lo.codes.shape[-1] * 32 // lo.bits, lo.scales.shape[-1] * lo.group, lo.biases.shape[-1] * lo.group]
        if self.up is not None:
            rooms += [self.up.shape[2] * self.block, self.index.shape[2] * self.block]
        return min(rooms) // self.block * self.block

    def scores(self, q: mx.array) -> mx.array:
        """float32 ``q Kᵀ`` (B, H, R, count): the lo plane's scores plus, per block, the
        promoted channels' queries against the up plane. One compiled pass over the whole
        buffers (``capacity`` tokens: every slice below is the buffer itself unless a
        restored state's buffers differ in room), then cut to ``count``: a decode step's
        elementwise operations on the planes fuse into a handful, and the buffers are read
        in place, not sliced to the count at every step."""
        fn, args, cut = self.score_pass()
        s = fn(q, *args)
        return s if cut is None else s[..., :cut]

    def score_pass(self) -> tuple:
        """(``scores``' compiled pass, its inputs after the queries, the count where the
        scores are cut to it from the room, else None): what ``PromotedKeys.step_read``
        keeps between writes."""
        lo, cap = self.lo, self.capacity
        words, groups = cap * lo.bits // 32, cap // lo.group
        args = [_cut(lo.codes, -1, words), _cut(lo.scales, -1, groups), _cut(lo.biases, -1, groups)]
        if self.up is not None:
            nb = cap // self.block
            args += [_cut(self.up, 2, nb), _cut(self.index, 2, nb),
                     _zeros((*self.up.shape[:2], nb, self.index.shape[-1], self.block // lo.group))]
        fn = _compiled_scores(lo.bits, lo.group, self.block, self.up_bits, self.up is None)
        return fn, tuple(args), (None if cap == self.count else self.count)

    def _scores(self, q: mx.array, zeros: mx.array | None) -> mx.array:
        """The scores over every token of the buffers (``lo.count`` is their capacity)."""
        lo = self.lo
        s = kd.affine_key_scores(q, lo.codes, lo.scales, lo.biases, lo.count, lo.bits, lo.group)
        if self.up is None:
            return s
        scales = self._up_scales(self.index, lo.scales)  # (B, H, nb, k, block / group)
        q_up = mx.take_along_axis(q[:, :, None], self.index[:, :, :, None, :], axis=-1)  # (B, H, nb, R, k)
        if self.up_bits in SUPPORTED_BITS and kd._pure_path() == "qmm":
            # one product over the packed plane: dequantizing it first costs a step a few
            # dozen unpacking operations on the CPU
            s_up = mx.quantized_matmul(q_up, self.up, scales, zeros, transpose=False,
                                       group_size=lo.group, bits=self.up_bits)
        else:
            s_up = q_up @ _up_plane(self.up, scales, lo.group, self.up_bits, zeros)
        s_up = s_up.transpose(0, 1, 3, 2, 4)  # (B, H, R, nb, block)
        return s + s_up.reshape(s.shape)


def _up_plane(codes: mx.array, scales: mx.array, group: int, up_bits: int, zeros: mx.array | None = None):
    """The up plane ``codes`` (B, H, nb, k, words) in float32 at ``scales`` (minimum 0)."""
    if up_bits in SUPPORTED_BITS:
        return dequantize(codes, scales, mx.zeros_like(scales) if zeros is None else zeros, group, up_bits)
    return unpack_codes(codes, up_bits).astype(mx.float32) * mx.repeat(scales, group, axis=-1)


def _cut(x: mx.array, axis: int, n: int) -> mx.array:
    """``x`` cut to ``n`` entries along ``axis`` (2 or -1); ``x`` itself, with no call into
    MLX, where it has them (a decode read: the buffers' room)."""
    if x.shape[axis] == n:
        return x
    return x[..., :n] if axis == -1 else x[:, :, :n]


@functools.lru_cache(maxsize=8)
def _zeros(shape: tuple) -> mx.array:
    """float32 zeros (the up plane's minima), built once per shape (it changes when the
    buffers grow) and evaluated with the step that first reads them: a node less a layer
    and step than ``zeros_like``."""
    return mx.zeros(shape, mx.float32)


@functools.lru_cache(maxsize=16)
def _compiled_scores(bits: int, group: int, block: int, up_bits: int, no_up: bool):
    def scores(q, codes, scales, biases, up=None, index=None, zeros=None):
        count = scales.shape[-1] * group
        lo = AffineLayout(codes, scales, biases, count, bits, group, "channel")
        return PromotedScores(lo, up, index, block, up_bits)._scores(q, zeros)

    return mx.compile(scores)


def _word_view(words: mx.array, bits: int) -> mx.array:
    """Packed words (..., W) as ``_unpacked`` reads them: (..., W, 1) where a word holds
    whole codes (one shift per code over the broadcast word), else as they are."""
    return words[..., None] if 32 % bits == 0 else words


@functools.lru_cache(maxsize=None)
def _shifts(bits: int) -> mx.array:
    """(32 / bits,) uint32: each code's shift within its word."""
    return mx.arange(32 // bits, dtype=mx.uint32) * bits


def _unpacked(words: mx.array, bits: int, shifts: mx.array | None) -> mx.array:
    """``affine.unpack_codes`` of ``_word_view``'s words (..., W[, 1]): (..., W * 32 / bits)
    uint8 (codes of at most 8 bits: a quarter of uint32's bytes for the rows in between)."""
    if shifts is None:
        return unpack_codes(words, bits).astype(mx.uint8)
    codes = ((words >> shifts) & ((1 << bits) - 1)).astype(mx.uint8)
    return codes.reshape(*codes.shape[:-2], -1)


@dataclass(frozen=True)
class RoomInputs:
    """``_compiled_rows``' inputs (``arrays``, views of the planes' buffers over their room)
    and which of them are packed words (``words``: what a decode read gates on its queries)."""

    arrays: tuple
    words: tuple[int, ...]


def _room_inputs(view: "PromotedScores", codec: PromotedChannels) -> RoomInputs:
    """The lo plane's words by block, (B, H, blocks, D, words a block[, 1]) (channels and
    blocks swapped: a view), scales and minima likewise (B, H, blocks, D, groups a block, 1),
    the words' shifts where a word holds whole codes; where channels are promoted, then the
    up plane's words (B, H, blocks, k, words a block[, 1]), the promoted channels (B, H,
    blocks, k, 1) and the up plane's shifts likewise."""
    lo, cap, block = view.lo, view.capacity, codec.block
    nb = cap // block
    b, h, d = lo.scales.shape[:3]

    def by_block(x, per_block):
        return x.reshape(b, h, d, nb, per_block).swapaxes(2, 3)

    words = _word_view(by_block(_cut(lo.codes, -1, cap * lo.bits // 32), block * lo.bits // 32), lo.bits)
    arrays = [words, *(by_block(_cut(x, -1, cap // lo.group), block // lo.group)[..., None]
                       for x in (lo.scales, lo.biases))]
    arrays += [_shifts(lo.bits)] if 32 % lo.bits == 0 else []
    if view.up is None:
        return RoomInputs(tuple(arrays), (0,))
    gated = (0, len(arrays))
    arrays += [_word_view(_cut(view.up, 2, nb), codec.up_bits), _cut(view.index, 2, nb)[..., None]]
    arrays += [_shifts(codec.up_bits)] if 32 % codec.up_bits == 0 else []
    return RoomInputs(tuple(arrays), gated)


@functools.lru_cache(maxsize=32)
def _compiled_rows(lo_bits: int, up_bits: int, group: int, block: int, dtype, promoted: bool):
    """``PromotedKeys.room_rows``' pass over ``_room_inputs``: every channel's code at its
    own width (a promoted channel's ``low + 2**lo * up``, the hi-bit code), then ``scale *
    code + minimum`` in float32, rounded once to ``dtype`` (a promoted channel's two planes
    are one code, not two dequantized terms each rounded): keys (B, H, room, D)."""
    lo_aligned, up_aligned = 32 % lo_bits == 0, 32 % up_bits == 0

    def rows(*arrays):
        words, scales, biases, *rest = arrays
        codes = _unpacked(words, lo_bits, rest.pop(0) if lo_aligned else None)  # (B, H, blocks, D, block)
        if promoted:
            up, index, *rest = rest
            upper = _unpacked(up, up_bits, rest[0] if up_aligned else None) << lo_bits  # (B, H, blocks, k, block)
            codes = mx.put_along_axis(codes, index, mx.take_along_axis(codes, index, axis=3) | upper, axis=3)
        b, h, nb, d, _ = codes.shape
        x = codes.reshape(b, h, nb, d, block // group, group).astype(mx.float32)
        x = x * scales.astype(mx.float32) + biases.astype(mx.float32)
        return x.astype(dtype).reshape(b, h, nb, d, block).swapaxes(3, 4).reshape(b, h, nb * block, d)

    return mx.compile(rows)


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
        self._read = KeptRead()  # a decode step's compiled pass and inputs (``step_read``)

    @property
    def count(self) -> int:
        return self.scales.length * self.codec.group

    def append(self, x: mx.array, decoding: bool = False) -> None:
        """Encode whole blocks ``x`` (B, H, n*block, D) after the keys already kept."""
        self._read_holder().value = None  # the kept reads hold the buffers written in place below
        self._rows_holder().value = None
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

    def _read_holder(self) -> "KeptRead":
        return held(self, "_read", KeptRead)

    def step_read(self):
        """``PromotedScores.score_pass`` of the kept keys where ``layout`` is a
        ``PromotedScores`` with promoted channels (None otherwise, or with no keys), built at
        the first read after a write and kept while the buffers (by identity) and the count
        stay: a decode step calls the pass alone (``cache.KittyStore``)."""
        count = self.count
        buffers = (self.codes.buffer, self.scales.buffer, self.biases.buffer, self.up.buffer, self.index.buffer)
        holder = self._read_holder()
        kept = holder.value
        if kept is not None and kept[0] == count and all(map(operator.is_, buffers, kept[1])):
            return kept[2]
        out = None
        if count and self.up.buffer is not None:
            out = self._view(None).score_pass()
        holder.value = (count, buffers, out)
        return out

    def decode(self, dtype) -> mx.array | None:
        """The valid keys (B, H, count, D) in ``dtype`` (transient: prefill chunks and tests)."""
        if not self.count:
            return None
        return self.room_rows(dtype)[:, :, : self.count]

    def room_rows(self, dtype, inputs: "RoomInputs | None" = None) -> mx.array:
        """The keys over the buffers' room (``PromotedScores.capacity`` tokens; past
        ``count``, rows of the buffers' spare room, to be cut off), (B, H, room, D) in
        ``dtype``, in one compiled pass whose shapes change only when the buffers grow.
        ``inputs``: ``room_inputs()`` as the caller holds them (a decode read gates the codes
        on its queries), else built from the buffers now."""
        c = self.codec
        arrays = (_room_inputs(self._view(None), c) if inputs is None else inputs).arrays
        return _compiled_rows(c.lo_bits, c.up_bits, c.group, c.block, dtype, self.up.buffer is not None)(*arrays)

    def kernel_inputs(self) -> tuple:
        """What ``kernel.key_rows`` reads: the whole buffers (lo codes, scales, minima, up
        codes, channel indices; the last two None where no channel is promoted)."""
        return self.codes.buffer, self.scales.buffer, self.biases.buffer, self.up.buffer, self.index.buffer

    def room_inputs(self) -> "RoomInputs":
        """``room_rows``' inputs, views of the buffers in the pass's layouts, kept while the
        buffers (by identity) and the count stay (the CUDA read, ``cache.KittyStore``):
        a step slices and reshapes nothing."""
        count = self.count
        buffers = (self.codes.buffer, self.scales.buffer, self.biases.buffer, self.up.buffer, self.index.buffer)
        holder = self._rows_holder()
        kept = holder.value
        if kept is None or kept[0] != count or not all(map(operator.is_, buffers, kept[1])):
            kept = holder.value = (count, buffers, _room_inputs(self._view(None), self.codec))
        return kept[2]

    def _rows_holder(self) -> "KeptRead":
        return held(self, "_rows_read", KeptRead)

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
