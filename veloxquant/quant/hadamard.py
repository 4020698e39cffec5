"""The randomized Hadamard rotation: seeded random signs, then the orthonormal
Walsh-Hadamard transform, ``y = (x * signs) H / sqrt(d)``.

After it, the coordinates of any fixed vector are spread evenly (close to Gaussian for
a large head_dim), which is what lets one fixed scalar codebook serve every vector
(AnchorKV's residuals, TurboQuant's keys and values). It is orthogonal, so its inverse
is its transpose: ``x = (y H / sqrt(d)) * signs``. Everything is derived from the seed
and head_dim (memoised transients, not state: a cache keeps only what it coded).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from .vq import rotation_problem

__all__ = ["rotation_problem", "signs", "rotate", "unrotate", "matrix"]


@functools.lru_cache(maxsize=8)
def signs(seed: int, d: int) -> mx.array:
    return mx.where(mx.random.bernoulli(0.5, (d,), key=mx.random.key(seed)), 1.0, -1.0)


def rotate(x: mx.array, seed: int) -> mx.array:
    """``(x * signs) H / sqrt(d)`` in float32, along the last axis."""
    d = x.shape[-1]
    return mx.hadamard_transform(x.astype(mx.float32) * signs(seed, d), scale=d ** -0.5)


def unrotate(y: mx.array, seed: int) -> mx.array:
    d = y.shape[-1]
    return mx.hadamard_transform(y, scale=d ** -0.5) * signs(seed, d)


@functools.lru_cache(maxsize=8)
def matrix(seed: int, d: int) -> mx.array:
    """The rotation as a dense (d, d) float32 matrix R, ``rotate(x) == x @ R``: one
    matmul folds it into a product that follows (a query against rotated keys)."""
    r = rotate(mx.eye(d, dtype=mx.float32), seed)
    mx.eval(r)
    return r
