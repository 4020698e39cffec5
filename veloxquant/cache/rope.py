"""The model's rotary embedding, undone on cached keys, for scores that want pre-RoPE keys.

mlx-lm hands caches post-RoPE keys: the key of the token at position p had each of its
feature pairs rotated by the angle p * w_i. ``Rotary`` says how a model rotated (its
base theta, which features pair up, its frequency scaling) and ``derotate`` rotates kept
keys back at their own positions, which need not be contiguous once tokens were evicted.
Pairs follow ``mx.fast.rope``: (i, i + d/2) by default, (2i, 2i + 1) when
``traditional``. Frequency scalings: none ('default'), 'linear' and 'llama3', read from
mlx-lm's ``rope_scaling`` dict; any other type is refused by name rather than undone
wrongly. Every feature is taken to be rotated (no partial rotary dimensions).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

SCALINGS = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Rotary:
    base: float
    traditional: bool = False
    scaling: str = ""  # the rope_scaling dict as sorted JSON; "" for none

    @classmethod
    def from_model_args(cls, args: Any) -> "Rotary | None":
        """The rotary settings of mlx-lm ``ModelArgs`` (None when they name no rope_theta)."""
        base = getattr(args, "rope_theta", None)
        if base is None:
            return None
        scaling = getattr(args, "rope_scaling", None) or {}
        kind = scaling.get("type") or scaling.get("rope_type") or "default"
        if kind not in SCALINGS:
            raise ValueError(f"rope_scaling type {kind!r} cannot be undone on cached keys "
                             f"(supported: {', '.join(SCALINGS)})")
        text = json.dumps(scaling, sort_keys=True) if kind != "default" else ""
        return cls(float(base), bool(getattr(args, "rope_traditional", False)), text)

    def to_json(self) -> str:
        return json.dumps([self.base, self.traditional, self.scaling])

    @classmethod
    def from_json(cls, text: str) -> "Rotary":
        base, traditional, scaling = json.loads(text)
        return cls(float(base), bool(traditional), scaling)

    def inverse_frequencies(self, dims: int) -> mx.array:
        """w_i (dims // 2,), float32: the angle per position of feature pair i."""
        w = self.base ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        scaling = json.loads(self.scaling) if self.scaling else {}
        kind = scaling.get("type") or scaling.get("rope_type") or "default"
        if kind == "linear":
            return w / scaling["factor"]
        if kind == "llama3":  # long wavelengths slowed by `factor`, short ones kept, a ramp between
            factor = scaling["factor"]
            low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
            old = scaling.get("original_max_position_embeddings", 8192)
            wavelength = 2 * math.pi / w
            ramp = mx.clip((old / wavelength - low) / (high - low), 0.0, 1.0)
            return w * ((1 - ramp) / factor + ramp)
        return w


def derotate(keys: mx.array, positions: mx.array, rotary: Rotary) -> mx.array:
    """Pre-RoPE keys (..., n, D), float32, from post-RoPE ``keys`` at ``positions`` (..., n)."""
    keys = keys.astype(mx.float32)
    d = keys.shape[-1]
    angle = positions.astype(mx.float32)[..., None] * rotary.inverse_frequencies(d)
    cos, sin = mx.cos(angle), mx.sin(angle)
    if rotary.traditional:
        x1, x2 = keys[..., 0::2], keys[..., 1::2]
    else:
        x1, x2 = keys[..., : d // 2], keys[..., d // 2 :]
    y1, y2 = x1 * cos + x2 * sin, x2 * cos - x1 * sin  # rotation by -angle
    if rotary.traditional:
        return mx.stack([y1, y2], axis=-1).reshape(keys.shape)
    return mx.concatenate([y1, y2], axis=-1)
