"""Decode attention over a store of packed parts: one entry point for every method.

A store hands over its history as ``DecodePart``s, each a run of tokens: keys as an
``AffineLayout`` (per channel) for the part's first tokens and full-precision keys after
them, values likewise (per token), the two splits free to differ (KIVI flushes keys in
blocks, values one by one). A part may hold only some KV heads (``heads``: per-head bit
widths), and its keys or values may be in another codec's form (``PackedScores``:
codebooks, promoted channels, low-rank factors), which the pure-MLX path reads, or, on
a GPU, a kernel of the codec's own where it brings one (``kernel_partials``).

One group-affine part is one launch of the fused kernel (``kivi_decode.py``), as before.
Where a kernel reads some part (a GPU), parts are attended part by part, each leaving
partial softmax states (base-2 max, sum, unnormalised output), merged by the merge
kernel (parts no kernel reads add pure-MLX partials in the same form). Where none does
(the CPU, ``use_kernel=False``), every part's scores go under one softmax and each
part's values take their slice of it: the partials' form would cost a decode step some
eight operations a part plus a dozen for the merge, for the same sums.

Packed batches of full-precision rows (the full cache's and StreamingLLM's, the eviction
base's) attend here too where their sequences' lengths differ: ``masked_decode_attention``
instead of MLX's fused attention with a mask (``RowsByLength``).
"""

from __future__ import annotations

import functools
import itertools

from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from ..quant.packed import AffineLayout
from . import kivi_decode as kd

LOG2E = 1.4426950408889634


class PackedScores(Protocol):
    """Keys or values in a form only the pure-MLX path reads."""

    count: int  # tokens held
    n_heads: int  # KV heads held

    def scores(self, q: mx.array) -> mx.array:
        """Keys: float32 ``q Kᵀ`` (B, H, R, count) for scaled float32 queries (B, H, R, D)."""

    def mix(self, p: mx.array) -> mx.array:
        """Values: ``p V`` (B, H, R, D) in float32 for probabilities (B, H, R, count)."""

    # Optional, where a codec's exact reading carries a term the joint softmax makes
    # redundant when its part is the only one (``_joint_attention`` then asks for them):
    #   scores_shifted(q): ``scores`` less a constant per query row (softmax-invariant);
    #   mix_normalised(p): ``mix`` for weights that sum to 1 over its tokens.


# not frozen: a decode step builds one a part, and a frozen dataclass takes about five times as long to make
@dataclass(eq=False, slots=True)
class DecodePart:
    keys: AffineLayout | Any | None  # the part's first keys, packed
    key_tail: mx.array | None  # (B, H, n, D) full-precision keys after them
    values: AffineLayout | Any | None  # the part's first values, packed
    value_tail: mx.array | None
    heads: mx.array | None = None  # the KV heads the part holds, increasing (None: all)
    # (key rows, value rows) valid from row 0 when the tails are whole window buffers with
    # room after them (None: the tails are exactly the rows)
    tail_rows: tuple[int, int] | None = None

    @property
    def length(self) -> int:
        return (self.keys.count if self.keys is not None else 0) + self.tail_counts[0]

    @property
    def tail_counts(self) -> tuple[int, int]:
        if self.tail_rows is not None:
            return self.tail_rows
        return _rows(self.key_tail), _rows(self.value_tail)

    def tails(self):
        """The full-precision key and value rows (views of the buffers where they have room)."""
        if self.tail_rows is None:
            return self.key_tail, self.value_tail
        (nk, nv), k, v = self.tail_rows, self.key_tail, self.value_tail
        return (k if k.shape[2] == nk else k[:, :, :nk]), (v if v.shape[2] == nv else v[:, :, :nv])

    @property
    def affine(self) -> bool:
        """Group-affine layouts at a width the fused kernels take (empty ones count)."""
        k, v = self.keys, self.values
        if k is None:
            return v is not None and _served(v)
        return _served(k) and (v is None or _served(v))

    @property
    def bits_and_group(self) -> tuple[int, int]:
        layout = self.keys if self.keys is not None and (self.keys.count or self.values is None) else self.values
        return layout.bits, layout.group

    def kernel_args(self):
        """The 12 cache arguments of the single-layout kernels (kivi_decode.py)."""
        k, v = self.keys, self.values
        n_kres, n_vres = self.tail_counts  # the kernels take a tail's rows from its buffer's start
        return (k.codes, k.scales, k.biases, k.count, self.key_tail, n_kres,
                v.codes, v.scales, v.biases, v.count, self.value_tail, n_vres)


