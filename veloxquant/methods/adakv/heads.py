"""Per-head bit widths inside a fixed bit budget a token: bit planes, decided on the device.

The allocation gives each KV head of a layer a width ``b_h`` in {lo, mid, hi} with
``sum b_h <= P = lo * H + spare`` (``spare = floor((target - lo) H)``), one allocation per
sequence (a (B, H) array: each row from its own keys' importance, so a cache fed B rows
stores each row as it would alone). Which heads get which width depends on the data; how
many bits a token holds at most does not. So a flushed block of ``block`` tokens is stored
as ``P`` *bit planes* a token: head h's code bits ``0 .. b_h - 1`` go to planes
``o_h .. o_h + b_h - 1`` (``o`` the exclusive cumsum of the row's widths), each plane
holding one bit of every channel, 32 channels a uint32 word. The block's widths are kept
(a sequence's row of H a block) and say, when read, which of that row's planes are
whose. Every size is known on the host before any value is: no host read at a flush and
no layout by width (the store this replaces opened an epoch per allocation, decided on
the host: one sync a flush).

Codes are KIVI's layout: keys per channel over the block's tokens (the block is one key
group), values per token in groups of ``group`` channels, min-max at the head's width,
scales and minima in the input's dtype (codes are taken against the rounded ones, so decoding
reads what encoding meant). Memory a token, KV head and K or V: ``P d / (8 H)`` bytes of
planes (the card's ``b_h d / 8`` summed over heads when the budget is spent, which it
always is when each upgrade costs one bit, as at the default 2/3/4) plus ``4 d / G``.

A decode step writes its token into the full-precision window in place (``window`` to
``window + block - 1`` rows) and attends through one compiled function over the whole
buffers (planes, scales, widths, window: spare room masked out, so its shapes change
only when a buffer grows): bits unpacked to codes per head, dequantized, the window
appended, one ``scaled_dot_product_attention``. On a GPU the stored rows come from one
kernel launch (``kernel.py``) instead of the compiled pass, the same values.
``RecentNorms`` keeps the key statistics the importance reads.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from ...cache.buffers import GrowingArray
from ...kernels.compiled import PerShape, index_range
from ...quant.packed import GROWTH_TOKENS
from ...quant.store import PackedStore
from ...quant.token_rows import ReadViews, held
from .kernel import plane_rows, stacked_maps

WORD = 32  # channels a plane word holds


def spare_bits(levels: tuple[int, int, int], target: float, n_heads: int) -> int:
    """The bits a token may spend above ``lo`` on every head: ``floor((target - lo) H)``."""
    return math.floor((target - levels[0]) * n_heads + 1e-9)


# -- the allocation, on the device ---------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def greedy_on_device(levels: tuple[int, int, int], spare: int, n_heads: int):
    """A compiled ``importance (..., H) -> widths (..., H) int32``: the card's greedy
    (``cache.py``'s ``allocate_bits``) for each row on its own (its own budget, lifted zeros
    and ties), in float32, a fixed number of rounds (each upgrade costs a bit at least, so
    ``spare`` rounds suffice; a round with nothing that fits changes nothing)."""
    lo, mid, hi = levels
    rounds = min(spare, 2 * n_heads)

    def allocate(importance):
        imp = importance.astype(mx.float32)
        imp = mx.where(mx.isfinite(imp) & (imp > 0), imp, 0.0)
        smallest = mx.min(mx.where(imp > 0, imp, mx.inf), axis=-1, keepdims=True)
        lifted = mx.where(mx.isinf(smallest), 1.0, 1e-3 * smallest)  # below every positive one
        imp = mx.where(imp > 0, imp, lifted)
        widths = mx.full(imp.shape, lo, mx.int32)
        left = mx.full((*imp.shape[:-1], 1), spare, mx.int32)  # each row's own budget
        heads = mx.arange(n_heads)
        for _ in range(rounds):
            upgrade = mx.where(widths == lo, mid, mx.where(widths == mid, hi, widths))
            cost = upgrade - widths
            fits = (cost > 0) & (cost <= left)
            gain = imp * (mx.power(4.0, -widths.astype(mx.float32)) - mx.power(4.0, -upgrade.astype(mx.float32)))
            gain = mx.where(fits, gain / mx.maximum(cost, 1).astype(mx.float32), -1.0)
            best = mx.argmax(gain, axis=-1, keepdims=True)  # the first of equal gains: the lower head
            taken = (heads == best) & (mx.take_along_axis(gain, best, axis=-1) >= 0)
            widths = mx.where(taken, upgrade, widths)
            left = left - mx.where(taken, cost, 0).sum(axis=-1, keepdims=True)
        return widths

    return mx.compile(allocate)


# -- codes and planes ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _bit_positions(n: int) -> mx.array:
    """0 .. n-1 as uint32 shifts, a constant (``kernels/compiled.index_range``'s kind)."""
    return mx.array(list(range(n)), mx.uint32)


def _top(widths: mx.array) -> mx.array:
    """(B, H) widths -> (B, H, 1, 1, 1) float32: 2**b_h - 1."""
    return ((mx.array(1, mx.int32) << widths) - 1).astype(mx.float32).reshape(*widths.shape, 1, 1, 1)


def _codes(x, lo, scale, top):
    s = scale.astype(mx.float32)
    q = mx.where(s > 0, mx.round((x - lo.astype(mx.float32)) / mx.where(s > 0, s, 1.0)), 0.0)
    return mx.clip(q, 0.0, top).astype(mx.uint32)


def quantize_keys(x: mx.array, widths: mx.array, block: int):
    """Per channel over each block's tokens: codes (B, H, nb, G, d), scales and minima (B, H, nb, 1, d)."""
    (b, h, n, d), dtype = x.shape, x.dtype
    x, top = x.astype(mx.float32).reshape(b, h, n // block, block, d), _top(widths)
    lo, hi = x.min(axis=3, keepdims=True), x.max(axis=3, keepdims=True)
    scale, lo = ((hi - lo) / top).astype(dtype), lo.astype(dtype)
    return _codes(x, lo, scale, top), scale, lo


def quantize_values(x: mx.array, widths: mx.array, block: int, group: int):
    """Per token in groups of ``group`` channels: codes (B, H, nb, G, d), scales and minima
    (B, H, nb, G, d/group)."""
    (b, h, n, d), dtype = x.shape, x.dtype
    g = x.astype(mx.float32).reshape(b, h, n // block, block, d // group, group)
    top = _top(widths)[..., None]
    lo, hi = g.min(axis=-1, keepdims=True), g.max(axis=-1, keepdims=True)
    scale, lo = ((hi - lo) / top).astype(dtype), lo.astype(dtype)
    return _codes(g, lo, scale, top).reshape(b, h, n // block, block, d), scale[..., 0], lo[..., 0]


def plane_map(widths: mx.array, n_planes: int, hi: int):
    """Where each row's head h's bit k lies, for (B, H) widths: the plane (B, H * hi) int32
    (``n_planes`` where b_h <= k) and the bit's weight (B, H, hi) uint32 (``2**k``, 0 where
    b_h <= k)."""
    offsets = mx.cumsum(widths, axis=-1) - widths
    k = index_range(hi)
    own = k < widths[..., None]
    source = mx.where(own, offsets[..., None] + k, n_planes).reshape(widths.shape[0], -1)
    return source, mx.where(own, mx.array(1, mx.uint32) << _bit_positions(hi), 0).astype(mx.uint32)


def to_planes(codes: mx.array, source: mx.array, n_planes: int, hi: int) -> mx.array:
    """(B, H, nb, G, d) codes, each row's bits to its own planes (``source`` (B, H * hi), as
    ``plane_map``'s) -> (B, P, nb, G, ceil(d/32), 1) uint32 planes (the last axis: where a
    read unpacks a word's 32 bits)."""
    b, h, nb, g, d = codes.shape
    words = -(-d // WORD)
    bits = (codes[:, :, None] >> _bit_positions(hi).reshape(1, 1, hi, 1, 1, 1)) & 1
    if d % WORD:
        bits = mx.pad(bits, [(0, 0)] * 5 + [(0, words * WORD - d)])
    packed = (bits.reshape(b, h, hi, nb, g, words, WORD) << _bit_positions(WORD)).sum(axis=-1)
    rows = packed.astype(mx.uint32).reshape(b, h * hi, nb, g, words)
    # each row's bits into its own row's planes (plane n_planes: a dump for the unused bits);
    # the bits of a plane are disjoint integers, so the order of the adds changes nothing
    planes = mx.zeros((b, n_planes + 1, nb, g, words), mx.uint32).at[index_range(b)[:, None], source].add(rows)
    return planes[:, :n_planes][..., None]


def from_planes(planes: mx.array, sources: list, weights: list, d: int) -> mx.array:
    """(B, P, nb, G, w, 1) planes, per bit k the plane of each row's head's bit k
    (B, H, nb, 1, 1, 1) and its weight (same shape) -> codes (B, H, nb, G, d) float32. One
    gather of a plane per bit, the bits summed elementwise (no (.., hi, ..) intermediate: under
    ``mx.compile`` the sum, and the dequantization after it, fuse into one pass that
    writes each code once)."""
    b, _, nb, g, words, _ = planes.shape
    codes = None
    for where, weight in zip(sources, weights):
        bit = ((mx.take_along_axis(planes, where, axis=1) >> _bit_positions(WORD)) & 1) * weight
        codes = bit if codes is None else codes + bit
    return codes.reshape(b, codes.shape[1], nb, g, words * WORD)[..., :d].astype(mx.float32)


def dequantized(k_planes, k_scales, k_min, v_planes, v_scales, v_min, sources, weights, *,
                group: int, d: tuple[int, int], dtype):
    """Keys and values (B, H, T, d) of the whole buffers (T: their capacity)."""
    kc = from_planes(k_planes, sources, weights, d[0])
    b, h, nb, g, _ = kc.shape
    keys = kc * k_scales.astype(mx.float32) + k_min.astype(mx.float32)
    vc = from_planes(v_planes, sources, weights, d[1]).reshape(b, h, nb, g, d[1] // group, group)
    values = vc * v_scales[..., None].astype(mx.float32) + v_min[..., None].astype(mx.float32)
    return keys.reshape(b, h, nb * g, d[0]).astype(dtype), values.reshape(b, h, nb * g, d[1]).astype(dtype)


@functools.lru_cache(maxsize=None)
def _encoder(hi: int, n_planes: int, block: int, group: int):
    """A flush's blocks (keys, values (B, H, n, d), widths (B, H)) -> key and value planes,
    their scales and minima, and per bit the plane (clipped to the last: the dump plane's
    bits have weight 0) and weight, (B, H, hi); compiled for each shape (``kernels/compiled.py``)."""
    def encode(keys, values, widths):
        source, weights = plane_map(widths, n_planes, hi)
        kc, ks, kmin = quantize_keys(keys, widths, block)
        vc, vs, vmin = quantize_values(values, widths, block, group)
        b, h = widths.shape
        return (to_planes(kc, source, n_planes, hi), to_planes(vc, source, n_planes, hi), ks, kmin, vs, vmin,
                mx.minimum(source, n_planes - 1).reshape(b, h, hi), weights)

    return PerShape(encode)


@functools.lru_cache(maxsize=None)
def _history(group: int, d: tuple[int, int], dtype):
    """``dequantized`` of the valid rows (a prompt chunk's history), compiled for each shape."""
    return PerShape(lambda *planes_and_maps: dequantized(*planes_and_maps, group=group, d=d, dtype=dtype))


@functools.lru_cache(maxsize=None)
def compiled_decode(group: int, d: tuple[int, int], scale: float):
    """One decode step's attention over the stored planes and the window, compiled (its
    shapes are the buffers', constant between growths)."""

    def attend(queries, k_planes, k_scales, k_min, v_planes, v_scales, v_min, sources, weights, win_k, win_v,
               valid):
        keys, values = dequantized(k_planes, k_scales, k_min, v_planes, v_scales, v_min, sources, weights,
                                   group=group, d=d, dtype=queries.dtype)
        mask = mx.where(valid, 0.0, -mx.inf).astype(queries.dtype)
        keys = mx.concatenate([keys, win_k.astype(queries.dtype)], axis=2)
        values = mx.concatenate([values, win_v.astype(queries.dtype)], axis=2)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    return mx.compile(attend)


def _fused_codes(planes, sources, weights) -> mx.array:
    """Codes in float32 of planes viewed (B, P, nb, G, ..., 1), per bit k the plane of each
    row's head's bit k and its weight broadcast to the gathered shape: (B, H, nb, G, ..., 32),
    the 32 bits of a word on the last axis (elementwise: fused with the dequantization)."""
    codes = None
    for where, weight in zip(sources, weights):
        bit = ((mx.take_along_axis(planes, where, axis=1) >> _bit_positions(WORD)) & 1) * weight
        codes = bit if codes is None else codes + bit
    return codes.astype(mx.float32)


@functools.lru_cache(maxsize=None)
def compiled_dequant(dtype):
    """A decode step's keys and values (B, H, nb, G, ...) of the whole plane buffers, in a
    layout where the dequantization is one elementwise pass after the gathers (the scales
    and minima viewed in the codes' layout: ``PlaneStore._read_views``)."""

    def dequant(k_planes, k_scales, k_min, k_sources, k_weights, v_planes, v_scales, v_min, v_sources,
                v_weights):
        keys = _fused_codes(k_planes, k_sources, k_weights) * k_scales.astype(mx.float32) + k_min.astype(mx.float32)
        values = _fused_codes(v_planes, v_sources, v_weights) * v_scales.astype(mx.float32) + v_min.astype(mx.float32)
        return keys.astype(dtype), values.astype(dtype)

    return mx.compile(dequant)


class PlaneStore(PackedStore):
    """Blocks of ``block`` tokens in bit planes behind a full-precision window of the newest
    ``window`` to ``window + block - 1`` tokens (fewer before that many came).

    ``levels``: (lo, mid, hi); ``target``: the average width, which bounds a token's bits;
    ``widths()``: the (B, H) int32 device array a flush stores under, a row a sequence
    (asked only then; an (H,) one is every row's).
    Every buffer grows a block at a time along its block axis (axis 2; the plane map's
    last), by the same step: their capacities stay equal.
    """

    def __init__(self, levels: tuple[int, int, int], target: float, block: int, group: int,
                 widths: Callable[[], mx.array], window: int = 0, step_tokens: int = GROWTH_TOKENS):
        self.levels, self.target, self.block, self.group, self.window = levels, target, block, group, window
        self.widths = widths
        steps = max(1, step_tokens // block)
        self.k_planes, self.v_planes = GrowingArray(step=steps), GrowingArray(step=steps)  # (B, P, nb, G, w)
        self.k_scales, self.k_min = GrowingArray(step=steps), GrowingArray(step=steps)  # (B, H, nb, 1, d)
        self.v_scales, self.v_min = GrowingArray(step=steps), GrowingArray(step=steps)  # (B, H, nb, G, d/g)
        # per bit k, (B, H, nb, 1, 1, 1): the plane holding each row's head's bit k (int32)
        # and the bit's weight (uint32, 2**k; 0 where the head's width is k or less)
        self.sources = [GrowingArray(axis=2, step=steps) for _ in range(levels[2])]
        self.weights = [GrowingArray(axis=2, step=steps) for _ in range(levels[2])]
        cap = window + block
        room = min(cap, GROWTH_TOKENS)
        # the window grows with what it holds (geometric) up to ``cap``, where the flush needs
        # it exactly: a short prompt pays no whole step
        self.k_win = GrowingArray(axis=2, step=room, limit=cap, geometric=True)
        self.v_win = GrowingArray(axis=2, step=room, limit=cap, geometric=True)
        self._views = ReadViews()  # the decode read's views of the buffers (``_read_views``)

    def n_planes(self, n_heads: int) -> int:
        return self.levels[0] * n_heads + spare_bits(self.levels, self.target, n_heads)

    @property
    def stored(self) -> int:
        return self.k_planes.length * self.block

    @property
    def length(self) -> int:
        return self.stored + self.k_win.length

    def block_widths(self) -> mx.array | None:
        """(B, nb, H): the widths each row's stored blocks were flushed under."""
        if self.weights[0].buffer is None:
            return None
        b, h = self.weights[0].buffer.shape[:2]
        return sum((w.view() > 0).astype(mx.int32) for w in self.weights).reshape(b, h, -1).swapaxes(1, 2)

    # -- writing -------------------------------------------------------------------------
    def commit(self, keys: mx.array, values: mx.array) -> None:
        """Take new tokens in; flush whole blocks under ``widths()`` (asked only then)."""
        n, cap = keys.shape[2], self.window + self.block
        if self.k_win.length + n <= cap:  # a decode step: rows written in place
            self.k_win.append(keys)
            self.v_win.append(values)
            if self.k_win.length == cap:
                b = self.block
                self._flush(self.k_win.buffer[:, :, :b], self.v_win.buffer[:, :, :b])
                for win in (self.k_win, self.v_win):  # the rest to the front, in place
                    if self.window:
                        win.buffer[:, :, : self.window] = win.buffer[:, :, b:]
                    win.truncate(self.window)
            return
        k, v = self._window()
        k = keys if k is None else mx.concatenate([k, keys], axis=2)
        v = values if v is None else mx.concatenate([v, values], axis=2)
        n_flush = max(0, k.shape[2] - self.window) // self.block * self.block
        if n_flush:
            self._flush(k[:, :, :n_flush], v[:, :, :n_flush])
        rest = k.shape[2] > n_flush
        self.k_win.reset(mx.contiguous(k[:, :, n_flush:]) if rest else None)  # no view pinning k
        self.v_win.reset(mx.contiguous(v[:, :, n_flush:]) if rest else None)

    def _flush(self, keys: mx.array, values: mx.array) -> None:
        if getattr(self, "_views", None) is not None:
            self._views.clear()  # no view pins a buffer the appends below write in place
        b, h = keys.shape[:2]
        widths = self.widths()
        if widths.shape != (b, h):  # one allocation for every row
            widths = mx.broadcast_to(widths, (b, h))
        hi, p, nb = self.levels[2], self.n_planes(h), keys.shape[2] // self.block
        k_planes, v_planes, ks, kmin, vs, vmin, source, weights = _encoder(hi, p, self.block, self.group)(
            keys, values, widths)
        self.k_planes.append(k_planes)
        self.v_planes.append(v_planes)
        for buf, x in ((self.k_scales, ks), (self.k_min, kmin), (self.v_scales, vs), (self.v_min, vmin)):
            buf.append(x)
        shape = (b, h, nb, 1, 1, 1)
        for k in range(hi):
            self.sources[k].append(mx.broadcast_to(source[:, :, k].reshape(b, h, 1, 1, 1, 1), shape))
            self.weights[k].append(mx.broadcast_to(weights[:, :, k].reshape(b, h, 1, 1, 1, 1), shape))

    # -- reading --------------------------------------------------------------------------
    def _window(self):
        if not self.k_win.length:
            return None, None
        return self.k_win.view(), self.v_win.view()

    def _dims(self) -> tuple[int, int]:
        return self.k_scales.buffer.shape[4], self.v_scales.buffer.shape[4] * self.group

    def history(self, dtype):
        """Every stored token in ``dtype``, in order (transient: prefill chunks and tests)."""
        k, v = self._window()
        if not self.stored:
            return (None, None) if k is None else (k.astype(dtype), v.astype(dtype))
        hk, hv = _history(self.group, self._dims(), dtype)(
            *(x.view() for x in (self.k_planes, self.k_scales, self.k_min, self.v_planes, self.v_scales, self.v_min)),
            [x.view() for x in self.sources], [x.view() for x in self.weights])
        if k is None:
            return hk, hv
        return mx.concatenate([hk, k.astype(dtype)], axis=2), mx.concatenate([hv, v.astype(dtype)], axis=2)

    def decode_attention(self, queries, keys, values, *, scale, use_kernel) -> mx.array:
        """A decode step: store the token, attend over the planes and the window at once."""
        self.commit(keys, values)
        return self.attend(queries, scale=scale)

    def attend(self, queries, *, scale, use_kernel=False, n_kv_heads=None) -> mx.array:
        """One query token a sequence over every stored token: the stored rows from the
        planes (one launch on a GPU, ``kernel.py``; else one compiled pass over the buffers'
        room, cut to the stored rows) and the window's joined, one unmasked
        ``scaled_dot_product_attention``."""
        k, v = self._window()
        if not self.stored:
            return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale)
        views = self._read_views()
        if views is None:  # a width or a group the fused layout does not take
            return self._attend_masked(queries, scale=scale)
        rows = plane_rows(self.plane_inputs, stored=self.stored, group=self.group, dtype=queries.dtype)
        keys, values = rows if rows is not None else self._dequantized_rows(views, queries.dtype)
        if k is not None:
            keys = mx.concatenate([keys, k.astype(keys.dtype)], axis=2)
            values = mx.concatenate([values, v.astype(values.dtype)], axis=2)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale)

    def _dequantized_rows(self, views, dtype) -> tuple[mx.array, mx.array]:
        """The stored keys and values (B, H, stored, d) through the compiled MLX pass."""
        keys, values = compiled_dequant(dtype)(*views)
        b, h, nb, g = keys.shape[:4]
        keys, values = keys.reshape(b, h, nb * g, -1), values.reshape(b, h, nb * g, -1)
        if self.stored < nb * g:
            keys, values = keys[:, :, : self.stored], values[:, :, : self.stored]
        return keys, values

    def plane_inputs(self) -> tuple:
        """What ``kernel.plane_rows`` reads: the whole buffers and the per-bit plane maps
        stacked (HI, B, H, nb), kept between flushes like ``_read_views``."""
        bufs = (self.k_planes, self.v_planes, self.k_scales, self.k_min, self.v_scales, self.v_min,
                *self.sources, *self.weights)
        key = (self.k_planes.length, *(x.buffer for x in bufs))

        def build():
            hi = len(self.sources)
            return (*(x.buffer for x in bufs[:6]),
                    *stacked_maps([x.buffer for x in bufs[6 : 6 + hi]], [x.buffer for x in bufs[6 + hi :]]))

        return held(self, "_plane_inputs", ReadViews).get(self, key, build)

    def _read_views(self):
        """What ``compiled_dequant`` reads, views of the whole buffers kept between flushes:
        the planes (B, P, nb, G, w, 1) for keys and (B, P, nb, G, d/g, g/32, 1) for values,
        the scales and minima in the codes' layout, each bit's source plane and weight
        broadcast to the gathered shape; None where a head dimension or the group is not a
        multiple of 32 (the masked read then)."""
        d_k, d_v = self._dims()
        g = self.group
        if d_k % WORD or d_v % WORD or g % WORD:
            return None
        bufs = (self.k_planes, self.k_scales, self.k_min, self.v_planes, self.v_scales, self.v_min,
                *self.sources, *self.weights)
        key = (self.k_planes.length, *(x.buffer for x in bufs))

        def build():
            kp, ks, kmin, vp, vs, vmin = (x.buffer for x in bufs[:6])
            b, p, nb, rows = kp.shape[:4]
            h = ks.shape[1]
            kp = kp.reshape(b, p, nb, rows, d_k // WORD, 1)
            vp = vp.reshape(b, p, nb, rows, d_v // g, g // WORD, 1)
            k_shape, v_shape = (b, h, nb, rows, d_k // WORD, 1), (b, h, nb, rows, d_v // g, g // WORD, 1)
            ks, kmin = (x.reshape(b, h, nb, 1, d_k // WORD, WORD) for x in (ks, kmin))
            vs, vmin = (x.reshape(b, h, nb, rows, d_v // g, 1, 1) for x in (vs, vmin))
            k_src = [mx.broadcast_to(x.buffer, k_shape) for x in self.sources]
            v_src = [mx.broadcast_to(x.buffer.reshape(b, h, nb, 1, 1, 1, 1), v_shape) for x in self.sources]
            k_w = [x.buffer for x in self.weights]  # (B, H, nb, 1, 1, 1)
            v_w = [x.buffer.reshape(b, h, nb, 1, 1, 1, 1) for x in self.weights]
            return kp, ks, kmin, k_src, k_w, vp, vs, vmin, v_src, v_w

        return held(self, "_views", ReadViews).get(self, key, build)

    def _attend_masked(self, queries, *, scale) -> mx.array:
        """The whole buffers dequantized, the spare rows masked out (``compiled_decode``)."""
        b, h = self.k_scales.buffer.shape[:2]
        d = self._dims()
        win_k, win_v = self.k_win.buffer, self.v_win.buffer
        if win_k is None:  # no window at all (residual_window 0, just flushed): one masked row
            win_k, win_v = mx.zeros((b, h, 1, d[0]), queries.dtype), mx.zeros((b, h, 1, d[1]), queries.dtype)
        valid = _valid(self.k_planes.capacity * self.block, win_k.shape[2], self.stored, self.k_win.length)
        return compiled_decode(self.group, d, scale)(
            queries, self.k_planes.buffer, self.k_scales.buffer, self.k_min.buffer, self.v_planes.buffer,
            self.v_scales.buffer, self.v_min.buffer, [x.buffer for x in self.sources],
            [x.buffer for x in self.weights], win_k, win_v, valid)

    # -- what is kept ----------------------------------------------------------------------
    def arrays(self) -> dict[str, Any]:
        return {"k_planes": self.k_planes, "v_planes": self.v_planes, "k_scales": self.k_scales,
                "k_min": self.k_min, "v_scales": self.v_scales, "v_min": self.v_min,
                **{f"plane_source_{k}": x for k, x in enumerate(self.sources)},
                **{f"plane_weights_{k}": x for k, x in enumerate(self.weights)}, "k_win": self.k_win, "v_win": self.v_win}

    def layout_problems(self, head_dims: tuple[int, int]):
        return iter(())

    def problems(self, offset: int, n_heads: int | None = None):
        """(field, found, expected) for each way the stored tokens contradict the policy."""
        blocks = self.k_planes.length
        for name, buf in self.arrays().items():
            if name not in ("k_win", "v_win") and buf.length != blocks:
                yield name, f"{buf.length} blocks", f"the {blocks} stored blocks"
        if n_heads is not None and self.k_planes.buffer is not None:
            if self.k_planes.buffer.shape[1] != self.n_planes(n_heads):
                yield "bit planes", self.k_planes.buffer.shape[1], self.n_planes(n_heads)
            if self.weights[0].buffer is not None and self.weights[0].buffer.shape[1] != n_heads:
                yield "plane weights heads", self.weights[0].buffer.shape[1], n_heads
        held, cap = self.k_win.length, self.window + self.block
        if not min(offset, self.window) <= held < cap or self.v_win.length != held:
            yield ("full-precision window", f"{held} keys / {self.v_win.length} values",
                   f"equal, from min(offset {offset}, window {self.window}) to below {cap}")
        if self.length != offset:
            yield "tokens stored", self.length, f"the offset {offset}"


def _valid(stored_room: int, window_room: int, stored: int, held: int) -> mx.array:
    """(stored_room + window_room,) bool: the rows of the buffers that hold tokens (a
    constant of the Python counters: no operation in the step's graph)."""
    pos = np.arange(stored_room + window_room)
    return mx.array((pos < stored) | ((pos >= stored_room) & (pos < stored_room + held)))


@functools.lru_cache(maxsize=1024)
def _position(pos: int) -> mx.array:
    """``mx.array([pos])``, made once a position (a decode step writes one a step)."""
    return mx.array([pos])


class RecentNorms:
    """The L2 norms of the newest ``window`` keys of each KV head, in a ring. Each write
    makes a new array (``slice_update``), so a ``snapshot`` is a reference, not a copy: an
    estimate is taken from one only when a flush needs it."""

    def __init__(self, window: int):
        self.window = window
        self.norms: mx.array | None = None  # (B, H, window) float32
        self.pos = self.filled = 0

    def observe(self, keys: mx.array) -> None:
        n = keys.shape[2]
        newest = keys if n <= self.window else keys[:, :, -self.window:]
        norms = mx.linalg.norm(newest.astype(mx.float32), axis=-1)  # (B, H, m)
        m = norms.shape[2]
        if self.norms is None:
            self.norms = mx.zeros((*norms.shape[:2], self.window), mx.float32)
        first = min(m, self.window - self.pos)
        self.norms = mx.slice_update(self.norms, norms if first == m else norms[:, :, :first],
                                     _position(self.pos), axes=(2,))
        if m > first:  # wraps around
            self.norms = mx.slice_update(self.norms, norms[:, :, first:], _position(0), axes=(2,))
        self.pos = (self.pos + m) % self.window
        self.filled = min(self.window, self.filled + n)

    def snapshot(self) -> tuple[mx.array | None, int]:
        return self.norms, self.filled

    def variance(self, snapshot: tuple[mx.array | None, int] | None = None) -> mx.array | None:
        """Per sequence and KV head (B, H), the variance of the held norms (now, or at
        ``snapshot``): each row its own, never pooled, so that a row's allocation is the one
        it gets alone; 0 with fewer than 2 keys seen, NaN (an overflowed key) read as 0."""
        norms, filled = snapshot or self.snapshot()
        if norms is None:
            return None
        if filled < 2:
            return mx.zeros(norms.shape[:2], mx.float32)
        held = norms if filled == self.window else norms[:, :, :filled]
        return mx.nan_to_num(mx.var(held, axis=-1), nan=0.0, posinf=0.0)

    def meta(self) -> dict[str, int]:
        return {"norms_pos": self.pos, "norms_filled": self.filled}

    def restore(self, meta: dict[str, Any], norms: mx.array | None) -> None:
        self.norms, self.pos, self.filled = norms, int(meta.get("norms_pos", 0)), int(meta.get("norms_filled", 0))


def check_case(dtype) -> tuple["PlaneStore", tuple[mx.array, mx.array]]:
    """A store of random tokens at the defaults' widths (2/3/4 bits, a target of 3, blocks and
    groups of 32, per-head widths that differ) and its stored keys and values through the
    compiled MLX pass: what ``kernel.py``'s self-check and tests compare the kernel with."""
    b, h, d, n = 2, 4, 64, 100
    widths = mx.array([[2, 4, 3, 3], [4, 2, 2, 4]], mx.int32)
    store = PlaneStore((2, 3, 4), 3.0, block=32, group=32, widths=lambda: widths, window=0)
    key = mx.random.split(mx.random.key(5), 2)
    store.commit(mx.random.normal((b, h, n, d), key=key[0]).astype(dtype),
                 mx.random.normal((b, h, n, d), key=key[1]).astype(dtype))
    return store, store._dequantized_rows(store._read_views(), dtype)
