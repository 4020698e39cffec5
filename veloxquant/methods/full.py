"""The uncompressed baseline: every token, full precision, through our protocol."""

from __future__ import annotations

from ..cache.base import CompressedKVCache
from ..cache.buffers import GrowingArray


class FullCache(CompressedKVCache):
    """Stores keys and values as they come, like mlx-lm's ``KVCache`` (same growth)."""

    batchable = True  # packed decode: cache/batch.py's FullPacked

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
