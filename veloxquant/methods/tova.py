"""TOVA: keep the tokens the current query attends to most; the state is the cache itself.

Scores when the prompt is in (with the last prompt token's query) and at every decode
step (with the step's query): the attention of that one query, averaged over all query
heads, so every KV head keeps the same tokens. Eviction follows attention, which sees
``tova_budget + 1`` tokens; the new token itself may be the one dropped.
``tova_backend``: 'reference' computes the logits in float32, 'auto' in the keys' own
dtype (no float32 copy of the keys); the softmax is float32 in both.
Adapted: sinks are protected (0 sinks is the original).
"""

from __future__ import annotations

import mlx.core as mx

from ..evict.base import Roles, Schedule, ScoredEvictionCache


class TOVACache(ScoredEvictionCache):
    roles = Roles(budget="tova_budget", n_sink="tova_n_sink")
    schedule = Schedule(prefill_end=True, decode_every=1)
    batchable = True  # packed decode: evict/batch.py runs the base's decode steps for the batch

    @property
    def logits_dtype(self):
        return mx.float32 if self.options.tova_backend == "reference" else None

    def score(self, inputs):
        return inputs.last_query_weights.mean(axis=(1, 2))[:, None]
