"""AdaKV-proxy: per-head bit widths allocated to a target average (card: AdaKV.md).

Ada-KV (arXiv 2407.11550) gives attention heads different *token* budgets; this project's
proxy gives KV heads different *bit widths*, the card's algorithm being inferred:

1. **Importance** per KV head (``adakv_importance='norm_variance'``): the variance of the
   L2 norms of the head's last ``adakv_obs_window`` keys (fewer when fewer were seen; 0
   under 2), averaged over the batch's sequences (one allocation per layer). Keys only;
   the card leaves values optional. No normalization: the allocation is scale-invariant
   within a layer, and layers never share a budget.
2. **Allocation** (``allocate_bits``): every head at ``adakv_lo_bit``; then, repeatedly, the
   single upgrade (lo->mid or mid->hi) with the largest drop of ``D_h(b) = I_h 4^-b`` per
   bit that still fits the budget, ties to the lower head index, until none fits. The
   budget is ``sum b_h <= target * H``: ``floor((target - lo) * H)`` extra bits (the
   card's ``round`` could exceed the target, which its own invariant forbids). A zero
   (or NaN) importance is read as a thousandth of the smallest positive one (1 when all
   are 0), so that heads of zero importance still take lo->mid before mid->hi: equal
   heads then differ by at most one level (unless a mid->hi step smaller than the lo->mid
   step is the only one that fits); the order of the others and their exact ties stay.
3. **Quantization**: keys per channel in groups of G = ``adakv_group_size`` tokens,
   values per token in groups of G channels (KIVI's layout), each head at its own width.
   The newest R tokens (the config's ``residual_window``) stay in full precision, keys
   and values alike (the config's meaning of R; KIVI keeps only ``T mod R`` keys); when G
   more have come, the oldest G flush, keys and values together, so a token's key and
   value share its head's width and each part covers the same tokens for both (KIVI's
   values leave one at a time, which would split an epoch's values across the window).
   The window holds R to R + G - 1 rows of each.
4. **Schedule**: the importance is re-estimated at every prefill chunk and every
   ``adakv_update_interval`` decode steps (on the device, no sync); a flush quantizes its
   block under the greedy allocation of the latest estimate (computed on the host only
   then: one sync per flush, not per step). Stored tokens keep their widths: no
   re-quantization. The allocation that counts is thus the one current at each flush.

Storage and attention (``methods/adakv/heads.py``): the history is a sequence of epochs of
constant allocation, each holding, per width, its heads as one ``DecodePart`` with
``heads=``; flushes under an unchanged allocation extend the newest epoch in place. A
decode step writes its token into the window in place and attends over the parts
(merged by log-sum-exp): parts at 2/4/8 bits (the defaults' lo and hi) are served by the
fused kernel on a GPU, parts at 3 bits (the default mid) and the CPU take the pure-MLX
path; the window rides as the tail of the newest part when that epoch holds every head
at one width, else it is a part of its own (kernel-served on a GPU). A prefill chunk
attends over the decoded history plus itself. Memory: per stored token and KV head, for
K and V each, ``b_h d/8 + 4 d/G`` bytes (float16 scales) at its own epoch's ``b_h``, plus
the window (R + G rows of capacity), the key-norm ring and the head index arrays.
Measurements of the parts a step attends over and of the importance's effect:
benchmarks/notes/quantization.md.
"""

from __future__ import annotations

import math
from typing import Sequence

import mlx.core as mx

from ...quant.cache import QuantizedCache
from .heads import KERNEL_BITS, AffineCodecs, HeadWiseStore, RecentNorms
from ...quant.packed import GROWTH_TOKENS

IMPORTANCE = {"norm_variance": RecentNorms.variance}  # adakv_importance -> estimate


