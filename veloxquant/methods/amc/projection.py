"""Rows kept as coefficients on a per-head principal basis: ``x ~ mean + B c``.

``pca_basis`` fits, per (batch, KV head), the mean of a block of rows and its ``rank``
leading principal directions (``factors.svd_factors`` of the centred rows; directions a
block too short to span are zero columns). ``ProjectedRows`` reads coefficients stored in
any ``PackedScores`` form as the full rows, without forming them: ``q xᵀ = (q B) cᵀ + q·mean``
and ``p x = (p c) Bᵀ + (Σ p) mean``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ...lowrank.factors import svd_factors


def pca_basis(x: mx.array, rank: int) -> tuple[mx.array, mx.array]:
    """(mean (B, H, D), basis (B, H, D, rank)), float32, of rows (B, H, n, D)."""
    x = x.astype(mx.float32)
    mean = x.mean(axis=2)
    _, right, _ = svd_factors(x - mean[:, :, None])
    basis = right[..., :rank]
    if basis.shape[-1] < rank:
        basis = mx.pad(basis, [(0, 0)] * 3 + [(0, rank - basis.shape[-1])])
    return mean, basis


@dataclass(frozen=True)
class ProjectedRows:
    """Coefficients (a ``PackedScores`` over (B, H, n, rank)) read as rows of head_dim D."""

    coefficients: Any
    basis: mx.array  # (B, H, D, rank) float32
    mean: mx.array  # (B, H, D) float32

    @property
    def count(self) -> int:
        return self.coefficients.count

    @property
    def n_heads(self) -> int:
        return self.coefficients.n_heads

    def scores(self, q: mx.array) -> mx.array:
        return self.coefficients.scores(q @ self.basis) + q @ self.mean[..., None]

    def mix(self, p: mx.array) -> mx.array:
        return (self.coefficients.mix(p) @ self.basis.swapaxes(-1, -2)
                + p.sum(axis=-1, keepdims=True) * self.mean[:, :, None])
