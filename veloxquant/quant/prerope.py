"""Keys quantized before the rotary embedding: rotated back at encode, rotated again at read.

mlx-lm hands caches post-RoPE keys. A codec that wants pre-RoPE keys (KVQuant: per-channel
structure survives there, RoPE mixes each channel pair by position) takes the model's
rotary settings (``cache/rope.py``'s ``Rotary``), de-rotates a run of keys at their
positions before encoding and rotates the decoded run again (here in the per-channel
layout, ``(..., D, n)``). Both use the same angles ``position * w_i`` in float32, so the
round trip is the identity to float rounding whatever the model's exact rotary is.

``model_rotary`` decides: the model's settings when the cache knows them (a context with
``model_args``), else None (post-RoPE), also when the rotary cannot be undone here (a
scaling type ``Rotary`` refuses, partial rotary dimensions).

The cos/sin tables of the newest run of positions are kept in a one-entry memo shared by
every layer (keys flush every few steps, so a decode step's layers reuse one table): a
transient like a kernel's workspace, not part of any cache's state.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..cache.rope import Rotary, derotate


def rotary_name(rotary: Rotary | None) -> str:
    """How a key rotary is written in a saved state and a calibration file ("none": keys
    kept post-RoPE)."""
    return rotary.to_json() if rotary is not None else "none"


def model_rotary(context) -> Rotary | None:
    return args_rotary(getattr(context, "model_args", None))


def args_rotary(args) -> Rotary | None:
    """``model_rotary`` of mlx-lm ``ModelArgs`` (None: unknown, or not undoable here)."""
    if args is None or getattr(args, "partial_rotary_factor", 1.0) not in (1, 1.0, None):
        return None
    try:
        return Rotary.from_model_args(args)
    except ValueError:  # a rotary scaling this module cannot undo: quantize post-RoPE
        return None


def to_pre_rope(keys: mx.array, start: int, rotary: Rotary) -> mx.array:
    """float32 pre-RoPE keys (B, H, n, D) of the post-RoPE ``keys`` at positions start.."""
    return derotate(keys, mx.arange(start, start + keys.shape[2]), rotary)


@functools.lru_cache(maxsize=1)
def rotary_angles(rotary: Rotary, dims: int, start: int, n: int):
    """cos and sin of the rotary angles of ``n`` positions from ``start``: (D/2, n) each."""
    angle = rotary.inverse_frequencies(dims)[:, None] * mx.arange(start, start + n).astype(mx.float32)
    return mx.cos(angle), mx.sin(angle)  # (D/2, n)


def _rotate_pairs(x1, x2, cos, sin):
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


_rotate = mx.compile(_rotate_pairs, shapeless=True)


def from_pre_rope_channels(keys_t: mx.array, start: int, rotary: Rotary) -> mx.array:
    """Post-RoPE keys in the per-channel layout (..., D, n) from pre-RoPE ones."""
    *lead, d, n = keys_t.shape
    cos, sin = rotary_angles(rotary, d, start, n)
    if rotary.traditional:  # pairs (2i, 2i + 1)
        pairs = keys_t.reshape(*lead, d // 2, 2, n)
        y1, y2 = _rotate(pairs[..., 0, :], pairs[..., 1, :], cos, sin)
        return mx.stack([y1, y2], axis=-2).reshape(*lead, d, n)
    y1, y2 = _rotate(keys_t[..., : d // 2, :], keys_t[..., d // 2 :, :], cos, sin)
    return mx.concatenate([y1, y2], axis=-2)
