"""The cache of a quantization method: a store the method configures, and the protocol.

``QuantizedCache`` holds one store (``quant/store.py`` or a store built on it) and does
what every quantization method does the same way: it hands a chunk's keys and values to
attention untouched, then, when the hook asks it to attend, a prompt chunk attends over
the decoded history plus itself and a decode step over the packed parts; what is kept,
saved and checked is the store's. A method module is its ``make_store`` (and, where its
algorithm needs it, ``observe``).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..cache.base import CompressedKVCache, causal_mask
from .store import end_pacing


class QuantizedCache(CompressedKVCache):
    requires_attention_hook = True
    group_field: str  # the options field holding the quantization group (must divide head_dim)

    def make_store(self):
        raise NotImplementedError

    @classmethod
    def packed_layout(cls):
        """The batch layout of ``quant/batch.py`` for a class that decodes with these steps
        (which stores it takes: ``QuantizedPacked.can_pack``)."""
        from .batch import QuantizedPacked

        return QuantizedPacked if QuantizedPacked.accepts(cls) else None

    def observe(self, keys: mx.array, values: mx.array, n_queries: int) -> None:
        """Called before each chunk or step is stored (default: nothing)."""

    def _init_storage(self) -> None:
        self.use_kernel = self.config.fused_attention
        self.store = self.make_store()
        self._pending = None

    @functools.cached_property
    def group(self) -> int:
        # read once: ``config.options`` builds and validates the options object, and this
        # is read at every decode step of every layer
        return getattr(self.config.options, self.group_field)

    # -- what is kept -------------------------------------------------------------------------
    def _arrays(self):
        return self.store.arrays()

    def _restore_arrays(self, arrays) -> None:
        self._saved_arrays = arrays  # restored with the meta: a store's layout may be in it

    def _meta(self):
        return self.store.meta()

    def _restore_meta(self, meta) -> None:
        self.store.restore(meta, self.__dict__.pop("_saved_arrays", {}))

    def _layout_problems(self):
        if self.kv_shape is not None:
            yield from self.store.layout_problems(self.kv_shape[2:])

    def _state_problems(self):
        return self.store.problems(self.offset)

    @property
    def stored_length(self) -> int:
        return self.store.length

    def dequantized(self, dtype):
        """The whole stored history in ``dtype`` (transient: for prefill chunks and tests)."""
        return self.store.history(dtype)

    # -- the protocol ---------------------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        self._expect_attend()
        self._check_shape(keys, values)
        d_k, d_v = keys.shape[-1], values.shape[-1]
        if d_k % self.group or d_v % self.group:
            raise ValueError(
                f"{self.group_field}={self.group} must divide head_dim={d_k} (values: {d_v}); "
                f"allowed here: {[g for g in (32, 64, 128) if d_k % g == 0 and d_v % g == 0] or 'none'}"
            )
        return self._stash_chunk(keys, values)

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        chunk_k, chunk_v = self._take_chunk(sinks)
        self.observe(chunk_k, chunk_v, queries.shape[2])
        if queries.shape[2] == 1:
            end_pacing()
            return self.store.decode_attention(queries, chunk_k, chunk_v, scale=scale,
                                               use_kernel=self.use_kernel)
        if isinstance(mask, mx.array):  # an array mask sized for layer 0: rebuild
            mask = causal_mask(queries.shape[2], self.store.length + queries.shape[2])
        return self.store.prefill_attention(queries, chunk_k, chunk_v, scale=scale, mask=mask)
