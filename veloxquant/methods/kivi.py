"""KIVI: keys quantized per channel, values per token, a full-precision recent window.

A configuration of the quantized store (``quant/store.py``): keys in groups of
``kivi_group_size`` tokens of one channel, quantized a whole residual block of R tokens at
a time (the newest ``T mod R`` keys stay exact); values in groups of ``kivi_group_size``
channels of one token, the newest R exact, the window sliding one token per step. R is the
config's ``residual_window`` and the bit width its ``kv_bits`` (KIVIOptions holds only the
group size). A prefill chunk attends over the decoded history plus itself, as KIVI's own
prefill does; a decode step over the packed history, through the fused kernel on a GPU.
"""

from __future__ import annotations

import mlx.core as mx

from ..cache.base import CompressedKVCache, causal_mask
from ..cache.buffers import GrowingArray
from ..kernels.decode import decode_attention
from ..quant.packed import GROWTH_TOKENS, GroupAffine
from ..quant.store import QuantizedKVStore


class KIVICache(CompressedKVCache):
    requires_attention_hook = True

    def _init_storage(self) -> None:
        c = self.config
        self.group = c.options.kivi_group_size
        self.code_bits, self.residual = c.kv_bits, c.residual_window  # config fields (see the spec)
        self.use_kernel = c.fused_attention
        flush = self.residual or self.group  # whole groups when there is no residual
        self.store = QuantizedKVStore(
            GroupAffine(self.code_bits, self.group, "channel"),
            GroupAffine(self.code_bits, self.group, "token"),
            window=self.residual, key_block=flush, step_tokens=max(GROWTH_TOKENS, flush),
        )
        self._pending = None

    # -- what is kept (names as saved) ------------------------------------------------------
    def _arrays(self):
        return self.store.arrays()

    def _restore_arrays(self, arrays) -> None:
        kept = self.store.arrays()
        for name, value in arrays.items():
            if isinstance(kept.get(name), GrowingArray):
                kept[name].reset(value)
        self.store.k_res, self.store.v_res = arrays.get("k_res"), arrays.get("v_res")

    def _layout_problems(self):
        if self.kv_shape is not None:
            yield from self.store.layout_problems(self.kv_shape[2:])

    def _state_problems(self):
        return self.store.problems(self.offset)

    @property
    def stored_length(self) -> int:
        return self.store.length

    @property
    def n_quantized_keys(self) -> int:
        return self.store.keys.count

    @property
    def n_quantized_values(self) -> int:
        return self.store.values.count

    def dequantized(self, dtype):
        """The whole stored history in ``dtype`` (transient: for prefill chunks and tests)."""
        return self.store.history(dtype)

    # -- protocol --------------------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        self._expect_attend()
        self._check_shape(keys, values)
        head_dim = keys.shape[-1]
        if head_dim % self.group or values.shape[-1] % self.group:
            raise ValueError(
                f"kivi_group_size={self.group} must divide head_dim={head_dim} "
                f"(values: {values.shape[-1]}); allowed here: "
                f"{[g for g in (32, 64, 128) if head_dim % g == 0] or 'none'}"
            )
        self._pending = (keys, values)
        self.offset += keys.shape[2]
        return keys, values

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        self._awaiting_attend = False
        chunk_k, chunk_v = self._pending
        self._pending = None
        if sinks is not None:
            raise NotImplementedError("method 'kivi' does not support attention sinks yet")
        if queries.shape[2] == 1:
            return self.store.decode_attention(queries, chunk_k, chunk_v, scale=scale,
                                               use_kernel=self.use_kernel)
        if isinstance(mask, mx.array):  # an array mask sized for layer 0: rebuild
            mask = causal_mask(queries.shape[2], self.store.length + queries.shape[2])
        return self.store.prefill_attention(queries, chunk_k, chunk_v, scale=scale, mask=mask)

    def _decode_attention(self, queries, scale):
        """Decode attention over what is stored (tests: against the dequantized reference)."""
        parts = self.store.decode_parts(mx.zeros((0,), queries.dtype))
        return decode_attention(queries, parts, scale=scale, use_kernel=self.use_kernel)
