"""Symmetric group quantization, and runs of tokens coded as deltas from an anchor token.

``quantize_symmetric``: per token, per group of ``group`` channels, ``s = max|g| / qmax``
with ``qmax = 2**(bits-1) - 1``, ``q = clip(round(g / s), -qmax, qmax)``; codes are kept
offset by ``qmax`` (``[0, 2 qmax]``, ``2**bits - 1`` symbols) and ``s`` in float16,
rounded before the codes are computed against it, so ``|x - x_hat| <= s / 2`` (the clip
can only take off the float16 rounding of the group's largest element). Zero-centred
data (deltas) is what the symmetric grid suits.

``AnchoredTokens`` keeps a growing run of tokens in whole anchor groups of ``group``
consecutive tokens (CacheGen): token 0 of a group is the anchor, quantized at
``ANCHOR_BITS``; every token of the group is then ``bits``-bit coded as its delta from the
**reconstructed** anchor (the anchor's own delta is zero), so errors do not drift along
the group. The deltas of a group share one step per channel group, the anchor's range
at ``bits`` bits (``max|anchor| / qmax``), widened only where a delta of the group is
larger (no clipping): on smooth data the deltas are small against that step and their
symbols crowd around zero, which is what lowers their entropy. A step per token would
spread every token's deltas over the whole grid again. With ``use_delta=False`` every
token is coded directly, with its own scales. What is kept: codes packed at ``bits`` per
symbol (uint32 words), float16 scales (one per token per channel group; with deltas one
per anchor group per channel group), and the anchors' 8-bit codes and scales. Attention reads ``AnchoredScores`` (the ``PackedScores`` protocol of
``kernels/decode.py``): the packed codes as they are, one group-affine product for the
deltas and one for the anchors (keys and values alike), never a decoded copy of the run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import mlx.core as mx

from ...cache.buffers import GrowingArray
from ...kernels.compiled import PerShape
from ...kernels import kivi_decode as kd
from ...quant.affine import dequantize, pack_codes, unpack_codes
from ...quant.chunk_store import ChunkedStore
from ...quant.store import joined_history
from ...quant.token_rows import ReadViews, mixed_into

ANCHOR_BITS = 8
_MIN_SCALE = 2.0**-20  # an all-zero group: codes at zero, reconstructed exactly


def qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def quantize_symmetric(x: mx.array, bits: int, group: int) -> tuple[mx.array, mx.array]:
    """(..., D) -> codes (..., D) uint32 in [0, 2 qmax], float16 scales (..., D / group)."""
    m = qmax(bits)
    g = x.astype(mx.float32).reshape(*x.shape[:-1], x.shape[-1] // group, group)
    s = mx.maximum(mx.abs(g).max(axis=-1, keepdims=True) / m, _MIN_SCALE).astype(mx.float16)
    q = mx.clip(mx.round(g / s.astype(mx.float32)), -m, m) + m
    return q.reshape(x.shape).astype(mx.uint32), s.squeeze(-1)


def quantize_deltas(deltas: mx.array, anchor_scales: mx.array, bits: int, group: int):
    """Deltas (B, H, n_groups, G tokens, D) -> codes (B, H, n_groups * G, D) uint32 in
    [0, 2 qmax] and one float16 step per anchor group per channel group (B, H, n_groups,
    D / group): the anchor's range at ``bits`` bits, or the deltas' if larger."""
    m = qmax(bits)
    b, h, n_groups, g_tokens, d = deltas.shape
    g = deltas.reshape(b, h, n_groups, g_tokens, d // group, group)
    anchor_range = anchor_scales.astype(mx.float32) * qmax(ANCHOR_BITS)
    delta_range = mx.abs(g).max(axis=(3, 5))
    s = mx.maximum(mx.maximum(anchor_range, delta_range) / m, _MIN_SCALE).astype(mx.float16)
    q = mx.clip(mx.round(g / s.astype(mx.float32)[:, :, :, None, :, None]), -m, m) + m
    return q.reshape(b, h, n_groups * g_tokens, d).astype(mx.uint32), s


def dequantize_symmetric(codes: mx.array, scales: mx.array, bits: int) -> mx.array:
    """float32 (..., D) from codes (..., D) and scales (..., D / group)."""
    d, n_groups = codes.shape[-1], scales.shape[-1]
    q = codes.astype(mx.float32) - qmax(bits)
    g = q.reshape(*codes.shape[:-1], n_groups, d // n_groups) * scales.astype(mx.float32)[..., None]
    return g.reshape(codes.shape)


@dataclass(frozen=True)
class AnchoredCodec:
    bits: int  # bits per delta (or direct) symbol
    group: int  # channels per scale, and tokens per anchor group
    use_delta: bool


def encode_anchored(c: AnchoredCodec, x: mx.array):
    """``AnchoredTokens.encode`` at codec ``c``."""
    if not c.use_delta:
        return (*quantize_symmetric(x, c.bits, c.group), None, None)
    b, h, n, d = x.shape
    groups = x.astype(mx.float32).reshape(b, h, n // c.group, c.group, d)
    a_codes, a_scales = quantize_symmetric(groups[:, :, :, 0], ANCHOR_BITS, c.group)
    anchor = dequantize_symmetric(a_codes, a_scales, ANCHOR_BITS)[:, :, :, None]
    first = mx.array([[i == 0] for i in range(c.group)])  # the anchor's own delta is zero (a constant: no kernel)
    deltas = mx.where(first, 0.0, groups - anchor)
    return (*quantize_deltas(deltas, a_scales, c.bits, c.group), a_codes, a_scales)


@functools.lru_cache(maxsize=None)
def _compiled_encoder(codec: AnchoredCodec):
    """``encode_anchored`` at ``codec`` as one compiled graph (its arrays only: no anchors
    without delta coding)."""
    return mx.compile(lambda x: tuple(a for a in encode_anchored(codec, x) if a is not None))


@functools.lru_cache(maxsize=None)
def _chunk_encoder(codec: AnchoredCodec):
    """``encode_anchored`` at ``codec`` with its codes packed, compiled for each prompt
    chunk's shape (``kernels/compiled.py``)."""
    def encode(x):
        codes, scales, anchor_codes, anchor_scales = encode_anchored(codec, x)
        return (pack_codes(codes, codec.bits), scales,
                None if anchor_codes is None else pack_codes(anchor_codes, ANCHOR_BITS), anchor_scales)

    return PerShape(encode)


