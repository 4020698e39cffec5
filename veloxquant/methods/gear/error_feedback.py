"""Error feedback on a group-affine backbone: sparse outliers, the quantized rest, and a
low-rank residual (GEAR's codec), for a growing run of chunks.

For a chunk X (B, H, n, D) of keys or values, per (batch, head), in float32:

1. **outliers**: per vector of the backbone's orientation (a key channel across the
   chunk's n tokens, a value token across its D channels) the ``ceil(s * len / 2)``
   largest and as many smallest entries (``outliers.tail_indices``);
2. **backbone**: those entries replaced by their vector's mean (GEAR's repo), the chunk
   quantized min-max in groups (``GroupAffine``, KIVI's grouping): ``D_hat``;
3. **low rank**: ``R = X - D_hat``, zero at the outliers, approximated by ``A Bᵀ = R V Vᵀ``
   with V the leading right singular vectors of R from ``lowrank.factors.leading_basis``
   (R's d x d Gram matrix on the device, then subspace iteration on it, 3 products as
   GEAR's 3 power-iteration loops, and a Rayleigh-Ritz step on the CPU stream: no
   decomposition over the chunk's tokens, and a d x d one only where k + 8 reaches a third
   of d, the 8B shape's cap of 7 being far below): a fixed rank, or, with no rank
   given, the energy rule: the smallest rank holding ``energy`` of R's spectral energy
   (``‖R‖²``), the largest over the chunk's heads, capped at ``ceil(RANK_CAP_FRACTION *
   min(n, D))`` (a quantization residual is nearly white and would otherwise take almost
   every rank). The rule reads the Ritz values of the cap's directions, which never
   exceed the exact singular values: it keeps at least the exact rule's rank (issue 31:
   an exact d x d eigh per head was 72 of gear's 83 ms per 4k layer on the H200). Kept at
   the cap, the columns past the rule's rank zero (the cap is a Python value, the rule's
   rank an array: a chunk flush reads nothing on the host);
4. **sparse**: at the outliers, ``delta = X - D_hat - A Bᵀ`` (with A and B as kept), so
   they come back exactly (to the rounding of ``delta`` in the model dtype). GEAR's repo
   restores the outliers before adding the low-rank term, so they come back off by L
   there; the storage is the same.

``x_hat = D_hat + A Bᵀ + scatter(delta)``. ``ErrorFeedbackTokens`` keeps the backbone as
``PackedTokens`` (what the fused kernel reads), the factors as ``ChunkedFactors``
(``methods/gear/chunked.py``) and the outliers as a ``SparseTable`` (``sparse.py``); decode
reads them as one compiled pass (``reader.py``: a ``ResidualScores``). With rank 0 and no outliers it is the
backbone alone, bit for bit, and its layout is the plain ``AffineLayout``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from ...kernels.compiled import PerShape, index_range
from ...lowrank.factors import energy_rank, leading_basis, rank_cap
from ...quant.outliers import per_tail, tail_indices
from ...quant.packed import GroupAffine, PackedTokens
from .chunked import ChunkedFactors
from .reader import ErrorFeedbackScores, backbone_room
from .sparse import SparseTable, channel_index_dtype

RANK_CAP_FRACTION = 0.05  # the card's cap on the energy rule (the paper's ranks: a few %)


@dataclass(frozen=True)
class ErrorFeedback:
    base: GroupAffine
    rank: int | None  # fixed rank (leading_basis), 0 for none, None for the energy rule
    energy: float
    sparse_fraction: float

    @property
    def per_channel(self) -> bool:
        return self.base.axis == "channel"

    def _vectors(self, x: mx.array) -> mx.array:
        """(B, H, rows, len): the vectors whose outliers are kept, as rows."""
        return x.swapaxes(-1, -2) if self.per_channel else x

    def factors(self, residual: mx.array):
        """(A, B) float32 of the chunk's residual (B, H, n, D), or None; under the energy
        rule at exactly its rank, the cap where the cap's directions fall short (read on
        the host: tests and tools, never a decode step)."""
        if self.rank is not None:
            return self.kept_factors(residual)
        b, sigma, total = self._fit(residual)
        need = int(energy_rank(sigma, self.energy, total=total).max())
        return (residual.astype(mx.float32) @ b)[..., :need], b[..., :need]

    def kept_factors(self, residual: mx.array):
        """(A, B) float32 as kept, or None: under the energy rule at the cap rank (a Python
        value), the columns past the energy rule's rank zero, so nothing is read on the host
        (a chunk flush is a decode step); the same product as ``factors``."""
        return self._fitted_factors(residual, self._fit(residual))

    def _fit(self, residual: mx.array):
        """The fit of the residual as ``_fitted_factors`` takes it: the fixed rank's basis,
        the energy rule's ``leading_basis`` at the cap rank (basis, singular values, total),
        or None (no rank). Its eigenproblems run on the CPU streams: never compiled."""
        if self.rank == 0:
            return None
        if self.rank is not None:
            rank = min(self.rank, *residual.shape[-2:])
            return leading_basis(residual, rank)[0] if rank else None
        return leading_basis(residual, rank_cap(*residual.shape[-2:], RANK_CAP_FRACTION))

    def _fitted_factors(self, residual: mx.array, fit):
        """(A, B) float32 from ``_fit``'s result, or None."""
        if isinstance(fit, tuple):  # the energy rule at the cap rank: columns past its rank zero
            b, sigma, total = fit
            a = residual.astype(mx.float32) @ b  # U Σ, from every row of the chunk
            keep = index_range(a.shape[-1]) < energy_rank(sigma, self.energy, total=total).max()
            return mx.where(keep, a, 0.0), mx.where(keep, b, 0.0)
        return None if fit is None else (residual.astype(mx.float32) @ fit, fit)

    def encode(self, x: mx.array, offset: int = 0):
        """A chunk (B, H, n, D) -> backbone (codes, scales, biases), factors (A, B) or None,
        outliers (delta, index) or None; token positions of per-channel outliers count from
        ``offset`` (the chunk's place in its run). The work before the low-rank fit and the
        work after it are each one pass compiled for the chunk's shape (``kernels/compiled.py``);
        the fit (``leading_basis``: its eigenproblems on the CPU streams) runs between them."""
        codes, scales, biases, approx, residual, index = _backbone_pass(self)(x)
        fit = self._fit(residual)
        factors, outliers = _correction_pass(self)(x, approx, residual, fit, index, mx.array(offset, mx.int32))
        return (codes, scales, biases), factors, outliers

    def _backbone(self, x: mx.array):
        """The chunk's backbone before the fit: its codes, scales and biases, their float32
        reconstruction, the residual to fit (outliers' entries zeroed) and the outliers'
        positions (None without outliers)."""
        dtype, xf = x.dtype, x.astype(mx.float32)
        vectors = self._vectors(xf)
        k = per_tail(self.sparse_fraction, vectors.shape[-1])
        index = mask = None
        if k:
            index = tail_indices(vectors, k)
            mask = mx.put_along_axis(mx.zeros(vectors.shape, mx.bool_), index, mx.array(True), axis=-1)
            vectors = mx.where(mask, vectors.mean(axis=-1, keepdims=True), vectors)
            mask = self._vectors(mask)  # back in the chunk's layout
        codes, scales, biases = self.base.encode(self._vectors(vectors).astype(dtype))
        approx = self.base.decode(codes, scales, biases, mx.float32)
        residual = xf - approx
        return codes, scales, biases, approx, residual if mask is None else mx.where(mask, 0.0, residual), index

    def _corrections(self, x, approx, residual, fit, index, offset):
        """After the fit (``fit``: the fixed rank's basis, the energy rule's ``leading_basis``
        triple, or None): the factors (A, B) in x's dtype or None, and the outliers (delta,
        index) or None, taken against the backbone plus the low-rank term."""
        dtype = x.dtype
        factors = self._fitted_factors(residual, fit)
        if factors is not None:
            factors = tuple(f.astype(dtype) for f in factors)
            approx = approx + factors[0].astype(mx.float32) @ factors[1].astype(mx.float32).swapaxes(-1, -2)
        outliers = None
        if index is not None:
            delta = mx.take_along_axis(self._vectors(x.astype(mx.float32) - approx), index, axis=-1).astype(dtype)
            where = (index + offset) if self.per_channel else index.astype(channel_index_dtype(x.shape[-1]))
            outliers = delta, where
        return factors, outliers


