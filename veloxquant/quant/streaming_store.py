"""A quantized store of attention sinks, key blocks and values encoded as they come.

``StreamingStore`` is ``QuantizedKVStore`` (``store.py``) with:

- the first ``n_sink`` tokens of the sequence in full precision for good (StreamingLLM's
  sinks), attended as a part of their own;
- key and value storage given, not built from a group-affine codec: ``PackedTokens`` or
  anything with its interface (``count``, ``append(x, one_token=False)``, ``decode``,
  ``layout``, ``arrays``), plus ``problems(name, head_dim)`` for what a restored state
  must satisfy, ``refit()`` when its codec can be refreshed, and ``rotary``/``start`` when
  it keeps keys pre-RoPE (``quant/nonuniform.py``'s ``NonUniformTokens``);
- KIVI's flush rule past the sinks: keys in whole blocks of ``key_block`` (the newest
  ``n mod key_block`` stay exact), values past a window of ``window`` tokens, 0 allowed:
  every value is encoded as it comes (a token stream);
- a decode step (one token) written in place and, every ``refit_interval`` decode steps
  (0: never), ``refit()`` on both storages.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..cache.buffers import GrowingArray
from ..kernels.decode import DecodePart
from .packed import GROWTH_TOKENS, GroupAffine
from .store import WINDOW_STEP, QuantizedKVStore, _rows


class StreamingStore(QuantizedKVStore):
    def __init__(self, keys, values, *, n_sink: int, key_block: int, window: int = 0,
                 refit_interval: int = 0, step_tokens: int = GROWTH_TOKENS):
        # The parent's windows and segments; its packed storage is replaced by what is given.
        placeholder = GroupAffine(8, 32, "token")
        super().__init__(placeholder, placeholder, window=window, key_block=key_block,
                         step_tokens=step_tokens)
        self.keys, self.values = keys, values
        self.n_sink, self.refit_interval, self.steps = n_sink, refit_interval, 0
        room = min(max(n_sink, 1), WINDOW_STEP * 8)  # sinks grow with what they hold
        self.sink_k = GrowingArray(step=room, limit=n_sink)
        self.sink_v = GrowingArray(step=room, limit=n_sink)

    @property
    def length(self) -> int:
        return self.sink_k.length + super().length

    # -- writing -------------------------------------------------------------------------
    def commit(self, keys: mx.array, values: mx.array) -> None:
        n = min(self.n_sink - self.sink_k.length, keys.shape[2])
        if n > 0:  # the sequence's first tokens: sinks
            self.sink_k.append(keys[:, :, :n])
            self.sink_v.append(values[:, :, :n])
            keys, values = keys[:, :, n:], values[:, :, n:]
        if keys.shape[2] == 1 and n <= 0:
            self._step(keys, values)
        elif keys.shape[2]:
            super().commit(keys, values)

    def _step(self, keys: mx.array, values: mx.array) -> None:
        """A decode step: rows written in place, a block flushed when whole, maybe a refit."""
        self.k_win.append(keys)
        if self.k_win.held == self.key_block:
            self.keys.append(self.k_win.view())
            self.k_win.reset(None)
        if self.window:
            self.v_win.append(values)
            if self.v_win.held > self.window:
                self.values.append(self.v_win.pop_front(1), one_token=True)
        else:
            self.values.append(values, one_token=True)
        self.steps += 1
        if self.refit_interval and self.steps % self.refit_interval == 0:
            for storage in (self.keys, self.values):
                getattr(storage, "refit", lambda: None)()

    # -- reading --------------------------------------------------------------------------
    def history(self, dtype):
        keys, values = super().history(dtype)
        if not self.sink_k.length:
            return keys, values
        sink_k, sink_v = self.sink_k.view().astype(dtype), self.sink_v.view().astype(dtype)
        if keys is None:
            return sink_k, sink_v
        return mx.concatenate([sink_k, keys], axis=2), mx.concatenate([sink_v, values], axis=2)

    def decode_parts(self, empty: mx.array) -> list[DecodePart]:
        parts = []
        if self.sink_k.length:
            parts.append(DecodePart(None, self.sink_k.view(), None, self.sink_v.view()))
        return parts + super().decode_parts(empty)

    # -- a restored state must agree with the policy ------------------------------------------
    def layout_problems(self, head_dims: tuple[int, int]):
        for storage, name, dim in ((self.keys, "key", head_dims[0]), (self.values, "value", head_dims[1])):
            yield from storage.problems(name, dim)
        for rows, name, dim in ((self.sink_k, "sink keys", head_dims[0]), (self.sink_v, "sink values", head_dims[1])):
            if rows.buffer is not None and rows.buffer.shape[3] != dim:
                yield f"{name} head_dim", rows.buffer.shape[3], dim

    def problems(self, offset: int):
        n_sink, rest = self.sink_k.length, max(0, offset - self.n_sink)
        n_kq, n_vq = self.keys.count, self.values.count
        k_res, v_res = _rows(self.k_res), _rows(self.v_res)
        if n_sink != min(offset, self.n_sink) or self.sink_v.length != n_sink:
            yield "sink tokens", f"{n_sink} keys / {self.sink_v.length} values", f"min(offset {offset}, {self.n_sink})"
        if n_kq % self.key_block:
            yield "quantized keys", n_kq, f"a multiple of the key block {self.key_block}"
        if k_res >= self.key_block:
            yield "full-precision keys", k_res, f"fewer than the key block {self.key_block}"
        if v_res != min(rest, self.window):
            yield "full-precision values", v_res, f"min({rest} tokens past the sinks, window {self.window})"
        if n_kq + k_res != rest or n_vq + v_res != rest:
            yield "tokens stored", f"{n_kq + k_res} keys / {n_vq + v_res} values past the sinks", f"{rest}"

    # -- what is kept ------------------------------------------------------------------------
    def arrays(self) -> dict[str, Any]:
        return {**super().arrays(), "sink_k": self.sink_k, "sink_v": self.sink_v}

    def meta(self) -> dict[str, Any]:
        rotary = getattr(self.keys, "rotary", None)
        return {"steps": self.steps, "rotary": rotary.to_json() if rotary is not None else "none"}

    def restore(self, meta: dict[str, Any], arrays: dict[str, Any]) -> None:
        super().restore(meta, arrays)
        self.steps = int(meta.get("steps", 0))
        if meta.get("rotary", "none") != "none":
            from ..evict.rope import Rotary

            self.keys.rotary = Rotary.from_json(meta["rotary"])