def allocate_bits(importance: Sequence[float], levels: tuple[int, int, int], target: float) -> tuple[int, ...]:
    """The card's greedy: bit width per head, ``sum <= target * len(importance)``."""
    n = len(importance)
    spare = math.floor((target - levels[0]) * n + 1e-9)
    imp = [x if math.isfinite(x) and x > 0 else 0.0 for x in importance]
    lifted = 1e-3 * min((x for x in imp if x > 0), default=1e3)  # below every positive one
    imp = [x or lifted for x in imp]
    widths = [levels[0]] * n
    step = {levels[0]: levels[1], levels[1]: levels[2]}  # each width's upgrade
    while True:
        best, best_gain = None, -1.0
        for h, b in enumerate(widths):
            if b not in step or step[b] - b > spare:
                continue
            gain = imp[h] * (4.0 ** -b - 4.0 ** -step[b]) / (step[b] - b)
            if gain > best_gain:  # strict: a tie stays with the lower head index
                best, best_gain = h, gain
        if best is None:
            return tuple(widths)
        spare -= step[widths[best]] - widths[best]
        widths[best] = step[widths[best]]


class AdaKVCache(QuantizedCache):
    group_field = "adakv_group_size"
    batchable = "per_sequence"  # the quantized store has no packed layout (cache/batch.py says why)

    def _init_storage(self) -> None:
        o = self.config.options
        self.levels = (o.adakv_lo_bit, o.adakv_mid_bit, o.adakv_hi_bit)
        self.target, self.interval = o.adakv_target_avg_bits, o.adakv_update_interval
        self.estimate = IMPORTANCE[o.adakv_importance]
        self.norms = RecentNorms(o.adakv_obs_window)
        self.importance: mx.array | None = None  # (H,) float32: the latest estimate
        self.since_update = 0  # decode steps since it
        self.updates = 0  # estimates made (prefill chunks + scheduled decode steps)
        self._widths: tuple[int, ...] | None = None  # its allocation, once a flush asked
        super()._init_storage()

    def make_store(self):
        tail_bits = next((b for b in self.levels if b in KERNEL_BITS), 4)
        return HeadWiseStore(AffineCodecs(self.group), block=self.group, widths=self.allocation,
                             window=self.config.residual_window, step_tokens=GROWTH_TOKENS,
                             tail_bits=tail_bits)

    # -- the allocation ------------------------------------------------------------------
    def observe(self, keys, values, n_queries) -> None:
        """Every chunk and every ``adakv_update_interval`` steps re-estimate the importance."""
        self.norms.observe(keys)
        if n_queries == 1:
            self.since_update += 1
        if n_queries > 1 or self.importance is None or self.since_update >= self.interval:
            self.importance = self.estimate(self.norms)
            self.since_update, self._widths = 0, None
            self.updates += 1

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        out = super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if queries.shape[2] > 1:
            return out
        # no decode attention reads the key-norm ring or the estimate; generate_step
        # evaluates only the logits, so they ride on its output (one node a layer), or
        # their lazy graphs would chain from step to step
        return mx.depends(out, [a for a in (self.norms.norms, self.importance) if a is not None])

    def allocation(self) -> tuple[int, ...]:
        """The bit width of each KV head for the tokens flushed now (syncs once per estimate)."""
        if self._widths is None:
            self._widths = allocate_bits(self.importance.tolist(), self.levels, self.target)
        return self._widths

    # -- what is kept (names as saved) ------------------------------------------------------
    def _arrays(self):
        return {**self.store.arrays(), "key_norms": self.norms.norms, "importance": self.importance}

    def _meta(self):
        return {**self.store.meta(), **self.norms.meta(), "since_update": self.since_update,
                "updates": self.updates}

    def _restore_meta(self, meta) -> None:
        arrays = self.__dict__.get("_saved_arrays", {})
        self.norms.restore(meta, arrays.get("key_norms"))
        self.importance = arrays.get("importance")
        self.since_update, self.updates = int(meta.get("since_update", 0)), int(meta.get("updates", 0))
        super()._restore_meta(meta)

    def _state_problems(self):
        yield from self.store.problems(self.offset, None if self.kv_shape is None else self.kv_shape[1])
        if self.store.length and self.importance is None:
            yield "importance", None, "an estimate once tokens are stored"
