"""Transform coding of a run of tokens: a PCA basis, per-component bit widths, scalar codes.

``fit_codec`` takes rows ``(n, p)`` (a token's heads concatenated, ``p = H * d``), in
float32: mean ``μ`` over every row, covariance ``(X - μ)ᵀ(X - μ) / n`` of at most
``lowrank.factors.FIT_SAMPLE_TOKENS`` evenly spaced rows (exact below that many, to
float32 rounding; a sample above it: a bounded fit on the prefill path, not LAPACK over
the data), its leading eigenpairs by decreasing eigenvalue ``λ`` (clamped at 0: the k
components that can get bits, by subspace iteration where that costs less than one p x p
eigenproblem, within 1% of the exact fit's reconstruction error on the spectra the tests
draw; every one by the exact eigendecomposition otherwise and in offline calibration), the
widths ``b_i`` by dynamic programming under the budget (``allocation.py``, over the components
that can get bits), and keeps the components that get bits (the rest are dropped: no
basis column, no code). Component i is coded by a uniform quantizer over
``[-β √λ_i, β √λ_i]``: ``q = clip(round(y / Δ_i + c_i), 0, 2**b_i - 1)`` with
``c_i = (2**b_i - 1) / 2``, ``ŷ = (q - c_i) Δ_i``; ``x̂ = μ + V ŷ``.

What is kept: ``μ`` and the kept columns of ``V`` in float16 (encoding and decoding both
use the rounded ones, so a saved and reloaded codec decodes the same codes to the same
rows), the widths (uint8) and steps (float32), and per token the kept components' codes
packed at their widths, one after the other, into ``ceil(Σ b_i / 32)`` uint32 words
(``quant/packed.py``'s ``FieldLayout``; a code may straddle two words), so a token holds its bit budget.

``TransformTokens`` is a growing run of such tokens. Keys are coded pre-RoPE when the
model's rotary settings are known (``cache/rope.py``: rotated back at their positions,
``start`` onwards, before coding; rotated again when read). ``TransformScores`` is what
decode attention reads where a step goes part by part (``kernels/decode.py``'s
``PackedScores``, the pure-MLX path; ``decode_step.py`` reads the same in one compiled pass):
keys reconstructed and rotated (float32, transient) for ``q Kᵀ``; values mixed in the
transform domain, ``p V̂ = ((p Ŷ) Vᵀ) + (Σ p) μ``, with no dense values at all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ...cache.buffers import GrowingArray
from ...cache.rope import Rotary, derotate
from ...kernels.compiled import PerShape
from ...kernels.kivi_decode import token_mix
from ...lowrank.factors import OVERSAMPLE, gram_basis, leading_basis
from ...quant.packed import FieldLayout
from .allocation import allocate_by_variance, leading_count, uniform_step


@dataclass(frozen=True)
class TransformCodec:
    stack_shared = True  # a sequence's codec, no batch axis: stacked sequences share an equal one (cache/stacked.py)

    mean: mx.array  # (p,) float16
    basis: mx.array  # (p, k) float16, the kept components by decreasing variance
    bits: mx.array  # (k,) uint8
    step: mx.array  # (k,) float32
    def __post_init__(self):
        # built where the codec is (a fit, a restore: on the host already), never per step
        object.__setattr__(self, "fields", FieldLayout.of(np.asarray(self.bits)))

    def _grid(self):
        top = (mx.array(1, mx.int32) << self.bits.astype(mx.int32)) - 1
        return top.astype(mx.float32), top.astype(mx.float32) / 2

    def encode(self, x: mx.array) -> mx.array:
        """(..., p) float32 -> (..., k) codes."""
        top, center = self._grid()
        y = (x - self.mean.astype(mx.float32)) @ self.basis.astype(mx.float32)
        return mx.clip(mx.round(y / self.step + center), 0, top).astype(mx.uint32)

    def coefficients(self, codes: mx.array) -> mx.array:
        return (codes.astype(mx.float32) - self._grid()[1]) * self.step

    def decode(self, codes: mx.array) -> mx.array:
        """(..., k) codes -> (..., p) float32."""
        return self.coefficients(codes) @ self.basis.astype(mx.float32).T + self.mean.astype(mx.float32)


def fit_codec(x: mx.array, budget: int, choices, beta: float,
              exact: bool = False) -> tuple[TransformCodec, np.ndarray, np.ndarray]:
    """The codec of rows ``x`` (n, p); also the eigenvalues it found (descending) and each
    one's width (for checks). Bounded work whatever n: the mean over every row and the
    covariance of at most ``FIT_SAMPLE_TOKENS`` evenly spaced centred rows, float32, on the
    default device. Only the k leading components can get bits (``allocation.leading_count``:
    256 of 1,024 at the defaults and the 8B shape); where the subspace iteration for them
    costs less than one p x p eigenproblem, they come from it (``factors.leading_basis``:
    ``POWER_ITERATIONS`` products with the covariance from a seeded start, then Rayleigh-Ritz;
    k values), else from the exact eigendecomposition (p values). ``exact``: always the
    latter (offline calibration). ``start_fit`` then ``finish_fit``: several fits started
    before any is finished wait for the device once, their decompositions side by side."""
    return finish_fit(start_fit(x, budget, choices, beta, exact), budget, choices, beta)


def start_fit(x: mx.array, budget: int, choices, beta: float, exact: bool = False) -> tuple:
    """The fit's work on arrays, lazy: (mean, components, singular values, rows)."""
    return start_fits([x], budget, choices, beta, exact)[0]


