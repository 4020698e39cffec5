"""Non-uniform scalar codebooks: 2^b sorted centroids in [-1, 1], Lloyd fitting, packed indices.

A codebook quantizes normalized values z (in [-1, 1]) to the nearest of ``2**bits``
centroids; what is stored per value is the centroid's index.

Codebooks have a leading batch axis: fitting takes values (B, ...), flattened per row, and
gives codebooks (B, 2^bits), row b's fitted (and refitted) on row b's values only, so that a
cache fed B rows holds the codebook each row's sequence holds alone. A single sequence's
codebook is a batch of one. Every reduction, sort and scatter-add is taken within a row, so
a row's codebook does not depend on the other rows (bit for bit on the CPU, where
scatter-adds add in order; on a GPU they are atomic, in no fixed order).

- **Fitting** (``fit``): a row's centroids start at its data's quantiles
  ``(j + 1/2) / 2^b`` (the quantiles of a normal, scaled into [-1, 1], when there is no
  data), or at the uniform grid where that fits the row's data better, and run ``iters``
  Lloyd steps (1-D k-means: assign each value to its nearest centroid, move each centroid
  to the mean of its members, an empty cluster keeps its centroid), which never increase
  the mean squared error. Values may carry weights (0: not part of the data, e.g.
  outliers; a histogram's counts for a warm refit, ``refit``). At most ``FIT_SAMPLES``
  values a row are used, a seeded sample of larger rows (the same positions in every
  row; the offline k-means it replaces fits a calibration sample too), so fitting a long
  prompt stays cheap and deterministic. The result is sorted and clipped into [-1, 1].
- **Warm refits** (``accumulate``, ``refit``): what each row encodes after its fit is
  added into its histogram of ``HIST_BINS`` bins over [-1, 1] (weight and weighted sum);
  ``refit`` runs Lloyd on each row's bins, warm-started at its codebook.
- **Nearest centroid** (``nearest``): the number of centroid midpoints below z (what
  ``searchsorted`` on the midpoints gives), as ``2^b - 1`` fused comparisons: no
  (values x centroids) array is formed; with one codebook (2^b,) or one per row.
- **Indices** are packed as bit planes (``pack_planes``): ``b`` uint32 words per 32
  consecutive indices, word p holding bit p of each, so that unpacking
  is elementwise at every width (3 and 5 bits included) and fuses into one compiled pass.
- **Lookup** (``lookup``): ``c[k] = c_0 + sum_j (c_j - c_{j-1}) [k >= j]``, fused
  elementwise (no gather, slow on the CPU), with one codebook or one per row (``tables``),
  in passes of at most ``FUSED_STEPS`` steps (what one compiled kernel takes).

The fused passes are compiled for each shape they meet (not shapeless: MLX's shapeless
kernels here run several times slower); readers hand them whole buffers, whose shapes
change only when the buffers grow. (MLX's ``vmap`` over one-row functions would give the
same values, but takes the compiled passes apart: one pass per centroid.)
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
    """uint32 index of the nearest centroid of each z (ties go to the lower centroid).
    ``centroids``: one codebook (2^b,), or one per row (B, 1, ..., 1, 2^b) of z's rank
    (its leading axes broadcast against z's; (B, 2^b) for values (B, N))."""
    c = centroids.astype(mx.float32)
    mids = (c[..., 1:] + c[..., :-1]) / 2
    # one-element slices (views), not scalar indexing (a gather each, which no pass fuses)
    return _nearest_fn(c.shape[-1])(z, *[mids[..., j : j + 1] for j in range(mids.shape[-1])])


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


# -- fitting ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def row_index(rows: int, n: int) -> mx.array:
    """(rows, n) uint32: each value's row, for the scatter-adds into (rows, 2^bits) (built
    once per shape, evaluated with the step that first reads it; of the indices' shape and
    type, so that a scatter adds no broadcast or cast to a decode step's graph)."""
    return mx.broadcast_to(mx.arange(rows, dtype=mx.uint32)[:, None], (rows, n))


def _sample(z: mx.array, weights: mx.array, seed: int):
    """Each row flattened, and past ``FIT_SAMPLES`` values a seeded sample (the same
    positions in every row, the ones a row alone gets)."""
    rows = z.shape[0]
    z, weights = z.reshape(rows, -1), weights.reshape(rows, -1)
    if z.shape[1] > FIT_SAMPLES:
        pick = mx.random.randint(0, z.shape[1], (FIT_SAMPLES,), key=mx.random.key(seed))
        z, weights = z[:, pick], weights[:, pick]
    return z.astype(mx.float32), weights.astype(mx.float32)


def quantile_init(z: mx.array, weights: mx.array, bits: int) -> mx.array:
    """(B, 2^bits): each row's centroids at the (j + 1/2) / 2^b quantiles of its values of
    nonzero weight (z, weights (B, N); the normal grid for a row with none)."""
    n = 1 << bits
    present = weights > 0
    ordered = mx.sort(mx.where(present, z, mx.inf), axis=-1)
    count = present.sum(axis=-1, keepdims=True)
    at = mx.floor((mx.arange(n, dtype=mx.float32) + 0.5) / n * count).astype(mx.int32)
    grid = mx.take_along_axis(ordered, mx.minimum(at, ordered.shape[-1] - 1), axis=-1)
    return mx.where(count > 0, grid, normal_grid(bits))


def mse(z: mx.array, centroids: mx.array, weights: mx.array) -> mx.array:
    """(B,): each row's weighted mean squared error of its values (z, weights (B, N))
    quantized to its codebook (centroids (B, 2^bits))."""
    err = mx.square(z - lookup(nearest(z, centroids).astype(mx.float32), centroids[:, None]))
    return (err * weights).sum(axis=-1) / weights.sum(axis=-1)


def lloyd_step(z: mx.array, weights: mx.array, centroids: mx.array, rows: mx.array) -> mx.array:
    """One Lloyd step in each row on its weighted values (z, weights (B, N)): each value to
    its nearest centroid of the row's codebook, then the row's weighted cluster means (an
    empty cluster keeps its centroid). ``rows``: ``row_index(B, N)``."""
    idx = nearest(z, centroids)
    mass = mx.zeros(centroids.shape, mx.float32).at[rows, idx].add(weights)
    total = mx.zeros(centroids.shape, mx.float32).at[rows, idx].add(weights * z)
    return mx.where(mass > 0, total / mx.where(mass > 0, mass, 1.0), centroids)


def lloyd(z: mx.array, weights: mx.array, centroids: mx.array, iters: int, rows: mx.array | None = None) -> mx.array:
    """``iters`` Lloyd steps in each row from ``centroids`` (B, 2^bits), sorted, in [-1, 1].
    1-D z, weights and centroids: one codebook (a batch of one, returned 1-D)."""
    if centroids.ndim == 1:
        return lloyd(z[None], weights[None], centroids[None], iters)[0]
    rows = row_index(*z.shape) if rows is None else rows
    c = centroids.astype(mx.float32)
    for _ in range(iters):
        c = lloyd_step(z, weights, c, rows)
    return mx.clip(mx.sort(c, axis=-1), -1.0, 1.0)


def uniform_grid(bits: int) -> mx.array:
    """2^b evenly spaced levels from -1 to 1: min-max (affine) quantization's, normalized."""
    return mx.linspace(-1.0, 1.0, 1 << bits)


def fit(z: mx.array, bits: int, iters: int, weights: mx.array, seed: int = 0) -> mx.array:
    """(B, 2^bits): row b's codebook of sorted centroids in [-1, 1] for its values ``z[b]``
    (weights: 0 leaves a value out): Lloyd from the quantile grid, or from the uniform grid
    where that fits the row better (from 16 levels on, a quantile start is far from the
    optimum and a few steps do not make up for it), so it never fits worse than uniform
    levels."""
    z, weights = _sample(z, weights, seed)
    grid = quantile_init(z, weights, bits)
    uniform = mx.broadcast_to(uniform_grid(bits), grid.shape)
    start = mx.where((mse(z, grid, weights) <= mse(z, uniform, weights))[:, None], grid, uniform)
    return lloyd(z, weights, start, iters, row_index(*z.shape))


# -- warm refits: what was encoded since the last fit, as a histogram ---------------------------
def histogram(z: mx.array, weights: mx.array) -> mx.array:
    """(B, 2, HIST_BINS) float32: per row, per bin of [-1, 1], the weight and the weighted
    sum of the row's z (the rows' histograms laid end to end in one scatter-add each: a
    value's bin offset by its row's place)."""
    rows, per_row, bins = z.shape[0], z.size // z.shape[0], HIST_BINS
    z, weights = z.reshape(-1).astype(mx.float32), weights.reshape(-1).astype(mx.float32)
    b = mx.clip(mx.floor((z + 1) * (bins / 2)), 0, bins - 1).astype(mx.uint32)
    if rows > 1:
        b = b + mx.repeat(mx.arange(rows, dtype=mx.uint32) * (2 * bins), per_row)
    out = mx.zeros((rows * 2 * bins,), mx.float32).at[b].add(weights).at[b + bins].add(weights * z)
    return out.reshape(rows, 2, bins)


def refit(hist: mx.array, centroids: mx.array, iters: int, rows: mx.array) -> mx.array:
    """(B, 2^bits): Lloyd in each row warm-started at its codebook (``centroids`` (B, 2^bits))
    on its histogram's bins (each bin its mean, weighed by its mass): ``iters`` steps,
    sorted, in [-1, 1]. ``rows``: ``row_index(B, HIST_BINS)``."""
    mass, total = (h.squeeze(1) for h in mx.split(hist, 2, axis=1))
    centres = (mx.arange(HIST_BINS, dtype=mx.float32) + 0.5) * (2 / HIST_BINS) - 1
    points = mx.where(mass > 0, total / mx.where(mass > 0, mass, 1.0), centres)
    return lloyd(points, mass, centroids, iters, rows)


@functools.lru_cache(maxsize=None)
def _compiled_refit(iters: int):
    return mx.compile(lambda hist, centroids, rows: refit(hist, centroids, iters, rows))


def compiled_refit(hist: mx.array, centroids: mx.array, iters: int) -> mx.array:
    """``refit`` as one compiled graph (traced once per shape): a decode step's refit,
    every row at once."""
    return _compiled_refit(iters)(hist, centroids, row_index(hist.shape[0], HIST_BINS))


@functools.lru_cache(maxsize=None)
def _compiled_accumulate():
    return mx.compile(lambda seen, z, weights: seen + histogram(z, weights))


def accumulate(seen: mx.array | None, z: mx.array, weights: mx.array) -> mx.array:
    """``seen`` (B, 2, HIST_BINS) plus each row's histogram of (``z``, ``weights``), in one
    compiled graph."""
    return histogram(z, weights) if seen is None else _compiled_accumulate()(seen, z, weights)
