"""A store of per-token rows between attention sinks and a sliding full-precision window,
in a channel order and with clip ratios fitted once from the first tokens it quantizes.

Layout of one layer (the sequence's tokens in order):

- the first ``n_sink`` tokens, keys and values in full precision for good (``Sinks`` of
  ``sink_store.py``);
- packed rows: keys *and* values per token (groups of ``group`` channels of one token),
  clipped (``methods/skvq/clip.py``), each a ``ClippedTokens`` run;
- the newest ``window`` tokens in full precision, keys and values alike: a step's token
  joins the window, and once ``FLUSH`` tokens are past it they leave together, quantized
  (SKVQ's sliding window, which quantizes one a step: the codes are the same, per token,
  and between flushes the window holds up to ``window + FLUSH - 1`` exact tokens; one
  quantization every ``FLUSH`` steps instead of one in each step's graph).

Fitting: when tokens are first about to be quantized, every full-precision row past the
sinks (the window plus the new chunk) fits, per (batch row, KV head), the channel order of
keys and of values (``key_order``/``value_order``, ``methods/skvq/reorder.py``; None keeps the
model's order) and then, on the reordered rows, the clip ratio of keys and of values
(``search_clip`` over ``clip_grid``; a grid of one value is a fixed ratio). Both are then
frozen: later chunks and decode steps use them as they are, and what is packed never
changes.

Installed (``install``): orders and clip ratios fitted elsewhere (a calibration file's,
``methods/skvq/cache.py``) taken before the first token, every batch row the same ones:
the store is fitted from the start, the sinks are kept reordered like everything else,
and no fit ever runs.

Channel space: once fitted, everything kept (sinks, packed rows, window) is in the
reordered order; a new token is permuted as it comes in (one gather), the sinks and the
window once at the fit. A decode step permutes the queries through the key order, attends
over the parts, and takes the output back through the inverse of the value order: two
more gathers, and attention itself never un-permutes the history. ``history`` (prefill
chunks, tests) gives every token back in the model's order.

Decode read (``_JointRead``, one part of the dispatcher's joint path): the sinks, the packed rows and the window under one float32
softmax, what ``kernels/decode.py``'s joint path computes for the parts ``decode_parts``
describes (no kernel reads per-token keys, on any device): on the CPU one
``quantized_matmul`` over the packed keys and one over the packed values, on Metal their
valid rows dequantized in float32 and multiplied. What it takes from the packed runs and
the sinks (their valid rows), the orders in the queries' layout and the scale are views kept
between flushes (``ReadViews``): a step slices nothing of the history. On CUDA, once rows
are packed, a step decodes every kept row in the queries' dtype (kept channel order) and
reads them with one ``mx.fast.scaled_dot_product_attention``, queries and output through
the orders as above; each layer's decode waits for its queries
(``PackedStore.history_after``).

It is a ``QuantizedKVStore`` for its windows, its packed runs' shape checks and what it
keeps; the flush, the reading and the policy checks are its own.

Decode parts: the sinks (full-precision rows only), then the packed rows with the window
as their full-precision tails. Packed values are an ``AffineLayout`` (axis "token": the
value layout of the fused kernels); packed keys, per token, are ``TokenRows``
(``quant/token_rows.py``), read by the pure-MLX path on every device: the kernels read keys
per channel only. ``capacity`` (None: unbounded) caps the packed rows' room at
``capacity - n_sink - window`` tokens.
"""

from __future__ import annotations

import itertools

from typing import Any

import mlx.core as mx

from ...cache.buffers import RecentRows
from ...cache.calibration import batch_rows
from ...kernels import kivi_decode as kd
from ...kernels.decode import DecodePart, decode_attention
from ...quant.affine import SUPPORTED_BITS
from .clip import ClippedTokens, fixed_clip, search_clip
from ...quant.packed import GROWTH_TOKENS, GroupAffine
from .reorder import PAIRINGS, RangeOrder, inverse, is_permutation, permute
from ...quant.sink_store import Sinks
from ...quant.store import VALUE_ROOM, WINDOW_STEP, QuantizedKVStore, _rows, as_dtype, joined_history
from ...quant.token_rows import ReadViews, TokenRows, mixed_into, row_mix, row_scores


FLUSH = VALUE_ROOM  # decode steps quantize the tokens past the window this many at a time


def _cat(old, new):
    return new if old is None else mx.concatenate([old, new], axis=2)


