"""L2Norm (KnormPress): a key with a low L2 norm draws attention, so low norms are kept.

Query-free, so it scores after every update: each prefill chunk is attended in full,
then the cache keeps its ``knorm_budget`` best tokens (a long prompt never holds more
than budget + one chunk), and each decode step frees the slot of the worst token.
A token's norm never changes (RoPE is a rotation), so it is computed once, in float32,
when the token arrives, and kept beside it. Adapted: an absolute budget with protected
sinks and recent tokens instead of the paper's keep ratio; every layer is compressed.
"""

from __future__ import annotations

import mlx.core as mx

from ..evict.base import Roles, Schedule, ScoredEvictionCache


class L2NormCache(ScoredEvictionCache):
    roles = Roles(budget="knorm_budget", n_sink="knorm_n_sink", recent="knorm_recent")
    schedule = Schedule(prefill_end=True, chunks=True, decode_every=1)
    batchable = True  # packed decode: evict/batch.py runs the base's decode steps for the batch
    token_state = ("key_norm",)

    def new_token_state(self, keys, values):
        return {"key_norm": mx.sqrt(mx.square(keys.astype(mx.float32)).sum(axis=-1))}

    def score(self, inputs):
        norms = inputs.state("key_norm")
        return -norms if self.options.knorm_keep == "low" else norms
