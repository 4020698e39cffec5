"""Decode attention over a store of group-affine parts: one entry point for every method.

A store hands over its history as ``DecodePart``s, each covering a run of tokens: keys as
an ``AffineLayout`` (per channel) for the part's first tokens and full-precision keys
after them, values likewise (per token), the two splits free to differ (KIVI flushes keys
in blocks and values one by one). One part is one launch of the fused kernel
(``kivi_decode.py``). Several parts (segments of different bit widths: precision by age,
by epoch) are attended part by part: on a GPU each launch leaves its partial softmax
states (max, sum, weighted values), the partials of all parts are merged by one
log-sum-exp merge; on the pure-MLX path the parts' scores share one softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..quant.packed import AffineLayout
from . import kivi_decode as kd


@dataclass(frozen=True)
class DecodePart:
    keys: AffineLayout | None  # per-channel layout of the part's first keys
    key_tail: mx.array | None  # (B, H, n, D) full-precision keys after them
    values: AffineLayout | None  # per-token layout of the part's first values
    value_tail: mx.array | None

    @property
    def length(self) -> int:
        return (self.keys.count if self.keys else 0) + _rows(self.key_tail)

    def kernel_args(self):
        """The 12 cache arguments of the single-layout kernels (kivi_decode.py)."""
        k, v = self.keys, self.values
        return (k.codes, k.scales, k.biases, k.count, self.key_tail, _rows(self.key_tail),
                v.codes, v.scales, v.biases, v.count, self.value_tail, _rows(self.value_tail))

    @property
    def kv_heads(self) -> int:
        for x in (self.key_tail, self.value_tail):
            if x is not None:
                return x.shape[1]
        return next(l.codes.shape[1] for l in (self.keys, self.values) if l and l.count)

    @property
    def bits_and_group(self) -> tuple[int, int]:
        layout = self.keys if self.keys and self.keys.count else self.values
        return layout.bits, layout.group


def _rows(x) -> int:
    return 0 if x is None else x.shape[2]


def decode_attention(queries, parts: list[DecodePart], *, scale, use_kernel=True) -> mx.array:
    """One query token per sequence over every part: (B, Hq, 1, D) in the query dtype."""
    parts = [p for p in parts if p.length]
    if len(parts) == 1:
        bits, group = parts[0].bits_and_group
        return kd.kivi_decode_attention(queries, *parts[0].kernel_args(), scale=scale,
                                        bits=bits, group_size=group, use_kernel=use_kernel)
    backend = kd.gpu_backend() if use_kernel else None
    if backend is not None and all(
            kd.kernel_algo(backend, queries, p.kv_heads, *p.bits_and_group) for p in parts):
        partials = [kd.decode_partials(backend, queries, *p.kernel_args(), scale=scale,
                                       bits=p.bits_and_group[0], group_size=p.bits_and_group[1])
                    for p in parts]
        o_part = mx.concatenate([o for o, _ in partials], axis=1)
        ml_part = mx.concatenate([ml for _, ml in partials], axis=1)
        return kd.merge_partials(backend, o_part, ml_part, queries.shape, queries.dtype)
    return _pure_mlx(queries, parts, scale)


def _pure_mlx(queries, parts, scale) -> mx.array:
    """Every part's scores in float32 under one softmax, then each part's share of values."""
    b, hq, _, d = queries.shape
    scores, values = [], []
    for p in parts:
        bits, group = p.bits_and_group
        s, v = kd.part_scores_and_values(queries, *p.kernel_args(), scale=scale, bits=bits,
                                         group_size=group)
        scores.append(s)
        values.append(v)
    probs = mx.softmax(mx.concatenate(scores, axis=-1), axis=-1)
    out, start = None, 0
    for s, mix in zip(scores, values):
        n = s.shape[-1]
        part = mix(probs[..., start : start + n])
        out = part if out is None else out + part
        start += n
    return out.reshape(b, hq, 1, d).astype(queries.dtype)
