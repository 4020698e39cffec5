"""StreamingLLM: attention sinks plus a window of the most recent tokens.

Adapted (see the spec's status): keys keep their original RoPE positions, there is no
pos-shift re-rotation. A prefill chunk of S tokens attends to the sinks, the last
``W - min(W, S)`` older tokens and itself (causally), as the official ``evict_for_space``
does; afterwards the cache keeps the sinks and the last W tokens. Decode steps write into
a ring over the window rows, so a step costs one row, not a copy of the window.
"""

from __future__ import annotations

import mlx.core as mx

from ..cache.base import CompressedKVCache
from ..cache.buffers import GrowingArray


class StreamingLLMCache(CompressedKVCache):
    batchable = "per_sequence"  # no packed layout for its sinks + window buffers
    evicts_tokens = True
    def _init_storage(self) -> None:
        options = self.config.options
        self.n_sink, self.window = options.stream_n_sink, options.stream_window_size
        # Room grows with what is kept, up to the capacity, never allocated ahead of it.
        self.keys = GrowingArray(limit=self.capacity, geometric=True)
        self.values = GrowingArray(limit=self.capacity, geometric=True)
        self.ring = 0  # next window row to overwrite once full (rows are then unordered)

    @property
    def capacity(self) -> int:
        return self.n_sink + self.window

    budget = capacity

    @property
    def filled(self) -> int:
        return self.keys.length

    @property
    def stored_length(self) -> int:
        return self.filled

    def _arrays(self):
        return {"keys": self.keys, "values": self.values}

    def _meta(self):
        return {"ring": self.ring}

    def _restore_meta(self, meta):
        self.ring = int(meta["ring"])

    def _kept_old(self, n_new: int) -> int:
        sinks = min(self.n_sink, self.filled)
        return sinks + min(self.filled - sinks, max(0, self.window - n_new))

    def _rows_returned(self, n_new: int) -> int:
        if n_new == 1:
            return min(self.filled + 1, self.capacity)
        return self._kept_old(n_new) + n_new

    def _temporal(self, grown: GrowingArray) -> mx.array:
        """Stored rows in the order the tokens came."""
        x = grown.view()
        if self.filled < self.capacity or self.ring == self.n_sink:
            return x
        s, r = self.n_sink, self.ring
        return mx.concatenate([x[:, :, :s], x[:, :, r:], x[:, :, s:r]], axis=2)

    def update_and_fetch(self, keys, values):
        self._check_shape(keys, values)
        n = keys.shape[2]
        self.offset += n
        if n == 1:
            return self._decode_step(keys, values)
        return self._prefill_chunk(keys, values)

    def _decode_step(self, keys, values):
        if self.filled < self.capacity:
            self.keys.append(keys)
            self.values.append(values)
            self.ring = self.n_sink if self.filled == self.capacity else self.filled
        else:
            row = self.ring
            self.ring = self.n_sink + (row - self.n_sink + 1) % self.window
            self.keys.buffer[:, :, row : row + 1] = keys
            self.values.buffer[:, :, row : row + 1] = values
        # Attention at a single-token step needs no order, so the ring is returned as is.
        return self.keys.view(), self.values.view()

    def _prefill_chunk(self, keys, values):
        if self.keys.buffer is None:
            all_k, all_v = keys, values
        else:
            kept = self._kept_old(keys.shape[2])
            sinks = min(self.n_sink, self.filled)
            old_k, old_v = self._temporal(self.keys), self._temporal(self.values)
            start = self.filled - (kept - sinks)
            all_k = mx.concatenate([old_k[:, :, :sinks], old_k[:, :, start:], keys], axis=2)
            all_v = mx.concatenate([old_v[:, :, :sinks], old_v[:, :, start:], values], axis=2)
        total = all_k.shape[2]
        keep_from = max(self.n_sink, total - self.window)
        if keep_from > self.n_sink:
            ret_k = mx.concatenate([all_k[:, :, : self.n_sink], all_k[:, :, keep_from:]], axis=2)
            ret_v = mx.concatenate([all_v[:, :, : self.n_sink], all_v[:, :, keep_from:]], axis=2)
        else:
            ret_k, ret_v = all_k, all_v
        self.keys.reset(ret_k)
        self.values.reset(ret_v)
        self.ring = self.n_sink if self.filled == self.capacity else self.filled
        return all_k, all_v

    def _state_problems(self):
        if self.filled != min(self.offset, self.capacity):
            yield "stored tokens", self.filled, f"min(offset {self.offset}, sinks + window {self.capacity})"
        if self.values.length != self.filled:
            yield "value rows", self.values.length, f"the {self.filled} key rows"
        if self.filled == self.capacity and not self.n_sink <= self.ring < self.capacity:
            yield "ring", self.ring, f"a window row in [{self.n_sink}, {self.capacity})"

    def is_trimmable(self) -> bool:
        return self.offset == self.filled  # nothing evicted yet

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        n = min(n, self.filled)
        self.keys.truncate(self.filled - n)
        self.values.truncate(self.keys.length)
        self.offset -= n
        self.ring = self.filled
        return n