class _JointRead:
    """A decode step's read of a ``SlidingWindowStore`` as one ``PackedScores`` part (keys
    and values) of ``kernels/decode.py``: the sinks, the packed rows and the window under
    the dispatcher's one softmax (its joint path: no kernel reads per-token keys), in the
    reordered channel space: ``scores`` takes the queries through the key order, ``mix``
    gives the output back through the inverse of the value order."""

    def __init__(self, store: "SlidingWindowStore", q_shape, n_kv_heads: int):
        b, hq, _, d = q_shape
        self.packed_k, self.packed_v, self.sinks, self.perm, self.inv, ends = \
            store._read_views(b, n_kv_heads, hq // n_kv_heads, d)
        self.key_codec, self.value_codec = store.keys.codec, store.values.codec
        k_res = store.k_res  # a view of the window built once a step (a property: a slice a read)
        self.window = None if k_res is None else (k_res, store.v_res)
        self.n_heads = n_kv_heads
        n = _rows(k_res)
        # where the sinks' and the packed rows' weights end (those held), then the window's
        self.cuts = ends if n else ends[:-1]
        self.count = (ends[-1] if ends else 0) + n

    def part(self) -> DecodePart:
        return DecodePart(self, None, self, None)

    def scores(self, q: mx.array) -> mx.array:
        """float32 scores (B, H, R, N) for scaled float32 queries (B, H, R, D) (model order):
        the sinks', the packed rows', the window's."""
        if self.perm is not None:
            q = mx.take_along_axis(q, self.perm, axis=-1)
        out = []
        if self.sinks is not None:
            out.append(q @ self.sinks[0].astype(mx.float32).swapaxes(-1, -2))
        if self.packed_k is not None:
            out.append(row_scores(q, self.packed_k, self.key_codec))
        if self.window is not None:
            out.append(q @ self.window[0].astype(mx.float32).swapaxes(-1, -2))
        return out[0] if len(out) == 1 else mx.concatenate(out, axis=-1)

    def mix(self, p: mx.array) -> mx.array:
        """float32 ``p V`` (B, H, R, D) in the model's channel order, weights (B, H, R, N)."""
        cuts = self.cuts
        weights = iter(mx.split(p, cuts, axis=-1) if cuts else [p])
        out = None
        if self.sinks is not None:
            out = mixed_into(out, next(weights), self.sinks[1].astype(mx.float32))
        if self.packed_v is not None:
            out = row_mix(out, next(weights), self.packed_v, self.value_codec)
        if self.window is not None:
            out = mixed_into(out, next(weights), self.window[1].astype(mx.float32))
        return out if self.inv is None else mx.take_along_axis(out, self.inv, axis=-1)


def _valid(packed) -> tuple:
    n = packed.count
    return tuple(g.buffer[:, :, :n] for g in (packed.codes, packed.scales, packed.biases))


class SlidingWindowStore(Sinks, QuantizedKVStore):
    def __init__(self, *, key_bits: int, value_bits: int, group: int, window: int, n_sink: int,
                 key_order: RangeOrder | None, value_order: RangeOrder | None,
                 clip_grid: tuple[float, ...], step_tokens: int = GROWTH_TOKENS,
                 capacity: int | None = None):
        # The parent's state (per-token keys: no key blocks), then the storage of this store.
        placeholder = GroupAffine(8, 32, "token")
        super().__init__(placeholder, placeholder, window=window, key_block=1, step_tokens=step_tokens)
        self.group = group
        self.key_order, self.value_order, self.clip_grid = key_order, value_order, tuple(clip_grid)
        room = None if capacity is None else max(capacity - n_sink - window, 0)
        self.keys = ClippedTokens(key_bits, group, step_tokens, room)
        self.values = ClippedTokens(value_bits, group, step_tokens, room)
        self._init_sinks(n_sink)
        # Keys slide with the values: the window, written in place, VALUE_ROOM rows of room.
        self.k_win = RecentRows(step=WINDOW_STEP, limit=window + VALUE_ROOM, geometric=True)
        # Fitted at the first quantization: orders (B, H, 1, D) uint32, clip ratios (B, H).
        self.perm_k = self.perm_v = self.inv_v = None
        self.alpha_k = self.alpha_v = None
        self._views = ReadViews()  # the decode read's views (``_read_views``)

    @property
    def fitted(self) -> bool:
        return self.alpha_k is not None

    @property
    def length(self) -> int:
        return self.sink_k.length + self.keys.count + self.k_win.held

    # -- writing -------------------------------------------------------------------------
    def commit(self, keys: mx.array, values: mx.array) -> None:
        """Take new tokens (model order) in: sinks first, then the window, whose oldest
        tokens beyond ``window`` are quantized."""
        # Permuted before the sinks are taken: orders installed before the first token
        # (``install``) keep the sinks reordered too; a fit comes only once the sinks are full.
        if self.perm_k is not None:
            keys = permute(keys, self.perm_k)
        if self.perm_v is not None:
            values = permute(values, self.perm_v)
        keys, values, _ = self._take_sinks(keys, values)
        if not keys.shape[2]:
            return
        if keys.shape[2] == 1 and self.window and (self.fitted or self.k_win.held < self.window):
            self.k_win.append(keys)  # a decode step: rows written in place
            self.v_win.append(values)
            if self.k_win.held >= self.window + FLUSH:
                n = self.k_win.held - self.window
                self._pack(self.k_win.pop_front(n), self.v_win.pop_front(n), decoding=True)
            return
        k_all, v_all = _cat(self.k_res, keys), _cat(self.v_res, values)
        n_old = k_all.shape[2] - self.window
        if n_old > 0:
            if not self.fitted:
                k_all, v_all = self.fit(k_all, v_all)
            self._pack(k_all[:, :, :n_old], v_all[:, :, :n_old], decoding=n_old == 1)
            keep = n_old < k_all.shape[2]
            k_all = mx.contiguous(k_all[:, :, n_old:]) if keep else None
            v_all = mx.contiguous(v_all[:, :, n_old:]) if keep else None
        self.k_res, self.v_res = k_all, v_all

    def fit(self, keys: mx.array, values: mx.array):
        """Orders and clip ratios from the full-precision rows past the sinks (model order);
        returns those rows reordered, after reordering the sinks in place."""
        if self.key_order is not None:
            self.perm_k = self.key_order.fit(keys)
            keys = permute(keys, self.perm_k)
            if self.sink_k.length:
                self.sink_k.reset(permute(self.sink_k.view(), self.perm_k))
        if self.value_order is not None:
            self.perm_v = self.value_order.fit(values)
            self.inv_v = inverse(self.perm_v)
            values = permute(values, self.perm_v)
            if self.sink_v.length:
                self.sink_v.reset(permute(self.sink_v.view(), self.perm_v))
        self.alpha_k = search_clip(keys, self.group, self.keys.codec.bits, self.clip_grid)
        self.alpha_v = search_clip(values, self.group, self.values.codec.bits, self.clip_grid)
        return keys, values

    def install(self, arrays: dict[str, mx.array], shape: tuple[int, int]) -> None:
        """Orders and clip ratios fitted elsewhere (a calibration file's: ``perm_k``,
        ``perm_v`` (1, H, 1, D) uint32 with a channel order, ``alpha_k``, ``alpha_v`` (1, H)
        float32 with the clip search), taken before any token by every one of the
        ``shape`` = (B, H) rows: the store is fitted and never fits. Without ratios, the
        ratio is the grid's one value, as a fit would give it."""
        batch = shape[0]
        if self.key_order is not None:
            self.perm_k = batch_rows(arrays["perm_k"], batch)
        if self.value_order is not None:
            self.perm_v = batch_rows(arrays["perm_v"], batch)
            self.inv_v = inverse(self.perm_v)  # a sort of the order's indices, not of data
        for name in ("alpha_k", "alpha_v"):
            if len(self.clip_grid) == 1:
                setattr(self, name, fixed_clip(shape, self.clip_grid[0]))
            else:
                setattr(self, name, batch_rows(arrays[name], batch))

    def _pack(self, keys, values, decoding: bool) -> None:
        self._views.clear()  # no view pins a buffer the appends below write in place
        self.keys.append(keys, self.alpha_k, decoding)
        self.values.append(values, self.alpha_v, decoding)

    # -- reading --------------------------------------------------------------------------
    def history(self, dtype) -> tuple[mx.array | None, mx.array | None]:
        """Every stored token in ``dtype``, in order and in the model's channel order
        (transient: prefill chunks and tests)."""
        keys, values = self._reordered_history(dtype)
        if keys is not None and self.perm_k is not None:
            keys = permute(keys, inverse(self.perm_k))
        if values is not None and self.inv_v is not None:
            values = permute(values, self.inv_v)
        return keys, values

    def _reordered_history(self, dtype) -> tuple[mx.array | None, mx.array | None]:
        """Every stored token in ``dtype``, in order, in the channel space they are kept in."""
        parts_k, parts_v = self._leading_history(dtype)
        if self.keys.count:
            parts_k.append(self.keys.decode(dtype))
            parts_v.append(self.values.decode(dtype))
        return joined_history(parts_k, parts_v, self.k_res, self.v_res, dtype)

    def decode_parts(self, empty: mx.array) -> list[DecodePart]:
        """Sinks, then packed rows with the window as tails (the reordered space)."""
        parts = self._sink_parts()
        values = self.values.layout(empty)
        if values.bits not in SUPPORTED_BITS:  # 7 bits: no shared reader takes the layout
            values = TokenRows(values)
        parts.append(DecodePart(TokenRows(self.keys.layout(empty)), self.k_res, values, self.v_res))
        return parts

    def attend(self, queries, *, scale, use_kernel, n_kv_heads=None) -> mx.array:
        """Decode attention over what is stored: queries through the key order, the output
        back through the inverse of the value order (``_JointRead``)."""
        h = n_kv_heads or next(x.shape[1] for x in (self.k_res, self.sink_k.buffer, self.keys.codes.buffer)
                               if x is not None)
        if use_kernel and self.keys.count and kd.gpu_backend() == "cuda":
            return self._decoded_attention(queries, scale, h)
        return decode_attention(queries, [_JointRead(self, queries.shape, h).part()], scale=scale,
                                use_kernel=use_kernel, n_kv_heads=h)

    def _decoded_attention(self, queries, scale, h: int) -> mx.array:
        """On CUDA: every kept row decoded in the queries' dtype, in the kept channel order,
        and one fused attention; the queries go through the key order and the output back
        through the inverse of the value order, so the history is never un-permuted. The
        float32 read's products are what cuBLAS serves badly at decode shapes
        (benchmarks/results/h200_s65). The packed runs, the sinks and the orders are the
        views kept between flushes; the codes are decoded only once the queries exist, so
        that MLX does not decode later layers' rows ahead of their attention and hold them
        all (``PackedStore.history_after``)."""
        b, hq, _, d = queries.shape
        packed_k, packed_v, sinks, perm, inv, _ = self._read_views(b, h, hq // h, d)
        codes_k, codes_v = mx.depends([packed_k[0], packed_v[0]], [queries])
        dtype = queries.dtype
        parts_k, parts_v = ([], []) if sinks is None else ([as_dtype(sinks[0], dtype)], [as_dtype(sinks[1], dtype)])
        parts_k.append(self.keys.codec.decode(codes_k, *packed_k[1:], dtype))
        parts_v.append(self.values.codec.decode(codes_v, *packed_v[1:], dtype))
        rows = joined_history(parts_k, parts_v, self.k_res, self.v_res, dtype)
        q = queries if perm is None else mx.take_along_axis(queries.reshape(perm.shape), perm, axis=-1)
        out = mx.fast.scaled_dot_product_attention(q.reshape(queries.shape), *rows, scale=scale)
        return out if inv is None else mx.take_along_axis(out.reshape(inv.shape), inv, axis=-1).reshape(out.shape)

    def _read_views(self, b: int, h: int, r: int, d: int):
        """(packed keys' valid rows or None, packed values' likewise, (sink keys, sink
        values) or None, the key order and the inverse value order broadcast over the queries
        (B, H, R, D), or None, where the sinks' and the packed rows' tokens end (those held,
        in that order)), views kept while what they view stays as it is."""
        sk, sv, k, v = self.sink_k, self.sink_v, self.keys, self.values  # spelled out: built every step
        key = (b, h, r, d, self.perm_k, self.inv_v, sk.buffer, sk.length, sv.buffer, sv.length,
               k.codes.buffer, k.scales.buffer, k.biases.buffer, k.count,
               v.codes.buffer, v.scales.buffer, v.biases.buffer, v.count)

        def build():
            shape = (b, h, r, d)
            sinks = (self.sink_k.view(), self.sink_v.view()) if self.sink_k.length else (None, None)
            packed = (_valid(self.keys), _valid(self.values)) if self.keys.count else (None, None)
            perm = None if self.perm_k is None else mx.broadcast_to(self.perm_k, shape)
            inv = None if self.inv_v is None else mx.broadcast_to(self.inv_v, shape)
            ends = list(itertools.accumulate(n for n in (_rows(sinks[0]), self.keys.count) if n))
            return (*packed, None if sinks[0] is None else sinks, perm, inv, ends)

        return self._views.get(self, key, build)

    def decode_attention(self, queries, keys, values, *, scale, use_kernel) -> mx.array:
        self.commit(keys, values)
        return self.attend(queries, scale=scale, use_kernel=use_kernel, n_kv_heads=keys.shape[1])

    # -- what is kept ------------------------------------------------------------------------
    def arrays(self) -> dict[str, Any]:
        return {**super().arrays(), **self._sink_arrays(), "perm_k": self.perm_k, "perm_v": self.perm_v,
                "inv_v": self.inv_v, "alpha_k": self.alpha_k, "alpha_v": self.alpha_v}

    def meta(self) -> dict[str, Any]:
        """The rotary pairing of a key order not fitted yet travels with a saved state."""
        return {"key_pairs": "" if self.key_order is None else (self.key_order.pairs or "none")}

    def restore(self, meta: dict[str, Any], arrays: dict[str, Any]) -> None:
        pairs = meta.get("key_pairs", "")
        if self.key_order is not None and pairs in PAIRINGS + ("none",):
            self.key_order = RangeOrder(None if pairs == "none" else pairs)
        super().restore(meta, arrays)

    # -- a restored state must agree with the policy ------------------------------------------
    def layout_problems(self, head_dims: tuple[int, int]):
        """(field, found, expected) for arrays whose shapes contradict their codecs."""
        yield from super().layout_problems(head_dims)
        yield from self._sink_layout_problems(head_dims)
        for kept, name, i in ((self.k_win, "window keys", 0), (self.v_win, "window values", 1)):
            if kept.buffer is not None and kept.buffer.shape[3] != head_dims[i]:
                yield f"{name} head_dim", kept.buffer.shape[3], head_dims[i]
        for perm, name, i in ((self.perm_k, "key order", 0), (self.perm_v, "value order", 1),
                              (self.inv_v, "inverse value order", 1)):
            if perm is not None and (perm.ndim != 4 or perm.shape[2:] != (1, head_dims[i]) or not is_permutation(perm)):
                yield name, tuple(perm.shape), f"a permutation of {head_dims[i]} channels per (batch, head)"

    def problems(self, offset: int):
        """(field, found, expected) for each way the stored tokens contradict the policy."""
        yield from self._sink_problems(offset)
        rest = max(0, offset - self.n_sink)
        low = min(rest, self.window)
        win = self.k_win.held
        if not low <= win < low + FLUSH or self.v_win.held != win:
            yield "full-precision tokens", f"{self.k_win.held} keys / {self.v_win.held} values", \
                f"from min({rest} tokens past the sinks, window {self.window}) to {FLUSH - 1} more"
            win = low
        n_kq, n_vq = self.keys.count, self.values.count
        if n_kq != rest - win or n_vq != rest - win:
            yield "quantized tokens", f"{n_kq} keys / {n_vq} values", f"{rest - win}"
        # fitted once tokens are quantized; a calibration file's orders and ratios are in
        # place before any is (``install``)
        fitted = bool(n_kq) or self.alpha_k is not None
        for found, name, wanted in ((self.alpha_k, "key clip ratio", fitted), (self.alpha_v, "value clip ratio", fitted),
                                    (self.perm_k, "key order", fitted and self.key_order is not None),
                                    (self.perm_v, "value order", fitted and self.value_order is not None),
                                    (self.inv_v, "inverse value order", fitted and self.value_order is not None)):
            if (found is not None) != wanted:
                yield name, "present" if found is not None else "absent", \
                    "present once fitted (tokens quantized, or a calibration file installed)" if wanted else "absent"
        for alpha, name in ((self.alpha_k, "key clip ratio"), (self.alpha_v, "value clip ratio")):
            if alpha is not None and not bool(mx.all(mx.any(alpha[..., None] == mx.array(self.clip_grid), axis=-1))):
                yield name, alpha.tolist(), f"values of the grid {self.clip_grid}"
        if self.perm_v is not None and self.inv_v is not None and self.perm_v.shape == self.inv_v.shape and \
                not bool(mx.all(permute(self.perm_v, self.inv_v) == mx.arange(self.perm_v.shape[-1]))):
            yield "inverse value order", "not the inverse of the value order", "its inverse"
