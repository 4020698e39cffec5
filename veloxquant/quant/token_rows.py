"""Per-token group-affine rows at any width and group: the codec, and how decode reads them.

Min-max quantization of each token in groups of ``group`` channels (along head_dim) at any
width 1-8 and any group that divides head_dim, ``quant/affine.py``'s arithmetic and code
order (one little-endian bit stream, ``mx.quantize``'s order), so MLX's routines read the
codes where MLX has them (widths 1-6 and 8, groups 32/64/128) and the same is done by hand
elsewhere (7 bits, other groups):

- ``quantize_rows``: codes, scales and minima (in the input's dtype), optionally with a
  clip ratio alpha per (batch row, KV head) that scales each group's minimum and maximum
  towards 0 (SKVQ's clipping, ``methods/skvq/clip.py``); without one, ``affine.quantize``'s codes
  bit for bit. ``dequantize_rows`` is its inverse;
- ``TokenGroups``: that codec in the ``GroupAffine`` interface, so ``PackedTokens`` stores it;
- ``TokenRows``: such rows as the pure-MLX decode path reads them (the ``PackedScores``
  protocol of ``kernels/decode.py``), as keys (``scores``) or values (``mix``), in one pass
  over the packed form: ``q Kᵀ`` one ``quantized_matmul`` (transpose=True: the rows are a
  quantized weight matrix) on the CPU, ``p V`` another; where MLX has no routine for the
  width or group, or no kernel for these shapes (a GPU), the valid rows are dequantized in
  float32 and multiplied. The fused kernels read keys per channel only, so per-token keys
  (SKVQ, ZipCache) always come here. With a per-channel scale ``c`` (ZipCache's
  channel-separable rows ``x / c``, ``methods/zipcache/channel_scaled.py``) the scale is folded into
  the query (``(q * c) K'ᵀ``) and the output (``(p V') * c``);
- ``PlainRows``: full-precision rows in the same protocol (values kept unquantized);
- ``row_scores`` / ``row_mix``: the same reads over valid rows a store has already cut
  (a store that reads several runs under one softmax: ZipCache's classes, SKVQ's sinks,
  packed rows and window), and ``ReadViews``, where such a store keeps those cuts between
  the flushes that change them.

Whole buffers with spare room are passed; only ``count`` rows are read.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import mlx.core as mx

from ..kernels import kivi_decode as kd
from .affine import SUPPORTED_BITS, dequantize, group_quantize, unpack_codes
from .packed import AffineLayout

WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8)
MLX_GROUPS = (32, 64, 128)  # the group sizes mx.dequantize / mx.quantized_matmul take


def packs(head_dim: int, bits: int) -> bool:
    """Whether rows of ``head_dim`` codes of ``bits`` bits fill whole uint32 words the
    way ``pack_codes`` lays them out."""
    return head_dim % (32 // bits) == 0 if 32 % bits == 0 else head_dim % 32 == 0


def _mlx_has(bits: int, group: int) -> bool:
    return bits in SUPPORTED_BITS and group in MLX_GROUPS


def quantize_rows(x: mx.array, group: int, bits: int, alpha: mx.array | None = None):
    """(B, H, T, D) rows -> codes (B, H, T, D*bits/32), scales and minima (B, H, T, D/group);
    ``alpha`` (B, H): the clip ratio of each (batch row, KV head), None for none."""
    if bits not in WIDTHS:
        raise ValueError(f"bits={bits} is not supported; allowed: {WIDTHS}")
    *lead, n = x.shape
    if n % group or not packs(n, bits):
        raise ValueError(f"{n} channels per row: need a multiple of group={group} that {bits}-bit codes pack")
    if alpha is not None:  # against the groups (..., G, 1)
        alpha = alpha.astype(mx.float32).reshape(*alpha.shape, *([1] * (len(lead) - alpha.ndim + 2)))
    return group_quantize(x, group, bits, alpha)


def dequantize_rows(codes, scales, minima, group: int, bits: int, dtype=None) -> mx.array:
    """Inverse of ``quantize_rows`` (any width and group), along the last axis; in the
    scales' dtype, or ``dtype`` (float32: not rounded to the scales' dtype on the way)."""
    if _mlx_has(bits, group):
        if dtype is not None and dtype == mx.float32:
            scales, minima = scales.astype(mx.float32), minima.astype(mx.float32)
        out = dequantize(codes, scales, minima, group, bits)
    else:
        q = unpack_codes(codes, bits).astype(mx.float32).reshape(*scales.shape, group)
        out = q * scales[..., None].astype(mx.float32) + minima[..., None].astype(mx.float32)
        out = out.reshape(*codes.shape[:-1], -1).astype(scales.dtype if dtype is None else dtype)
    return out if dtype is None else out.astype(dtype)


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
        return quantize_rows(x, self.group, self.bits)

    def encode_one(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """``encode`` of one token as one compiled graph (a decode step's host time)."""
        return compiled_quantizer(self.group, self.bits)(x)

    def decode(self, codes, scales, biases, dtype=None) -> mx.array:
        return dequantize_rows(codes, scales, biases, self.group, self.bits, dtype)


@functools.lru_cache(maxsize=None)
def compiled_quantizer(group: int, bits: int, clipped: bool = False):
    """``quantize_rows`` at (group, bits) as one compiled graph of (x) or, clipped, (x, alpha)."""
    if clipped:
        return mx.compile(lambda x, alpha: quantize_rows(x, group, bits, alpha))
    return mx.compile(lambda x: quantize_rows(x, group, bits))


@dataclass(frozen=True)
class TokenRows:
    """Per-token rows (``layout``: an ``AffineLayout`` of axis "token", whole buffers,
    ``count`` valid rows) of ``x / c``, ``channel`` c (B, H, D) float32 or None (plain rows)."""

    layout: AffineLayout
    channel: mx.array | None = None

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
        return _reads_by_qmm(self.layout)

    def rows(self) -> mx.array:
        """The valid rows ``x / c`` (B, H, count, D) in float32 (transient)."""
        x = self.layout
        return dequantize_rows(*self._valid(), x.group, x.bits, mx.float32)

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
            out = kd.token_mix(p, self.rows())
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
        return kd.token_mix(p, self.rows[:, :, : self.count].astype(mx.float32))


def _reads_by_qmm(codec) -> bool:
    return _mlx_has(codec.bits, codec.group) and kd._pure_path() == "qmm"


def row_scores(q: mx.array, rows, codec) -> mx.array:
    """float32 ``q Kᵀ`` (B, H, R, n) of float32 queries (B, H, R, D) over packed rows
    (the valid codes, scales and minima of a ``TokenGroups`` ``codec``)."""
    if _reads_by_qmm(codec):
        return mx.quantized_matmul(q, *rows, transpose=True, group_size=codec.group, bits=codec.bits)
    return q @ dequantize_rows(*rows, codec.group, codec.bits, mx.float32).swapaxes(-1, -2)


def mixed_into(out: mx.array | None, p: mx.array, values: mx.array) -> mx.array:
    """``out + p V`` (``p V`` where ``out`` is None) for float32 rows ``values`` (B, H, n, D):
    one ``addmm`` where ``token_mix`` would be one product (it cuts long runs on CUDA)."""
    if out is None:
        return kd.token_mix(p, values)
    if p.shape[-1] < 2 * kd.SPLIT_TOKENS or not kd._splits_tokens():
        return mx.addmm(out, p, values)
    return out + kd.token_mix(p, values)


def row_mix(out: mx.array | None, p: mx.array, rows, codec) -> mx.array:
    """``out +`` float32 ``p V`` (B, H, R, D) of weights (B, H, R, n) over packed rows (as
    ``row_scores``), or over full-precision rows (an array)."""
    if isinstance(rows, mx.array):
        return mixed_into(out, p, rows.astype(mx.float32))
    if _reads_by_qmm(codec):
        o = mx.quantized_matmul(p, *rows, transpose=False, group_size=codec.group, bits=codec.bits)
        return o if out is None else out + o
    return mixed_into(out, p, dequantize_rows(*rows, codec.group, codec.bits, mx.float32))


def _same(a, b) -> bool:
    return a is not None and len(a) == len(b) and all(
        x is y or (type(x) in (int, float, str) and type(y) is type(x) and x == y) for x, y in zip(a, b))


def held(owner, name: str, kind):
    """``owner``'s ``name`` (a ``ReadViews`` or ``KeptRead``), made at its first use: a store
    made without ``__init__`` (a stacked batch's join) or before it kept one has none yet."""
    kept = getattr(owner, name, None)
    if kept is None:
        kept = kind()
        setattr(owner, name, kept)
    return kept


class KeptRead:
    """What a store's decode read keeps between writes (a compiled pass with its inputs, a
    launch plan), checked by its owner at each read and dropped before each write: a copy of
    the store starts without it (it holds this store's buffers and views of them), and
    ``cache/stacked.py`` does not walk it (no ``__dict__``)."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = None

    def __deepcopy__(self, memo):
        return KeptRead()


class ReadViews:
    """What a decode step reads of a store, in the layout it reads it (slices, reshapes
    and broadcasts of the stored arrays: views, no bytes of their own, never saved),
    built when what they are made from changes (a flush, a prefill chunk, a fit, a
    restore) and kept until then, so that a step slices nothing of the history. ``key``:
    the arrays they view (compared by identity), the counts and settings (numbers, by
    value; a dtype as its name); ``clear`` before a write
    in place into a viewed buffer. A copy of the store starts without them, and they
    answer only the store that built them (a stacked batch's join shares attributes it
    does not know)."""

    __slots__ = ("owner", "key", "value")

    def __init__(self):
        self.owner = self.key = self.value = None

    def __deepcopy__(self, memo):
        return ReadViews()

    def get(self, owner, key: tuple, build):
        if self.owner is None or self.owner() is not owner or not _same(self.key, key):
            self.owner, self.key, self.value = weakref.ref(owner), None, None
            self.value = build()
            self.key = key
        return self.value

    def clear(self) -> None:
        self.key = self.value = None
