"""KIVI: keys quantized per channel, values per token, a full-precision recent window.

A configuration of the quantized store (``quant/store.py``): keys in groups of
``kivi_group_size`` tokens of one channel, quantized a whole residual block of R tokens at
a time (the newest ``T mod R`` keys stay exact); values in groups of ``kivi_group_size``
channels of one token, the newest R exact, the window sliding one token per step. R is the
config's ``residual_window`` and the bit width its ``kv_bits`` (KIVIOptions holds only the
group size). A prefill chunk attends over the decoded history plus itself, as KIVI's own
prefill does; a decode step over the packed history, through the fused kernel on a GPU.
As in the official decode, a step attends first (its key and value exact, in the windows)
and flushes after: the step that fills a key block reads those R keys exact, then packs
them. Adapted: the official decode packs the value that leaves the window at every step;
here values leave 32 at a time (the window holds R to R + 31 exact values), so that a
decode step does no quantization work and 31 of 32 steps only write their row. The packed
values are the same codes (per-token groups do not depend on their neighbours); the
memory held is the same (the window's buffer had that room already).
"""

from __future__ import annotations

from ..quant.cache import QuantizedCache
from ..quant.packed import GROWTH_TOKENS, GroupAffine
from ..quant.store import VALUE_ROOM, QuantizedKVStore


class KIVICache(QuantizedCache):
    group_field = "kivi_group_size"
    batchable = True  # packed decode: quant/batch.py runs the store's decode steps for the batch

    def make_store(self):
        bits, residual = self.config.kv_bits, self.config.residual_window  # config fields (the spec)
        flush = residual or self.group  # whole groups when there is no residual
        return QuantizedKVStore(
            GroupAffine(bits, self.group, "channel"), GroupAffine(bits, self.group, "token"),
            window=residual, key_block=flush, step_tokens=max(GROWTH_TOKENS, flush),
            attend_then_flush=True, value_flush=VALUE_ROOM,
        )

    @property
    def n_quantized_keys(self) -> int:
        return self.store.keys.count

    @property
    def n_quantized_values(self) -> int:
        return self.store.values.count