def start_fits(xs: list[mx.array], budget: int, choices, beta: float, exact: bool = False) -> list[tuple]:
    """``start_fit`` of each of ``xs``. Rows of one shape whose leading components come by
    subspace iteration (a layer's keys and values) iterate as one batch: on a GPU, half the
    launches of two fits (``factors.device_leading``), each matrix's arithmetic unchanged."""
    xs = [x.astype(mx.float32) for x in xs]
    means = [x.mean(axis=0) for x in xs]
    centred = [x - mean for x, mean in zip(xs, means)]
    ks = [_iterated_k(x.shape, budget, choices, beta, exact) for x in xs]
    if len(xs) > 1 and ks[0] is not None and len({(x.shape, k) for x, k in zip(xs, ks)}) == 1:
        vecs, sigma, _ = leading_basis(mx.stack(centred), ks[0])  # by decreasing Ritz value
        return [(mean, vecs[i], sigma[i], xs[0].shape[0]) for i, mean in enumerate(means)]
    out = []
    for x, mean, c, k in zip(xs, means, centred, ks):
        vecs, sigma = leading_basis(c, k)[:2] if k is not None else gram_basis(c)  # by decreasing value
        out.append((mean, vecs, sigma, x.shape[0]))
    return out


def _iterated_k(shape: tuple, budget: int, choices, beta: float, exact: bool) -> int | None:
    """The components a fit of rows ``shape`` (n, p) takes by subspace iteration, or None
    where it takes the exact decomposition (offline calibration, or where the iteration
    would cost more than one p x p eigenproblem)."""
    n, p = shape
    k = leading_count(p, choices, budget, beta)
    return k if not exact and 0 < k and 3 * (k + OVERSAMPLE) < min(p, n) else None


def finish_fit(started: tuple, budget: int, choices, beta: float) -> tuple[TransformCodec, np.ndarray, np.ndarray]:
    """``start_fit``'s arrays read on the host, the widths allocated: the codec, the
    eigenvalues (descending) and the widths."""
    mean, vecs, sigma, n = started
    lam = np.maximum(np.asarray((sigma * sigma / n).astype(mx.float32), dtype=np.float64), 0.0)
    order = np.argsort(-lam, kind="stable")  # ‖x v‖² need not keep eigh's order to the last bit
    lam, vecs = lam[order], np.asarray(vecs)[:, order]
    bits = allocate_by_variance(lam, choices, budget, beta)
    keep = bits > 0
    codec = TransformCodec(
        mean.astype(mx.float16), mx.array(np.ascontiguousarray(vecs[:, keep]).astype(np.float16)),
        mx.array(bits[keep].astype(np.uint8)), mx.array(uniform_step(lam[keep], bits[keep], beta).astype(np.float32)))
    return codec, lam, bits