@functools.lru_cache(maxsize=None)
def _chunk_decoder(codec: AnchoredCodec, dtype):
    """``reconstruct`` at ``codec`` in ``dtype``, compiled for each shape (``kernels/compiled.py``)."""
    return PerShape(lambda *runs: reconstruct(codec, *runs).astype(dtype))


class AnchoredTokens:
    """A growing run of whole anchor groups in one ``AnchoredCodec`` (the interface of
    ``PackedTokens``: count, append, decode, layout, arrays, expected_shapes)."""

    def __init__(self, codec: AnchoredCodec, step_tokens: int):
        self.codec = codec
        anchor_step = max(1, step_tokens // codec.group)
        self.codes = GrowingArray(axis=2, step=step_tokens)
        self.scales = GrowingArray(axis=2, step=anchor_step if codec.use_delta else step_tokens)
        self.anchor_codes = GrowingArray(axis=2, step=anchor_step) if codec.use_delta else None
        self.anchor_scales = GrowingArray(axis=2, step=anchor_step) if codec.use_delta else None
        self._views = ReadViews()  # what ``rebuilt`` reads, kept between flushes (``_read_views``)
        self._scores = ReadViews()  # ``layout``'s AnchoredScores (views), kept likewise

    @property
    def count(self) -> int:
        return self.codes.length

    def encode(self, x: mx.array):
        """(B, H, n, D), n a multiple of the group -> (codes, scales, anchor codes, anchor
        scales), codes unpacked; anchors None without delta coding."""
        return encode_anchored(self.codec, x)

    def append(self, x: mx.array, decoding: bool = False) -> None:
        """``decoding``: a decode step's chunk (its shape recurs): the compiled encoder; a
        prompt chunk: encoded and packed in one pass compiled for its shape."""
        if not decoding:
            return self.put(*_chunk_encoder(self.codec)(x), packed=True)
        parts = _compiled_encoder(self.codec)(x)
        self.put(*parts, *(None,) * (4 - len(parts)))

    def put(self, codes, scales, anchor_codes=None, anchor_scales=None, exact=False, packed=False) -> None:
        """Keep computed (unpacked) codes after the tokens already kept; ``exact``: replace
        what is kept by them, exactly sized (a restored state); ``packed``: the codes and
        anchor codes come packed already (a resident state)."""
        self._views.clear()  # no view pins a buffer the appends below write in place
        self._scores.clear()
        keep = (lambda g, x: g.reset(x)) if exact else (lambda g, x: g.append(x))
        pack = (lambda x, bits: x) if packed else pack_codes
        keep(self.codes, pack(codes, self.codec.bits))
        keep(self.scales, scales)
        if self.codec.use_delta:
            keep(self.anchor_codes, pack(anchor_codes, ANCHOR_BITS))
            keep(self.anchor_scales, anchor_scales)

    def unpacked(self):
        """(codes, scales, anchor codes, anchor scales) of the whole run, codes unpacked."""
        c = self.codec
        codes = unpack_codes(self.codes.view(), c.bits)
        if not c.use_delta:
            return codes, self.scales.view(), None, None
        return codes, self.scales.view(), unpack_codes(self.anchor_codes.view(), ANCHOR_BITS), self.anchor_scales.view()

    def dense(self) -> mx.array | None:
        """Every kept token reconstructed, float32 (B, H, count, D)."""
        if not self.count:
            return None
        return reconstruct(self.codec, self.codes.view(), self.scales.view(),
                           *((self.anchor_codes.view(), self.anchor_scales.view()) if self.codec.use_delta else ()))

    def decode(self, dtype) -> mx.array | None:
        """``dense`` in ``dtype`` (a prompt chunk's history), one pass compiled for its shape."""
        if not self.count:
            return None
        runs = (self.codes, self.scales) + ((self.anchor_codes, self.anchor_scales) if self.codec.use_delta else ())
        return _chunk_decoder(self.codec, dtype)(*(g.view() for g in runs))

    @property
    def rebuilds(self) -> bool:
        """Whether ``rebuilt`` reads the run: tokens held, each channel group's codes in
        whole words (deltas and anchors)."""
        c = self.codec
        return self.count > 0 and c.group * c.bits % 32 == 0 and c.group * ANCHOR_BITS % 32 == 0

    def _read_views(self) -> tuple:
        """What ``rebuilt`` reads, as views kept until a write changes what they view (a
        flush, a restore): the valid codes split into (anchor groups, their tokens, channel
        groups, the group's words) and the scales shaped to broadcast over them, the anchors
        likewise, and the unit affine maps (scale 1, bias ``-qmax``: broadcast scalars)."""
        c, n = self.codec, self.count
        runs = (self.codes, self.scales) + ((self.anchor_codes, self.anchor_scales) if c.use_delta else ())
        key = tuple(g.buffer for g in runs) + (n,)

        def build():
            b, h, _, words = self.codes.buffer.shape
            groups = words * 32 // c.bits // c.group
            tokens = c.group if c.use_delta else 1
            rows = n // tokens
            views = (self.codes.buffer[:, :, :n].reshape(b, h, rows, tokens, groups, -1),
                     self.scales.buffer[:, :, :rows].reshape(b, h, rows, 1, groups, 1),
                     *_unit_affine((b, h, rows, tokens, groups, 1), c.bits))
            if c.use_delta:
                views += (self.anchor_codes.buffer[:, :, :rows].reshape(b, h, rows, 1, groups, -1),
                          self.anchor_scales.buffer[:, :, :rows].reshape(b, h, rows, 1, groups, 1),
                          *_unit_affine((b, h, rows, 1, groups, 1), ANCHOR_BITS))
            return views

        return self._views.get(self, key, build)

    def rebuilt(self, dtype=mx.float32, after: mx.array | None = None) -> mx.array:
        """The run reconstructed (B, H, count, D) in ``dtype``, as a decode step on a GPU
        reads it: the codes unpacked at unit scale (``code - qmax``: exact), then one fused
        ``delta s + anchor s_a`` over every token in float32, rounded once to ``dtype`` (the
        anchors broadcast over their group's tokens, the steps over their channel groups: no
        per-token copy of a scale). ``after``: the codes are unpacked no earlier than it (a
        decode read's queries: ``PackedStore.history_after``)."""
        c, v = self.codec, self._read_views()
        codes = (v[0], v[4]) if c.use_delta else (v[0],)
        if after is not None:
            codes = mx.depends(list(codes), [after])
        x = dequantize(codes[0], v[2], v[3], c.group, c.bits)  # (B, H, rows, tokens, groups, group)
        if c.use_delta:
            x = _anchored(dtype)(x, v[1], dequantize(codes[1], v[6], v[7], c.group, ANCHOR_BITS), v[5])
        else:
            x = _stepped(dtype)(x, v[1])
        return x.reshape(*x.shape[:2], self.count, -1)

    def layout(self, empty: mx.array) -> "AnchoredScores":
        """The run as the parts' path reads it: views of the valid rows, built when a write
        changes them (kept in ``_scores`` until then: a steady step slices nothing)."""
        runs = (self.codes, self.scales) + ((self.anchor_codes, self.anchor_scales) if self.codec.use_delta else ())
        return self._scores.get(self, tuple(g.buffer for g in runs) + (self.count,),
                                lambda: AnchoredScores(self.codec, self.count, tuple(g.view() for g in runs)))

    def expected_shapes(self, head_dim: int):
        c, n = self.codec, self.count
        return (n, head_dim * c.bits // 32), (n // c.group if c.use_delta else n, head_dim // c.group)

    def problems(self, head_dim: int):
        if self.codec.use_delta and self.anchor_codes.length * self.codec.group != self.count:
            yield "anchors", self.anchor_codes.length, f"one per {self.codec.group} of the {self.count} tokens"

    def arrays(self, prefix: str) -> dict:
        out = {f"{prefix}_codes": self.codes, f"{prefix}_scales": self.scales}
        if self.codec.use_delta:
            out.update({f"{prefix}_anchor_codes": self.anchor_codes, f"{prefix}_anchor_scales": self.anchor_scales})
        return out


@functools.lru_cache(maxsize=None)
def _unit(value: float) -> mx.array:
    return mx.array(value, mx.float32)


def _unit_affine(shape: tuple, bits: int) -> tuple[mx.array, mx.array]:
    """Scale 1 and bias ``-qmax`` broadcast to ``shape`` (views of two scalars): ``mx.dequantize``
    then gives ``code - qmax``."""
    return mx.broadcast_to(_unit(1.0), shape), mx.broadcast_to(_unit(-qmax(bits)), shape)


# one fused elementwise pass each (shapeless: traced once a dtype, whatever the run's length)
@functools.lru_cache(maxsize=None)
def _anchored(dtype):
    return mx.compile(lambda d, s, a, s_a: (d * s.astype(mx.float32) + a * s_a.astype(mx.float32)).astype(dtype),
                      shapeless=True)


@functools.lru_cache(maxsize=None)
def _stepped(dtype):
    return mx.compile(lambda d, s: (d * s.astype(mx.float32)).astype(dtype), shapeless=True)


_scaled = mx.compile(lambda q, scale: q.astype(mx.float32) * scale, shapeless=True)


class AnchoredStore(ChunkedStore):
    """``ChunkedStore`` whose decode step, where MLX reads no packed codes in place (a GPU:
    ``kivi_decode._pure_path()``), attends over the runs rebuilt (``AnchoredTokens.rebuilt``)
    and the buffer's rows under one softmax: what the joint path of ``kernels/decode.py``
    computes over ``AnchoredScores``, in fewer operations (a tiny llama's steady step: 67
    graph nodes a layer, 95 through the joint path; the full cache's 48). On CUDA the runs
    are rebuilt in the queries' dtype for one fused attention instead. The CPU's read
    (``quantized_matmul`` over the packed codes) is the parts' path, as before."""

    def decode_attention(self, queries, keys, values, *, scale, use_kernel) -> mx.array:
        self.commit(keys, values)
        runs = (self.keys, self.values)
        if (kd._pure_path() == "qmm" or not self.quantize_values or self.values.count != self.keys.count
                or not all(r.rebuilds for r in runs)):
            return self.attend_parts(queries, scale=scale, use_kernel=use_kernel, n_kv_heads=keys.shape[1])
        if use_kernel and kd.gpu_backend() == "cuda":
            # the float32 products below are what cuBLAS serves badly at decode shapes; the
            # runs rebuilt in the queries' dtype and one fused attention take less on CUDA
            # (kitty's and skvq's reads, benchmarks/results/h200_s66)
            dtype = queries.dtype
            k, v = joined_history([self.keys.rebuilt(dtype, queries)], [self.values.rebuilt(dtype, queries)],
                                  self.k_buf.view(), self.v_buf.view(), dtype)
            return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale)
        return rebuilt_attention(queries, self.keys.rebuilt(), self.values.rebuilt(), self.k_buf.view(),
                                 self.v_buf.view(), scale)


def rebuilt_attention(queries, k, v, k_tail, v_tail, scale) -> mx.array:
    """One query token over float32 rows ``k``, ``v`` (B, H, n, D) and the full-precision
    tails (None, or (B, H, t, D)), under one softmax: (B, Hq, 1, D) in the query dtype."""
    b, hq, _, d = queries.shape
    h = k.shape[1]
    q = _scaled(queries, _unit(float(scale))).reshape(b, h, hq // h, d)
    s = q @ k.swapaxes(-1, -2)
    if k_tail is None:
        o = kd.token_mix(mx.softmax(s, axis=-1), v)
    else:
        s = mx.concatenate([s, q @ k_tail.astype(mx.float32).swapaxes(-1, -2)], axis=-1)
        p, p_tail = mx.split(mx.softmax(s, axis=-1), [k.shape[2]], axis=-1)
        o = mixed_into(kd.token_mix(p, v), p_tail, v_tail.astype(mx.float32))
    return o.reshape(b, hq, 1, v.shape[-1]).astype(queries.dtype)


def reconstruct(codec: AnchoredCodec, codes, scales, anchor_codes=None, anchor_scales=None) -> mx.array:
    """float32 (B, H, n, D) from packed codes (and anchors)."""
    codes = unpack_codes(codes, codec.bits)
    if anchor_codes is None:
        return dequantize_symmetric(codes, scales, codec.bits)
    b, h, n, d = codes.shape
    by_group = codes.reshape(b, h, n // codec.group, codec.group, d)
    x = dequantize_symmetric(by_group, scales[:, :, :, None], codec.bits)
    anchor = dequantize_symmetric(unpack_codes(anchor_codes, ANCHOR_BITS), anchor_scales, ANCHOR_BITS)
    return (x + anchor[:, :, :, None]).reshape(b, h, n, d)


@dataclass(frozen=True)
class AnchoredScores:
    """A run's keys or values as decode attention reads them (``PackedScores``): the
    packed codes read where they lie, never unpacked into a copy of the history.

    A token's delta is affine in its code per channel group, ``s (q - m) = s q - m s``,
    so one ``quantized_matmul`` (its group-affine form, ``mx.quantize``'s bit order; the
    CPU) or one dequantization and product (a GPU) reads the deltas, with the anchor
    group's step repeated over its G tokens; the anchors' own term is one more such
    product over the 8-bit anchors (keys: ``q a`` per anchor group, repeated over its
    tokens; values: the probabilities summed per anchor group, times the anchors)."""

    codec: AnchoredCodec
    count: int
    views: tuple
    # with delta coding, the anchor groups' steps broadcast over their tokens (B, H, groups,
    # G, w): a view of ``views[1]`` (no bytes of its own), made with the others
    steps: mx.array | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.codec.use_delta and self.steps is None and self.views[1] is not None:
            b, h, n_groups, w = self.views[1].shape
            object.__setattr__(self, "steps", mx.broadcast_to(self.views[1][:, :, :, None],
                                                              (b, h, n_groups, self.codec.group, w)))

    @property
    def n_heads(self) -> int:
        return self.views[0].shape[1]

    def _token_affine(self):
        """The codes with one (scale, bias) per token and channel group (float16 steps made
        float32: exact, so cast before or after their repetition over the tokens alike)."""
        c, codes = self.codec, self.views[0]
        if c.use_delta:  # one step per anchor group: repeated over its tokens
            b, h, _, _, w = self.steps.shape
            s = self.steps.reshape(b, h, -1, w).astype(mx.float32)
        else:
            s = self.views[1].astype(mx.float32)
        return codes, s, s * _neg_offset(c.bits), c.bits

    def _anchors(self):
        a_codes, a_scales = self.views[2], self.views[3].astype(mx.float32)
        return a_codes, a_scales, a_scales * _neg_offset(ANCHOR_BITS), ANCHOR_BITS

    def _matmul(self, x, packed, transpose: bool) -> mx.array:
        codes, scales, biases, bits = packed
        if kd._pure_path() == "qmm":
            return mx.quantized_matmul(x, codes, scales, biases, transpose=transpose,
                                       group_size=self.codec.group, bits=bits)
        w = dequantize(codes, scales, biases, self.codec.group, bits)
        return x @ (w.swapaxes(-1, -2) if transpose else w)

    def scores(self, q: mx.array) -> mx.array:
        s = self._matmul(q, self._token_affine(), transpose=True)
        if not self.codec.use_delta:
            return s
        b, h, r, n = s.shape
        anchors = self._matmul(q, self._anchors(), transpose=True)  # (B, H, R, n / G)
        return (s.reshape(b, h, r, n // self.codec.group, self.codec.group) + anchors[..., None]).reshape(s.shape)

    def mix(self, p: mx.array) -> mx.array:
        o = self._matmul(p, self._token_affine(), transpose=False)
        if not self.codec.use_delta:
            return o
        b, h, r, n = p.shape
        per_group = p.reshape(b, h, r, n // self.codec.group, self.codec.group).sum(axis=-1)
        return o + self._matmul(per_group, self._anchors(), transpose=False)


@functools.lru_cache(maxsize=None)
def _neg_offset(bits: int) -> mx.array:
    """``-qmax`` in float32, made once: a symmetric code's bias per unit of scale."""
    return mx.array(-qmax(bits), mx.float32)
