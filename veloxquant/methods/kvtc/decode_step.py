"""A kvtc decode step's attention as one compiled pass over fixed rooms.

What ``kernels/decode.py``'s joint path computes over the store's parts (the sinks, the
coded middle read through ``TransformScores``, the window's rows), with shapes that change
only now and then: the packed codes are read over a room of whole ``GROWTH_TOKENS`` (the
buffer cut there, or padded where it holds less), the window's rows gathered oldest first
into ``window + CODE_EVERY - 1`` rows (the most it holds), and the rows past the coded count
or the window's held rows score -inf (their weights are then zero). The rooms depend on
the counts alone, not on how the buffers grew, so a restored cache reads exactly what the
original reads. The counts come in as small arrays, so the pass is traced again only when
the coded room grows; the layers of a step, of equal shapes, replay one traced graph.

Keys are rebuilt as ``Ŷ Vᵀ + μ`` and, pre-RoPE, rotated at their positions as
``x cos + swap(x) (±sin)`` (``swap``: each channel's rotary partner, a reversed view of the
pairs; ``derotate``'s arithmetic at the negated positions); values are mixed in the PCA
domain, ``((p Ŷ) Vᵀ) + (Σ p) μ``, as ``TransformScores.mix`` does. Only the angle tables
and row indices are built outside (once per room, shared by every layer, evaluated with
the first step that reads them); nothing here reads an array's values on the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from ...cache.buffers import fitted_rows, row_indices
from ...cache.rope import Rotary
from ...kernels.kivi_decode import token_mix
from ...quant.packed import GROWTH_TOKENS
from ...quant.packed import unpack_fields


@dataclass(frozen=True)
class _Step:
    """What the pass depends on besides its inputs' shapes."""

    scale: float
    rotary: bool | None  # pre-RoPE codes rotated forward (True: traditional pairs); None: post-RoPE


def _coefficients(words, word, next_word, shift, high_shift, crosses, mask, bits, step):
    """``TransformCodec.coefficients`` of the codes in (B, room, n_words) words: (B, room, k)."""
    codes = unpack_fields(words, word, next_word, shift, high_shift, crosses, mask)
    center = ((mx.array(1, mx.int32) << bits.astype(mx.int32)) - 1).astype(mx.float32) / 2
    return (codes.astype(mx.float32) - center) * step