@functools.lru_cache(maxsize=None)
def _backbone_pass(codec: ErrorFeedback):
    return PerShape(codec._backbone)


@functools.lru_cache(maxsize=None)
def _correction_pass(codec: ErrorFeedback):
    return PerShape(codec._corrections)


class ErrorFeedbackTokens:
    """A growing run of chunks in one ``ErrorFeedback`` codec (the ``PackedTokens``
    interface: ``count``, ``append``, ``decode``, ``layout``, ``arrays``, ``expected_shapes``)."""

    def __init__(self, codec: ErrorFeedback, step_tokens: int):
        self.codec = codec
        self.base = PackedTokens(codec.base, step_tokens)
        self.factors = ChunkedFactors(step_tokens) if codec.rank != 0 else None
        self.sparse = None
        if codec.sparse_fraction > 0:
            step = step_tokens if not codec.per_channel else 2 * per_tail(codec.sparse_fraction, step_tokens)
            self.sparse = SparseTable(codec.base.axis, step)

    @property
    def count(self) -> int:
        return self.base.count

    def head_dim(self) -> int:
        codes, c = self.base.codes.buffer, self.codec.base
        return codes.shape[2] if c.axis == "channel" else codes.shape[3] * 32 // c.bits

    def append(self, x: mx.array, decoding: bool = False) -> None:
        """Encode the chunk ``x`` (B, H, n, D) and keep it after the tokens already kept."""
        backbone, factors, outliers = self.codec.encode(x, offset=self.count)
        for kept, part in zip((self.base.codes, self.base.scales, self.base.biases), backbone):
            kept.append(part)
        if factors is not None:
            self.factors.append(*factors)
        if outliers is not None:
            self.sparse.append(*outliers)

    def _terms(self, room: int) -> tuple:
        terms = []
        if self.factors is not None and self.factors.count:
            terms.append(self.factors.term(room, self.codec.base.group, scores=self.codec.per_channel))
        if self.sparse is not None and self.sparse.entries:
            terms.append(self.sparse.term(self.head_dim(), self.count))
        return tuple(terms)

    def decode(self, dtype) -> mx.array | None:
        """The valid tokens (B, H, count, D) in ``dtype`` (transient: prefill and tests)."""
        if not self.count:
            return None
        x = self.base.decode(mx.float32)
        if self.factors is not None:
            x = x + self.factors.dense()
        if self.sparse is not None and self.sparse.entries:
            x = x + self.sparse.term(x.shape[-1], self.count).dense()
        return x.astype(dtype)

    def layout(self, empty: mx.array):
        """The backbone's ``AffineLayout`` when nothing else is kept, else ``ResidualScores``."""
        base = self.base.layout(empty)
        if self.factors is None and self.sparse is None:
            return base
        return ErrorFeedbackScores(base, self._terms(backbone_room(base)) if self.count else ())

    def expected_shapes(self, head_dim: int):
        return self.base.expected_shapes(head_dim)

    def problems(self, head_dim: int):
        """(field, found, expected) where the factors or outliers contradict the backbone."""
        if self.factors is not None:
            yield from self.factors.problems(head_dim, self.count)
        if self.sparse is not None:
            yield from self.sparse.problems(head_dim, self.count)

    def arrays(self, prefix: str) -> dict:
        out = dict(self.base.arrays(prefix))
        if self.factors is not None:
            out.update(self.factors.arrays(prefix))
        if self.sparse is not None:
            out.update(self.sparse.arrays(prefix))
        return out
