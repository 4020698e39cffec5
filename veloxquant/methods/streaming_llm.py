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
from ..cache.batch import PackedLayout, check_step_rows, grown_capacity, pad_rows, single_buffer
from ..kernels.decode import RowsByLength
from ..cache.buffers import GrowingArray


def next_row(filled: int, ring: int, n_sink: int, window: int) -> tuple[int, int, int]:
    """(the row a decode token takes, rows filled after it, the ring after it): rows are
    appended until sinks and window are full, then the window's rows are overwritten in
    turn (the ring: the next one to overwrite)."""
    capacity = n_sink + window
    if filled < capacity:
        filled += 1
        return filled - 1, filled, n_sink if filled == capacity else filled
    return ring, filled, n_sink + (ring - n_sink + 1) % window


class StreamingLLMCache(CompressedKVCache):
    batchable = True  # packed decode: StreamingPacked below
    evicts_tokens = True

    @classmethod
    def packed_layout(cls):
        return StreamingPacked if cls is StreamingLLMCache else None
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
        row, _, self.ring = next_row(self.filled, self.ring, self.n_sink, self.window)
        if row == self.filled:
            self.keys.append(keys)
            self.values.append(values)
        else:
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


class StreamingPacked(RowsByLength, PackedLayout):
    """StreamingLLM's packed decode layout: keys and values (B, H, rows, D), sequence b's
    kept rows at 0 .. filled[b] - 1 in the order its own cache keeps them (sinks first,
    then the window, a ring once full), the rows after them padding (masked by row). A
    decode step writes each sequence's row where its cache alone would (its next row, or
    its ring's), one write for the batch; attention is one call over the batch's rows."""

    @staticmethod
    def can_pack(single) -> bool:
        return single.keys.buffer is not None

    @classmethod
    def pack(cls, singles) -> "StreamingPacked":
        self = cls.__new__(cls)
        self.shells = singles
        self.n_sink, self.window = singles[0].n_sink, singles[0].window
        self.step = singles[0].keys.step  # the singles' growth, for their capacities alone
        self.filled = [s.filled for s in singles]
        self.rings = [s.ring for s in singles]
        self.capacities = [s.keys.capacity for s in singles]
        self.offsets = [s.offset for s in singles]
        room = max(self.capacities)
        self.keys = mx.concatenate([pad_rows(s.keys.view(), room) for s in singles])
        self.values = mx.concatenate([pad_rows(s.values.view(), room) for s in singles])
        for s in singles:  # the shells keep their config, context and layer; not their rows
            s.keys = GrowingArray(limit=s.capacity, geometric=True)
            s.values = GrowingArray(limit=s.capacity, geometric=True)
        self._sync()
        return self

    def _sync(self) -> None:
        self.offset_array = mx.array(self.offsets, mx.int32)
        self.length_array = mx.array(self.filled, mx.int32)
        self.padded = len(set(self.filled)) > 1

    def _advance(self, b: int) -> int:
        """The row sequence b's next token goes to (``StreamingLLMCache._decode_step``'s),
        its counters moved on, its buffer's room as it would have grown alone."""
        row, filled, self.rings[b] = next_row(self.filled[b], self.rings[b], self.n_sink, self.window)
        if filled > self.filled[b]:  # appended: the room its own buffer would have grown to
            self.capacities[b] = grown_capacity(self.capacities[b], row, 1, self.step,
                                                self.n_sink + self.window, geometric=True)
        self.filled[b] = filled
        return row

    def update_and_fetch(self, keys, values):
        check_step_rows(self.shells[0], keys, values)
        rows = [self._advance(b) for b in range(len(self.shells))]
        if max(rows) >= self.keys.shape[2]:  # a sequence not yet full outgrows the batch's room
            room = max(self.capacities)
            self.keys, self.values = pad_rows(self.keys, room), pad_rows(self.values, room)
        if len(set(rows)) == 1:  # the same row in every sequence (the same lengths): in place
            row = rows[0]
            self.keys[:, :, row : row + 1] = keys
            self.values[:, :, row : row + 1] = values
        else:
            index = mx.array(rows, mx.int32).reshape(-1, 1, 1, 1)
            index = mx.broadcast_to(index, (*keys.shape[:3], 1))
            self.keys = mx.put_along_axis(self.keys, index, keys, axis=2)
            self.values = mx.put_along_axis(self.values, index, values, axis=2)
        self.offsets = [o + 1 for o in self.offsets]
        self.offset_array = self.offset_array + 1
        self._sync_filled()
        n = max(self.filled)
        return self.keys[:, :, :n], self.values[:, :, :n]

    def _sync_filled(self) -> None:
        padded = len(set(self.filled)) > 1
        if padded or self.padded:
            self.length_array = mx.array(self.filled, mx.int32)
        self.padded = padded

    def make_mask(self, N, return_array):
        if N != 1:
            raise ValueError("a packed StreamingLLM batch takes decode steps only (prompt chunks run per sequence)")
        if not (return_array or self.padded):
            return None
        after = [min(f + 1, self.n_sink + self.window) for f in self.filled]  # rows held after the step
        visible = mx.arange(max(after))[None] < mx.array(after, mx.int32)[:, None]
        return visible[:, None, None, :]

    def filter(self, keep: list[int]) -> None:
        index = mx.array(keep, mx.int32)
        self.shells = [self.shells[i] for i in keep]
        for name in ("filled", "rings", "capacities", "offsets"):
            setattr(self, name, [getattr(self, name)[i] for i in keep])
        self.keys, self.values = self.keys[index], self.values[index]
        self._sync()

    def extend(self, other: "StreamingPacked") -> None:
        rows = max(self.keys.shape[2], other.keys.shape[2])
        self.keys = mx.concatenate([pad_rows(self.keys, rows), pad_rows(other.keys, rows)])
        self.values = mx.concatenate([pad_rows(self.values, rows), pad_rows(other.values, rows)])
        self.shells += other.shells
        for name in ("filled", "rings", "capacities", "offsets"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._sync()

    def _single(self, b: int, shell):
        n, cap, limit = self.filled[b], self.capacities[b], self.n_sink + self.window
        shell.keys = single_buffer(self.keys[b : b + 1, :, :n], cap, self.step, limit, geometric=True)
        shell.values = single_buffer(self.values[b : b + 1, :, :n], cap, self.step, limit, geometric=True)
        shell.ring, shell.offset = self.rings[b], self.offsets[b]
        return shell

    def is_trimmable(self) -> bool:
        return self.offsets == self.filled  # nothing evicted yet, in any sequence

    def size(self) -> int:
        return max(self.filled)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.offset_array.nbytes + self.length_array.nbytes

    @property
    def state(self):
        return [self.keys, self.values]

    __deepcopy__ = CompressedKVCache.__deepcopy__
