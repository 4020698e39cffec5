"""TOVA: keep the tokens the current query attends to most; the state is the cache itself.

Scores when the prompt is in (with the last prompt token's query) and every
``EVICT_EVERY`` decode steps (``evict/base.py``; with that step's query): the attention of
that one query, averaged over all query heads, so every KV head keeps the same tokens.
Eviction follows attention, which sees up to ``tova_budget + EVICT_EVERY`` tokens. The
paper drops the lowest token at every step; here the ``EVICT_EVERY`` lowest leave at once,
and a step between does nothing but write and attend. The newest ``RECENT_FLOOR`` tokens
(``recent_floor``, at most a quarter of the budget) are never dropped, which the paper
does not do: a batch scores the tokens generated since the last one by that step's query
alone, where the paper's one-a-step rule let each of them face every query after it; with
no floor generated tokens left 17 steps after they came on the reference model (issue 37).
kvpress's TOVAPress compresses only the prompt, so it never evicts a generated token.
``tova_backend``: 'reference' computes the logits in float32, 'auto' in the keys' own
dtype (no float32 copy of the keys); the softmax is float32 in both.
Adapted: sinks are protected (0 sinks is the original).
"""

from __future__ import annotations

import mlx.core as mx

from ..evict.base import EVICT_EVERY, RECENT_FLOOR, Roles, Schedule, ScoredEvictionCache


class TOVACache(ScoredEvictionCache):
    roles = Roles(budget="tova_budget", n_sink="tova_n_sink")
    schedule = Schedule(prefill_end=True, decode_every=EVICT_EVERY)
    batchable = True  # packed decode: evict/batch.py runs the base's decode steps for the batch
    recent_floor = RECENT_FLOOR  # the paper has no recent window (module docstring)

    @property
    def logits_dtype(self):
        return mx.float32 if self.options.tova_backend == "reference" else None

    def score(self, inputs):
        return inputs.last_query_weights.mean(axis=(1, 2))[:, None]
