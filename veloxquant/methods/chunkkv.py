"""ChunkKV: the prompt is kept in whole chunks of consecutive tokens, the best-scored ones.

Scores once, when the prompt is in (mlx-lm sends its last token alone); until then
attention sees every token and the last 32 queries are buffered (the observation window:
a constant, the card has no field for it). Each token's score a_j is the softmax attention
the window pays it (float32, causal inside the window), summed over the window and over
every query head. The tokens between the ``chunkkv_n_sink`` sinks and the window are cut
into chunks of ``chunkkv_chunk_size`` consecutive positions counted from the first
non-sink position (the last one may be shorter); a chunk scores the sum of its tokens'
a_j, and the k = (budget - sinks - 32) // chunk_size best chunks are kept whole, with the
sinks and the window: the same positions in every KV head, chosen per sequence. The
budget's remainder stays unused. Decode only appends.

Layer-wise index reuse (``chunkkv_reuse_layers`` = R > 1): the compressed layers, in
order, form groups of R; a group's first layer chooses and publishes the slots it keeps in
the model context (``context.shared``), and the others keep exactly those slots, after
checking that they hold the same tokens in the same slots (they buffer no queries).
The chooser's budget decides for its group. Reuse needs the context ``make_prompt_cache``
builds: a reusing layer without one (a cache loaded from a file, given a new prompt)
refuses. Adapted: sinks, the fixed window, chunks aligned after the sinks, the short last
chunk scored by its sum (the card's reading; kvpress takes the mean).
"""

from __future__ import annotations

import mlx.core as mx

from ..evict.base import Roles, Schedule, ScoredEvictionCache
from ..evict.select import top_k_chunks

WINDOW = 32  # observation window, always kept (the card's constant)


def window_attention(cache, inputs) -> mx.array:
    """a_j: the window's attention on each kept token, summed over queries and query heads: (B, 1, rows)."""
    queries = inputs.window_queries
    w, group = queries.shape[2], queries.shape[1] // inputs.keys.shape[1]
    positions = inputs.query_positions[-1] + 1 - w + mx.arange(w)
    mass = inputs.mass(queries, positions)
    if cache.context is not None:  # tensor-sharded: every rank chooses with every head's mass
        mass = cache.context.gather_heads(mass)
    return group * mass.sum(axis=1, keepdims=True)


SCORES = {"attn_mass": window_attention}


class ChunkKVCache(ScoredEvictionCache):
    roles = Roles(budget="chunkkv_budget", n_sink="chunkkv_n_sink")
    schedule = Schedule(prefill_end=True)
    kept_count_follows_budget = False  # whole chunks: up to a chunk below the budget
    batchable = True
    # its own _evict (whole chunks) runs at the prompt's end only (decode only appends), which
    # a batch runs per sequence: packed decode steps never evict
    same_at_decode = ("_evict",)

    def _init_storage(self) -> None:
        super()._init_storage()
        reuse = self.options.chunkkv_reuse_layers
        layers = getattr(self.context, "compressed_layers", None)
        self.rank = layers.index(self.layer) if layers else self.layer
        self.group_first = self.rank - self.rank % reuse
        self.group_last = min(self.group_first + reuse, len(layers) if layers else self.rank + 1) - 1
        self.chooses = self.rank == self.group_first
        if self.context is not None and self.group_last > self.group_first:
            self.context.require_one_stage(layers[self.group_first : self.group_last + 1],
                                           "chooses the kept tokens once for")

    @property
    def recent(self) -> int:
        return WINDOW

    @property
    def window(self) -> int:  # only a choosing layer buffers queries
        return WINDOW if self.chooses else 0

    def _evict(self, inputs, decode_step):
        if self.chooses:
            slots = self._choose(inputs) if self.store.rows > self.budget else None
            if self.group_last > self.group_first and self.context is not None:
                self.context.shared[self._shared_key] = (inputs.positions, slots)
        else:
            slots = self._reused(inputs.positions)
        if slots is not None:
            b, h = inputs.positions.shape[:2]
            self.store.keep(mx.broadcast_to(slots, (b, h, slots.shape[-1])))

    def _choose(self, inputs) -> mx.array:
        c, s = self.options.chunkkv_chunk_size, self.n_sink
        positions = inputs.positions[:, :1]  # every head holds the same tokens
        scores = SCORES[self.options.chunkkv_score](self, inputs)
        chunk_ids = mx.maximum(positions - s, 0) // c
        n_chunks = max(1, -(-(self.offset - s) // c))
        k = max(0, (self.budget - s - WINDOW) // c)
        return top_k_chunks(scores, chunk_ids, n_chunks, k, self.protected(positions))

    @property
    def _shared_key(self) -> str:
        return f"chunkkv:{self.group_first}"

    def _reused(self, positions: mx.array) -> mx.array | None:
        """The slots this layer's group chose (None: it kept everything)."""
        name = "chunkkv_reuse_layers"
        if self.context is None:
            raise ValueError(f"{name}={self.options.chunkkv_reuse_layers}: layer {self.layer} reuses "
                             "the kept tokens of an earlier layer, which needs the model context "
                             "make_prompt_cache builds; this cache has none (loaded from a file?)")
        entry = self.context.shared.get(self._shared_key)
        if self.rank == self.group_last:  # the group's last layer: the entry is done with
            self.context.shared.pop(self._shared_key, None)
        if entry is None or entry[0].shape != positions.shape or not mx.array_equal(entry[0], positions):
            raise RuntimeError(f"{name}: layer {self.layer} does not hold the tokens its group's "
                               "first layer chose from; the group's layers must see the same prompt")
        return entry[1]
