"""The quantized store: a layer's keys and values, packed, with a full-precision window.

New tokens wait in full precision, then flush into packed storage: keys in blocks of
``key_block`` tokens (a per-channel codec needs whole groups of tokens), values one token
at a time so that the newest ``window`` values stay exact (KIVI's residual R; with
``key_block = window`` the newest ``T mod R`` keys stay exact too). A per-token key codec
needs no blocks of tokens: with ``key_block=None`` keys and values slide together past
the newest ``window``, flushed ``slide_block`` tokens at a time (so a decode step codes
nothing on most steps: the window holds ``window`` to ``window + slide_block - 1`` tokens). A codec that is not group-affine brings its own storage (``codec.tokens(step)``:
``PackedTokens``' interface, and ``layout_problems(name, head_dim)``). Older runs of tokens
may sit in sealed ``segments`` of other codecs (precision by age, by epoch): each is
attended as one part of the decode, the parts merged by log-sum-exp.

A prefill chunk attends over the history (decoded, transient) plus itself; a decode step
over the packed parts, through the fused kernel on a GPU or the pure-MLX path elsewhere
(``kernels/decode.py``). Nothing is kept in full precision beyond the window; new rows
are written into grown buffers in place, the history is never concatenated or re-sliced
at a decode step.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..cache.buffers import GrowingArray, RecentRows, arrays_written
from ..kernels.decode import DecodePart, decode_attention
from .packed import GROWTH_TOKENS, PackedTokens


@dataclass
class Segment:
    """A sealed run of tokens: keys and values in their own codecs, the same tokens."""

    keys: PackedTokens
    values: PackedTokens


VALUE_ROOM = 32  # rows of room past the values' window: its rows move once every 32 steps
WINDOW_STEP = 32  # the windows grow with what they hold, 32 rows at a time


def _tokens(codec, step_tokens: int = GROWTH_TOKENS):
    """The packed storage of ``codec``: its own, or group-affine ``PackedTokens``."""
    return codec.tokens(step_tokens) if hasattr(codec, "tokens") else PackedTokens(codec, step_tokens)


def _rows(x) -> int:
    return 0 if x is None else x.shape[2]


@functools.lru_cache(maxsize=None)
def absent_buffer(dtype) -> mx.array:
    """The stand-in of an absent packed buffer, made once (never written: a graph node less
    a layer and step)."""
    return mx.zeros((0,), dtype)


def joined_history(parts_k: list, parts_v: list, tail_k, tail_v, dtype):
    """What ``history`` returns: the decoded runs of keys and of values (in order), then
    the full-precision tails (None, or rows: an empty one is left out), each joined along
    the tokens; (None, None) when nothing is stored."""
    if _rows(tail_k):
        parts_k = parts_k + [as_dtype(tail_k, dtype)]
    if _rows(tail_v):
        parts_v = parts_v + [as_dtype(tail_v, dtype)]
    if not parts_k:
        return None, None
    return _joined(parts_k), _joined(parts_v)


def as_dtype(x: mx.array, dtype) -> mx.array:
    """``x`` in ``dtype``, itself where it already is (no copy in the graph)."""
    return x if x.dtype == dtype else x.astype(dtype)


def _joined(parts: list):
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


PACE_ON_CPU = False  # tests turn it on


class _Pacing(threading.local):
    previous: mx.array | None = None  # the last output ``paced`` scheduled in this thread


_pacing = _Pacing()


def paced(out: mx.array) -> mx.array:
    """A prompt chunk's attention output over a decoded history, scheduled now; the host
    then waits for the previous such output (the layer before it). Left lazy, the host
    builds every layer's graph before the device runs them, and on a GPU each layer's
    decoded history is held until its kernels finish: a whole model's histories at once.
    Waiting one layer behind keeps the device fed while the host builds the next layer;
    waiting for this layer (or for its queries, which an asynchronous evaluation signals
    with its output) starves it (benchmarks/notes/prefill.md, session 51). The CPU
    back-end shows no such pile-up, and there a chunk whose output nobody reads stays
    uncomputed."""
    if not (PACE_ON_CPU or mx.default_device() == mx.gpu):
        return out
    mx.async_eval(out)
    previous, _pacing.previous = _pacing.previous, out
    if previous is not None:
        mx.eval(previous)
    return out


def end_pacing() -> None:
    """A decode step: the prompt's last paced output is no longer held."""
    _pacing.previous = None


