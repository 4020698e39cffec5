"""Rows kept as coefficients on a per-head principal basis: ``x ~ mean + B c``.

``pca_basis`` fits, per (batch, KV head), the mean of a block of rows and its ``rank``
leading principal directions: the eigenvectors of the float32 covariance of at most
``FIT_SAMPLE_TOKENS`` evenly spaced centred rows (``factors.gram_basis``: one matrix
product over the rows, then the eigenproblem of a head_dim x head_dim matrix; bounded work
at any prompt length, exact up to the sample size). ``ProjectedRows`` reads coefficients
stored in any ``PackedScores`` form as the full rows, without forming them:
``q xᵀ = (q B) cᵀ + q·mean`` and ``p x = (p c) Bᵀ + (Σ p) mean``. Keys kept before RoPE
cannot be read that way (each position turns by its own angle): ``RotatedRows`` reads
them rebuilt and rotated (one product with the basis over the tier per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ...kernels.kivi_decode import token_mix
from ...lowrank.factors import FIT_SAMPLE_TOKENS, gram_basis


def pca_basis(x: mx.array, rank: int, sample: int = FIT_SAMPLE_TOKENS) -> tuple[mx.array, mx.array]:
    """(mean (B, H, D), basis (B, H, D, rank)), float32, of rows (B, H, n, D)."""
    x = x.astype(mx.float32)
    mean = x.mean(axis=2)
    vectors, _ = gram_basis(x - mean[:, :, None], sample)
    return mean, vectors[..., :rank]


@dataclass(frozen=True)
class RotatedRows:
    """Rows already rebuilt (B, H, capacity, D) float32, read as they are."""

    rows: mx.array

    @property
    def count(self) -> int:
        return self.rows.shape[2]

    @property
    def n_heads(self) -> int:
        return self.rows.shape[1]

    def scores(self, q: mx.array) -> mx.array:
        return q @ self.rows.swapaxes(-1, -2)

    def mix(self, p: mx.array) -> mx.array:
        return token_mix(p, self.rows)


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
