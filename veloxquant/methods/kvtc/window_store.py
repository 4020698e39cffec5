"""A store of sinks, a coded middle and a full-precision window of the newest tokens.

The first ``n_sink`` tokens stay in full precision for good; the newest ``window`` tokens
too; a token leaving the window joins the coded middle (keys and values together, each
in its own run: ``transform.TransformTokens`` or anything with its interface, ``fit``
included). The runs are fitted when the first token leaves the window, on the rows then
leaving it (a prompt chunk's rows before its new window; at a decode step, the leaving
rows and the window), and frozen after: later prompt chunks and decode tokens are coded
with that fit.

A prompt chunk moves what overflows the window into the runs at once and keeps the
window exactly sized; a decode step writes its row in place (``RecentRows``), and once
``CODE_EVERY`` rows past the window wait, they leave together and are coded in one batch
(the window then holds ``window`` to ``window + CODE_EVERY - 1`` rows): a step between
codes nothing. A prompt chunk attends over the reconstructed history plus
itself (``PackedStore``); a decode step over the sinks, the coded middle and the window's
rows under one softmax, as one compiled pass (``decode_step.py``; the parts' path,
``decode_parts``, where the store is not yet in that steady state).
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from ...cache.buffers import GrowingArray, RecentRows
from ...kernels.decode import DecodePart
from ...quant.store import VALUE_ROOM, WINDOW_STEP, PackedStore
from ...quant.token_rows import ReadViews
from . import decode_step

CODE_EVERY = VALUE_ROOM  # decode rows coded at once: the window's buffer has that much room


class SinkWindowStore(PackedStore):
    def __init__(self, keys, values, *, n_sink: int, window: int, fit: Callable[[list[tuple[Any, mx.array]]], None]):
        self.keys, self.values = keys, values
        self.n_sink, self.window, self._fit = n_sink, window, fit
        self.sink_k = GrowingArray(step=max(n_sink, 1), limit=n_sink)
        self.sink_v = GrowingArray(step=max(n_sink, 1), limit=n_sink)
        # the window grows with what it holds (geometric): a short prompt pays no 32-row step
        self.k_win = RecentRows(step=WINDOW_STEP, limit=window + VALUE_ROOM, geometric=True)
        self.v_win = RecentRows(step=WINDOW_STEP, limit=window + VALUE_ROOM, geometric=True)
        # what the compiled pass reads of the codes' buffers, the codecs (and their gather
        # indices over the room), and the sinks' keys transposed (``decode_step.py``): views
        # kept until what they view changes (a write in place into a viewed buffer clears them)
        self._code_views, self._codec_views, self._room_views, self._sink_views = (
            ReadViews(), ReadViews(), ReadViews(), ReadViews())

    @property
    def length(self) -> int:
        return self.sink_k.length + self.keys.count + self.k_win.held

    def _code(self, keys: mx.array, values: mx.array) -> None:
        """Rows leaving the window (oldest first) join the middle; the first fit the runs."""
        self._code_views.clear()  # no view pins a codes buffer the appends below write in place
        if self.keys.codec is None:  # both fits at once: one wait for the device, side by side on the CPU
            self._fit([(run, mx.concatenate([x, *[w for w in (window.view(),) if w is not None]], axis=2))
                       for run, x, window in ((self.keys, keys, self.k_win), (self.values, values, self.v_win))])
        self.keys.append(keys)
        self.values.append(values)

    def commit(self, keys: mx.array, values: mx.array) -> None:
        n = min(self.n_sink - self.sink_k.length, keys.shape[2])
        if n > 0:
            self._sink_views.clear()
            self.sink_k.append(keys[:, :, :n])
            self.sink_v.append(values[:, :, :n])
            keys, values = keys[:, :, n:], values[:, :, n:]
        if not keys.shape[2]:
            return
        if keys.shape[2] == 1 and self.window:  # a decode step: in place, rows leave in batches
            self.k_win.append(keys)
            self.v_win.append(values)
            if self.k_win.held == self.window + CODE_EVERY:
                old_k, old_v = self.k_win.pop_front(CODE_EVERY), self.v_win.pop_front(CODE_EVERY)
                self._code(old_k, old_v)
            return
        k = keys if self.k_win.view() is None else mx.concatenate([self.k_win.view(), keys], axis=2)
        v = values if self.v_win.view() is None else mx.concatenate([self.v_win.view(), values], axis=2)
        out = k.shape[2] - self.window
        if out > 0:
            self.k_win.reset(None)
            self.v_win.reset(None)
            self._code(k[:, :, :out], v[:, :, :out])
            k, v = k[:, :, out:], v[:, :, out:]
        self.k_win.reset(mx.contiguous(k) if k.shape[2] else None)
        self.v_win.reset(mx.contiguous(v) if v.shape[2] else None)

    def history(self, dtype):
        ks = [self.sink_k.view(), self.keys.decode(dtype), self.k_win.view()]
        vs = [self.sink_v.view(), self.values.decode(dtype), self.v_win.view()]
        ks, vs = [x.astype(dtype) for x in ks if x is not None], [x.astype(dtype) for x in vs if x is not None]
        if not ks:
            return None, None
        return mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)

    def decode_parts(self, empty: mx.array) -> list[DecodePart]:
        parts = []
        if self.sink_k.length:
            parts.append(DecodePart(None, self.sink_k.view(), None, self.sink_v.view()))
        coded = self.keys.count > 0
        parts.append(DecodePart(self.keys.layout(empty) if coded else None, self.k_win.view(),
                                self.values.layout(empty) if coded else None, self.v_win.view()))
        return parts

    def decode_attention(self, queries, keys, values, *, scale, use_kernel) -> mx.array:
        """A decode step: store the token, then attend in one compiled pass
        (``decode_step.py``) where the parts are the steady state's, else part by part."""
        self.commit(keys, values)
        out = decode_step.decode_attention(self, queries, scale, most_held=self.window + CODE_EVERY - 1)
        if out is not None:
            return out
        return self.attend_parts(queries, scale=scale, use_kernel=use_kernel, n_kv_heads=keys.shape[1])

    # -- a restored state must agree with the policy ------------------------------------------
    def layout_problems(self, head_dims: tuple[int, int]):
        for rows, name, dim in ((self.sink_k, "sink keys", head_dims[0]), (self.sink_v, "sink values", head_dims[1]),
                                (self.k_win, "window keys", head_dims[0]), (self.v_win, "window values", head_dims[1])):
            if rows.buffer is not None and rows.buffer.shape[3] != dim:
                yield f"{name} head_dim", rows.buffer.shape[3], dim

    def problems(self, offset: int):
        n_sink, rest = self.sink_k.length, max(0, offset - self.n_sink)
        if n_sink != min(offset, self.n_sink) or self.sink_v.length != n_sink:
            yield "sink tokens", f"{n_sink} keys / {self.sink_v.length} values", f"min(offset {offset}, {self.n_sink})"
        held = self.k_win.held
        if not min(rest, self.window) <= held < max(1, min(rest + 1, self.window + CODE_EVERY)) or self.v_win.held != held:
            yield ("window tokens", f"{held} keys / {self.v_win.held} values",
                   f"equal, from min({rest}, window {self.window}) to below window + {CODE_EVERY}")
        coded = rest - held
        if (self.keys.count, self.values.count) != (coded, coded):
            yield "coded tokens", f"{self.keys.count} keys / {self.values.count} values", coded

    def arrays(self) -> dict[str, Any]:
        return {**self.keys.arrays("k"), **self.values.arrays("v"), "sink_k": self.sink_k,
                "sink_v": self.sink_v, "k_win": self.k_win, "v_win": self.v_win}

