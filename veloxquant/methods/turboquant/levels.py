"""Lloyd-Max levels for one coordinate of a random unit vector in R^d.

After a random rotation, each coordinate of a unit vector has the density
``f(x) ∝ (1 - x²)^((d-3)/2)`` on [-1, 1] (TurboQuant, Lemma 1: close to N(0, 1/d) for a
large d), whatever the vector was. Its optimal scalar quantizer at ``bits`` bits is the
fixed point of Lloyd-Max's conditions: each cell boundary midway between its two levels,
each level the mean of ``f`` over its cell. Nothing is calibrated; the levels depend on
(bits, d) only, computed once in float64 by Lloyd's iteration on a fine midpoint grid of
the density (``GRID`` points over the range that holds all but ~e^-72 of its mass).
"""

from __future__ import annotations

import functools
import math

import numpy as np

GRID = 1 << 18  # midpoints of the density's grid
RANGE_SIGMAS = 12.0  # the grid's half-width, in units of 1/sqrt(d) (capped at 1)
MAX_ITERS = 2000
TOLERANCE = 1e-13  # a level's largest move, in units of 1/sqrt(d), at which Lloyd stops


def density_grid(d: int) -> tuple[np.ndarray, np.ndarray]:
    """(midpoints, weights) of the coordinate density at head_dim ``d`` (weights sum to 1)."""
    half = min(1.0, RANGE_SIGMAS / math.sqrt(d))
    h = 2 * half / GRID
    x = -half + h * (np.arange(GRID) + 0.5)
    logf = (d - 3) / 2 * np.log1p(-x * x)
    w = np.exp(logf - logf.max())
    return x, w / w.sum()


@functools.lru_cache(maxsize=None)
def sphere_levels(bits: int, d: int) -> tuple[float, ...]:
    """The 2^bits Lloyd-Max levels (increasing) of a unit vector's coordinate in R^d."""
    x, w = density_grid(d)
    n = 1 << bits
    sigma = 1 / math.sqrt(d)
    # start at the high-resolution optimum's spacing (point density ~ f^(1/3): N(0, 3/d))
    u = (np.arange(n) + 0.5) / n
    levels = np.array([math.sqrt(6) * sigma * _erfinv(2 * p - 1) for p in u])
    # a cell's mass and first moment as differences of prefix sums over the sorted grid:
    # an iteration costs 2^bits searches, not a pass over the grid
    mass_sum = np.concatenate([[0.0], np.cumsum(w)])
    moment_sum = np.concatenate([[0.0], np.cumsum(w * x)])
    for _ in range(MAX_ITERS):
        ends = np.concatenate([[0], np.searchsorted(x, (levels[1:] + levels[:-1]) / 2, side="right"), [len(x)]])
        mass = mass_sum[ends[1:]] - mass_sum[ends[:-1]]
        moment = moment_sum[ends[1:]] - moment_sum[ends[:-1]]
        new = np.where(mass > 0, moment / np.where(mass > 0, mass, 1.0), levels)
        moved = np.abs(new - levels).max()
        levels = new
        if moved < TOLERANCE * sigma:
            break
    return tuple(float(v) for v in levels)


def distortion(levels, d: int) -> float:
    """E[(X - Q(X))²] of one coordinate; times d, the mean squared error of a unit vector."""
    x, w = density_grid(d)
    lv = np.asarray(levels)
    q = lv[np.searchsorted((lv[1:] + lv[:-1]) / 2, x)]
    return float((w * (x - q) ** 2).sum())


def _erfinv(y: float) -> float:
    x = 0.0
    for _ in range(100):  # Newton on erf(x) = y
        step = (math.erf(x) - y) / (2 / math.sqrt(math.pi) * math.exp(-x * x))
        x -= step
        if abs(step) < 1e-15:
            break
    return x
