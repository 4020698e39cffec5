"""Low-rank factors ``x ~ A Bᵀ`` of a batch of matrices ``x (..., T, d)``, float32, with
no QR or SVD over the tokens: the work over the T rows is matrix products on the default
device, and the only decompositions are of small matrices (``eigh`` of d x d or k x k for a
rank k, QR of d x k) on the CPU, where MLX runs them (MLX's CUDA back-end has no
``eigh``; a Jacobi kernel on the device lost to the CPU stream's at every size measured:
benchmarks/notes/fits.md), a batch of them split over several CPU streams
(``cpu_streams.py``).

- ``sample_rows``: at most ``FIT_SAMPLE_TOKENS`` evenly spaced rows, float32, non-finite
  entries zeroed (LAPACK refuses a NaN: one overflowed row must not stop a prefill).
- ``orthonormalize``: columns of the same span made orthonormal through their k x k Gram
  matrix instead of a QR over the T rows (columns scaled to unit norm first; three
  passes: a float32 Gram squares the condition number, so the first passes only keep the
  span and the last one, on nearly orthonormal columns, is accurate; a dependent column
  comes back zero).
- ``randomized_basis``: the leading right singular vectors and values of ``x`` by subspace
  iteration on both sides and a Rayleigh-Ritz step (randomized SVD), for a given rank or
  for the smallest rank holding a fraction of the energy (the rank doubled until it
  does: the energy it finds is a lower bound of the exact top-r energy, so the rank it
  returns meets the fraction, never fewer directions than the exact rule's). Up to
  ``DIRECT_MAX`` rows or columns it takes the exact basis through the smaller side's Gram
  matrix instead: one small eigenproblem costs less than the iterations' many. So it does
  up to ``GRAM_MAX`` (2,048: xKV's two layers of 8 x 128 channels) for the energy rule and
  for a rank past a third of the smaller side: the subspace iteration makes 22
  eigenproblems of the iterated size (seven orthonormalisations of three passes, and the
  Ritz step), the energy rule's doubling repeats it per size (32 .. 2,048: 133 of them and
  seven host reads for a 0.95 rule needing 1,194 of 2,048 directions, issue 31), where
  one eigenproblem of the Gram matrix (channels x channels: bounded by the model, not by
  the tokens) gives the exact spectrum and basis with one host read. The total energy the
  doubling compares with is summed per column first (one float32 sum over 8M squares
  lost 1.2% of it and chose 1,135 directions for the exact rule's 1,194).
- ``leading_bases``: ``randomized_basis`` of several matrices (xKV's groups at a prompt's
  end), the exact route's eigenproblems queued a wave at a time over the fit streams, each
  wave's ranks in one host read.
- ``svd_factors``: the exact thin SVD through a QR first (tests and offline tools; not on
  a prefill path).
- ``gram_basis``: the right singular vectors and singular values of a tall ``x`` through
  its Gram matrix ``xᵀx`` (d x d) on at most ``FIT_SAMPLE_TOKENS`` evenly spaced rows.
  Exact (to float32 rounding of the squared singular values) up to the sample size;
  past it, a fit on a sample of the tokens (``tests/test_lowrank_fit.py`` bounds its
  reconstruction error against the exact SVD's).
- ``leading_basis``: the leading k right singular vectors and values of ``x`` and its
  total energy, for a k well below d: the Gram matrix ``xᵀx`` (d x d) is the one product
  over the T rows, on the default device; subspace iteration on it (k + ``OVERSAMPLE``
  columns from a seeded Gaussian start, ``POWER_ITERATIONS`` products, each orthonormalised
  by a QR of the d x (k + p) product, then a Rayleigh-Ritz step) runs on the CPU stream as
  one block: O(d² k) arithmetic and a single wait for the default device,
  where a d x d ``eigh`` is O(d³) (1.6 ms per 128 x 128 problem on the H200's host,
  ``benchmarks/notes/fits.md``). Randomized: the Ritz values never exceed the exact
  singular values (but for the float32 Gram's rounding), so an energy rule on them keeps
  at least the exact rule's rank; ``tests/test_lowrank_fit.py`` bounds the rank-k error
  within 2% of the exact SVD's.
- ``device_leading``: ``leading_basis``'s iteration on a GPU, for Gram matrices of at least
  ``DEVICE_FIT_MIN_DIM`` columns (kvtc's 1,024 channels; GEAR's 128-wide heads stay on the
  CPU streams: small products, where the polar steps' launches are unmeasured): the products with
  the Gram matrix on the device, each block orthonormalised by Newton-Schulz steps
  (``device_polar``: matrix products only), and only the Rayleigh-Ritz step's (k + 8) x
  (k + 8) eigenproblem on a CPU stream. MLX multiplies float32 in TF32 on CUDA (10 mantissa
  bits) unless ``MLX_ENABLE_TF32=0``; a product with the covariance then loses the directions
  about 1e-4 below the first (kvtc's fit 1.77x the exact one's error on a power-law
  spectrum), so each product's operands are split into the part TF32 keeps and the rest
  (``split_product``: three products, float32's precision). ``tests/test_device_fit.py``
  emulates TF32's operands on the CPU; ``VQ_DEVICE_FIT=0`` keeps the CPU streams.
- ``energy_rank``: the smallest r whose singular values hold a fraction of the energy
  (squared singular values) or of their mass (``power=1``).
"""

