"""H2O: heavy hitters, the tokens that have drawn the most attention so far, are kept.

Each token carries its accumulated attention mass S (float32, averaged over the query
heads of its KV head). After every attention call, S <- decay^N * S plus the chunk's
column sums, query i of the chunk weighted decay^(N-1-i); the prompt's queries are taken
in blocks, so its weights are never held whole. Scores when the prompt is in (keeping
the top ``h2o_budget``) and every ``EVICT_EVERY`` decode steps (``evict/base.py``), keeping the
top ``h2o_budget`` of the budget plus the tokens come since: the paper frees the slot of
the lowest S at every step; here the lowest ``EVICT_EVERY`` leave at once, and a step only
adds its column of attention to S.
The sinks and the ``h2o_grace`` newest tokens are never evicted: a new token has had no
time to gather mass. Adapted: sinks, grace and decay (1.0 is the paper's plain sum).
``h2o_rope_base`` is not used: the hook hands over post-RoPE queries, so nothing is
re-rotated for scoring.
"""

from __future__ import annotations

import mlx.core as mx

from ..evict.base import EVICT_EVERY, Roles, Schedule, ScoredEvictionCache


class H2OCache(ScoredEvictionCache):
    roles = Roles(budget="h2o_budget", n_sink="h2o_n_sink", recent="h2o_grace")
    schedule = Schedule(prefill_end=True, decode_every=EVICT_EVERY)
    batchable = True  # packed decode: evict/batch.py runs the base's decode steps for the batch
    token_state = ("mass",)
    state_from_queries = True

    def observe(self, inputs):
        decay, n = self.options.h2o_decay, inputs.n_new
        # a decode step's one query needs no weight (decay ** 0)
        new = inputs.mass(query_weights=None if n == 1 else decay ** mx.arange(n - 1, -1, -1, dtype=mx.float32))
        old = inputs.state("mass")
        self.store.update("mass", (old if decay == 1.0 else old * decay**n) + new)

    def score(self, inputs):
        return inputs.state("mass")
