"""XQuant: layers in groups share one layer's quantization codes (arXiv 2510.11236).

KIVI underneath (``quant/store.py``): keys per channel in groups of
``xquant_group_quant_size`` tokens, values per token in groups of as many channels, the
newest ``residual_window`` tokens in full precision (KIVI's R, a config field; 0: keys in
whole packing units of groups, values at once). Layers are grouped
``xquant_group_size`` at a time from the first compressed layer (``cache/cross_layer.py``).
What is kept:

- the group's first layer, the **anchor** (the shallower: mlx-lm runs it first in every
  forward pass, so its codes for a token range exist when the others need them): codes
  at ``xquant_base_bits``, with its scales and zeros; its codes are what the group shares
  (counted and saved once, with it);
- every other layer, a **reuse** layer: for each group of its own data, its own min-max
  scale and zero and no codes, ``x_hat = q_anchor * s_own + z_own`` (the paper's
  cross-layer rule, ``methods/xquant/borrowed.py``); with ``xquant_residual_bits > 0`` also
  ``x - x_hat`` quantized at that width in the same layout and added back (not in the
  paper; 0 is the paper's pure reuse).

When: each layer quantizes when the store's flush policy says so; anchor and reuse
layers see the same tokens in the same calls, so they flush the same ranges. A prompt
chunk attends over the decoded history plus itself; a decode step over the packed parts
(the fused kernel on a GPU when there is no residual).

Adapted: no calibration shift (eta = 0: plain min-max, KIVI's quantizer) and no start
depth (every group, from the first layer, pairs); widths are those mx.quantize packs
(1-6, 8). ``xquant_max_ctx`` bounds the tokens a group's shared codes cover: a group
of more than one layer refuses to grow past it, naming the field.
"""

from __future__ import annotations

from ...cache.cross_layer import CrossLayer, consecutive_groups
from ...lowrank.shared_latent import packing_unit
from .borrowed import BorrowedCodes, BorrowedStore
from ...quant.cache import QuantizedCache
from ...quant.packed import GROWTH_TOKENS, GroupAffine
from ...quant.store import VALUE_ROOM, QuantizedKVStore


class XQuantCache(CrossLayer, QuantizedCache):
    batchable = "stacked"  # its rows never mix: sequences in the same state share one cache at every layer, linked by a context of their own (cache/stacked.py)
    group_field = "xquant_group_quant_size"

    def layer_groups(self, compressed, n_layers):
        # the flat field, not ``config.options`` (which builds and validates an options
        # object at each read; the group is looked up at every step: the groups are kept)
        return consecutive_groups(compressed, self.config.xquant_group_size)

    def _init_storage(self) -> None:
        self._init_cross_layer()
        super()._init_storage()

    def make_store(self):
        o, window = self.config.options, self.config.residual_window
        block = window or packing_unit(self.group)
        step = max(GROWTH_TOKENS, block)
        keys = GroupAffine(o.xquant_base_bits, self.group, "channel")
        values = GroupAffine(o.xquant_base_bits, self.group, "token")
        if self.is_owner:
            return QuantizedKVStore(keys, values, window=window, key_block=block, step_tokens=step,
                                    attend_then_flush=True, value_flush=VALUE_ROOM)  # KIVI's decode
        bits = o.xquant_residual_bits

        def residual(axis):
            return GroupAffine(bits, self.group, axis) if bits else None

        return BorrowedStore(BorrowedCodes(keys, residual("channel"), self._anchor_keys, step),
                             BorrowedCodes(values, residual("token"), self._anchor_values, step),
                             window=window, key_block=block, step_tokens=step, attend_then_flush=True,
                             value_flush=VALUE_ROOM)

    def _anchor_keys(self):
        return self.owner.store.keys

    def _anchor_values(self):
        return self.owner.store.values

    def _relinked(self) -> None:
        self.store = self.make_store()  # a restored layer learns its role from its context

    def update_and_fetch(self, keys, values):
        limit = self.config.xquant_max_ctx  # the flat field: config.options validates at each read
        # the count first: a step within the cap never looks its group up
        if self.offset + keys.shape[2] > limit and len(self.layer_group) > 1:
            raise ValueError(
                f"xquant_max_ctx={limit}: layer {self.layer}'s group would share codes for "
                f"{self.offset + keys.shape[2]} tokens; allowed: at most xquant_max_ctx (raise it)")
        self._note_update(keys.shape[2])
        return super().update_and_fetch(keys, values)

    def _state_problems(self):
        yield from super()._state_problems()
        if not self.is_owner:
            anchor = self.owner.store
            for mine, theirs, name in ((self.store.keys, anchor.keys, "keys"),
                                       (self.store.values, anchor.values, "values")):
                if mine.count > theirs.count:
                    yield f"reused {name}", mine.count, f"at most the anchor's {theirs.count}"
