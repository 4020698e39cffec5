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

Reads (``_AnchorRead``: the prompt and the exact rows after it under one softmax, through
views of the part kept until it changes, ``_Views``) never rebuild the tokens:

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

import functools
from dataclasses import dataclass, fields
from typing import Any, Callable

import mlx.core as mx

from ...cache.buffers import GrowingArray
from ...kernels import kivi_decode as kd
from ...kernels.decode import DecodePart, scaled_queries
from .lloyd_max import RotatedGaussian
from ...quant.store import WINDOW_STEP, PackedStore, joined_history
from ...quant.token_rows import ReadViews


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
class _Views:
    """What a decode step reads of an ``AnchorPart``, in the layout it reads it (views: a
    transpose, expanded and broadcast index and coefficient rows; no bytes of their own),
    for ``r`` query rows per KV head."""

    anchor_kt: mx.array  # (B, H, d, k) anchor_k transposed
    anchor_v: mx.array  # (B, H, k, d)
    # None where every token is an anchor (M = 0):
    key_ref: mx.array | None  # (B, H, r, M) each token's key anchor, broadcast over the query rows
    key_coef: mx.array | None  # (B, H, 1, M) float16
    value_coef: mx.array | None  # (B, H, 1, M) float16
    value_ends: mx.array | None  # (B, H, r, k)
    key_slot: mx.array | None  # (B, H, r, M), where keys have residuals
    value_pos: mx.array | None  # (B, H, r, N_v), where values have residuals

    @classmethod
    def of(cls, p: AnchorPart, r: int) -> "_Views":
        b, h, k, _ = p.anchor_k.shape
        m = p.key_ref.shape[2]
        rows = lambda x: mx.broadcast_to(x[:, :, None], (b, h, r, x.shape[2]))  # noqa: E731
        if not m:  # every token an anchor
            return cls(p.anchor_k.swapaxes(-1, -2), p.anchor_v, None, None, None, None, None, None)
        return cls(p.anchor_k.swapaxes(-1, -2), p.anchor_v, rows(p.key_ref), p.key_coef[:, :, None],
                   p.value_coef[:, :, None], rows(p.value_ends),
                   rows(p.key_slot) if p.key_codes.shape[2] else None,
                   rows(p.value_pos) if p.value_codes.shape[2] else None)


class _AnchorRead:
    """The read of an ``AnchorStore`` holding a compressed prompt: the prompt and the exact
    rows after it as one ``PackedScores`` part (keys and values) of ``kernels/decode.py``
    (``decode_parts``; no kernel reads the anchor form), and a decode step's attention,
    ``attention``: the joint path's arithmetic over that part, its queries scaled in one
    pass. Scores, in this order: the anchors ``A = q anchor_kᵀ``, the other prompt tokens
    ``γ_t A[a(t)]`` (plus their key residuals), the exact rows; values: one split of the
    probabilities into the three, the per-anchor sums of ``p_t γ_t`` as differences of one
    cumulative sum at ``value_ends``, one product with ``anchor_v``, the value residuals,
    one product with the exact rows added to it. What is read of the part is the store's
    ``_Views``, kept until the part changes."""

    def __init__(self, store: "AnchorStore"):
        self.store, self.part, self.codec = store, store.part, store.codec
        self.k_tail, self.v_tail = _rows_or_none(store.k_tail.view()), _rows_or_none(store.v_tail.view())
        self.n_heads = self.part.anchor_k.shape[1]
        self.count = self.part.count + (0 if self.k_tail is None else self.k_tail.shape[2])

    def decode_part(self) -> DecodePart:
        return DecodePart(self, None, self, None)

    def attention(self, queries: mx.array, scale: float) -> mx.array:
        """(B, Hq, 1, D) in the query dtype: the queries scaled in float32 in one pass."""
        q = scaled_queries(queries, self.n_heads, scale)
        o = self.mix(mx.softmax(self.scores(q), axis=-1))
        return o.reshape(queries.shape).astype(queries.dtype)

    def scores(self, q: mx.array) -> mx.array:
        """float32 scores (B, H, R, count) for scaled float32 queries (B, H, R, D)."""
        p, v = self.part, self.store.read_views(q.shape[2])
        if v.key_ref is None:
            out = [q @ _float32(v.anchor_kt)]  # (B, H, R, k)
        else:  # the prompt's scores: one compiled call (its shapes are the part's: traced once)
            read = _prompt_scores(self.codec.bits, self.codec.seed, v.key_slot is not None)
            out = list(read(q, v.anchor_kt, v.key_ref, v.key_coef, p.key_codes, p.key_scales, v.key_slot)
                       if v.key_slot is not None else read(q, v.anchor_kt, v.key_ref, v.key_coef))
        if self.k_tail is not None:
            out.append(q @ _float32(self.k_tail).swapaxes(-1, -2))
        return out[0] if len(out) == 1 else mx.concatenate(out, axis=-1)

    def mix(self, w: mx.array) -> mx.array:
        """float32 ``w V`` (B, H, R, D) for weights (B, H, R, count) in ``scores``' order."""
        p, v = self.part, self.store.read_views(w.shape[2])
        k, m = p.anchor_v.shape[2], p.key_ref.shape[2]
        cuts = ([k, k + m] if m else [k])[: (m > 0) + (self.v_tail is not None)]
        parts = mx.split(w, cuts, axis=-1) if cuts else [w]  # one node, not a slice a part
        if m:  # the prompt's mix: one compiled call (its shapes are the part's: traced once)
            read = _prompt_mix(self.codec.bits, self.codec.seed, v.value_pos is not None)
            o = (read(parts[0], parts[1], v.value_coef, v.value_ends, v.anchor_v, v.value_pos,
                      p.value_codes, p.value_scales)
                 if v.value_pos is not None else read(parts[0], parts[1], v.value_coef, v.value_ends, v.anchor_v))
        else:
            o = parts[0] @ _float32(v.anchor_v)
        if self.v_tail is not None:
            o = _mixed_into(o, parts[-1], _float32(self.v_tail))
        return o


