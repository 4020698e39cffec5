"""AdaKV-proxy: per-head bit widths allocated to a target average (card: AdaKV.md).

Ada-KV (arXiv 2407.11550) gives attention heads different *token* budgets; this project's
proxy gives KV heads different *bit widths*, the card's algorithm being inferred:

1. **Importance** per sequence and KV head (``adakv_importance='norm_variance'``): the
   variance of the L2 norms of the head's last ``adakv_obs_window`` keys (fewer when fewer
   were seen; 0 under 2), a (B, H) table: each sequence of a batch keeps its own (one
   allocation per sequence and layer), so that a cache fed B rows stores each as it would
   alone and sequences in the same state can share one cache (``cache/stacked.py``). Keys
   only; the card leaves values optional. No normalization: the allocation is
   scale-invariant within a layer, and layers never share a budget.
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
   value share its head's width. The window holds R to R + G - 1 rows of each.
4. **Schedule**: the importance is re-estimated at every prefill chunk and every
   ``adakv_update_interval`` decode steps; a flush quantizes its blocks under the greedy
   allocation of the latest estimate, computed on the device (``heads.greedy_on_device``,
   the greedy above in float32, a fixed number of rounds, each row on its own budget):
   nothing is read on the host, at a flush or ever (the allocation used to be read to lay
   the store out by width: a sync a flush). Stored tokens keep their widths: no
   re-quantization. The allocation that counts is thus the one current at each flush.
   ``allocate_bits`` is the host reference the device greedy is tested against (float32
   gains may order two heads whose float64 gains differ by under 1e-7 the other way).

Storage and attention (``methods/adakv/heads.py``): a token's codes fill a fixed budget of
``lo H + spare`` bit planes whatever the allocation (each block keeps each sequence's
widths, which say whose of that sequence's planes are whose), so every size is known on
the host; a decode step writes its token into the window in place and attends through
one compiled function over the planes, the scales and the window (pure MLX on every
back-end). Memory: per stored token
and KV head, for K and V each, ``b_h d/8 + 4 d/G`` bytes (scales and minima in the
model's dtype: 2 bytes each at float16) when the budget is spent (always at one bit an
upgrade, as at the defaults), plus the plane map (8 bytes a head and bit a block), the
window (R + G rows of capacity) and the key-norm ring.
"""

from __future__ import annotations

import math
from typing import Sequence

import mlx.core as mx

from ...quant.cache import QuantizedCache
from .heads import PlaneStore, RecentNorms, greedy_on_device, spare_bits

IMPORTANCE = {"norm_variance": RecentNorms.variance}  # adakv_importance -> estimate


def allocate_bits(importance: Sequence[float], levels: tuple[int, int, int], target: float) -> tuple[int, ...]:
    """The card's greedy: bit width per head, ``sum <= target * len(importance)`` (the host
    reference of ``heads.greedy_on_device``)."""
    n = len(importance)
    spare = spare_bits(levels, target, n)
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
    batchable = "stacked"  # its rows never mix (each its own importance and widths): sequences in the same state share one cache (cache/stacked.py)

    def _init_storage(self) -> None:
        o = self.config.options
        self.levels = (o.adakv_lo_bit, o.adakv_mid_bit, o.adakv_hi_bit)
        self.target, self.interval = o.adakv_target_avg_bits, o.adakv_update_interval
        self.estimate = IMPORTANCE[o.adakv_importance]
        self.norms = RecentNorms(o.adakv_obs_window)
        self._estimated_at = None  # the ring as the latest scheduled estimate saw it
        self._importance: mx.array | None = None  # (B, H) float32: that estimate, once asked
        self.since_update = 0  # decode steps since it
        self.updates = 0  # estimates made (prefill chunks + scheduled decode steps)
        super()._init_storage()

    def make_store(self):
        return PlaneStore(self.levels, self.target, block=self.group, group=self.group, widths=self.allocation,
                          window=self.config.residual_window)

    # -- the allocation ------------------------------------------------------------------
    def observe(self, keys, values, n_queries) -> None:
        """Every chunk and every ``adakv_update_interval`` steps re-estimate the importance."""
        self.norms.observe(keys)
        if n_queries == 1:
            self.since_update += 1
        if n_queries > 1 or not self.updates or self.since_update >= self.interval:
            # a reference to the ring as it is now: the estimate is computed when a flush or
            # a save asks for it, not at every scheduled step
            self._estimated_at, self._importance = self.norms.snapshot(), None
            self.since_update = 0
            self.updates += 1

    @property
    def importance(self) -> mx.array | None:
        """(B, H) float32: each sequence's importance at the latest scheduled estimate."""
        if self._importance is None and self._estimated_at is not None:
            self._importance = self.estimate(self.norms, self._estimated_at)
            self._estimated_at = None  # the ring as it was is no longer held
        return self._importance

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        out = super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if queries.shape[2] > 1:
            return out
        # no decode attention reads the key-norm ring; generate_step evaluates only the
        # logits, so it rides on its output (one node a layer), or its lazy graph would
        # chain from step to step
        return mx.depends(out, [self.norms.norms])

    def allocation(self) -> mx.array:
        """The bit width of each sequence's KV heads (B, H) int32 for the tokens flushed now,
        on the device."""
        n = self.importance.shape[-1]
        return greedy_on_device(self.levels, spare_bits(self.levels, self.target, n), n)(self.importance)

    # -- what is kept (names as saved) ------------------------------------------------------
    def _arrays(self):
        return {**self.store.arrays(), "key_norms": self.norms.norms, "importance": self.importance}

    def _meta(self):
        return {**self.store.meta(), **self.norms.meta(), "since_update": self.since_update,
                "updates": self.updates}

    def _restore_meta(self, meta) -> None:
        arrays = self.__dict__.get("_saved_arrays", {})
        self.norms.restore(meta, arrays.get("key_norms"))
        importance = arrays.get("importance")
        if importance is not None and importance.ndim == 1:
            importance = importance[None]  # saved before it had a batch axis: one sequence's
        self._importance = importance
        self._estimated_at = None
        self.since_update, self.updates = int(meta.get("since_update", 0)), int(meta.get("updates", 0))
        super()._restore_meta(meta)

    def _state_problems(self):
        yield from self.store.problems(self.offset, None if self.kv_shape is None else self.kv_shape[1])
        if self.store.length and self.importance is None:
            yield "importance", None, "an estimate once tokens are stored"
        elif self.importance is not None and self.kv_shape is not None and self.importance.shape != self.kv_shape[:2]:
            # one row for several would be every row's allocation: the rows would mix
            yield "importance", self.importance.shape, f"a row a sequence, {self.kv_shape[:2]}"
