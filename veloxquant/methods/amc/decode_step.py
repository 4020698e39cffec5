"""An amc decode step's attention as one compiled pass over the tiers' buffers and the window.

What ``kernels/decode.py``'s joint path computes over ``TieredRowsStore.decode_parts`` and
the cache's window of exact rows (every part's scores under one softmax, each part's
values mixed by its slice): the tiers' whole buffers are read, rows past each head's
count score ``MASKED``; High and Mid rows dequantized in float32; Low keys rebuilt on the
basis, ``c Bᵀ + μ``, and (pre-RoPE) rotated at their positions; Low values mixed in the
basis' domain, ``(p c) Bᵀ + (Σ p) μ``; the window's whole buffer, its rows past the held
count (an array) ``MASKED`` too. Shapes change only when a tier grows (at a flush), so the
pass is traced again only then; the layers of a step, of equal shapes, replay one traced
graph. Nothing here reads an array's values on the host.

Few operations a step (issue 30): each part's scores are its keys times the transposed
queries (no part's keys transposed; one transpose of the scores side by side); one mask
over all the parts, from one column index and the parts' counts; one split of the
weights; the Low keys turned in one fused pass over a (2, D/2) view of their pairs (the
angles' cos and sin in it; RoPE's frequencies a constant argument); rows of a group
``mx.dequantize`` does not take unpacked against a constant of shifts; casts and
broadcasts of the stored operands placed where the fused passes absorb them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from ...cache.rope import Rotary
from ...kernels.kivi_decode import token_mix
from ...quant.token_rows import _mlx_has, dequantize_rows
from .token_tiers import MASKED


@dataclass(frozen=True)
class _Step:
    scale: float
    codecs: tuple[tuple[int, int], ...]  # (bits, group) of each tier (keys and values alike)
    projected: tuple[bool, ...]  # each tier kept as coefficients on a basis
    rotary: Rotary | None  # the projected keys kept pre-RoPE, rotated with these settings
    present: tuple[bool, ...]  # each tier has buffers
    window: bool  # the cache holds exact rows in its window


# -- small constants, made once (a step's graph takes them as inputs, not as operations) -------
@functools.lru_cache(maxsize=16)
def _shifts(bits: int) -> mx.array:
    return mx.array([j * bits for j in range(32 // bits)], mx.uint32)


@functools.lru_cache(maxsize=16)
def _turns(rotary: Rotary, d: int) -> tuple[mx.array, mx.array]:
    """RoPE's angle per position of each feature pair, laid out for rows viewed as
    (2, d/2) (pairs (i, i + d/2)) or (d/2, 2) (traditional: (2i, 2i + 1)), and the sign
    that turns the pair (x1, x2), swapped, into the rotation's second term."""
    w = rotary.inverse_frequencies(d)
    if rotary.traditional:
        return w.reshape(d // 2, 1), mx.array([1.0, -1.0], mx.float32)
    return w, mx.array([[1.0], [-1.0]], mx.float32)


# -- the step ----------------------------------------------------------------------------------
def _rows(codes, scales, minima, group: int, bits: int, shifts) -> mx.array:
    """``dequantize_rows(..., float32)``, the same values: rows of a group MLX does not
    take unpacked with the shifts given (a constant) where whole words make a group."""
    per_word = 32 // bits if 32 % bits == 0 else 0
    if _mlx_has(bits, group) or not per_word or group % per_word:
        return dequantize_rows(codes, scales, minima, group, bits, mx.float32)
    *lead, n_groups = scales.shape
    # (…, groups, words a group, codes a word): a group's scale and minimum broadcast over it
    # (a row of one word is that already)
    if codes.shape[-1] == 1:
        words, at = codes, ...
    elif group == per_word:
        words, at = codes[..., None], (..., None)
    else:
        words, at = codes.reshape(*lead, n_groups, group // per_word, 1), (..., None, None)
    q = ((words >> shifts) & ((1 << bits) - 1)).astype(mx.float32)
    out = q * scales[at].astype(mx.float32) + minima[at].astype(mx.float32)
    return out.reshape(*lead, n_groups * group)


def _rotated(rows, mean, positions, rotary: Rotary, turns) -> mx.array:
    """``derotate(rows + mean, -positions, rotary)``: pre-RoPE rows (B, H, n, D) float32 turned
    to their positions; the pairs as a (2, D/2) (or (D/2, 2)) view, so that one pass turns
    both halves (the angles' cos and sin fused in it)."""
    w, sign = turns
    *lead, n, d = rows.shape
    pairs = (d // 2, 2) if rotary.traditional else (2, d // 2)
    x = (rows + mean).reshape(*lead, n, *pairs)
    swapped = x[..., ::-1] if rotary.traditional else x[..., ::-1, :]
    angle = (-positions[..., None, None]).astype(mx.float32) * w
    return (x * mx.cos(angle) + swapped * (mx.sin(angle) * sign)).reshape(*lead, n, d)


def _graph(how: _Step, queries, counts, tiers, projections, positions, window, shifts, turns):
    b, hq, _, d = queries.shape
    h = (window[0] if how.window else next(iter(tiers.values()))[0][0]).shape[1]
    # scores as (keys) @ (queries)ᵀ, (B, H, n, hq/h) a part: the parts side by side, one
    # transpose of the whole; no part's keys are transposed
    qt = queries.astype(mx.float32).reshape(b, h, hq // h, d).swapaxes(-1, -2)
    scores, values, held = [], [], []
    for t, ((kc, ks, kb), (vc, vs, vb)) in tiers.items():
        bits, group = how.codecs[t]
        keys = _rows(kc, ks, kb, group, bits, shifts.get(bits))
        vals = _rows(vc, vs, vb, group, bits, shifts.get(bits))
        if how.projected[t]:
            k_mean, k_basis, v_mean, v_basis = projections[t]
            keys = keys @ k_basis.astype(mx.float32).swapaxes(-1, -2)
            if how.rotary is not None:
                keys = _rotated(keys, k_mean[:, :, None].astype(mx.float32), positions[t], how.rotary, turns)
            else:
                keys = keys + k_mean[:, :, None].astype(mx.float32)
            values.append((vals, v_basis, v_mean))
        else:
            values.append((vals, None, None))
        scores.append(keys @ qt)
        held.append(counts[t][:, :, None, None])
    if how.window:
        keys, vals, n_held = window
        scores.append(keys.astype(mx.float32) @ qt)
        values.append((vals.astype(mx.float32), None, None))
        held.append(n_held)
    # one mask over the parts side by side (one pass): a column is valid below its part's
    # count, from its index (the parts' starts are this trace's constants)
    sizes = [v[0].shape[2] for v in values]
    cuts = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
    column = mx.arange(sum(sizes), dtype=mx.int32)
    valid = column - cuts[-1] < held[-1] if cuts else column < held[-1]
    for i in range(len(cuts) - 1, -1, -1):
        valid = mx.where(column < cuts[i], column - (cuts[i - 1] if i else 0) < held[i], valid)
    s = mx.concatenate(scores, axis=2).swapaxes(-1, -2)
    p = mx.softmax(mx.where(valid, s * how.scale, MASKED), axis=-1)
    o = None
    for pt, (vals, basis, mean) in zip(mx.split(p, cuts, axis=-1) if cuts else [p], values):
        part = token_mix(pt, vals)
        if basis is not None:
            part = (part @ basis.astype(mx.float32).swapaxes(-1, -2)
                    + pt.sum(axis=-1, keepdims=True) * mean[:, :, None].astype(mx.float32))
        o = part if o is None else o + part
    return o.reshape(queries.shape).astype(queries.dtype)


@functools.lru_cache(maxsize=None)
def _step_fn(how: _Step):
    def run(queries, *args):
        rest = list(args)
        window = None
        if how.window:
            window, rest = tuple(rest[:3]), rest[3:]
        counts, tiers, projections, positions = {}, {}, {}, {}
        for t, present in enumerate(how.present):
            if not present:
                continue
            counts[t], tiers[t], rest = rest[0], (tuple(rest[1:4]), tuple(rest[4:7])), rest[7:]
            if how.projected[t]:
                projections[t], rest = tuple(rest[:4]), rest[4:]
                if how.rotary is not None:
                    positions[t], rest = rest[0], rest[1:]
        shifts = {}
        for bits in sorted({how.codecs[t][0] for t, p in enumerate(how.present) if p}):
            shifts[bits], rest = rest[0], rest[1:]
        turns = tuple(rest[:2]) if how.rotary is not None else None
        return _graph(how, queries, counts, tiers, projections, positions, window, shifts, turns)

    return mx.compile(run)


def decode_attention(store, queries, scale: float, window=None) -> mx.array | None:
    """The decode attention over the store's tiers and ``window`` (the exact rows' key and
    value buffers and the count held, an int32 array; None: no rows) in one compiled pass;
    None where a tier's keys and values differ in room (the parts' path serves then)."""
    ks, vs = store.k_tiers, store.v_tiers
    present = tuple(bool(k.capacity) and k.counts is not None for k in ks)
    if any(p and v.capacity != k.capacity for p, k, v in zip(present, ks, vs)) or not (any(present) or window):
        return None
    projected = tuple(t in store.projections for t in range(len(ks)))
    if any(p and q and (ks[t].positions is None) != (store.rotary is None)
           for t, (p, q) in enumerate(zip(present, projected))):
        return None
    rotary = store.rotary if any(p and ks[t].positions is not None for t, p in enumerate(present)) else None
    how = _Step(float(scale), tuple((k.codec.bits, k.codec.group) for k in ks), projected, rotary, present,
                window is not None)
    args = list(window or ())
    for t, (k, v) in enumerate(zip(ks, vs)):
        if present[t]:
            args += [k.counts, k.codes, k.scales, k.biases, v.codes, v.scales, v.biases]
            if projected[t]:
                args += list(store.projections[t])
                if rotary is not None:
                    args.append(k.positions)
    args += [_shifts(bits) for bits in sorted({k.codec.bits for k, p in zip(ks, present) if p})]
    if rotary is not None:
        d = next(store.projections[t][0].shape[-1] for t, p in enumerate(present) if p and projected[t])
        args += list(_turns(rotary, d))
    return _step_fn(how)(queries, *args)