def _rotate(keys: mx.array, start: int, rotary: Rotary | None, inverse: bool) -> mx.array:
    """Keys (B, H, n, d) at positions start.. rotated back (inverse) or forward, float32."""
    if rotary is None:
        return keys.astype(mx.float32)
    positions = mx.arange(start, start + keys.shape[2])
    return derotate(keys, positions if inverse else -positions, rotary)  # -angle: RoPE itself


class TransformTokens:
    """A growing run of tokens in one ``TransformCodec`` (fitted on first use)."""

    def __init__(self, step_tokens: int, rotary: Rotary | None = None, start: int = 0):
        self.codec: TransformCodec | None = None
        self.codes = GrowingArray(axis=1, step=step_tokens)  # (B, T, words): packed codes
        self.rotary, self.start = rotary, start
        self.heads: tuple[int, int] | None = None  # (H, d)

    @property
    def count(self) -> int:
        return self.codes.length

    def _rows(self, x: mx.array, first: int) -> mx.array:
        """(B, H, n, d) -> (B, n, H*d) float32, pre-RoPE where the rotary is known."""
        b, h, n, d = x.shape
        self.heads = (h, d)
        return _rotate(x, first, self.rotary, inverse=True).transpose(0, 2, 1, 3).reshape(b, n, h * d)

    def fit(self, x: mx.array, budget: int, choices, beta: float, exact: bool = False):
        """Fit the codec on ``x`` (B, H, n, d), the tokens at positions ``start``..."""
        return self.finish_fit(self.start_fit(x, budget, choices, beta, exact), budget, choices, beta)

    def start_fit(self, x: mx.array, budget: int, choices, beta: float, exact: bool = False) -> tuple:
        """``fit``'s work on arrays, lazy (``transform.start_fit``)."""
        return start_fit(self.fit_rows(x), budget, choices, beta, exact)

    def fit_rows(self, x: mx.array) -> mx.array:
        """The rows (B n, H d) a fit on ``x`` (B, H, n, d) reads, at positions ``start``..."""
        rows = self._rows(x, self.start)
        return rows.reshape(-1, rows.shape[-1])

    def finish_fit(self, started: tuple, budget: int, choices, beta: float):
        """``start_fit``'s arrays read on the host: the codec kept; its eigenvalues and widths."""
        self.codec, lam, bits = finish_fit(started, budget, choices, beta)
        return lam, bits

    def append(self, x: mx.array, decoding: bool = False) -> None:
        """Code ``x`` (B, H, n, d) after the tokens kept: rotated back, projected, quantized
        and packed in one pass compiled for its shape (``kernels/compiled.py``)."""
        first = self.start + self.count
        positions = None if self.rotary is None else mx.arange(first, first + x.shape[2])
        self.heads = x.shape[1], x.shape[3]
        c = self.codec
        self.codes.append(_coder(self.rotary, c.fields.n_words)(x, positions, c.mean, c.basis, c.bits, c.step,
                                                                 c.fields.arrays()))

    def unpacked(self, start: int = 0, end: int | None = None) -> mx.array:
        """The codes of tokens [start, end), (B, n, k) uint32."""
        return self.codec.fields.unpack(self.codes.view()[:, start:end])

    def dense(self) -> mx.array | None:
        """Every kept token reconstructed (B, H, T, d), float32, post-RoPE again."""
        if not self.count:
            return None
        return _reconstruct(self.codec, self.unpacked(), self.heads, self.rotary, self.start)

    def decode(self, dtype) -> mx.array | None:
        """``dense`` in ``dtype`` (a prompt chunk's history), one pass compiled for its shape."""
        if not self.count:
            return None
        c = self.codec
        return _decoder(self.heads, self.rotary, self.start, dtype)(self.codes.view(), c.mean, c.basis, c.bits, c.step,
                                                                   c.fields.arrays())

    def layout(self, empty: mx.array) -> "TransformScores":
        return TransformScores(self.codec, self.unpacked(), self.count, self.heads, self.rotary, self.start)

    def arrays(self, prefix: str) -> dict:
        out = {f"{prefix}_codes": self.codes}
        if self.codec is not None:
            c = self.codec
            out.update({f"{prefix}_mean": c.mean, f"{prefix}_basis": c.basis, f"{prefix}_bits": c.bits,
                        f"{prefix}_step": c.step, f"{prefix}_fields": c.fields.arrays()})
        return out