def _rows(x) -> int:
    return 0 if x is None else x.shape[2]


def _served(layout) -> bool:
    """A group-affine layout at a width the fused kernels take."""
    return isinstance(layout, AffineLayout) and layout.bits in kd.SUPPORTED_BITS


def decode_attention(queries, parts: list[DecodePart], *, scale, use_kernel=True,
                     n_kv_heads: int | None = None) -> mx.array:
    """One query token per sequence over every part: (B, Hq, 1, D) in the query dtype.

    ``n_kv_heads``: the layer's KV heads, needed only when every part holds a subset.
    """
    parts = [p for p in parts if p.length]
    if len(parts) == 1 and parts[0].affine and parts[0].heads is None:
        bits, group = parts[0].bits_and_group
        return kd.kivi_decode_attention(queries, *parts[0].kernel_args(), scale=scale,
                                        bits=bits, group_size=group, use_kernel=use_kernel)
    backend = kd.gpu_backend() if use_kernel else None
    if all(p.heads is None for p in parts) and not any(_kernel_may_read(backend, p) for p in parts):
        # no kernel reads a part: one softmax over every part's scores gives what the
        # partials' log-sum-exp merge gives, in a quarter of the step's operations
        return _joint_attention(queries, parts, scale)
    if n_kv_heads is None:
        n_kv_heads = next(_kv_heads(p) for p in parts if p.heads is None)
    gqa = queries.shape[1] // n_kv_heads
    o_parts, ml_parts = [], []
    kernel_ran = False
    for p in parts:
        q = queries if p.heads is None else _head_queries(queries, p.heads, gqa)
        algo = backend and p.affine and kd.kernel_algo(backend, q, _kv_heads(p), *p.bits_and_group)
        own = None if algo or not backend else _own_kernel_partials(backend, q, p, scale)
        if own is not None:
            kernel_ran = True
            o, ml = own
        elif algo:
            kernel_ran = True
            bits, group = p.bits_and_group
            o, ml = kd.decode_partials(backend, q, *p.kernel_args(), scale=scale, bits=bits,
                                       group_size=group)
        else:
            o, ml = _pure_partials(q, p, scale)
        if p.heads is not None:
            o, ml = _on_all_heads(o, ml, p.heads, queries.shape[0], n_kv_heads, gqa)
        o_parts.append(o)
        ml_parts.append(ml)
    if not kernel_ran and all(p.heads is None for p in parts):
        # no kernel served after all (a failed self-check): the same answer as use_kernel=False
        return _joint_attention(queries, parts, scale)
    o_part, ml_part = mx.concatenate(o_parts, axis=1), mx.concatenate(ml_parts, axis=1)
    # the merge kernel passed its self-check together with a main kernel that ran here
    if kernel_ran:
        return kd.merge_partials(backend, o_part, ml_part, queries.shape, queries.dtype)
    return merge_partials_mlx(o_part, ml_part, queries.shape, queries.dtype)


def _kernel_may_read(backend, part: DecodePart) -> bool:
    """Whether a kernel might read the part on ``backend`` (None: no kernel runs)."""
    if backend is None:
        return False
    return part.affine or getattr(part.keys, "kernel_partials", None) is not None


def _joint_attention(queries, parts: list[DecodePart], scale) -> mx.array:
    """Every part's scores under one softmax, then each part's values mixed by its slice
    of the probabilities: (B, Hq, 1, D) in the query dtype."""
    q = scaled_queries(queries, _kv_heads(parts[0]), scale)
    scores, reads = [], []
    for part in parts:
        key_tail, value_tail = part.tails()
        scores += _key_scores(q, part, key_tail, alone=len(parts) == 1 and key_tail is None)
        reads += _value_reads(part, value_tail)
    p = mx.softmax(scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1), axis=-1)
    return _mixed(p, reads, normalised=True).reshape(queries.shape).astype(queries.dtype)


