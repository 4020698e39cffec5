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

Keys are rebuilt channels first, ``V Ŷᵀ + μ`` (B, p, room: the scores' layout, no
transpose of the rebuilt rows; the codes are gathered along each row's words and the
coefficients turned: gathering across the rows from words read transposed ran 3x slower
on the CPU), and, pre-RoPE, rotated at their positions as ``(x + μ) cos + (swap(x) + swap(μ)) (±sin)`` (``swap``: each
channel's rotary partner, a reversed view of the pairs; ``derotate``'s arithmetic at the
negated positions); values are mixed in the PCA domain, ``((p Ŷ) Vᵀ) + (Σ p) μ``, as
``TransformScores.mix`` does. The parts' scores are masked once, after they are joined,
and the probabilities cut once (``mx.split``). Only the angle tables, row indices and the
window's gather index are built outside (once per room or window position, shared by every
layer, evaluated with the first step that reads them), and the views the pass reads of the
codes' buffers and the codecs (the words in the pass's layouts, the field tables
broadcast over the room, the bases and means reshaped, the sinks' keys transposed) are kept
by the store between the writes that change them (``ReadViews``); nothing here reads an
array's values on the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from ...cache.buffers import fitted_rows, row_indices
from ...cache.rope import Rotary
from ...kernels.kivi_decode import token_mix
from ...quant.packed import GROWTH_TOKENS


@dataclass(frozen=True)
class _Step:
    """What the pass depends on besides its inputs' shapes."""

    scale: float
    rotary: bool | None  # pre-RoPE codes rotated forward (True: traditional pairs); None: post-RoPE


def _coefficients(words, word, next_word, shift, high_shift, crosses, mask, bits, step, axis):
    """``TransformCodec.coefficients`` of the codes in ``words`` (``unpack_fields``' arithmetic,
    the words gathered along ``axis`` by indices already broadcast to the codes' shape)."""
    low, high = mx.take_along_axis(words, word, axis=axis), mx.take_along_axis(words, next_word, axis=axis)
    codes = ((low >> shift) | mx.where(crosses, high << high_shift, 0).astype(mx.uint32)) & mask
    center = ((mx.array(1, mx.int32) << bits.astype(mx.int32)) - 1).astype(mx.float32) / 2
    return (codes.astype(mx.float32) - center) * step


