"""The uncompressed baseline: every token, full precision, through our protocol."""

from __future__ import annotations

import mlx.core as mx

from ..cache.base import CompressedKVCache, causal_mask
from ..cache.batch import PackedLayout, check_step_rows, grown_capacity, pad_rows, single_buffer
from ..kernels.decode import RowsByLength
from ..cache.buffers import GrowingArray


class FullCache(CompressedKVCache):
    """Stores keys and values as they come, like mlx-lm's ``KVCache`` (same growth)."""

    batchable = True  # packed decode: FullPacked below

    @classmethod
    def packed_layout(cls):
        return FullPacked if cls is FullCache else None

    def _init_storage(self) -> None:
        self.keys = GrowingArray()
        self.values = GrowingArray()

    def update_and_fetch(self, keys, values):
        self._check_shape(keys, values)
        self.keys.append(keys)
        self.values.append(values)
        self.offset += keys.shape[2]
        return self.keys.view(), self.values.view()

    @property
    def stored_length(self) -> int:
        return self.keys.length

    def _arrays(self):
        return {"keys": self.keys, "values": self.values}

    def _state_problems(self):
        if self.keys.length != self.offset:
            yield "stored tokens", self.keys.length, f"the offset {self.offset}"
        if self.values.length != self.keys.length:
            yield "value rows", self.values.length, f"the {self.keys.length} key rows"

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.keys.length, n)
        self.keys.truncate(self.keys.length - n)
        self.values.truncate(self.values.length - n)
        self.offset -= n
        return n


class FullPacked(RowsByLength, PackedLayout):
    """The dense cache's packed decode layout: keys and values (B, H, rows, D), sequence
    b's tokens in rows 0 .. lengths[b] - 1, the rows after them padding (masked by row)."""

    @staticmethod
    def can_pack(single) -> bool:
        return single.keys.buffer is not None

    @classmethod
    def pack(cls, singles) -> "FullPacked":
        self = cls.__new__(cls)
        self.shells = singles
        self.lengths = [s.keys.length for s in singles]
        self.capacities = [s.keys.capacity for s in singles]
        self.offsets = [s.offset for s in singles]
        room = max(self.capacities)
        step = singles[0].keys.step
        self.keys, self.values = GrowingArray(step=step), GrowingArray(step=step)
        self.keys.buffer = mx.concatenate([pad_rows(s.keys.view(), room) for s in singles])
        self.values.buffer = mx.concatenate([pad_rows(s.values.view(), room) for s in singles])
        self.keys.length = self.values.length = max(self.lengths)
        for s in singles:  # the shells keep their config, context and layer; not their rows
            s.keys, s.values = GrowingArray(), GrowingArray()
        self._sync()
        return self

    def _sync(self) -> None:
        self.offset_array = mx.array(self.offsets, mx.int32)
        self.length_array = mx.array(self.lengths, mx.int32)
        self.padded = len(set(self.lengths)) > 1

    def update_and_fetch(self, keys, values):
        check_step_rows(self.shells[0], keys, values)
        if not self.padded:  # every sequence ends at the last row: plain appends
            self.keys.append(keys)
            self.values.append(values)
        else:  # each new row goes after its own sequence's rows, into its padding
            if max(self.lengths) == self.keys.length:  # the longest has none left: one more row
                self.keys.append(mx.zeros_like(keys))
                self.values.append(mx.zeros_like(values))
            slot = self.length_array.reshape(-1, 1, 1, 1)
            for grown, rows in ((self.keys, keys), (self.values, values)):
                index = mx.broadcast_to(slot, (*rows.shape[:3], 1))
                grown.buffer = mx.put_along_axis(grown.buffer, index, rows, axis=2)
        step = self.keys.step
        self.capacities = [grown_capacity(c, n, 1, step, None) for c, n in zip(self.capacities, self.lengths)]
        self.lengths = [n + 1 for n in self.lengths]
        self.offsets = [o + 1 for o in self.offsets]
        self.offset_array = self.offset_array + 1
        self.length_array = self.length_array + 1
        return self.keys.view(), self.values.view()

    def step_writes(self) -> list[mx.array]:
        return [self.length_array]

    def make_mask(self, N, return_array):
        if N == 1 and not (return_array or self.padded):
            return None
        rows = self.keys.length + N
        visible = mx.arange(rows)[None] < (self.length_array + N)[:, None]
        return visible[:, None, None, :] & causal_mask(N, rows)[None, None]

    def filter(self, keep: list[int]) -> None:
        index = mx.array(keep, mx.int32)
        self.shells = [self.shells[i] for i in keep]
        for name in ("lengths", "capacities", "offsets"):
            setattr(self, name, [getattr(self, name)[i] for i in keep])
        for grown in (self.keys, self.values):
            grown.buffer = grown.buffer[index]
            grown.length = max(self.lengths)
        self._sync()

    def extend(self, other: "FullPacked") -> None:
        rows = max(self.keys.capacity, other.keys.capacity)
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            mine.buffer = mx.concatenate([pad_rows(mine.buffer, rows), pad_rows(theirs.buffer, rows)])
            mine.length = max(mine.length, theirs.length)
        self.shells += other.shells
        self.lengths += other.lengths
        self.capacities += other.capacities
        self.offsets += other.offsets
        self._sync()

    def _single(self, b: int, shell):
        n, cap = self.lengths[b], self.capacities[b]
        shell.keys = single_buffer(self.keys.buffer[b : b + 1, :, :n], cap, self.keys.step, None)
        shell.values = single_buffer(self.values.buffer[b : b + 1, :, :n], cap, self.keys.step, None)
        shell.offset = self.offsets[b]
        return shell

    def is_trimmable(self) -> bool:
        return True

    def size(self) -> int:
        return max(self.lengths)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.offset_array.nbytes + self.length_array.nbytes

    @property
    def state(self):
        return [self.keys.view(), self.values.view()]

    __deepcopy__ = CompressedKVCache.__deepcopy__