def _step_graph(how: _Step, queries, sink_k, sink_v, win_k, win_v, n_coded, win_start, win_held,
                coded_rows, win_rows, win_at, cos, sin, k_words, k_codec, v_words, v_codec):
    b, hq, _, d = queries.shape
    h = sink_k.shape[1]
    q = queries.astype(mx.float32).reshape(b, h, hq // h, d) * how.scale
    room = k_words.shape[1]
    # the coded keys (B, H, d, room), rebuilt and rotated
    *k_fields, k_basis, k_mean = k_codec
    x = _coefficients(k_words, *k_fields) @ k_basis.astype(mx.float32).T[None] + k_mean.astype(mx.float32)
    if how.rotary is None:
        x = x.reshape(b, room, h, d).transpose(0, 2, 3, 1)
    else:  # (B, H, 2, d/2, room) halves or (B, H, d/2, 2, room) pairs; the partners reversed
        pairs = (d // 2, 2) if how.rotary else (2, d // 2)
        x = x.reshape(b, room, h, *pairs).transpose(0, 2, 3, 4, 1)
        swapped = x[..., ::-1, :] if how.rotary else x[:, :, ::-1]
        x = (x * cos + swapped * sin).reshape(b, h, d, room)
    coded = mx.where(coded_rows < n_coded, q @ x, -mx.inf)
    # the window's rows oldest first (rows past those held: any row, masked)
    at = mx.minimum(win_at + win_start, win_k.shape[2] - 1)  # (1, 1, most, 1)
    win_k, win_v = mx.take_along_axis(win_k, at, axis=2), mx.take_along_axis(win_v, at, axis=2)
    window = mx.where(win_rows < win_held, q @ win_k.astype(mx.float32).swapaxes(-1, -2), -mx.inf)
    sinks = q @ sink_k.astype(mx.float32).swapaxes(-1, -2)
    n_sink = sinks.shape[-1]
    p = mx.softmax(mx.concatenate([sinks, coded, window], axis=-1), axis=-1)
    p_coded = p[..., n_sink : n_sink + room]
    *v_fields, v_basis, v_mean = v_codec
    y = _coefficients(v_words, *v_fields)[:, None]  # (B, 1, room, k)
    w = v_basis.reshape(h, d, -1).swapaxes(-1, -2).astype(mx.float32)  # (H, k, d)
    mean = v_mean.reshape(1, h, 1, d).astype(mx.float32)
    o = p[..., :n_sink] @ sink_v.astype(mx.float32)
    o = o + (token_mix(p_coded, y) @ w + p_coded.sum(axis=-1, keepdims=True) * mean)
    o = o + p[..., n_sink + room :] @ win_v.astype(mx.float32)
    return o.reshape(queries.shape).astype(queries.dtype)


N_CODEC = 10  # a codec's arrays as the pass takes them: 6 of the field layout, bits, step, basis, mean


@functools.lru_cache(maxsize=None)
def _step_fn(how: _Step):
    def run(*args):
        head, k_codec, v_words, v_codec = args[:14], args[14 : 14 + N_CODEC], args[14 + N_CODEC], args[15 + N_CODEC :]
        return _step_graph(how, *head, k_codec, v_words, v_codec)

    return mx.compile(run)


@functools.lru_cache(maxsize=8)
def _rows_along_tokens(room: int) -> mx.array:
    """``row_indices`` shaped (1, 1, room, 1), to gather along the tokens of (B, H, T, D) rows."""
    return mx.arange(room, dtype=mx.int32).reshape(1, 1, room, 1)


@functools.lru_cache(maxsize=4)
def _angles(rotary: Rotary, d: int, start: int, room: int) -> tuple[mx.array, mx.array]:
    """cos and the signed sin of the rows' angles at positions ``start``.. (``derotate`` at
    the negated positions, as ``transform._rotate`` rotates forward: the same angles to the
    bit) in the pass's layout of a head's channels: (2, d/2, room) for halves, (d/2, 2, room)
    for pairs; a pair's second member takes -sin."""
    positions = -mx.arange(start, start + room)
    angle = (positions.astype(mx.float32)[..., None] * rotary.inverse_frequencies(d)).T  # (d/2, room)
    cos, sin = mx.cos(angle), mx.sin(angle)
    axis = 1 if rotary.traditional else 0
    return mx.stack([cos, cos], axis=axis), mx.stack([sin, -sin], axis=axis)


def decode_attention(store, queries, scale: float, most_held: int) -> mx.array | None:
    """The store's decode attention as one compiled pass (``most_held``: the most rows its
    window holds); None where its parts are not the steady state's three (sinks, coded
    middle, window rows): the parts' path serves then."""
    keys, values = store.keys, store.values
    n, sink_k, sink_v, win_k, win_v = keys.count, store.sink_k, store.sink_v, store.k_win, store.v_win
    if (not n or values.count != n or not sink_k.length or sink_k.length != sink_k.capacity
            or sink_v.length != sink_k.length or win_k.buffer is None or not win_k.held
            or (win_k.start, win_k.length) != (win_v.start, win_v.length) or win_k.held > most_held):
        return None
    room = -(-n // GROWTH_TOKENS) * GROWTH_TOKENS
    rotary = keys.rotary
    if rotary is None:
        cos = sin = row_indices(0)
    else:
        cos, sin = _angles(rotary, keys.heads[1], keys.start, room)
    codecs = [(*run.codec.fields.arrays(), run.codec.bits, run.codec.step, run.codec.basis, run.codec.mean)
              for run in (keys, values)]
    how = _Step(float(scale), None if rotary is None else rotary.traditional)
    counts = [mx.array(x, dtype=mx.int32) for x in (n, win_k.start, win_k.held)]
    return _step_fn(how)(
        queries, sink_k.buffer, sink_v.buffer, win_k.buffer, win_v.buffer, *counts, row_indices(room),
        row_indices(most_held), _rows_along_tokens(most_held), cos, sin, fitted_rows(keys.codes.buffer, room, 1), *codecs[0],
        fitted_rows(values.codes.buffer, room, 1), *codecs[1])