from __future__ import annotations

import functools
import math
import os

import mlx.core as mx

from .cpu_streams import cpu_eigh, fit_streams, on_fit_streams

POWER_ITERATIONS = 3  # GEAR's run scripts (--loop 3)
SEED = 0  # the start of every power iteration: the same chunk gives the same factors


FIT_SAMPLE_TOKENS = 4096  # rows a basis fit reads at most: bounded work at any context
ORTHO_PASSES = 3
EIG_FLOOR = 1e-12  # eigenvalues of a Gram matrix below this share of the largest: kept, not inverted to inf
DEPENDENT = 1e-2  # the last pass drops directions of unit columns' Gram below this (linear dependence)


def sample_rows(x: mx.array, sample: int | None = None) -> mx.array:
    """At most ``sample`` (default ``FIT_SAMPLE_TOKENS``) evenly spaced rows of ``x``
    (..., T, d), float32, non-finite entries zeroed."""
    sample = FIT_SAMPLE_TOKENS if sample is None else sample
    t = x.shape[-2]
    if t > sample:
        x = x[..., mx.array([i * t // sample for i in range(sample)]), :]
    x = x.astype(mx.float32)
    return mx.where(mx.isfinite(x), x, 0.0)


def orthonormalize(y: mx.array, passes: int = ORTHO_PASSES) -> mx.array:
    """Orthonormal columns (..., T, k) spanning the columns of ``y`` (k <= T). Where ``y``
    has fewer independent columns than k (a rank-deficient chunk), the extra columns come
    back zero: ``Q Qᵀ`` is still the projection on the span."""
    for i in range(passes):
        y = y / mx.maximum(mx.linalg.norm(y, axis=-2, keepdims=True), 1e-30)
        w, v = cpu_eigh(y.swapaxes(-1, -2) @ y)
        if i < passes - 1:  # keep the span: a small direction is amplified, not dropped
            inv = mx.rsqrt(mx.maximum(w, EIG_FLOOR * w[..., -1:]))
        else:  # near-orthonormal unit columns by now: an eigenvalue near 0 is a repeated direction
            inv = mx.where(w > DEPENDENT, mx.rsqrt(mx.maximum(w, DEPENDENT)), 0.0)
        y = y @ (v * inv[..., None, :])
    return y


def _ritz(x: mx.array, v: mx.array):
    """The right singular pairs of ``x`` within the span of the orthonormal ``v``: (V, sigma)
    by decreasing sigma (``‖x v_i‖``, not the eigenvalue's root: small values keep float32)."""
    b = x @ v
    _, w = cpu_eigh(b.swapaxes(-1, -2) @ b)  # ascending
    v = v @ w[..., ::-1]
    return v, mx.sqrt(((x @ v) ** 2).sum(axis=-2))


def subspace_basis(x: mx.array, k: int, iterations: int = POWER_ITERATIONS, seed: int = SEED):
    """(V (..., d, k), sigma (..., k)): approximate leading right singular vectors and values
    of ``x`` (..., T, d), float32, by subspace iteration from a seeded Gaussian start."""
    *lead, t, d = x.shape
    if not 0 < k <= min(t, d):
        raise ValueError(f"k={k} must be in 1..min(T={t}, d={d})")
    if k == d:  # every direction: the Gram route is exact and as cheap
        return _ritz(x, mx.broadcast_to(mx.eye(d), (*lead, d, d)))
    v = orthonormalize(mx.random.normal((*lead, d, k), key=mx.random.key(seed)))
    for _ in range(iterations):
        v = orthonormalize(x.swapaxes(-1, -2) @ orthonormalize(x @ v))
    return _ritz(x, v)


OVERSAMPLE = 8  # extra directions a fixed-rank fit iterates on (randomized SVD's p)
DIRECT_MAX = 512  # up to this many rows or columns, the exact basis through the smaller Gram matrix


GRAM_MAX = 2048  # up to this many rows or columns, the energy rule (or a rank past a third) also takes it


def _small_side_basis(x: mx.array):
    """(V (..., d, m), sigma (..., m)) of ``x`` (..., T, d), m = min(T, d), exact to float32
    rounding of the squared singular values, through the Gram matrix of the smaller side."""
    t, d = x.shape[-2:]
    if d <= t:
        _, v = cpu_eigh(x.swapaxes(-1, -2) @ x)  # (d, d), ascending
        v = v[..., ::-1]
        return v, mx.sqrt(((x @ v) ** 2).sum(axis=-2))  # ‖x v_i‖: small values keep float32
    _, u = cpu_eigh(x @ x.swapaxes(-1, -2))  # (T, T), ascending
    v = x.swapaxes(-1, -2) @ u[..., ::-1]  # V Σ
    sigma = mx.linalg.norm(v, axis=-2)
    return v / mx.maximum(sigma[..., None, :], 1e-30), sigma
START_RANK = 32  # the energy rule's first try


def randomized_basis(x: mx.array, rank: int | None, fraction: float = 1.0, sample: int | None = None):
    """(V (..., d, r), r) for ``x`` (..., T, d): the leading r right singular vectors from at
    most ``sample`` rows (``sample_rows``). ``rank`` given: capped at min(T, d); None: the
    smallest r whose directions hold ``fraction`` of the sampled rows' energy ``‖x‖²``,
    the largest over the batch (read on the host: a prefill step, never a decode step)."""
    xs = sample_rows(x, sample)
    m = min(xs.shape[-2:])
    if _exact_route(m, rank):
        v, sigma = _small_side_basis(xs)
        r = min(rank, m) if rank is not None else int(energy_rank(sigma, fraction).max())
        return v[..., :r], r
    if rank is not None:
        r = min(rank, m)
        v, _ = subspace_basis(xs, min(r + OVERSAMPLE, m))
        return v[..., :r], r
    total = (xs**2).sum(axis=-2).sum(axis=-1)  # per column first: one float32 sum of T*d squares drifts
    k = min(START_RANK, m)
    while True:
        v, sigma = subspace_basis(xs, k)
        found = mx.cumsum(sigma**2, axis=-1)
        short = found < fraction * total[..., None] * (1 - 1e-6)
        if k == m or not bool(short[..., -1].any()):
            r = min(int((short.sum(axis=-1) + 1).max()), k)
            return v[..., :r], r
        k = min(2 * k, m)


def _exact_route(m: int, rank: int | None) -> bool:
    """Whether ``randomized_basis`` takes the exact basis (one eigenproblem of the smaller
    side's Gram matrix) for a sample whose smaller side is ``m``: up to ``DIRECT_MAX``, or up
    to ``GRAM_MAX`` where the iterations would cost more (the energy rule, or a rank past a
    third of ``m``)."""
    wide = rank is None or 3 * (min(rank, m) + OVERSAMPLE) >= m
    return m <= DIRECT_MAX or (m <= GRAM_MAX and wide)


def leading_bases(xs: list, rank: int | None, fraction: float = 1.0, sample: int | None = None) -> list:
    """``randomized_basis`` of each matrix of ``xs``, the exact route's eigenproblems queued
    a wave at a time before any of their ranks is read: each wave (as many matrices as
    ``fit_streams()``) runs side by side on the fit streams (``cpu_eigh`` hands single
    matrices to the streams in turn) and its ranks come back in one host read, where
    ``randomized_basis`` one matrix at a time waits for each eigenproblem alone. Each basis
    is the one ``randomized_basis`` gives (each matrix decomposed alone), cut to its rank
    and copied and evaluated with its wave, so no wave's full eigenvectors outlive it."""
    out: list = [None] * len(xs)
    exact = []
    for i, x in enumerate(xs):
        s = sample_rows(x, sample)
        if _exact_route(min(s.shape[-2:]), rank):
            exact.append((i, s))
        else:
            out[i] = randomized_basis(x, rank, fraction, sample)
    wave = max(1, len(fit_streams()))
    for lo in range(0, len(exact), wave):
        fits = [(i, *_small_side_basis(s)) for i, s in exact[lo : lo + wave]]
        if rank is not None:
            ranks = [min(rank, v.shape[-1]) for _, v, _ in fits]
        else:
            ranks = mx.stack([energy_rank(sigma, fraction).max() for _, _, sigma in fits]).tolist()
        bases = [mx.contiguous(v[..., :r]) for (_, v, _), r in zip(fits, ranks)]
        mx.eval(bases)
        for (i, _, _), v, r in zip(fits, bases, ranks):
            out[i] = (v, int(r))
    return out


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


def gram_basis(x: mx.array, sample: int | None = None):
    """(V, sigma): the right singular vectors (..., d, d) by decreasing singular value and
    the singular values (..., d) of ``x`` (..., T, d), from at most ``sample`` of its rows
    (evenly spaced; the singular values rescaled to all T rows)."""
    t = x.shape[-2]
    x = sample_rows(x, sample)
    gram = x.swapaxes(-1, -2) @ x
    _, vectors = cpu_eigh(gram)  # ascending
    vectors = vectors[..., ::-1]
    # ‖x v‖ rather than the eigenvalue's root: the small singular values keep float32's
    # precision instead of losing half of it to the square
    sigma = mx.sqrt(((x @ vectors) ** 2).sum(axis=-2) * (t / x.shape[-2]))
    return vectors, sigma


_STARTS: dict[tuple[int, int, int], mx.array] = {}


def _gaussian_start(d: int, width: int, seed: int) -> mx.array:
    """The seeded Gaussian (d, width) every subspace iteration of that size starts from,
    drawn once."""
    key = (d, width, seed)
    if key not in _STARTS:
        _STARTS[key] = mx.random.normal((d, width), key=mx.random.key(seed), stream=mx.cpu)
    return _STARTS[key]


def gram_leading(gram: mx.array, k: int, iterations: int = POWER_ITERATIONS, seed: int = SEED):
    """(V (..., d, k), eigenvalues (..., k), trace (...)) of the Gram matrices ``gram``
    (..., d, d): ``leading_basis``'s work after the product over the rows. On a GPU, Gram
    matrices of at least ``DEVICE_FIT_MIN_DIM`` columns iterate there (``device_leading``);
    the rest on the CPU streams (``stream_leading``)."""
    d = gram.shape[-1]
    if _iterates_on_device(d, min(k + OVERSAMPLE, d)):
        return device_leading(gram, k, iterations, seed, split_product if _reduced_products() else mx.matmul)
    return stream_leading(gram, k, iterations, seed)


def stream_leading(gram: mx.array, k: int, iterations: int = POWER_ITERATIONS, seed: int = SEED):
    """``gram_leading`` on the CPU streams: d x width products, Householder QRs of d x width
    and a width x width eigenproblem (one wait for the Gram), or one d x d eigenproblem where
    the iterations' would cost more."""
    d = gram.shape[-1]
    width = min(k + OVERSAMPLE, d)

    def leading(g):
        if 3 * width >= d:  # the iterations' eigenproblems would cost more than one of d x d
            w, v = mx.linalg.eigh(g)
        else:
            v = _gaussian_start(d, width, seed)
            for _ in range(iterations):
                v = mx.linalg.qr(g @ v)[0]  # Householder on d x width: no pass over the tokens
            w, u = mx.linalg.eigh(v.swapaxes(-1, -2) @ g @ v)  # Rayleigh-Ritz, ascending
            v = v @ u
        leading = slice(-1, -k - 1, -1)  # the k largest, by decreasing value
        return v[..., leading], w[..., leading], mx.trace(g, axis1=-2, axis2=-1)

    return on_fit_streams(leading, gram)


DEVICE_FIT_ENV = "VQ_DEVICE_FIT"  # "0": every iteration on the CPU streams (A/B benchmarks)
DEVICE_FIT_MIN_DIM = 512  # Gram matrices at least this wide iterate on a GPU (kvtc's 1,024 channels)
POLAR_STEPS = (14, 4)  # Newton-Schulz steps: the quintic's (lift every singular value), then the cubic's
QUINTIC = (3.4445, -4.7750, 2.0315)  # the Muon optimizer's: (0, 1] into about [0.7, 1.2], small values x3.44 a step
_TF32_KEEPS = 0xFFFFE000  # the float32 bits a TF32 operand keeps: sign, exponent, 10 of 23 mantissa bits


def _iterates_on_device(d: int, width: int) -> bool:
    return (mx.default_device() != mx.cpu and d >= DEVICE_FIT_MIN_DIM and 3 * width < d
            and os.environ.get(DEVICE_FIT_ENV, "1") != "0")


def _reduced_products() -> bool:
    """Whether the default device multiplies float32 in TF32 (MLX does on CUDA, and on the
    GPUs with such units, unless ``MLX_ENABLE_TF32=0``)."""
    return mx.default_device() != mx.cpu and os.environ.get("MLX_ENABLE_TF32", "1") != "0"


def _high(a: mx.array) -> mx.array:
    return (a.view(mx.uint32) & _TF32_KEEPS).view(mx.float32)


def split_product(a: mx.array, b: mx.array, product=mx.matmul) -> mx.array:
    """``a @ b`` to about float32's precision where ``product`` rounds its operands to TF32:
    each operand split into the part TF32 keeps and the rest (exact in float32), the three
    products that matter summed (the two rests' product is below float32's rounding)."""
    ah, bh = _high(a), _high(b)
    return product(ah, bh) + (product(ah, b - bh) + product(a - ah, bh))


def device_polar(y: mx.array, product=mx.matmul, steps: tuple = POLAR_STEPS) -> mx.array:
    """Orthonormal columns spanning those of ``y`` (..., d, w) by Newton-Schulz steps, matrix
    products only (no decomposition, so it runs on a GPU): the columns to unit norm, the
    whole scaled by ``1/sqrt(w)`` (every singular value in (0, 1]), ``steps[0]`` quintic steps
    (a value below 1 grows 3.44x a step: 14 lift 1e-7 into about [0.7, 1.2]), ``steps[1]``
    cubic ones (``y (3 - yᵀy) / 2``: quadratic convergence to the polar factor). The singular
    vectors stay; a direction with no weight (a dependent column) stays near zero."""
    y = y / mx.maximum(mx.linalg.norm(y, axis=-2, keepdims=True), 1e-30) / math.sqrt(y.shape[-1])
    a5, b5, c5 = QUINTIC
    for _ in range(steps[0]):
        gram = product(y.swapaxes(-1, -2), y)
        y = a5 * y + product(y, b5 * gram + c5 * product(gram, gram))
    for _ in range(steps[1]):
        y = 1.5 * y - 0.5 * product(y, product(y.swapaxes(-1, -2), y))
    return y


@functools.lru_cache(maxsize=None)
def compiled_polar(product):
    """``device_polar`` with ``product`` as one compiled pass (its elementwise work fused: a
    launch or two a step besides the products), traced once a shape."""
    return mx.compile(functools.partial(device_polar, product=product))


def device_leading(gram: mx.array, k: int, iterations: int = POWER_ITERATIONS, seed: int = SEED,
                   product=mx.matmul, polar=None):
    """``gram_leading`` with its products on the default device (a GPU): subspace iteration
    orthonormalised by ``polar`` (``device_polar`` with ``product``, compiled by default),
    then the Rayleigh-Ritz step's (k + p) x (k + p) eigenproblem on a CPU stream, the one
    wait for the device."""
    d = gram.shape[-1]
    width = min(k + OVERSAMPLE, d)
    polar = compiled_polar(product) if polar is None else polar
    v = mx.broadcast_to(_gaussian_start(d, width, seed), (*gram.shape[:-2], d, width))
    for _ in range(iterations):
        v = polar(product(gram, v))
    ritz = product(v.swapaxes(-1, -2), product(gram, v))
    w, u = cpu_eigh((ritz + ritz.swapaxes(-1, -2)) / 2)  # ascending
    leading = slice(-1, -k - 1, -1)
    return product(v, u[..., leading]), w[..., leading], mx.trace(gram, axis1=-2, axis2=-1)


def leading_basis(x: mx.array, k: int, iterations: int = POWER_ITERATIONS, seed: int = SEED):
    """(V (..., d, k), sigma (..., k), energy (...)): approximate leading right singular
    vectors and values of ``x`` (..., T, d) by decreasing value, from at most
    ``FIT_SAMPLE_TOKENS`` of its rows (``sample_rows``; the values and the energy
    rescaled to all T rows), and the energy ``‖x‖²``; float32."""
    t, d = x.shape[-2:]
    if not 0 < k <= min(t, d):
        raise ValueError(f"k={k} must be in 1..min(T={t}, d={d})")
    xs = sample_rows(x)
    scale = t / xs.shape[-2]
    v, w, energy = gram_leading(xs.swapaxes(-1, -2) @ xs, k, iterations, seed)
    if scale != 1:
        w, energy = w * scale, energy * scale
    return v, mx.sqrt(mx.maximum(w, 0.0)), energy


def energy_rank(sigma: mx.array, fraction: float, power: int = 2, total: mx.array | None = None) -> mx.array:
    """(...) int32: the smallest r with ``sum(sigma[:r]**p) >= fraction * sum(sigma**p)``;
    ``power`` 2 is the spectral energy, 1 the singular-value mass (SVDq's and Palu's rule).
    ``total`` (...): the whole sum when ``sigma`` holds only the leading values (then
    ``len(sigma)`` where they fall short)."""
    energy = mx.cumsum(sigma.astype(mx.float32) ** power, axis=-1)
    whole = energy[..., -1:] if total is None else total[..., None]
    below = (energy < fraction * whole).sum(axis=-1)
    return mx.minimum(below + 1, sigma.shape[-1]).astype(mx.int32)


def rank_cap(t: int, d: int, fraction: float) -> int:
    """``max(1, ceil(fraction * min(t, d)))``: the largest rank a rule may choose."""
    return max(1, math.ceil(fraction * min(t, d) - 1e-9))
