"""Non-uniform scalar codebooks: 2^b sorted centroids in [-1, 1], Lloyd fitting, packed indices.

A codebook quantizes normalized values z (in [-1, 1]) to the nearest of ``2**bits``
centroids; what is stored per value is the centroid's index.

- **Fitting** (``fit``): centroids start at the data's quantiles ``(j + 1/2) / 2^b`` (the
  quantiles of a normal, scaled into [-1, 1], when there is no data), or at the uniform
  grid where that fits the data better, and run ``iters``
  Lloyd steps (1-D k-means: assign each value to its nearest centroid, move each centroid
  to the mean of its members, an empty cluster keeps its centroid), which never increase
  the mean squared error. Values may carry weights (0: not part of the data, e.g.
  outliers; a histogram's counts for a warm refit, ``RefitHistogram``). At most
  ``FIT_SAMPLES`` values are used, a seeded sample of larger sets (the offline k-means it
  replaces fits a calibration sample too), so fitting a long prompt stays cheap and
  deterministic. The result is sorted and clipped into [-1, 1].
- **Nearest centroid** (``nearest``): the number of centroid midpoints below z (what
  ``searchsorted`` on the midpoints gives), as ``2^b - 1`` fused comparisons: no
  (values x centroids) array is formed.
- **Indices** are packed as bit planes (``pack_planes``): ``b`` uint32 words per 32
  consecutive indices, word p holding bit p of each, so that unpacking
  is elementwise at every width (3 and 5 bits included) and fuses into one compiled pass.
- **Lookup** (``lookup``): ``c[k] = c_0 + sum_j (c_j - c_{j-1}) [k >= j]``, fused
  elementwise (no gather, slow on the CPU), with one codebook or one per row (``tables``),
  in passes of at most ``FUSED_STEPS`` steps (what one compiled kernel takes).

The fused passes are compiled for each shape they meet (not shapeless: MLX's shapeless
kernels here run several times slower); readers hand them whole buffers, whose shapes
change only when the buffers grow.
"""

from __future__ import annotations

import functools

import mlx.core as mx

# Centroid steps one compiled lookup pass takes: MLX's CPU compile fuses the 7 steps of 3
# bits into one kernel but not the 15 of 4 bits (benchmarks/notes/quantization.md).
FUSED_STEPS = 7
FIT_SAMPLES = 1 << 16  # values a fit looks at, at most (a seeded sample beyond)
HIST_BINS = 256  # bins of a refit histogram over [-1, 1]
_SHIFTS = mx.arange(32, dtype=mx.uint32)


def normal_grid(bits: int) -> mx.array:
    """The quantiles (j + 1/2) / 2^b of a standard normal, scaled so the outermost are +-1."""
    n = 1 << bits
    q = mx.sqrt(mx.array(2.0)) * mx.erfinv(2 * (mx.arange(n, dtype=mx.float32) + 0.5) / n - 1)
    return q / q[-1]


# -- nearest centroid and lookup: fused elementwise passes -------------------------------
@functools.lru_cache(maxsize=None)
def _nearest_fn(n: int):
    def nearest(z, *mids):
        idx = (z > mids[0]).astype(mx.uint32)
        for m in mids[1:]:
            idx = idx + (z > m).astype(mx.uint32)
        return idx

    return mx.compile(nearest)


def nearest(z: mx.array, centroids: mx.array) -> mx.array:
    """uint32 index of the nearest centroid of each z (ties go to the lower centroid)."""
    c = centroids.astype(mx.float32)
    mids = (c[1:] + c[:-1]) / 2
    # one-element slices (views), not scalar indexing (a gather each, which no pass fuses)
    return _nearest_fn(c.shape[0])(z, *[mids[j : j + 1] for j in range(mids.shape[0])])


@functools.lru_cache(maxsize=None)
def _lookup_fn(first: int, n: int):
    def lookup(k, c, *steps):
        c = c + 0 * k
        for j, s in enumerate(steps, start=first):
            c = c + mx.where(k >= j, s, 0.0)
        return c

    return mx.compile(lookup)


def lookup(codes: mx.array, tables: mx.array) -> mx.array:
    """Centroid values (float32) of float32 ``codes``. ``tables``: one codebook (2^b,), or
    one per row (..., 2^b), its leading axes (``codes``' rank) broadcast against ``codes``.
    At most ``FUSED_STEPS`` steps a pass: one pass up to 3 bits, 3 at 4 bits, 5 at 5."""
    t = tables.astype(mx.float32)
    steps = t[..., 1:] - t[..., :-1]
    c = t[..., 0]
    for first in range(0, steps.shape[-1], FUSED_STEPS):
        part = [steps[..., j] for j in range(first, min(first + FUSED_STEPS, steps.shape[-1]))]
        c = _lookup_fn(first + 1, len(part))(codes, c, *part)
    return c


