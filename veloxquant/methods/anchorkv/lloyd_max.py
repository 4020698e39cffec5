"""Vectors coded as a random-sign Hadamard rotation, one scale, and Lloyd-Max levels.

``RotatedGaussian(bits, seed)`` codes a vector r (d,): ``y = (r * signs) H`` (H the
orthonormal Walsh-Hadamard transform, ``signs`` seeded ±1: ``quant/hadamard.py``), ``s = ||y|| / sqrt(d)`` (the
RMS, so that ``y / s`` has unit variance, the scale the levels were made for), codes =
the nearest of the ``2**bits`` Lloyd-Max levels of a unit Gaussian (2 bits: ±0.4528,
±1.5104). After a random rotation the coordinates of a vector are close to Gaussian,
which is why one fixed codebook serves every vector. ``r_hat = s (levels[c] H) * signs``.

Reads never rebuild r: ``q . r_hat = s ((q * signs) H) . levels[c]`` (the query rotated
once), ``Σ_t p_t r_hat_t = ((Σ_t p_t s_t levels[c_t]) H) * signs`` (rotated back once).

The signs and the levels are derived from ``seed`` and ``bits`` (memoised transients,
not state: a cache keeps only codes and scales). Codes are packed at ``bits`` bits
(``affine.pack_codes``: d must be a multiple of 32 at widths that do not divide 32).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx

from ...quant import hadamard
from ...quant.affine import pack_codes, unpack_codes
from ...quant.codebook import nearest
from ...quant.hadamard import rotation_problem

LLOYD_ITERS = 300  # enough for the 8-bit levels to settle to float32


@functools.lru_cache(maxsize=None)
def gaussian_levels(bits: int) -> tuple[float, ...]:
    """The Lloyd-Max levels of a unit Gaussian at ``bits`` bits, increasing: each level the
    mean of the Gaussian over its cell, each cell boundary midway between two levels."""
    n = 1 << bits
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    levels = [math.sqrt(2) * _erfinv(2 * (j + 0.5) / n - 1) for j in range(n)]
    for _ in range(LLOYD_ITERS):
        cuts = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
        new = []
        for lo, hi, old in zip(cuts, cuts[1:], levels):
            mass = cdf(hi) - cdf(lo)
            new.append((pdf(lo) - pdf(hi)) / mass if mass > 0 else old)
        levels = new
    return tuple(levels)


def _erfinv(y: float) -> float:
    x = 0.0
    for _ in range(60):  # Newton on erf(x) = y
        x -= (math.erf(x) - y) / (2 / math.sqrt(math.pi) * math.exp(-x * x))
    return x


@dataclass(frozen=True)
class RotatedGaussian:
    bits: int
    seed: int

    def problem(self, d: int) -> str | None:
        if rotation_problem(d):
            return rotation_problem(d)
        if 32 % self.bits and d % 32:
            return f"head_dim={d}: {self.bits}-bit codes pack 32 at a time"
        return None

    def levels(self) -> mx.array:
        return mx.array(gaussian_levels(self.bits), mx.float32)

    def rotate(self, x: mx.array) -> mx.array:
        """``(x * signs) H``, float32 (queries before scoring, vectors before coding)."""
        return hadamard.rotate(x, self.seed)

    def unrotate(self, y: mx.array) -> mx.array:
        return hadamard.unrotate(y, self.seed)

    def encode(self, r: mx.array):
        """Vectors (..., d) -> (codes (..., d * bits / 32) uint32, scales (...) float16)."""
        if r.size == 0:
            return mx.zeros((*r.shape[:-1], r.shape[-1] * self.bits // 32), mx.uint32), mx.zeros(r.shape[:-1], mx.float16)
        y = self.rotate(r)
        scale = mx.sqrt(mx.mean(y * y, axis=-1)).astype(mx.float16)
        s = mx.maximum(scale.astype(mx.float32), 1e-30)[..., None]
        return pack_codes(nearest(y / s, self.levels()), self.bits), scale

    def coordinates(self, codes: mx.array, scales: mx.array) -> mx.array:
        """The rotated vectors ``s levels[c]`` (..., d), float32."""
        return self.levels()[unpack_codes(codes, self.bits)] * scales.astype(mx.float32)[..., None]

    def decode(self, codes: mx.array, scales: mx.array) -> mx.array:
        return self.unrotate(self.coordinates(codes, scales))
