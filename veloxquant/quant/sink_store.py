"""Attention sinks for quantized stores, and the quantized stores that keep them.

``Sinks`` is what every store with sinks shares (SKVQ's sliding store too): the first
``n_sink`` tokens of the sequence stay in full precision for good (StreamingLLM's sinks,
kept as ``sink_k``/``sink_v``), taken off the front of the first chunks, put back in front
of the history, attended as a decode part of their own (full-precision rows only), and
checked when a state is restored.

``SinkKVStore`` is ``QuantizedKVStore`` (``store.py``) with sinks in front and key storage
given, not built from a codec: ``PackedTokens`` or anything with its interface (``count``,
``append``, ``decode``, ``layout``, ``arrays``). Its two flush rules:

- ``SinkQuantizedStore`` (Kitty): keys flush in blocks of ``key_block`` only once the
  full-precision tail holds more than ``key_block`` keys, so the block flushed never holds
  the newest token and the tail keeps 1..key_block keys (Kitty's ``-L-1:-1`` slice);
  values slide one token at a time as in the parent, the newest ``window`` exact; the key
  storage also has ``expected_shapes``, ``codes``/``scales``, ``codec.bits``/``group``
  (``plane_problems`` if it keeps more), such as ``promoted.PromotedKeys``;
- ``StreamingStore`` (``streaming_store.py``, KVQuant): KIVI's rule, a value window that
  may be 0 (every value encoded as it comes), refits of the codecs.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..cache.buffers import GrowingArray, RecentRows
from ..kernels.decode import DecodePart
from .packed import GROWTH_TOKENS, GroupAffine, PackedTokens
from .store import WINDOW_STEP, QuantizedKVStore, _rows, as_dtype


class Sinks:
    """The sinks of a store: ``n_sink``, ``sink_k``, ``sink_v`` and what reads them."""

    def _init_sinks(self, n_sink: int) -> None:
        self.n_sink = n_sink
        room = min(max(n_sink, 1), WINDOW_STEP * 8)  # sinks grow with what they hold
        self.sink_k = GrowingArray(step=room, limit=n_sink)
        self.sink_v = GrowingArray(step=room, limit=n_sink)

    def _take_sinks(self, keys: mx.array, values: mx.array):
        """Keep the sequence's first tokens of a chunk as sinks: (the rest, tokens taken)."""
        n = min(self.n_sink - self.sink_k.length, keys.shape[2])
        if n <= 0:
            return keys, values, 0
        self.sink_k.append(keys[:, :, :n])
        self.sink_v.append(values[:, :, :n])
        return keys[:, :, n:], values[:, :, n:], n

    def _leading_history(self, dtype) -> tuple[list, list]:
        """The sinks' keys and values in ``dtype``, to lead ``history``'s one join."""
        if not self.sink_k.length:
            return [], []
        return [as_dtype(self.sink_k.view(), dtype)], [as_dtype(self.sink_v.view(), dtype)]

    def _sink_parts(self) -> list[DecodePart]:
        if not self.sink_k.length:
            return []
        return [DecodePart(None, self.sink_k.view(), None, self.sink_v.view())]

    def _sink_arrays(self) -> dict[str, GrowingArray]:
        return {"sink_k": self.sink_k, "sink_v": self.sink_v}

    def _sink_layout_problems(self, head_dims: tuple[int, int]):
        for rows, name, dim in ((self.sink_k, "sink keys", head_dims[0]), (self.sink_v, "sink values", head_dims[1])):
            if rows.buffer is not None and rows.buffer.shape[3] != dim:
                yield f"{name} head_dim", rows.buffer.shape[3], dim

    def _sink_problems(self, offset: int):
        n_sink = self.sink_k.length
        if n_sink != min(offset, self.n_sink) or self.sink_v.length != n_sink:
            yield "sink tokens", f"{n_sink} keys / {self.sink_v.length} values", f"min(offset {offset}, {self.n_sink})"