# -- packed indices ---------------------------------------------------------------------------
def plane_words(n: int) -> int:
    """uint32 words per bit plane for ``n`` indices."""
    return -(-n // 32)


def pack_planes(idx: mx.array, bits: int) -> mx.array:
    """(..., n) indices below 2^bits -> (..., bits, ceil(n / 32)) uint32 bit planes."""
    *lead, n = idx.shape
    pad = plane_words(n) * 32 - n
    idx = idx.astype(mx.uint32)
    if pad:
        idx = mx.pad(idx, [(0, 0)] * len(lead) + [(0, pad)])
    idx = idx.reshape(*lead, -1, 32)
    planes = [(((idx >> p) & 1) << _SHIFTS).sum(axis=-1).astype(mx.uint32) for p in range(bits)]
    return mx.stack(planes, axis=-2)


@functools.lru_cache(maxsize=None)
# -- fitting ------------------------------------------------------------------------------------
def _sample(z: mx.array, weights: mx.array, seed: int):
    z, weights = z.reshape(-1), weights.reshape(-1)
    if z.size > FIT_SAMPLES:
        pick = mx.random.randint(0, z.size, (FIT_SAMPLES,), key=mx.random.key(seed))
        z, weights = z[pick], weights[pick]
    return z.astype(mx.float32), weights.astype(mx.float32)


def quantile_init(z: mx.array, weights: mx.array, bits: int) -> mx.array:
    """Centroids at the (j + 1/2) / 2^b quantiles of the values of nonzero weight (the
    normal grid when there are none)."""
    n = 1 << bits
    present = weights > 0
    ordered = mx.sort(mx.where(present, z, mx.inf))
    count = present.sum()
    at = mx.floor((mx.arange(n, dtype=mx.float32) + 0.5) / n * count).astype(mx.int32)
    grid = ordered[mx.minimum(at, ordered.shape[0] - 1)]
    return mx.where(count > 0, grid, normal_grid(bits))


def lloyd_step(z: mx.array, weights: mx.array, centroids: mx.array) -> mx.array:
    """One Lloyd step on weighted values: nearest centroid, then weighted cluster means
    (an empty cluster keeps its centroid)."""
    idx = nearest(z, centroids)
    n = centroids.shape[0]
    mass = mx.zeros((n,), mx.float32).at[idx].add(weights)
    total = mx.zeros((n,), mx.float32).at[idx].add(weights * z)
    return mx.where(mass > 0, total / mx.where(mass > 0, mass, 1.0), centroids)


def lloyd(z: mx.array, weights: mx.array, centroids: mx.array, iters: int) -> mx.array:
    c = centroids.astype(mx.float32)
    for _ in range(iters):
        c = lloyd_step(z, weights, c)
    return mx.clip(mx.sort(c), -1.0, 1.0)


def uniform_grid(bits: int) -> mx.array:
    """2^b evenly spaced levels from -1 to 1: min-max (affine) quantization's, normalized."""
    return mx.linspace(-1.0, 1.0, 1 << bits)


def fit(z: mx.array, bits: int, iters: int, weights: mx.array | None = None, seed: int = 0) -> mx.array:
    """A codebook of 2^bits sorted centroids in [-1, 1] for the values ``z`` (weights:
    0 leaves a value out): Lloyd from the quantile grid, or from the uniform grid where
    that fits the data better (from 16 levels on, a quantile start is far from the optimum
    and a few steps do not make up for it), so it never fits worse than uniform levels."""
    z, weights = _sample(z, mx.ones(z.shape) if weights is None else weights, seed)
    grid, uniform = quantile_init(z, weights, bits), uniform_grid(bits)
    start = mx.where(mse(z, grid, weights) <= mse(z, uniform, weights), grid, uniform)
    return lloyd(z, weights, start, iters)


def mse(z: mx.array, centroids: mx.array, weights: mx.array | None = None) -> mx.array:
    """Mean squared error of ``z`` quantized to ``centroids`` (weighted)."""
    err = mx.square(z - lookup(nearest(z, centroids).astype(mx.float32), centroids))
    if weights is None:
        return err.mean()
    return (err * weights).sum() / weights.sum()


# -- warm refits: what was encoded since the last fit, as a histogram ---------------------------
def histogram(z: mx.array, weights: mx.array) -> mx.array:
    """(2, HIST_BINS) float32: per bin of [-1, 1], the weight and the weighted sum of z."""
    z, weights = z.reshape(-1).astype(mx.float32), weights.reshape(-1).astype(mx.float32)
    b = mx.clip(mx.floor((z + 1) * (HIST_BINS / 2)), 0, HIST_BINS - 1).astype(mx.uint32)
    mass = mx.zeros((HIST_BINS,), mx.float32).at[b].add(weights)
    total = mx.zeros((HIST_BINS,), mx.float32).at[b].add(weights * z)
    return mx.stack([mass, total])


def refit(hist: mx.array, centroids: mx.array, iters: int) -> mx.array:
    """Lloyd warm-started at ``centroids`` on a histogram's bins (each bin its mean, weighed
    by its mass): ``iters`` steps, sorted, in [-1, 1]."""
    mass, total = hist[0], hist[1]
    centres = (mx.arange(HIST_BINS, dtype=mx.float32) + 0.5) * (2 / HIST_BINS) - 1
    points = mx.where(mass > 0, total / mx.where(mass > 0, mass, 1.0), centres)
    return lloyd(points, mass, centroids, iters)


@functools.lru_cache(maxsize=None)
def compiled_refit(iters: int):
    """``refit`` at ``iters`` steps as one compiled graph of (hist, centroids): a decode
    step's refit, traced once (its shapes do not change)."""
    return mx.compile(lambda hist, centroids: refit(hist, centroids, iters))


@functools.lru_cache(maxsize=None)
def _compiled_accumulate():
    return mx.compile(lambda seen, z, weights: seen + histogram(z, weights))


def accumulate(seen: mx.array | None, z: mx.array, weights: mx.array) -> mx.array:
    """``seen`` plus the histogram of (``z``, ``weights``), in one compiled graph."""
    return histogram(z, weights) if seen is None else _compiled_accumulate()(seen, z, weights)