def _codec_of(mean, basis, bits, step, fields) -> "TransformCodec":
    """A ``TransformCodec`` of given arrays and field layout, for a compiled pass's trace
    (``fields`` the layout's arrays; its word count is what the trace was made for)."""
    codec = object.__new__(TransformCodec)
    for name, value in (("mean", mean), ("basis", basis), ("bits", bits), ("step", step)):
        object.__setattr__(codec, name, value)
    object.__setattr__(codec, "fields", fields)
    return codec


@functools.lru_cache(maxsize=None)
def _coder(rotary: Rotary | None, n_words: int):
    """``TransformTokens.append``'s arithmetic as a function of the chunk, its positions and
    the codec's arrays: rows rotated back, projected, quantized, packed into ``n_words``."""
    def code(x, positions, mean, basis, bits, step, layout):
        b, h, n, d = x.shape
        rows = (x.astype(mx.float32) if rotary is None else derotate(x, positions, rotary))
        rows = rows.transpose(0, 2, 1, 3).reshape(b, n, h * d)
        codec = _codec_of(mean, basis, bits, step, FieldLayout(*layout, n_words))
        return codec.fields.pack(codec.encode(rows))

    return PerShape(code)


@functools.lru_cache(maxsize=None)
def _decoder(heads: tuple[int, int], rotary: Rotary | None, start: int, dtype):
    """``TransformTokens.dense`` in ``dtype`` as a function of the packed codes and the
    codec's arrays."""
    def decode(words, mean, basis, bits, step, layout):
        codec = _codec_of(mean, basis, bits, step, FieldLayout(*layout, words.shape[-1]))
        return _reconstruct(codec, codec.fields.unpack(words), heads, rotary, start).astype(dtype)

    return PerShape(decode)


def _reconstruct(codec, codes, heads, rotary, start) -> mx.array:
    b, t, _ = codes.shape
    h, d = heads
    x = codec.decode(codes).reshape(b, t, h, d).transpose(0, 2, 1, 3)
    return _rotate(x, start, rotary, inverse=False)


@dataclass(frozen=True)
class TransformScores:
    """Keys or values of a ``TransformTokens`` run as decode attention reads them."""

    codec: TransformCodec
    codes: mx.array  # (B, T, k)
    count: int
    heads: tuple[int, int]
    rotary: Rotary | None
    start: int

    @property
    def n_heads(self) -> int:
        return self.heads[0]

    def scores(self, q: mx.array) -> mx.array:
        return q @ _reconstruct(self.codec, self.codes, self.heads, self.rotary, self.start).swapaxes(-1, -2)

    def mix(self, p: mx.array) -> mx.array:
        h, d = self.heads
        y = self.codec.coefficients(self.codes)[:, None]  # (B, 1, T, k)
        w = self.codec.basis.astype(mx.float32).reshape(h, d, -1)  # (H, d, k)
        mean = self.codec.mean.astype(mx.float32).reshape(1, h, 1, d)
        return token_mix(p, y) @ w.swapaxes(-1, -2) + p.sum(axis=-1, keepdims=True) * mean
