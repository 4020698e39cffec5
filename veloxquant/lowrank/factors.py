"""Low-rank factors ``x ~ A Bᵀ`` of a batch of matrices ``x (..., T, d)``, float32.

- ``power_iteration``: subspace iteration from a seeded Gaussian start (GEAR's repo runs 3
  loops); ``A = Q`` (T x r, orthonormal) and ``B = xᵀ Q`` (d x r), so ``A Bᵀ = Q Qᵀ x`` is an
  orthogonal projection of ``x``: its error never exceeds ``‖x‖`` and is Eckart-Young's
  optimum when r reaches the rank of ``x``. Q is orthonormalised at every loop (GEAR's
  repo does it at the last loop only; the subspace is the same in exact arithmetic, and
  float32 keeps the small directions this way).
- ``svd_factors``: the exact thin SVD through a QR first (``x = Q R``, then the SVD of the
  small square ``R``), as ``A = U Σ`` and ``B = V``: sliced to r columns, the best rank-r
  approximation.
- ``gram_basis``: the right singular vectors and singular values of a tall ``x`` through
  its Gram matrix ``xᵀx`` (d x d) on at most ``FIT_SAMPLE_TOKENS`` evenly spaced rows:
  the work over the tokens is one matrix product on the default device, in float32
  whatever the input's dtype; only the small d x d eigenproblem runs on the CPU stream.
  Exact (to float32 rounding of the squared singular values) up to the sample size;
  past it, a fit on a sample of the tokens (``tests/test_lowrank_fit.py`` bounds its
  reconstruction error against the exact SVD's).
- ``energy_rank``: the smallest r whose singular values hold a fraction of the energy
  (squared singular values) or of their mass (``power=1``).

MLX runs QR, SVD and eigh on the CPU stream only; everything here is float32 there.
"""

from __future__ import annotations

import math

import mlx.core as mx

POWER_ITERATIONS = 3  # GEAR's run scripts (--loop 3)
SEED = 0  # the start of every power iteration: the same chunk gives the same factors


def power_iteration(x: mx.array, rank: int, iterations: int = POWER_ITERATIONS, seed: int = SEED):
    """(A, B): (..., T, r) and (..., d, r) with ``A Bᵀ = Q Qᵀ x``; ``rank <= min(T, d)``."""
    *lead, t, d = x.shape
    if not 0 < rank <= min(t, d) or iterations < 1:
        raise ValueError(f"rank={rank} must be in 1..min(T={t}, d={d}); iterations={iterations} >= 1")
    x = x.astype(mx.float32)
    p = mx.random.normal((*lead, d, rank), key=mx.random.key(seed))
    for _ in range(iterations):
        q, _ = mx.linalg.qr(x @ p, stream=mx.cpu)
        p = x.swapaxes(-1, -2) @ q
    return q, p


def svd_factors(x: mx.array):
    """(A, B, sigma): ``A = U Σ`` (..., T, m), ``B = V`` (..., d, m), the singular values
    (..., m) in decreasing order, m = min(T, d); ``A[..., :r] B[..., :r]ᵀ`` is the best rank r."""
    x = x.astype(mx.float32)
    tall = x.shape[-2] >= x.shape[-1]
    m = x if tall else x.swapaxes(-1, -2)  # (n, k) with n >= k
    q, r = mx.linalg.qr(m, stream=mx.cpu)
    u, sigma, vt = mx.linalg.svd(r, stream=mx.cpu)  # r (k, k) = u diag(sigma) vt
    left, right = q @ u, vt.swapaxes(-1, -2)  # m = left diag(sigma) rightᵀ
    if not tall:
        left, right = right, left
    return left * sigma[..., None, :], right, sigma


FIT_SAMPLE_TOKENS = 4096  # rows a basis fit reads at most: bounded work at any context


def gram_basis(x: mx.array, sample: int = FIT_SAMPLE_TOKENS):
    """(V, sigma): the right singular vectors (..., d, d) by decreasing singular value and
    the singular values (..., d) of ``x`` (..., T, d), from at most ``sample`` of its rows
    (evenly spaced; the singular values rescaled to all T rows)."""
    t = x.shape[-2]
    if t > sample:
        x = x[..., mx.array([i * t // sample for i in range(sample)]), :]
    x = x.astype(mx.float32)
    x = mx.where(mx.isfinite(x), x, 0.0)  # LAPACK refuses a NaN (SVD error -4): a bad row must not stop a prefill
    gram = x.swapaxes(-1, -2) @ x
    _, vectors = mx.linalg.eigh(gram, stream=mx.cpu)  # ascending
    vectors = vectors[..., ::-1]
    # ‖x v‖ rather than the eigenvalue's root: the small singular values keep float32's
    # precision instead of losing half of it to the square
    sigma = mx.sqrt(((x @ vectors) ** 2).sum(axis=-2) * (t / x.shape[-2]))
    return vectors, sigma


def energy_rank(sigma: mx.array, fraction: float, power: int = 2) -> mx.array:
    """(...) int32: the smallest r with ``sum(sigma[:r]**p) >= fraction * sum(sigma**p)``;
    ``power`` 2 is the spectral energy, 1 the singular-value mass (SVDq's and Palu's rule)."""
    energy = mx.cumsum(sigma.astype(mx.float32) ** power, axis=-1)
    below = (energy < fraction * energy[..., -1:]).sum(axis=-1)
    return mx.minimum(below + 1, sigma.shape[-1]).astype(mx.int32)


def rank_cap(t: int, d: int, fraction: float) -> int:
    """``max(1, ceil(fraction * min(t, d)))``: the largest rank a rule may choose."""
    return max(1, math.ceil(fraction * min(t, d) - 1e-9))
