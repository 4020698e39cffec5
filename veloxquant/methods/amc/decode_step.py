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
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from ...cache.rope import Rotary, derotate
from ...kernels import kivi_decode as kd
from ...kernels.compiled import index_range
from ...kernels.kivi_decode import token_mix
from ...quant.token_rows import dequantize_rows
from .token_tiers import MASKED


@dataclass(frozen=True)
class _Step:
    scale: float
    codecs: tuple[tuple[int, int], ...]  # (bits, group) of each tier (keys and values alike)
    projected: tuple[bool, ...]  # each tier kept as coefficients on a basis
    rotary: Rotary | None  # the projected keys kept pre-RoPE, rotated with these settings
    present: tuple[bool, ...]  # each tier has buffers
    window: bool  # the cache holds exact rows in its window
    unpacked_here: bool  # on the CPU: words unpacked in one shift (``_dequantize``)


def _unpacks_here() -> bool:
    """Whether the words are unpacked here (``_dequantize``): on the CPU."""
    return mx.default_device() == mx.cpu


def _dequantize(how: _Step, codes, scales, biases, group: int, bits: int) -> mx.array:
    """``dequantize_rows(..., float32)``. On the CPU, where ``mx.dequantize`` expands into a
    graph of one shift per code in a word (28 shift nodes and as many expansions for the
    three tiers' keys, as many for their values), the words are unpacked in one shift
    (``kivi_decode.unpacked_affine``, as ``evict/quantized_slots.py`` does: the same values,
    bit for bit); on a GPU ``mx.dequantize`` is one node."""
    if how.unpacked_here and 32 % bits == 0:
        return kd.unpacked_affine(codes, scales.astype(mx.float32), biases.astype(mx.float32), group, bits)
    return dequantize_rows(codes, scales, biases, group, bits, mx.float32)


def _graph(how: _Step, queries, counts, tiers, projections, positions, window):
    b, hq, _, d = queries.shape
    h = (window[0] if how.window else next(iter(tiers.values()))[0][0]).shape[1]
    q = queries.astype(mx.float32).reshape(b, h, hq // h, d) * how.scale
    scores, values = [], []
    for t, ((kc, ks, kb), (vc, vs, vb)) in tiers.items():
        bits, group = how.codecs[t]
        keys = _dequantize(how, kc, ks, kb, group, bits)
        vals = _dequantize(how, vc, vs, vb, group, bits)
        if how.projected[t]:
            k_mean, k_basis, v_mean, v_basis = (a.astype(mx.float32) for a in projections[t])
            keys = keys @ k_basis.swapaxes(-1, -2) + k_mean[:, :, None]
            if how.rotary is not None:
                keys = derotate(keys, -positions[t], how.rotary)
            values.append((vals, v_basis, v_mean))
        else:
            values.append((vals, None, None))
        valid = index_range(kc.shape[2]) < counts[t][..., None]
        scores.append(mx.where(valid[:, :, None], q @ keys.swapaxes(-1, -2), MASKED))
    if how.window:
        keys, vals, held = window
        valid = index_range(keys.shape[2]) < held
        scores.append(mx.where(valid, q @ keys.astype(mx.float32).swapaxes(-1, -2), MASKED))
        values.append((vals.astype(mx.float32), None, None))
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
        return _graph(how, queries, counts, tiers, projections, positions, window)

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
                window is not None, _unpacks_here())
    args = list(window or ())
    for t, (k, v) in enumerate(zip(ks, vs)):
        if present[t]:
            args += [k.counts, k.codes, k.scales, k.biases, v.codes, v.scales, v.biases]
            if projected[t]:
                args += list(store.projections[t])
                if rotary is not None:
                    args.append(k.positions)
    return _step_fn(how)(queries, *args)