@functools.lru_cache(maxsize=None)
def _prompt_scores(bits: int, seed: int, residuals: bool):
    """The scores of a compressed prompt (other tokens present), compiled: the anchors'
    ``A = q anchor_kᵀ`` and the others' ``γ_t A[a(t)]`` (plus their key residuals), the
    operations ``scores`` did one by one, in the same order (a step's host time)."""
    codec = RotatedGaussian(bits, seed)

    def read(q, anchor_kt, key_ref, key_coef, key_codes=None, key_scales=None, key_slot=None):
        a = q @ _float32(anchor_kt)  # (B, H, R, k)
        g = mx.take_along_axis(a, key_ref, axis=-1)
        if not residuals:
            return a, g * key_coef.astype(mx.float32)
        res = codec.rotate(q) @ codec.coordinates(key_codes, key_scales).swapaxes(-1, -2)
        res = mx.pad(res, [(0, 0), (0, 0), (0, 0), (1, 0)])  # slot 0: no residual
        return a, g * key_coef.astype(mx.float32) + mx.take_along_axis(res, key_slot, axis=-1)

    return mx.compile(read)


@functools.lru_cache(maxsize=None)
def _prompt_mix(bits: int, seed: int, residuals: bool):
    """The mix over a compressed prompt (other tokens present), compiled: the per-anchor
    sums of ``p_t γ_t`` from one cumulative sum, one product with ``anchor_v``, the value
    residuals (``mix``'s operations one by one before, in the same order)."""
    codec = RotatedGaussian(bits, seed)

    def read(w_anchor, rest, value_coef, value_ends, anchor_v, value_pos=None, value_codes=None, value_scales=None):
        run = mx.cumsum(rest * value_coef.astype(mx.float32), axis=-1)
        run = mx.pad(run, [(0, 0), (0, 0), (0, 0), (1, 0)])  # run[i]: the sum of the first i
        end = mx.take_along_axis(run, value_ends, axis=-1)
        start = mx.pad(end[..., :-1], [(0, 0), (0, 0), (0, 0), (1, 0)])  # a run starts where the last ended
        o = (w_anchor + (end - start)) @ _float32(anchor_v)
        if residuals:
            picked = mx.take_along_axis(rest, value_pos, axis=-1)
            o = o + codec.unrotate(picked @ codec.coordinates(value_codes, value_scales))
        return o

    return mx.compile(read)


def _rows_or_none(x: mx.array | None) -> mx.array | None:
    return None if x is None or x.shape[2] == 0 else x


def _float32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def _mixed_into(o: mx.array, w: mx.array, rows: mx.array) -> mx.array:
    """``o + w rows``: one fused product where ``token_mix`` would not cut the tokens."""
    if w.shape[-1] < 2 * kd.SPLIT_TOKENS or not kd._splits_tokens():
        return mx.addmm(o, w, rows)
    return o + kd.token_mix(w, rows)


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
        self._views = ReadViews()  # the decode read's views of the part (``read_views``)

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

    def read_views(self, r: int) -> _Views:
        """The part's ``_Views`` for ``r`` query rows per KV head, kept until the part changes."""
        p = self.part  # replaced, never changed in place (frozen): its identity keys the views
        return self._views.get(self, (p, r), lambda: _Views.of(p, r))

    def attend_parts(self, queries, *, scale, use_kernel, n_kv_heads: int) -> mx.array:
        """A decode step's attention: once the prompt is compressed, ``_AnchorRead``."""
        if self.part is None:
            return super().attend_parts(queries, scale=scale, use_kernel=use_kernel, n_kv_heads=n_kv_heads)
        return _AnchorRead(self).attention(queries, scale)

    def attend(self, queries, *, scale, use_kernel, n_kv_heads=None) -> mx.array:
        """A decode step's attention over what is stored (no token added)."""
        n_kv_heads = n_kv_heads or (self.k_tail.buffer if self.part is None else self.part.anchor_k).shape[1]
        return self.attend_parts(queries, scale=scale, use_kernel=use_kernel, n_kv_heads=n_kv_heads)

    def decode_parts(self, empty: mx.array) -> list[DecodePart]:
        if self.part is None:
            return [DecodePart(None, self.k_tail.view(), None, self.v_tail.view())]
        return [_AnchorRead(self).decode_part()]

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
