"""TurboQuant's codec: a rotated unit vector's coordinates at the Lloyd-Max levels of
their known density, its norm, and for keys a 1-bit QJL sketch of what is left.

Per vector x (d,), with R the layer's randomized Hadamard rotation (``quant/hadamard.py``)
and ``m = bits - 1`` with the sketch (TurboQuant_prod), ``m = bits`` without (_mse):

1. ``y = x R``; ``idx = nearest level of y_i / ‖x‖`` among ``sphere_levels(m, d)``
   (``levels.py``); ``ŷ = ‖x‖₁₆ levels[idx]`` (the norm as stored, float16, so the residual
   below absorbs its rounding);
2. sketch: ``r = y - ŷ`` (the residual, in the rotated frame: ``‖r‖ = ‖x - x̃_mse‖``),
   stored as ``sign(S r)`` (d bits, S a seeded d x d standard Gaussian, sign(0) = +1) and
   ``γ = ‖r‖`` (float16). Since ``S R`` is Gaussian too, this is the paper's
   ``sign(S (x - x̃_mse))`` with another draw of S.

A row keeps its codes as bit planes, words (P, W, 1) uint32 (P = m planes of levels, then
the sign plane; W = ceil(d / 32) words a plane, bit j of word w the coordinate 32 w + j),
and (‖x‖, γ) as (N, 1, 1) float16: ``d (m + 1) + 32`` bits with the sketch, ``d m + 16``
without. The trailing unit axes are the read's: each plane, sliced as it is kept, shifts
against 32 bit positions, so that unpacking, the level lookup and the norm's scaling are
one fused elementwise pass from the words to float32 rows (no array of bits, no index
array, no gather).

Reading folds the rotation (and the sketch) into the query, never into the history:
``q · x̃ = [q R, c q R Sᵀ] · [ŷ, γ sign(S r)]`` with ``c = sqrt(π/2) / d``, the first an
estimate of ``q · x`` whose error ``q · r`` the second cancels in expectation over S
(TurboQuant Theorem 2: unbiased). One (d x 2d) matrix ``M`` turns the query, one product
scores it against the rows; values are mixed in the rotated frame and turned back once
(``o = (p ŷ) Rᵀ``). ``x̃ = [ŷ, γ sign] Mᵀ`` is the decoded row (prefill chunks, tests).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx

from ...cache.buffers import GrowingArray
from ...kernels.compiled import PerShape
from ...kernels.kivi_decode import token_mix
from ...quant import codebook as cb
from ...quant import hadamard
from ...quant.packed import GROWTH_TOKENS
from .levels import sphere_levels

QJL_SCALE = math.sqrt(math.pi / 2)
_TINY = 1e-30  # the norm a zero vector divides by (its codes are then the levels nearest 0)


@functools.lru_cache(maxsize=8)
def sketch(seed: int, d: int) -> mx.array:
    """S: (d, d) standard Gaussian, drawn from the seed's second key (the rotation's signs
    use the seed's own key)."""
    s = mx.random.normal((d, d), key=mx.random.split(mx.random.key(seed))[1])
    mx.eval(s)
    return s


