"""A quantized store of attention sinks, key blocks and values encoded as they come.

``StreamingStore`` is ``SinkKVStore`` (``sink_store.py``: sinks in front of
``QuantizedKVStore``) with:

- key and value storage given, not built from a group-affine codec: ``PackedTokens`` or
  anything with its interface (``count``, ``append(x, decoding=False)``, ``decode``,
  ``layout``, ``arrays``), plus ``problems(name, head_dim)`` for what a restored state
  must satisfy, ``refit()`` when its codec can be refreshed, and ``rotary``/``start`` when
  it keeps keys pre-RoPE (``methods/kvquant/nonuniform.py``'s ``NonUniformTokens``);
- KIVI's flush rule past the sinks: keys in whole blocks of ``key_block`` (the newest
  ``n mod key_block`` stay exact), values past a window of ``window`` tokens, 0 allowed:
  every value is encoded as it comes (a token stream), or, with ``value_flush`` > 1, decode
  steps encode the values past the window that many at a time;
- a decode step (one token) written in place and, every ``refit_interval`` decode steps
  (0: never), ``refit()`` on both storages.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ...quant.packed import GROWTH_TOKENS
from ...quant.sink_store import SinkKVStore


class StreamingStore(SinkKVStore):
    def __init__(self, keys, values, *, n_sink: int, key_block: int, window: int = 0,
                 refit_interval: int = 0, step_tokens: int = GROWTH_TOKENS, value_flush: int = 1):
        super().__init__(keys, values, window=window, key_block=key_block, n_sink=n_sink, step_tokens=step_tokens,
                         value_flush=value_flush)
        self.refit_interval, self.steps = refit_interval, 0

    # -- writing -------------------------------------------------------------------------
    def commit(self, keys: mx.array, values: mx.array) -> None:
        keys, values, n = self._take_sinks(keys, values)
        if keys.shape[2] == 1 and not n:
            self._step(keys, values)
        elif keys.shape[2]:
            super().commit(keys, values)

    def _step(self, keys: mx.array, values: mx.array) -> None:
        """A decode step: rows written in place, a block flushed when whole, maybe a refit."""
        self.k_win.append(keys)
        if self.k_win.held == self.key_block:
            self.keys.append(self.k_win.view(), decoding=True)
            self.k_win.reset(None)
        if self.window or self.value_flush > 1:
            self._step_values(values)
        else:
            self.values.append(values, decoding=True)
        self.steps += 1
        if self.refit_interval and self.steps % self.refit_interval == 0:
            for storage in (self.keys, self.values):
                getattr(storage, "refit", lambda: None)()

    # -- a restored state must agree with the policy ------------------------------------------
    def layout_problems(self, head_dims: tuple[int, int]):
        for storage, name, dim in ((self.keys, "key", head_dims[0]), (self.values, "value", head_dims[1])):
            yield from storage.problems(name, dim)
        yield from self._sink_layout_problems(head_dims)

    # -- what is kept ------------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        rotary = getattr(self.keys, "rotary", None)
        return {"steps": self.steps, "rotary": rotary.to_json() if rotary is not None else "none"}

    def restore(self, meta: dict[str, Any], arrays: dict[str, Any]) -> None:
        for storage, prefix in ((self.keys, "k"), (self.values, "v")):
            upgrade = getattr(storage, "with_batch_axis", None)  # a layout saved before the batch axis
            arrays = arrays if upgrade is None else upgrade(prefix, arrays)
        super().restore(meta, arrays)
        self.steps = int(meta.get("steps", 0))
        if meta.get("rotary", "none") != "none":
            from ...cache.rope import Rotary

            self.keys.rotary = Rotary.from_json(meta["rotary"])
