"""Tokens kept as a multiple of one anchor token plus an optional coded residual.

Per (batch row, KV head), a run of S tokens is held as k anchors kept exactly and
M = S - k other tokens, each ``x_t ~ γ_t x_{a(t)} + r_hat_t`` (a projection on one
anchor, a residual for some). Keys and values have their own assignments and
coefficients over the same anchors. ``AnchorPart`` is what is kept, tokens in a stored
order (anchors first, then the others sorted by their value anchor; attention over a
set of older tokens does not depend on their order):

- ``anchor_k``, ``anchor_v`` (B, H, k, d): the anchors, in the model's dtype;
- ``key_ref`` (B, H, M): each token's key anchor (uint8/16/32 by k); ``key_coef``,
  ``value_coef`` (B, H, M) float16: γ for keys and values;
- ``value_ends`` (B, H, k) int32: where each value anchor's run of tokens ends;
- ``key_slot`` (B, H, M): 0, or 1 + the row of the token's key residual;
- key residuals ``key_codes`` (B, H, N_k, W) uint32, ``key_scales`` (B, H, N_k) float16;
  value residuals ``value_codes``, ``value_scales`` and ``value_pos`` (B, H, N_v), the
  token each belongs to; the residual codec is ``quant/lloyd_max.RotatedGaussian``.

Reads (``AnchorKeys.scores``, ``AnchorValues.mix``, ``PackedScores`` of
``kernels/decode.py``) never rebuild the tokens:

- scores: ``A = q anchor_kᵀ`` (k per query), ``s_t = γ_t A[a(t)] + s_t (q~ . levels)`` for
  the residual rows, gathered per token by ``key_slot`` (gathers only: MLX's scatter is
  slow on the CPU);
- mix: ``p_anchors anchor_v + (Σ_{t in run a} p_t γ_t)_a anchor_v + residual rows``, the
  per-anchor sums as differences of one cumulative sum at ``value_ends`` (the tokens are
  sorted by value anchor for that), the residual rows weighted by ``p`` gathered at
  ``value_pos`` and rotated back once.

``AnchorStore`` holds a layer: the prompt waits exactly until the first single-token
step, then ``compress`` (the method's) turns every token held into an ``AnchorPart``;
that step's token and every later one are kept exactly after it (never re-anchored).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

import mlx.core as mx

from ...cache.buffers import GrowingArray
from ...kernels.decode import DecodePart
from .lloyd_max import RotatedGaussian
from ...quant.store import WINDOW_STEP, PackedStore, joined_history


def index_dtype(n: int):
    """The smallest unsigned integer dtype holding 0..n-1."""
    return mx.uint8 if n <= 1 << 8 else mx.uint16 if n <= 1 << 16 else mx.uint32


@dataclass(frozen=True)
class AnchorPart:
    anchor_k: mx.array
    anchor_v: mx.array
    key_ref: mx.array
    key_coef: mx.array
    value_coef: mx.array
    value_ends: mx.array
    key_slot: mx.array
    key_codes: mx.array
    key_scales: mx.array
    value_codes: mx.array
    value_scales: mx.array
    value_pos: mx.array

    @property
    def count(self) -> int:
        return self.anchor_k.shape[2] + self.key_ref.shape[2]

    def arrays(self) -> dict[str, mx.array]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def dense(self, codec: RotatedGaussian):
        """Keys and values (B, H, S, d) in stored order, float32 (transient: tests, prefill)."""
        ka, va = self.anchor_k.astype(mx.float32), self.anchor_v.astype(mx.float32)
        ref = self.key_ref.astype(mx.int32)[..., None]
        k = mx.take_along_axis(ka, ref, axis=2) * self.key_coef.astype(mx.float32)[..., None]
        if self.key_codes.shape[2]:
            res = mx.pad(codec.decode(self.key_codes, self.key_scales), [(0, 0), (0, 0), (1, 0), (0, 0)])
            k = k + mx.take_along_axis(res, self.key_slot.astype(mx.int32)[..., None], axis=2)
        m = self.key_ref.shape[2]
        run = (mx.arange(m)[None, None, :, None] >= self.value_ends[:, :, None, :]).sum(axis=-1)
        v = mx.take_along_axis(va, run[..., None], axis=2) * self.value_coef.astype(mx.float32)[..., None]
        if self.value_codes.shape[2]:
            res = codec.decode(self.value_codes, self.value_scales)
            hit = self.value_pos.astype(mx.int32)[..., None] == mx.arange(m)  # (B, H, N_v, M)
            v = v + hit.astype(mx.float32).swapaxes(-1, -2) @ res
        return mx.concatenate([ka, k], axis=2), mx.concatenate([va, v], axis=2)


@dataclass(frozen=True)
class _AnchorReader:
    """The compressed prompt as the pure-MLX decode path reads it (``PackedScores``)."""

    part: AnchorPart
    codec: RotatedGaussian

    @property
    def count(self) -> int:
        return self.part.count

    @property
    def n_heads(self) -> int:
        return self.part.anchor_k.shape[1]


class AnchorKeys(_AnchorReader):
    def scores(self, q: mx.array) -> mx.array:
        p = self.part
        a = q @ p.anchor_k.astype(mx.float32).swapaxes(-1, -2)  # (B, H, R, k)
        s = mx.take_along_axis(a, p.key_ref.astype(mx.int32)[:, :, None], axis=-1)
        s = s * p.key_coef.astype(mx.float32)[:, :, None]
        if p.key_codes.shape[2]:
            res = self.codec.rotate(q) @ self.codec.coordinates(p.key_codes, p.key_scales).swapaxes(-1, -2)
            res = mx.pad(res, [(0, 0), (0, 0), (0, 0), (1, 0)])
            s = s + mx.take_along_axis(res, p.key_slot.astype(mx.int32)[:, :, None], axis=-1)
        return mx.concatenate([a, s], axis=-1)


class AnchorValues(_AnchorReader):
    def mix(self, w: mx.array) -> mx.array:
        p = self.part
        k = p.anchor_v.shape[2]
        rest = w[..., k:]
        run = mx.cumsum(rest * p.value_coef.astype(mx.float32)[:, :, None], axis=-1)
        run = mx.pad(run, [(0, 0), (0, 0), (0, 0), (1, 0)])  # run[i]: the sum of the first i
        ends = p.value_ends[:, :, None]
        starts = mx.pad(ends[..., :-1], [(0, 0), (0, 0), (0, 0), (1, 0)])
        per_anchor = mx.take_along_axis(run, ends, axis=-1) - mx.take_along_axis(run, starts, axis=-1)
        o = (w[..., :k] + per_anchor) @ p.anchor_v.astype(mx.float32)
        if p.value_codes.shape[2]:
            picked = mx.take_along_axis(rest, p.value_pos.astype(mx.int32)[:, :, None], axis=-1)
            o = o + self.codec.unrotate(picked @ self.codec.coordinates(p.value_codes, p.value_scales))
        return o


class AnchorStore(PackedStore):
    """``compress(keys, values) -> AnchorPart`` runs once, on the whole prompt."""

    def __init__(self, compress: Callable[[mx.array, mx.array], AnchorPart], codec: RotatedGaussian):
        self.compress, self.codec = compress, codec
        self.part: AnchorPart | None = None
        # Exact rows: the prompt until it is compressed, then the decode tokens. Room grows
        # 32 rows at a time (a copy of the tail every 32 steps): next to a compressed
        # prompt, 256 rows of room would cost more than the prompt itself.
        self.k_tail = GrowingArray(axis=2, step=WINDOW_STEP)
        self.v_tail = GrowingArray(axis=2, step=WINDOW_STEP)

    @property
    def compressed(self) -> int:
        return 0 if self.part is None else self.part.count

    @property
    def length(self) -> int:
        return self.compressed + self.k_tail.length

    def commit(self, keys: mx.array, values: mx.array) -> None:
        if self.part is None and keys.shape[2] == 1 and self.k_tail.length:  # the prompt is complete
            self.part = self.compress(self.k_tail.view(), self.v_tail.view())
            self.k_tail.reset(None)
            self.v_tail.reset(None)
        self.k_tail.append(keys)
        self.v_tail.append(values)

    def history(self, dtype):
        parts_k, parts_v = [], []
        if self.part is not None:
            k, v = self.part.dense(self.codec)
            parts_k.append(k.astype(dtype))
            parts_v.append(v.astype(dtype))
        return joined_history(parts_k, parts_v, self.k_tail.view(), self.v_tail.view(), dtype)

    def decode_parts(self, empty: mx.array) -> list[DecodePart]:
        if self.part is None:
            return [DecodePart(None, self.k_tail.view(), None, self.v_tail.view())]
        return [DecodePart(AnchorKeys(self.part, self.codec), self.k_tail.view(),
                           AnchorValues(self.part, self.codec), self.v_tail.view())]

    def arrays(self) -> dict[str, Any]:
        out = {"k_tail": self.k_tail, "v_tail": self.v_tail}
        if self.part is not None:
            out.update(self.part.arrays())
        return out

    def restore(self, meta: dict[str, Any], arrays: dict[str, Any]) -> None:
        self.k_tail.reset(arrays.get("k_tail"))
        self.v_tail.reset(arrays.get("v_tail"))
        names = [f.name for f in fields(AnchorPart)]
        if arrays.get("anchor_k") is not None:
            missing = [n for n in names if arrays.get(n) is None]
            self.part = None if missing else AnchorPart(**{n: arrays[n] for n in names})
            self._missing = missing

    def layout_problems(self, head_dims: tuple[int, int]):
        for name in getattr(self, "_missing", []):
            yield f"anchor array {name}", None, "saved with the other anchor arrays"
        p = self.part
        if p is None:
            return
        if (p.anchor_k.shape[3], p.anchor_v.shape[3]) != tuple(head_dims):
            yield "anchor head_dims", (p.anchor_k.shape[3], p.anchor_v.shape[3]), tuple(head_dims)
        m = p.key_ref.shape[2]
        for name in ("key_coef", "value_coef", "key_slot"):
            if getattr(p, name).shape[2] != m:
                yield f"{name} tokens", getattr(p, name).shape[2], m
        if p.value_ends.shape[2] != p.anchor_k.shape[2]:
            yield "value_ends", p.value_ends.shape[2], f"one per anchor ({p.anchor_k.shape[2]})"

    def problems(self, offset: int):
        if self.length != offset:
            yield "tokens stored", self.length, f"the offset {offset}"
        if self.v_tail.length != self.k_tail.length:
            yield "exact values", self.v_tail.length, f"{self.k_tail.length}, as many as keys"