@dataclass(frozen=True)
class TurboCodec:
    bits: int  # per coordinate, the sketch's sign bit included
    qjl: bool  # keys: TurboQuant_prod (b-1 bits of levels and a 1-bit sketch); else _mse
    seed: int  # the rotation's (and the sketch's)

    @property
    def level_bits(self) -> int:
        return self.bits - 1 if self.qjl else self.bits

    @property
    def planes(self) -> int:
        return self.level_bits + self.qjl

    def tokens(self, step_tokens: int = GROWTH_TOKENS) -> "TurboTokens":
        return TurboTokens(self, step_tokens)

    def rotation(self, d: int) -> mx.array:
        return hadamard.matrix(self.seed, d)

    def query_matrix(self, d: int) -> mx.array:
        """M (d, d) or, with the sketch, (d, 2d): ``q M`` scored against a row's
        ``[ŷ, γ sign]`` is ``q · x̃``."""
        return _matrices(self, d)[0]

    def row_shapes(self, d: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The trailing shapes of a row's words and of its norms."""
        return (self.planes, cb.plane_words(d), 1), (self.n_norms, 1, 1)

    @property
    def n_norms(self) -> int:
        return 2 if self.qjl else 1

    def encode(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Rows (..., n, d) -> (words (..., n, P, W, 1) uint32, norms (..., n, N, 1, 1) float16)."""
        return _encoder(self, x.shape[-1], False)(x)

    def encode_one(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """``encode`` compiled (a decode step's token): fewer graph nodes, the same codes."""
        return _encoder(self, x.shape[-1], True)(x)

    def rows(self, words: mx.array, norms: mx.array, d: int) -> mx.array:
        """float32 ``[ŷ, γ sign]`` (..., n, d or 2d) of stored rows, in the rotated frame."""
        return _rows_fn(self, d)(words, norms)

    def decode(self, words: mx.array, norms: mx.array, d: int) -> mx.array:
        """x̃ (..., n, d) float32: the rows turned back (with the sketch's estimate added)."""
        return self.rows(words, norms, d) @ _matrices(self, d)[1]


@functools.lru_cache(maxsize=None)
def _matrices(codec: TurboCodec, d: int) -> tuple[mx.array, mx.array]:
    """(M, Mᵀ), evaluated: constants a step's graph reads, not transposes it builds."""
    r = codec.rotation(d)
    m = r if not codec.qjl else mx.concatenate([r, (QJL_SCALE / d) * (r @ sketch(codec.seed, d).T)], axis=1)
    m_t = mx.contiguous(m.T)
    mx.eval(m, m_t)
    return m, m_t


def _nearest(z: mx.array, lv: tuple[float, ...]) -> mx.array:
    """Index of the nearest level (ties to the lower one), as fused comparisons against
    the midpoints held as Python constants."""
    idx = (z > (lv[0] + lv[1]) / 2).astype(mx.uint32)
    for a, b in zip(lv[1:-1], lv[2:]):
        idx = idx + (z > (a + b) / 2).astype(mx.uint32)
    return idx


def _lookup(idx: mx.array, lv: tuple[float, ...]) -> mx.array:
    """``lv[idx]`` as fused steps (``lv_0 + Σ_j (lv_j - lv_{j-1}) [idx >= j]``): no gather."""
    out = mx.where(idx >= 1, lv[1], lv[0])
    for j in range(2, len(lv)):
        out = out + mx.where(idx >= j, lv[j] - lv[j - 1], 0.0)
    return out


def _pack(bits: mx.array, d: int) -> mx.array:
    """(..., P, d) bits -> (..., P, W, 1) uint32 words, 32 coordinates a word."""
    *lead, p, _ = bits.shape
    w = cb.plane_words(d)
    if w * 32 != d:
        bits = mx.pad(bits, [(0, 0)] * (len(lead) + 1) + [(0, w * 32 - d)])
    bits = bits.astype(mx.uint32).reshape(*lead, p, w, 32)
    return (bits << _SHIFTS).sum(axis=-1, keepdims=True).astype(mx.uint32)


def _plane(words: mx.array, p: int) -> mx.array:
    """Plane p's bits (..., 1, W, 32): the slice shifted against the 32 bit positions."""
    return (words[..., p : p + 1, :, :] >> _SHIFTS) & 1


_SHIFTS = mx.arange(32, dtype=mx.uint32)


@functools.lru_cache(maxsize=None)
def _encoder_constants(codec: TurboCodec, d: int):
    """The rotation, the sketch's transpose (evaluated) and the bit weights, shared by the
    compiled and plain encoders: made by a prompt's first encode, so a decode step that
    first compiles the encoder (a flushed block) evaluates nothing."""
    s_t = mx.contiguous(sketch(codec.seed, d).T) if codec.qjl else None
    if s_t is not None:
        mx.eval(s_t)
    return codec.rotation(d), s_t, mx.array([1 << p for p in range(codec.level_bits)], mx.uint32)[:, None]


@functools.lru_cache(maxsize=None)
def _encoder(codec: TurboCodec, d: int, compiled: bool):
    lv = sphere_levels(codec.level_bits, d)
    r, s_t, weights = _encoder_constants(codec, d)

    def encode(x):
        y = x.astype(mx.float32) @ r
        norm = mx.sqrt(mx.sum(y * y, axis=-1, keepdims=True))
        norm16 = norm.astype(mx.float16)
        idx = _nearest(y / mx.maximum(norm, _TINY), lv)
        bits = (idx[..., None, :] // weights) & 1  # (..., m, d): plane p holds bit p
        if not codec.qjl:
            return _pack(bits, d), norm16[..., None, None]
        res = y - norm16.astype(mx.float32) * _lookup(idx, lv)
        sign = ((res @ s_t) >= 0).astype(mx.uint32)[..., None, :]
        gamma = mx.sqrt(mx.sum(res * res, axis=-1, keepdims=True)).astype(mx.float16)
        return _pack(mx.concatenate([bits, sign], axis=-2), d), mx.concatenate([norm16, gamma], axis=-1)[..., None, None]

    # a prompt chunk's encode: compiled for each chunk shape, a few kept (kernels/compiled.py)
    return mx.compile(encode) if compiled else PerShape(encode)


@functools.lru_cache(maxsize=None)
def _rows_fn(codec: TurboCodec, d: int):
    m = codec.level_bits
    lv = sphere_levels(m, d)

    def rows(words, norms):
        # words (..., n, P, W, 1), norms (..., n, N, 1, 1): every operation below is
        # elementwise over (..., n, 1, W, 32) but the slices, so it compiles to one pass
        idx = _plane(words, 0)
        for p in range(1, m):
            idx = idx | (_plane(words, p) << p)
        out = _lookup(idx, lv) * norms[..., 0:1, :, :].astype(mx.float32)
        if codec.qjl:
            sign = (_plane(words, m).astype(mx.float32) * 2 - 1) * norms[..., 1:2, :, :].astype(mx.float32)
            out = mx.concatenate([out, sign], axis=-3)
        *lead, parts, w, _ = out.shape
        if w * 32 == d:
            return out.reshape(*lead, parts * d)
        return out.reshape(*lead, parts, w * 32)[..., :d].reshape(*lead, parts * d)

    return mx.compile(rows)


@functools.lru_cache(maxsize=None)
def _history_fn(codec: TurboCodec, d: int, dtype):
    """``codec.decode`` in ``dtype``, compiled for each shape (``kernels/compiled.py``)."""
    return PerShape(lambda words, norms: codec.decode(words, norms, d).astype(dtype))


class TurboTokens:
    """A growing run of rows in one ``TurboCodec`` (the store's packed keys or values)."""

    def __init__(self, codec: TurboCodec, step_tokens: int = GROWTH_TOKENS):
        self.codec = codec
        self.words = GrowingArray(axis=2, step=step_tokens)
        self.norms = GrowingArray(axis=2, step=step_tokens)
        self.dim: int | None = None
        # the fused read's plan between two flushes (kernel.py): not kept, not copied, and
        # not walked by cache/stacked.py (no __dict__); stamped by the buffers it reads
        self.launch = None

    @property
    def count(self) -> int:
        return self.words.length

    def append(self, x: mx.array, decoding: bool = False) -> None:
        self.dim = x.shape[-1]
        words, norms = self.codec.encode_one(x) if decoding else self.codec.encode(x)
        self.words.append(words)
        self.norms.append(norms)

    def decode(self, dtype) -> mx.array | None:
        """The rows held, in ``dtype`` (a prompt chunk's history), one pass compiled for its shape."""
        if not self.count:
            return None
        return _history_fn(self.codec, self.dim, dtype)(self.words.view(), self.norms.view())

    def layout(self, empty: mx.array) -> "TurboScores":
        return TurboScores(self, self.count)

    def arrays(self, prefix: str) -> dict[str, GrowingArray]:
        return {f"{prefix}_words": self.words, f"{prefix}_norms": self.norms}

    def layout_problems(self, name: str, head_dim: int):
        """(field, found, expected) where the kept rows contradict the codec."""
        if self.words.buffer is None:
            return
        want = self.codec.row_shapes(head_dim)
        found = (tuple(self.words.buffer.shape[3:]), None if self.norms.buffer is None else tuple(self.norms.buffer.shape[3:]))
        if found != want:
            yield f"{name} words and norms per row", found, f"{want} ({self.codec.bits}-bit TurboQuant rows)"


_kernel_partials = None  # kernel.kernel_partials, imported at first use (kernel.py imports this module)


@dataclass(frozen=True)
class TurboScores:
    """A ``TurboTokens`` run as the pure-MLX decode path reads it (``PackedScores``):
    whole buffers (spare room included: zero rows), sliced to ``count`` after the product."""

    tokens: TurboTokens
    count: int

    @property
    def n_heads(self) -> int:
        return self.tokens.words.buffer.shape[1]

    def _rows(self, d: int) -> mx.array:
        t = self.tokens
        return t.codec.rows(t.words.buffer, t.norms.buffer, d)

    def scores(self, q: mx.array) -> mx.array:
        """float32 ``q x̃ᵀ`` (B, H, R, count) for scaled float32 queries (B, H, R, d)."""
        d = q.shape[-1]
        qm = q @ self.tokens.codec.query_matrix(d)
        return (qm @ self._rows(d).swapaxes(-1, -2))[..., : self.count]

    def kernel_partials(self, backend, queries, values: "TurboScores", scale):
        """The fused kernel's partials over these keys and ``values`` (``kernel.py``), or
        None where it does not serve (the pure path reads them then)."""
        global _kernel_partials
        if _kernel_partials is None:
            from .kernel import kernel_partials as _kernel_partials
        return _kernel_partials(backend, queries, self, values, scale)

    def mix(self, p: mx.array) -> mx.array:
        """float32 ``p x̃`` (B, H, R, d) for probabilities (B, H, R, count)."""
        t = self.tokens
        room = t.words.capacity - self.count
        if room:
            p = mx.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, room)])
        d = t.dim
        return token_mix(p, self._rows(d)) @ _matrices(t.codec, d)[1]