class PackedStore:
    """What every quantized store shares. A store provides ``commit`` (take new tokens in),
    ``history`` (every token decoded, in order), ``decode_parts``, ``length``, ``arrays``
    (what it keeps, by name), ``layout_problems`` and ``problems`` (how a restored state
    contradicts it), and ``meta``/``restore`` when its layout is more than fixed arrays."""

    def prefill_attention(self, queries, keys, values, *, scale, mask) -> mx.array:
        """A prompt chunk attends over the decoded history plus itself, then is stored."""
        old_k, old_v = self.history(keys.dtype)
        all_k = keys if old_k is None else mx.concatenate([old_k, keys], axis=2)
        all_v = values if old_v is None else mx.concatenate([old_v, values], axis=2)
        out = mx.fast.scaled_dot_product_attention(queries, all_k, all_v, scale=scale, mask=mask)
        self.commit(keys, values)
        return paced(mx.depends(out, self.written()))

    def history_after(self, dtype, after: mx.array) -> tuple[mx.array | None, mx.array | None]:
        """``history``, computed no earlier than ``after``: a decode step's read over the
        decoded history. The stored arrays are ready before the layer runs, so without the
        gate MLX may decode several layers' histories ahead of their attention and hold
        them all (benchmarks/dense_read_peak.py). The gate is on the buffers for this read
        only: the store keeps its own arrays, free of the step's graph. It holds back the
        integer buffers (codes, indices: every decode that expands rows reads one), or the
        largest buffer where there are none (latents): each gated buffer costs graph-
        building time (benchmarks/notes/decode_kernels.md)."""
        held = [a for a in self.arrays().values() if isinstance(getattr(a, "buffer", None), mx.array)]
        gated = [a for a in held if mx.issubdtype(a.buffer.dtype, mx.integer)]
        if not gated and held:
            gated = [max(held, key=lambda a: a.buffer.nbytes)]
        kept = [a.buffer for a in gated]
        for a, buffer in zip(gated, mx.depends(kept, [after]) if gated else []):
            a.buffer = buffer
        try:
            return self.history(dtype)
        finally:
            for a, buffer in zip(gated, kept):
                a.buffer = buffer

    def written(self) -> list[mx.array]:
        """Every array the store keeps (``buffers.arrays_written``)."""
        return arrays_written(self.arrays())

    def decode_attention(self, queries, keys, values, *, scale, use_kernel) -> mx.array:
        """A decode step: store the token, attend over every part of the packed cache."""
        self.commit(keys, values)
        return self.attend_parts(queries, scale=scale, use_kernel=use_kernel, n_kv_heads=keys.shape[1])

    def attend_parts(self, queries, *, scale, use_kernel, n_kv_heads: int) -> mx.array:
        """A decode step's attention over every part of what is stored (``decode_parts``)."""
        return decode_attention(queries, self.decode_parts(absent_buffer(queries.dtype)), scale=scale,
                                use_kernel=use_kernel, n_kv_heads=n_kv_heads)

    def meta(self) -> dict[str, Any]:
        return {}

    def restore(self, meta: dict[str, Any], arrays: dict[str, Any]) -> None:
        """Put saved arrays back where ``arrays`` keeps them (by name)."""
        kept = self.arrays()
        for name, value in arrays.items():
            if isinstance(kept.get(name), GrowingArray):
                kept[name].reset(value)
            elif name in kept:
                setattr(self, name, value)