class SinkKVStore(Sinks, QuantizedKVStore):
    """``QuantizedKVStore`` after the sinks, with the key (and maybe value) storage given."""

    def __init__(self, keys, values, *, window: int, key_block: int, n_sink: int,
                 step_tokens: int = GROWTH_TOKENS, value_flush: int = 1):
        # The parent's windows and segments; its packed storage is replaced by what is given.
        placeholder = GroupAffine(8, 32, "token")
        super().__init__(placeholder, placeholder, window=window, key_block=key_block, step_tokens=step_tokens,
                         value_flush=value_flush)
        self.keys, self.values = keys, values
        self._init_sinks(n_sink)

    def _step_values(self, values: mx.array) -> None:
        """A decode step's value row, written in place; the values past the window are
        encoded once ``value_flush`` of them wait, together (one encode every
        ``value_flush`` steps instead of one in every step's graph)."""
        self.v_win.append(values)
        if self.v_win.held >= self.window + self.value_flush:
            n = self.v_win.held - self.window
            self.values.append(self.v_win.pop_front(n), decoding=True)
            self.v_win.compact()

    @property
    def length(self) -> int:
        return self.sink_k.length + super().length

    def decode_parts(self, empty: mx.array) -> list[DecodePart]:
        return self._sink_parts() + super().decode_parts(empty)

    def arrays(self) -> dict[str, Any]:
        return {**super().arrays(), **self._sink_arrays()}

    def key_tail(self, rest: int) -> tuple[int, int, str]:
        """Full-precision keys the flush rule leaves after ``rest`` tokens past the sinks:
        (fewest, most, the rule in words)."""
        return 0, self.key_block - 1, f"fewer than the key block {self.key_block}"

    def problems(self, offset: int):
        """(field, found, expected) for each way the stored tokens contradict the policy."""
        yield from self._sink_problems(offset)
        rest = max(0, offset - self.n_sink)
        n_kq, n_vq = self.keys.count, self.values.count
        k_res, v_res = _rows(self.k_res), _rows(self.v_res)
        low, high, rule = self.key_tail(rest)
        if n_kq % self.key_block:
            yield "quantized keys", n_kq, f"a multiple of the key block {self.key_block}"
        if not low <= k_res <= high:
            yield "full-precision keys", k_res, rule
        low = min(rest, self.window)
        if not low <= v_res < low + self.value_flush:
            yield "full-precision values", v_res, (
                f"min({rest} tokens past the sinks, window {self.window})" if self.value_flush == 1 else
                f"from min({rest} tokens past the sinks, window {self.window}) to {self.value_flush - 1} more")
        if n_kq + k_res != rest or n_vq + v_res != rest:
            yield "tokens stored", f"{n_kq + k_res} keys / {n_vq + v_res} values past the sinks", f"{rest}"


class SinkQuantizedStore(SinkKVStore):
    """Keys flushed in whole blocks once a newer key follows them (the newest stays exact)."""

    def __init__(self, keys, value_codec: GroupAffine, *, window: int, key_block: int,
                 n_sink: int, step_tokens: int = GROWTH_TOKENS, value_flush: int = 1):
        super().__init__(keys, PackedTokens(value_codec), window=window, key_block=key_block, n_sink=n_sink,
                         step_tokens=step_tokens, value_flush=value_flush)
        # a whole block and the newest key wait in place until the block leaves
        self.k_win = RecentRows(step=WINDOW_STEP, limit=key_block + 1, geometric=True)

    def commit(self, keys: mx.array, values: mx.array) -> None:
        keys, values, n = self._take_sinks(keys, values)
        if keys.shape[2] == 1 and not n:  # a decode step: rows written in place
            self.k_win.append(keys)
            if self.k_win.held > self.key_block:
                self.keys.append(self.k_win.pop_front(self.key_block))
                self.k_win.compact()
            self._step_values(values)
        elif keys.shape[2]:  # never the parent's decode path: its flush rule is KIVI's
            self._append_rows(keys, values)

    def _keys_to_flush(self, n_exact: int) -> int:
        return (n_exact - 1) // self.key_block * self.key_block  # the newest stays

    def key_tail(self, rest: int) -> tuple[int, int, str]:
        return (1 if rest else 0), min(rest, self.key_block), f"1..{self.key_block} once past the sinks"

    def layout_problems(self, head_dims: tuple[int, int]):
        """(field, found, expected) for arrays whose shapes contradict their codecs."""
        yield from super().layout_problems(head_dims)
        yield from getattr(self.keys, "plane_problems", lambda d: ())(head_dims[0])
        yield from self._sink_layout_problems(head_dims)
