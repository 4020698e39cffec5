"""An amc decode step's attention as one compiled pass over the three tiers' buffers.

What ``kernels/decode.py``'s joint path computes over ``TieredRowsStore.decode_parts``
(every tier's scores under one softmax, each tier's values mixed by its slice): the
tiers' whole buffers are read, rows past each head's count score ``MASKED``; High and Mid
rows dequantized in float32; Low keys rebuilt on the basis, ``c Bᵀ + μ``, and (pre-RoPE)
rotated at their positions; Low values mixed in the basis' domain, ``(p c) Bᵀ + (Σ p) μ``.
Shapes change only when a tier grows, so the pass is traced again only then; the layers
of a step, of equal shapes, replay one traced graph. Nothing here reads an array's values
on the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from ...cache.rope import Rotary, derotate
from ...kernels.kivi_decode import token_mix
from ...quant.token_rows import dequantize_rows, quantize_rows
from .token_tiers import MASKED


@dataclass(frozen=True)
class _Step:
    scale: float
    codecs: tuple[tuple[int, int], ...]  # (bits, group) of each tier (keys and values alike)
    projected: tuple[bool, ...]  # each tier kept as coefficients on a basis
    rotary: Rotary | None  # the projected keys kept pre-RoPE, rotated with these settings


def _graph(how: _Step, queries, counts, tiers, projections, positions):
    b, hq, _, d = queries.shape
    h = counts[0].shape[1]
    q = queries.astype(mx.float32).reshape(b, h, hq // h, d) * how.scale
    scores, values = [], []
    for t, ((kc, ks, kb), (vc, vs, vb)) in enumerate(tiers):
        bits, group = how.codecs[t]
        keys = dequantize_rows(kc, ks, kb, group, bits, mx.float32)
        vals = dequantize_rows(vc, vs, vb, group, bits, mx.float32)
        if how.projected[t]:
            k_mean, k_basis, v_mean, v_basis = (a.astype(mx.float32) for a in projections[t])
            keys = keys @ k_basis.swapaxes(-1, -2) + k_mean[:, :, None]
            if how.rotary is not None:
                keys = derotate(keys, -positions[t], how.rotary)
            values.append((vals, v_basis, v_mean))
        else:
            values.append((vals, None, None))
        valid = mx.arange(kc.shape[2]) < counts[t][..., None]
        scores.append(mx.where(valid[:, :, None], q @ keys.swapaxes(-1, -2), MASKED))
    p = mx.softmax(mx.concatenate(scores, axis=-1), axis=-1)
    o, at = None, 0
    for vals, basis, mean in values:
        n = vals.shape[2]
        pt = p[..., at : at + n]
        at += n
        if basis is None:
            part = token_mix(pt, vals)
        else:
            part = token_mix(pt, vals) @ basis.swapaxes(-1, -2) + pt.sum(axis=-1, keepdims=True) * mean[:, :, None]
        o = part if o is None else o + part
    return o.reshape(queries.shape).astype(queries.dtype)


@functools.lru_cache(maxsize=None)
def _step_fn(how: _Step, n_tiers: int):
    def run(queries, *args):
        counts = args[:n_tiers]
        flat = args[n_tiers : n_tiers + 6 * n_tiers]
        tiers = [(flat[6 * t : 6 * t + 3], flat[6 * t + 3 : 6 * t + 6]) for t in range(n_tiers)]
        rest = list(args[7 * n_tiers :])
        projections, positions = {}, {}
        for t in range(n_tiers):
            if how.projected[t]:
                projections[t], rest = tuple(rest[:4]), rest[4:]
                if how.rotary is not None:
                    positions[t], rest = rest[0], rest[1:]
        return _graph(how, queries, counts, tiers, projections, positions)

    return mx.compile(run)


def decode_attention(store, queries, scale: float) -> mx.array | None:
    """The store's decode attention in one compiled pass; None where a tier is empty or
    its keys and values differ in room (the parts' path serves then)."""
    ks, vs = store.k_tiers, store.v_tiers
    if any(not k.capacity or k.counts is None or v.capacity != k.capacity for k, v in zip(ks, vs)):
        return None
    projected = tuple(t in store.projections for t in range(len(ks)))
    if any(p and (ks[t].positions is None) != (store.rotary is None) for t, p in enumerate(projected)):
        return None
    rotary = store.rotary if any(ks[t].positions is not None for t in range(len(ks))) else None
    how = _Step(float(scale), tuple((k.codec.bits, k.codec.group) for k in ks), projected, rotary)
    args = [k.counts for k in ks]
    for k, v in zip(ks, vs):
        args += [k.codes, k.scales, k.biases, v.codes, v.scales, v.biases]
    for t in range(len(ks)):
        if projected[t]:
            args += list(store.projections[t])
            if rotary is not None:
                args.append(ks[t].positions)
    return _step_fn(how, len(ks))(queries, *args)


# -- the tier write of a decode step ------------------------------------------------------------
@dataclass(frozen=True)
class _Write:
    codecs: tuple[tuple[int, int], ...]
    projected: tuple[bool, ...]
    positioned: tuple[bool, ...]  # the tier's keys kept with their positions
    rotary: Rotary | None  # projected keys taken before RoPE with these settings


def _write_graph(how: _Write, keys, values, wanted, caps, position, counts, buffers, projections):
    """``TieredRowsStore.commit_step`` after the room is planned: the tiers taken, then each
    tier's buffers with the token written at each head's count, and the new counts."""
    n_tiers = len(counts)
    room = mx.stack([c < cap - 1 for c, cap in zip(counts, caps)], axis=-1)  # (B, H, T)
    order = mx.arange(n_tiers)
    w = wanted.astype(mx.int32)
    cost = 2 * mx.abs(order - w) + (order > w)
    tiers = mx.argmin(mx.where(room, cost, 4 * n_tiers), axis=-1, keepdims=True).astype(mx.uint8)
    b, h = wanted.shape[:2]
    bi, hi = mx.arange(b).reshape(b, 1, 1), mx.arange(h).reshape(1, h, 1)
    out_buffers, out_counts = [], []
    for t in range(n_tiers):
        bits, group = how.codecs[t]
        k, v = keys, values
        if how.projected[t]:
            k_mean, k_basis, v_mean, v_basis = (a.astype(mx.float32) for a in projections[t])
            k32 = derotate(keys, position, how.rotary) if how.rotary is not None else keys.astype(mx.float32)
            k = ((k32 - k_mean[:, :, None]) @ k_basis).astype(keys.dtype)
            v = ((values.astype(mx.float32) - v_mean[:, :, None]) @ v_basis).astype(values.dtype)
        pos = counts[t][..., None]
        bufs = list(buffers[t])
        new = []
        for i, rows in ((0, k), (1, v)):
            codes, scales, biases = quantize_rows(rows, group, bits)
            kc, ks, kb = bufs[3 * i : 3 * i + 3]
            kc[bi, hi, pos] = codes
            ks[bi, hi, pos] = scales
            kb[bi, hi, pos] = biases
            new += [kc, ks, kb]
        if how.positioned[t]:
            p = bufs[6]
            p[bi, hi, pos] = mx.broadcast_to(position.astype(mx.int32), pos.shape)
            new.append(p)
        out_buffers += new
        out_counts.append(counts[t] + (tiers[..., 0] == t).astype(mx.int32))
    return (tiers, *out_counts, *out_buffers)


@functools.lru_cache(maxsize=None)
def _write_fn(how: _Write):
    n = len(how.codecs)

    def run(keys, values, wanted, caps, position, *args):
        counts, rest = args[:n], list(args[n:])
        buffers, projections = [], {}
        for t in range(n):
            m = 7 if how.positioned[t] else 6
            buffers.append(tuple(rest[:m]))
            rest = rest[m:]
        for t in range(n):
            if how.projected[t]:
                projections[t], rest = tuple(rest[:4]), rest[4:]
        return _write_graph(how, keys, values, wanted, [caps[t] for t in range(n)], position, counts,
                            buffers, projections)

    return mx.compile(run)


def commit_step(store, keys, values, wanted, caps: list[int]):
    """The tiers' write of a decode step in one compiled pass (the tiers grown to ``caps``
    first); None where a tier has no buffers yet (the store's own path serves then)."""
    ks, vs = store.k_tiers, store.v_tiers
    if any(k.codes is None or v.codes is None or k.counts is None for k, v in zip(ks, vs)):
        return None
    projected = tuple(t in store.projections for t in range(len(ks)))
    positioned = tuple(k.positions is not None for k in ks)
    if any(p and not q for p, q in zip(positioned, projected)):
        return None
    rotary = store.rotary if any(positioned) else None
    for k, v, cap in zip(ks, vs, caps):
        k.grow_to(cap)
        v.grow_to(cap)
    how = _Write(tuple((k.codec.bits, k.codec.group) for k in ks), projected, positioned, rotary)
    args = [k.counts for k in ks]
    for k, v in zip(ks, vs):
        args += [k.codes, k.scales, k.biases, v.codes, v.scales, v.biases]
        if k.positions is not None:
            args.append(k.positions)
    for t in range(len(ks)):
        if projected[t]:
            args += list(store.projections[t])
    out = _write_fn(how)(keys, values, wanted, _caps(tuple(caps)), _position(store.length), *args)
    tiers, out = out[0], list(out[1:])
    counts, out = out[: len(ks)], out[len(ks) :]
    for k, v, c in zip(ks, vs, counts):
        k.codes, k.scales, k.biases, v.codes, v.scales, v.biases = out[:6]
        out = out[6:]
        if k.positions is not None:
            k.positions, out = out[0], out[1:]
        k.counts, v.counts = c, c + 0
        k.bound = min(k.bound + 1, k.capacity - 1)
        v.bound = min(v.bound + 1, v.capacity - 1)
    return tiers


def _caps(caps: tuple[int, ...]) -> mx.array:
    return mx.array(caps, dtype=mx.int32)


def _position(start: int) -> mx.array:
    return mx.array([start], dtype=mx.int32)