class QuantizedKVStore(PackedStore):
    """``attend_then_flush``: a decode step attends over the windows with its new rows in
    them (``key_block`` keys, ``window + 1`` values at most), then flushes what is due, as
    KIVI's official decode does; otherwise it flushes first, and the step's own key may be
    read quantized."""

    def __init__(self, key_codec, value_codec, window: int,
                 key_block: int | None, step_tokens: int, attend_then_flush: bool = False,
                 slide_block: int = 1, value_flush: int = 1):
        if not 1 <= value_flush <= VALUE_ROOM:
            raise ValueError(f"value_flush={value_flush}: must be from 1 to {VALUE_ROOM}")
        self.window, self.key_block = window, key_block
        self.slide_block = slide_block if key_block is None else 1
        self.attend_then_flush = attend_then_flush
        # decode steps pack values ``value_flush`` at a time (keys in blocks): the window
        # then holds from ``window`` to ``window + value_flush - 1`` exact values
        self.value_flush = value_flush if key_block is not None else 1
        self.keys = _tokens(key_codec, step_tokens)
        self.values = _tokens(value_codec)
        # Full-precision windows, written in place: keys not yet flushed (< key_block, or
        # the newest ``window`` when they slide), the newest ``window`` values, each sliding
        # one with VALUE_ROOM rows of room, so a step moves no rows.
        room = window + self.slide_block - 1 + VALUE_ROOM
        self.k_win = RecentRows(step=WINDOW_STEP, limit=room if self.sliding_keys else key_block,
                                geometric=True)
        self.v_win = RecentRows(step=WINDOW_STEP, limit=room, geometric=True)
        self.segments: list[Segment] = []

    @property
    def sliding_keys(self) -> bool:
        return self.key_block is None

    @property
    def k_res(self) -> mx.array | None:
        return self.k_win.view()

    @k_res.setter
    def k_res(self, rows) -> None:
        self.k_win.reset(rows)

    @property
    def v_res(self) -> mx.array | None:
        return self.v_win.view()

    @v_res.setter
    def v_res(self, rows) -> None:
        self.v_win.reset(rows)

    @property
    def length(self) -> int:
        sealed = sum(s.keys.count for s in self.segments)
        return sealed + self.keys.count + _rows(self.k_res)

    # -- writing -------------------------------------------------------------------------
    def commit(self, keys: mx.array, values: mx.array) -> None:
        """Take new tokens in; flush what the policy says is old enough."""
        if keys.shape[2] == 1 and (self.window or self.sliding_keys):  # a decode step: rows written in place
            self.k_win.append(keys)
            self.v_win.append(values)
            self._flush_windows()
            return
        self._append_rows(keys, values)

    def _flush_windows(self) -> None:
        """After a decode step's rows: a full key block and the value past the window, or,
        sliding keys, a block of both once that many are past the window."""
        if self.sliding_keys:
            n = self.slide_block
            if self.k_win.held >= self.window + n:
                self.keys.append(self.k_win.pop_front(n), decoding=True)
                self.values.append(self.v_win.pop_front(n), decoding=True)
            return
        if self.k_win.held == self.key_block:
            self.keys.append(self.k_win.view(), decoding=True)
            self.k_win.truncate(0)  # its room stays: the next block fills it without growing
        if self.v_win.held >= self.window + self.value_flush:
            n = self.v_win.held - self.window
            self.values.append(self.v_win.pop_front(n), decoding=True)
            self.v_win.compact()  # rows from 0 again: the kernels read the buffer itself

    def decode_attention(self, queries, keys, values, *, scale, use_kernel) -> mx.array:
        if not (self.attend_then_flush and (self.window or self.sliding_keys)):
            return super().decode_attention(queries, keys, values, scale=scale, use_kernel=use_kernel)
        self.k_win.append(keys)
        self.v_win.append(values)
        out = self.attend_parts(queries, scale=scale, use_kernel=use_kernel, n_kv_heads=keys.shape[1])
        self._flush_windows()
        return out

    def _keys_to_flush(self, n_exact: int) -> int:
        """How many of ``n_exact`` full-precision keys (oldest first) the flush rule packs."""
        if self.sliding_keys:
            return max(0, n_exact - self.window)
        return n_exact // self.key_block * self.key_block

    def _append_rows(self, keys: mx.array, values: mx.array) -> None:
        """Tokens joined to the windows by concatenation, then flushed by the rules."""
        k_res = keys if self.k_res is None else mx.concatenate([self.k_res, keys], axis=2)
        n_flush = self._keys_to_flush(k_res.shape[2])
        if n_flush:
            self.keys.append(k_res[:, :, :n_flush])
            k_res = mx.contiguous(k_res[:, :, n_flush:])  # no view pinning the old block
        self.k_res = k_res

        v_res = values if self.v_res is None else mx.concatenate([self.v_res, values], axis=2)
        n_old = v_res.shape[2] - self.window  # (sliding keys: the same tokens as the keys)
        if n_old > 0:
            self.values.append(v_res[:, :, :n_old])
            v_res = mx.contiguous(v_res[:, :, n_old:])
        self.v_res = v_res

    # -- reading --------------------------------------------------------------------------
    def history(self, dtype) -> tuple[mx.array | None, mx.array | None]:
        """Every stored token in ``dtype``, in order (transient: prefill chunks and tests)."""
        parts_k, parts_v = self._leading_history(dtype)
        for keys, values in [(s.keys, s.values) for s in self.segments] + [(self.keys, self.values)]:
            if keys.count:
                parts_k.append(keys.decode(dtype))
            if values.count:
                parts_v.append(values.decode(dtype))
        return joined_history(parts_k, parts_v, self.k_res, self.v_res, dtype)

    def _leading_history(self, dtype) -> tuple[list, list]:
        """Rows that lead ``history``'s join before the packed runs (none here; a sink
        store's sinks), as lists of keys and of values in ``dtype``."""
        return [], []

    def decode_parts(self, empty: mx.array) -> list[DecodePart]:
        parts = [DecodePart(s.keys.layout(empty), None, s.values.layout(empty), None)
                 for s in self.segments]
        k_held, v_held = self.k_win.held, self.v_win.held
        if k_held and v_held and not self.k_win.start and not self.v_win.start:
            # the windows' buffers themselves, rows from 0: no slice (and no copy of it
            # into a contiguous array for the kernel) at each step
            parts.append(DecodePart(self.keys.layout(empty), self.k_win.buffer,
                                    self.values.layout(empty), self.v_win.buffer,
                                    tail_rows=(k_held, v_held)))
        else:
            parts.append(DecodePart(self.keys.layout(empty), self.k_res,
                                    self.values.layout(empty), self.v_res))
        return parts

    def layout_problems(self, head_dims: tuple[int, int]):
        """(field, found, expected) for packed arrays whose shapes contradict their codecs;
        ``head_dims``: the key and value head_dim they must have."""
        for packed, name, dim in ((self.keys, "key", head_dims[0]), (self.values, "value", head_dims[1])):
            if hasattr(packed, "layout_problems"):  # a codec's own storage checks itself
                yield from packed.layout_problems(name, dim)
                continue
            if packed.codes.buffer is None:  # nothing flushed yet: every token is in the windows
                continue
            expected = packed.expected_shapes(dim)
            found = tuple(packed.codes.view().shape[2:]), tuple(packed.scales.view().shape[2:])
            if found != expected:
                c = packed.codec
                yield f"{name} codes and scales", found, f"{expected} ({c.bits}-bit codes, groups of {c.group})"

    def problems(self, offset: int):
        """(field, found, expected) for each way the stored tokens contradict the policy."""
        n_kq, n_vq = self.keys.count, self.values.count
        k_res, v_res = _rows(self.k_res), _rows(self.v_res)
        if self.sliding_keys:
            low, high = min(offset, self.window), self.window + self.slide_block - 1
            for name, rows in (("keys", k_res), ("values", v_res)):
                if not low <= rows <= high:
                    yield f"full-precision {name}", rows, f"{low}..{high} (window {self.window}, blocks of {self.slide_block})"
            if n_kq + k_res != offset or n_vq + v_res != offset:
                yield "tokens stored", f"{n_kq + k_res} keys / {n_vq + v_res} values", f"the offset {offset}"
            return
        if n_kq % self.key_block:
            yield "quantized keys", n_kq, f"a multiple of the key block {self.key_block}"
        if k_res >= self.key_block:
            yield "full-precision keys", k_res, f"fewer than the key block {self.key_block}"
        low = min(offset, self.window)
        if not low <= v_res < low + self.value_flush:
            allowed = (f"min(offset {offset}, window {self.window})" if self.value_flush == 1 else
                       f"from min(offset {offset}, window {self.window}) to {self.value_flush - 1} more")
            yield "full-precision values", v_res, allowed
        if n_kq + k_res != offset or n_vq + v_res != offset:
            yield "tokens stored", f"{n_kq + k_res} keys / {n_vq + v_res} values", f"the offset {offset}"

    # -- what is kept ------------------------------------------------------------------------
    def arrays(self) -> dict[str, Any]:
        out = {**self.keys.arrays("k"), **self.values.arrays("v"), "k_res": self.k_win, "v_res": self.v_win}
        for i, s in enumerate(self.segments):
            out.update(s.keys.arrays(f"seg{i}_k"))
            out.update(s.values.arrays(f"seg{i}_v"))
        return out
