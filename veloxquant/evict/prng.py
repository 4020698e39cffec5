"""Explicit PRNG keys for methods that draw at random: a hash of (seed, layer, position).

A draw depends only on the seed, the layer and the step's position, never on MLX's
global seed or on what was drawn before, so a saved, loaded or copied cache draws what
a fresh one would. The hash is splitmix64's finaliser (cam's gate draws from ``step_key``;
keyformer keys its per-logit position hash with ``mix64``).
"""

from __future__ import annotations

import mlx.core as mx

MASK64 = 2**64 - 1


def mix64(x: int) -> int:
    """splitmix64's finaliser: a 64-bit integer hash (distinct inputs, unrelated outputs)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def step_key(seed: int, layer: int, position: int) -> mx.array:
    """MLX's PRNG key of a hash of (seed, layer, position): one array op."""
    return mx.random.key(mix64(mix64(mix64(seed & MASK64) ^ layer) ^ position))