def scaled_queries(queries, n_kv_heads: int, scale) -> mx.array:
    """Queries (B, Hq, 1, D) as the pure reads take them: float32 (B, H, Hq / H, D) times
    ``scale``, the cast and the product one compiled pass (a Python scale: a constant of it)."""
    b, hq, _, d = queries.shape
    q = queries.reshape(b, n_kv_heads, hq // n_kv_heads, d)
    if isinstance(scale, mx.array):  # not made a constant: reading it would wait for the device
        return q.astype(mx.float32) * scale
    return _query_scaler(float(scale))(q)


@functools.lru_cache(maxsize=None)
def _query_scaler(scale: float):
    return mx.compile(lambda q: q.astype(mx.float32) * scale, shapeless=True)


def _key_scores(q, part: DecodePart, key_tail, alone: bool = False) -> list:
    """The part's float32 scores, packed keys then the full-precision tail, for scaled
    float32 queries (B, H, R, D). ``alone``: the packed keys' scores are the only ones under
    their softmax (a constant per query row may be left out: ``scores_shifted``)."""
    scores, k = [], part.keys
    if k is not None and k.count:
        if isinstance(k, AffineLayout):
            scores.append(kd.affine_key_scores(q, k.codes, k.scales, k.biases, k.count, k.bits, k.group))
        else:
            scores.append(k.scores_shifted(q) if alone and hasattr(k, "scores_shifted") else k.scores(q))
    if key_tail is not None:
        scores.append(q @ key_tail.astype(mx.float32).swapaxes(-1, -2))
    return scores


def _value_reads(part: DecodePart, value_tail) -> list:
    """(tokens, values) in the scores' order: the packed values, then the tail's rows."""
    reads, v = [], part.values
    if v is not None and v.count:
        reads.append((v.count, v))
    if value_tail is not None:
        reads.append((value_tail.shape[2], value_tail))
    return reads


def _mixed(w, reads, normalised: bool = False) -> mx.array:
    """``w V`` in float32 for weights ``w`` (B, H, R, tokens) over the values of ``reads``.
    ``normalised``: ``w`` sums to 1 over its tokens (a softmax), so values that are all of
    them may take the shortcut ``mix_normalised``."""
    o = None
    cuts = list(itertools.accumulate(n for n, _ in reads[:-1]))
    weights = mx.split(w, cuts, axis=-1) if cuts else [w]  # one node, not a slice a read
    for (n, v), part_w in zip(reads, weights):
        if isinstance(v, mx.array):
            r = kd.token_mix(part_w, v.astype(mx.float32))
        elif isinstance(v, AffineLayout):
            r = kd.affine_value_mix(part_w, v.codes, v.scales, v.biases, n, v.bits, v.group)
        elif normalised and n == w.shape[-1] and hasattr(v, "mix_normalised"):
            r = v.mix_normalised(part_w)
        else:
            r = v.mix(part_w)
        o = r if o is None else o + r
    return o


def _own_kernel_partials(backend, queries, part: DecodePart, scale):
    """Partials of a part whose packed keys bring a kernel of their own over them and the
    values (``kernel_partials(backend, queries, values, scale)``: None where it does not
    serve), the full-precision tails joined as a pure-MLX partial; None: the pure path."""
    k, v = part.keys, part.values
    read = getattr(k, "kernel_partials", None)
    if read is None or part.heads is not None or not k.count or v is None or v.count != k.count:
        return None
    out = read(backend, queries, v, scale)
    if out is None:
        return None
    tail = DecodePart(None, part.key_tail, None, part.value_tail)
    if tail.length:
        o, ml = _pure_partials(queries, tail, scale)
        out = (mx.concatenate([out[0], o], axis=1), mx.concatenate([out[1], ml], axis=1))
    return out


def _kv_heads(part: DecodePart) -> int:
    for x in (part.key_tail, part.value_tail):
        if x is not None:
            return x.shape[1]
    layout = part.keys if part.keys is not None and part.keys.count else part.values
    return layout.codes.shape[1] if isinstance(layout, AffineLayout) else layout.n_heads


def _head_queries(queries, heads, gqa):
    """The query heads that read ``heads`` (GQA: ``gqa`` query heads per KV head)."""
    b, hq, _, d = queries.shape
    q = queries.reshape(b, hq // gqa, gqa, d)[:, heads]
    return q.reshape(b, heads.shape[0] * gqa, 1, d)


def _on_all_heads(o, ml, heads, b, n_kv_heads, gqa):
    """A part's partials for its own heads, as empty states (max -inf, sum 0) for the rest."""
    splits, d = o.shape[1], o.shape[2]
    full_o = mx.zeros((b, n_kv_heads, gqa, splits, d), mx.float32)
    full_ml = mx.broadcast_to(mx.array([-float("inf"), 0.0]), (b, n_kv_heads, gqa, splits, 2))
    full_o[:, heads] = o.reshape(b, heads.shape[0], gqa, splits, d)
    full_ml = mx.array(full_ml)
    full_ml[:, heads] = ml.reshape(b, heads.shape[0], gqa, splits, 2)
    rows = b * n_kv_heads * gqa
    return full_o.reshape(rows, splits, d), full_ml.reshape(rows, splits, 2)


def _pure_partials(queries, part: DecodePart, scale):
    """A part's partial softmax state in the kernels' form: o (B*Hq, 1, D) unnormalised,
    ml (B*Hq, 1, 2) = (base-2 max of the scores, sum of 2^(score - max))."""
    b, hq, _, d = queries.shape
    o, m, l = _pure_state(queries, part, scale)
    ml = mx.concatenate([m * LOG2E, l], axis=-1)
    return o.reshape(b * hq, 1, d), ml.reshape(b * hq, 1, 2)


def _pure_state(queries, part: DecodePart, scale):
    """A part's softmax state per KV head and query: o (B, H, R, D) unnormalised, the
    scores' max and the sum of exp(score - max) (B, H, R, 1)."""
    key_tail, value_tail = part.tails()
    q = scaled_queries(queries, _kv_heads(part), scale)
    scores = _key_scores(q, part, key_tail)
    s = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
    m = s.max(axis=-1, keepdims=True)
    e = mx.exp(s - m)
    o = _mixed(e, _value_reads(part, value_tail))
    return o, m, e.sum(axis=-1, keepdims=True)


def merge_partials_mlx(o_part, ml_part, out_shape, dtype) -> mx.array:
    """The pure-MLX twin of the merge kernel: partials (B*Hq, S, ·) into (B, Hq, 1, D)."""
    m, l = ml_part[..., 0], ml_part[..., 1]
    top = m.max(axis=1, keepdims=True)
    w = mx.power(2.0, m - top)  # an empty partial (max -inf) weighs nothing
    out = (w[..., None] * o_part).sum(axis=1) / (w * l).sum(axis=1)[..., None]
    return out.reshape(out_shape).astype(dtype)


# -- packed batches whose sequences hold different numbers of rows --


class RowsByLength:
    """``attend`` of a dense packed layout whose sequence b holds rows 0 .. length_array[b]
    - 1 (``padded``: the lengths differ, the rows after a sequence's own masked). Equal
    lengths take MLX's fused attention unmasked; differing ones ``masked_decode_attention``:
    MLX 0.32.4's fused attention with any mask ran 9.6x its unmasked time on the H200 (batch
    9 at 32k), this 1.8x (benchmarks/results/serve_h200_s54/README.md)."""

    def _visible(self, rows: int) -> mx.array | None:
        if not self.padded:
            return None
        return (mx.arange(rows)[None] < self.length_array[:, None])[:, None, None, :]

    def attend(self, queries, keys, values, *, scale, sinks=None):
        mask = self._visible(keys.shape[2])
        if mask is not None and sinks is None and queries.shape[2] == 1:
            return masked_decode_attention(queries, keys, values, mask, scale=scale)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def masked_decode_attention(queries, keys, values, visible, *, scale) -> mx.array:
    """Decode attention (queries (B, Hq, 1, D)) over the rows ``visible`` (B, 1 or Hkv, 1, T)
    marks (per sequence, or per sequence and KV head):
    the scores' product, a float32 masked softmax, then the values' product over the token
    axis in pieces (``kivi_decode.token_mix``)."""
    return _masked_attention(queries, keys, values, scale, _masked_softmax, visible)


def held_rows_decode_attention(queries, keys, values, positions, *, scale) -> mx.array:
    """``masked_decode_attention`` over the rows whose ``positions`` (B, Hkv, T) are >= 0 (an
    eviction store's padding slots hold -1), the mask built inside the softmax's kernel."""
    return _masked_attention(queries, keys, values, scale, _held_rows_softmax, positions)


def _masked_attention(queries, keys, values, scale, softmax, mask) -> mx.array:
    b, hq, n, d = queries.shape
    h = keys.shape[1]
    q = _scaled(queries.reshape(b, h, hq // h * n, d), mx.array(scale, queries.dtype))
    p = softmax(q @ keys.swapaxes(-1, -2), mask).astype(values.dtype)
    return kd.token_mix(p, values).reshape(b, hq, n, values.shape[-1])


# a decode step's scale and mask, each one kernel (traced once: shapeless)
_scaled = mx.compile(lambda q, scale: q * scale, shapeless=True)
_masked_softmax = mx.compile(
    lambda scores, visible: mx.softmax(mx.where(visible, scores.astype(mx.float32), -mx.inf), axis=-1),
    shapeless=True)
_held_rows_softmax = mx.compile(
    lambda scores, positions: mx.softmax(
        mx.where(positions[:, :, None, :] >= 0, scores.astype(mx.float32), -mx.inf), axis=-1),
    shapeless=True)