def _step_graph(how: _Step, queries, sink_kt, sink_v, win_k, win_v, n_coded, win_held, rows, k_at, v_at,
                cos, sin, k_words, k_codec, v_words, v_codec):
    b, hq, _, d = queries.shape
    h = sink_v.shape[1]
    q = queries.astype(mx.float32).reshape(b, h, hq // h, d) * how.scale
    room = k_words.shape[1]
    # the coded keys (B, H, d, room), rebuilt channels first and rotated
    *k_fields, k_basis, k_mean, k_mean_swapped = k_codec
    x = k_basis.astype(mx.float32) @ _coefficients(k_words, *k_fields, axis=-1).swapaxes(1, 2)  # (B, p, room)
    if how.rotary is None:
        x = (x + k_mean.astype(mx.float32)).reshape(b, h, d, room)
    else:  # (B, H, 2, d/2, room) halves or (B, H, d/2, 2, room) pairs; the partners reversed
        x = x.reshape(b, h, *((d // 2, 2) if how.rotary else (2, d // 2)), room)
        swapped = x[..., ::-1, :] if how.rotary else x[:, :, ::-1]
        x = ((x + k_mean.astype(mx.float32)) * cos
             + (swapped + k_mean_swapped.astype(mx.float32)) * sin).reshape(b, h, d, room)
    # the window's rows oldest first (rows past those held: any row, masked)
    win_k, win_v = mx.take_along_axis(win_k, k_at, axis=2), mx.take_along_axis(win_v, v_at, axis=2)
    n_sink = sink_kt.shape[-1]
    s = mx.concatenate([q @ sink_kt.astype(mx.float32), q @ x, q @ win_k.astype(mx.float32).swapaxes(-1, -2)],
                       axis=-1)
    valid = mx.where(rows < n_sink + room, (rows < n_sink) | (rows - n_sink < n_coded),
                     rows - (n_sink + room) < win_held)
    p_sink, p_coded, p_win = mx.split(mx.softmax(mx.where(valid, s, -mx.inf), axis=-1), [n_sink, n_sink + room],
                                      axis=-1)
    *v_fields, w, mean = v_codec
    y = _coefficients(v_words, *v_fields, axis=-1)  # (B, 1, room, k)
    o = p_sink @ sink_v.astype(mx.float32)
    o = o + (token_mix(p_coded, y) @ w.astype(mx.float32) + p_coded.sum(axis=-1, keepdims=True) * mean.astype(mx.float32))
    o = o + p_win @ win_v.astype(mx.float32)
    return o.reshape(queries.shape).astype(queries.dtype)


N_KEY_CODEC = 11  # the keys' arrays as the pass takes them: 6 of the field layout, bits, step, basis, 2 means
N_HEAD = 13  # the arrays before them: queries, 4 row buffers, 2 counts, rows, 2 gather indices, cos, sin, words


@functools.lru_cache(maxsize=None)
def _step_fn(how: _Step):
    def run(*args):
        head, k_codec = args[:N_HEAD], args[N_HEAD : N_HEAD + N_KEY_CODEC]
        v_words, v_codec = args[N_HEAD + N_KEY_CODEC], args[N_HEAD + N_KEY_CODEC + 1 :]
        return _step_graph(how, *head, k_codec, v_words, v_codec)

    return mx.compile(run)


@functools.lru_cache(maxsize=8)
def _window_index(start: int, capacity: int, most: int, shape: tuple) -> mx.array:
    """The window's rows oldest first in a buffer of ``capacity`` rows whose first held row is
    ``start`` (rows past the buffer: its last, masked), broadcast to ``shape`` (B, H, most, D):
    a gather index built once per window position and shape, shared by every layer."""
    at = mx.minimum(row_indices(most) + start, capacity - 1).reshape(1, 1, most, 1)
    return mx.broadcast_to(at, shape)


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


def _key_reads(run) -> tuple:
    """The keys' field tables (1, 1, k), widths and steps, the basis (1, p, k: one sequence's
    product broadcasts nothing), and the mean in the rebuilt rows' layout with its rotary
    partners' (views)."""
    c, (h, d) = run.codec, run.heads
    fields = (*c.fields.arrays(), c.bits, c.step, c.basis[None])
    if run.rotary is None:
        return (*fields, c.mean.reshape(h * d, 1), c.mean)
    pairs = (d // 2, 2) if run.rotary.traditional else (2, d // 2)
    mean = c.mean.reshape(h, *pairs, 1)
    return (*fields, mean, mean[..., ::-1, :] if run.rotary.traditional else mean[:, ::-1])


def _value_reads(run) -> tuple:
    """The values' field tables shaped (1, 1, 1, k) to unpack words read as (B, 1, room,
    words), widths and steps, the basis as (1, H, k, d) and the mean as (1, H, 1, d) (views)."""
    c, (h, d) = run.codec, run.heads
    k = c.bits.size
    return (*(a.reshape(1, 1, 1, k) for a in c.fields.arrays()), c.bits, c.step,
            c.basis.reshape(1, h, d, k).swapaxes(-1, -2), c.mean.reshape(1, h, 1, d))


def _words(run, room: int):
    """The run's words over ``room`` rows, and whether that is a view of its buffer (a buffer
    of fewer rows is padded: a copy, never kept)."""
    buffer = run.codes.buffer
    return fitted_rows(buffer, room, 1), buffer.shape[1] >= room


def _code_views(store, b: int, room: int) -> tuple:
    """(key words (B, room, words), key codec arrays, value words (B, 1, room, words), value
    codec arrays) as the pass reads them: views the store keeps, the codecs' while the codecs
    stay (built once, after the fit), their gather indices broadcast over the room while it
    stays, the words while the codes' buffers and the room stay (a coding drops them first)."""
    keys, values = store.keys, store.values
    k_codec, v_codec = store._codec_views.get(store, (keys.codec, values.codec, keys.rotary),
                                              lambda: (_key_reads(keys), _value_reads(values)))

    def broadcast():
        kk, vk = keys.codec.bits.size, values.codec.bits.size
        return (*(mx.broadcast_to(a, (b, room, kk)) for a in k_codec[:2]),
                *(mx.broadcast_to(a, (b, 1, room, vk)) for a in v_codec[:2]))

    indices = store._room_views.get(store, (k_codec, v_codec, b, room), broadcast)

    def words():
        (k_words, k_kept), (v_words, v_kept) = _words(keys, room), _words(values, room)
        return k_words if k_kept else None, v_words[:, None] if v_kept else None

    k_words, v_words = store._code_views.get(store, (keys.codes.buffer, values.codes.buffer, room), words)
    if k_words is None:
        k_words = _words(keys, room)[0]
    if v_words is None:
        v_words = _words(values, room)[0][:, None]
    return k_words, (*indices[:2], *k_codec[2:]), v_words, (*indices[2:], *v_codec[2:])


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
    b, h = sink_k.buffer.shape[:2]
    k_words, k_codec, v_words, v_codec = _code_views(store, b, room)
    sink_kt = store._sink_views.get(store, (sink_k.buffer,), lambda: sink_k.buffer.swapaxes(-1, -2))
    at = [_window_index(win_k.start, x.capacity, most_held, (b, h, most_held, x.buffer.shape[3])) for x in (win_k, win_v)]
    how = _Step(float(scale), None if rotary is None else rotary.traditional)
    counts = [mx.array(x, dtype=mx.int32) for x in (n, win_k.held)]
    return _step_fn(how)(
        queries, sink_kt, sink_v.buffer, win_k.buffer, win_v.buffer, *counts,
        row_indices(sink_k.length + room + most_held), *at, cos, sin, k_words, *k_codec, v_words, *v_codec)
