"""L2Norm (KnormPress): a key with a low L2 norm draws attention, so low norms are kept.

Query-free, so it scores after every update: each prefill chunk is attended in full,
then the cache keeps its ``knorm_budget`` best tokens (a long prompt never holds more
than budget + one chunk), and every ``EVICT_EVERY`` decode steps (``evict/base.py``) the
``EVICT_EVERY`` worst leave at once (the press evicts every step; a step between does
nothing but write, with the token's norm, and attend).
A token's norm never changes (RoPE is a rotation), so it is computed once, in float32,
when the token arrives, and kept beside it. Adapted: an absolute budget with protected
sinks and recent tokens instead of the paper's keep ratio; every layer is compressed. The
recent window is at least ``RECENT_FLOOR`` tokens (``recent_floor``, at most a quarter of
the budget) whatever ``knorm_recent`` says: the contract's default, 0, would evict each
new token as it arrives whenever its norm is above the kept ones', and the text degenerates.

Ties: a token id seen twice gives the first layer two keys of one norm (RoPE rotates
them), equal up to the last bits of the rotation, which differ between back-ends. Norms
are compared rounded to 16 significant bits (2^-16 relative), and among equal rounded
norms the later token is kept: the score is the rank in that order, so every device
keeps the same tokens.
"""

from __future__ import annotations

import mlx.core as mx

from ..evict.base import EVICT_EVERY, RECENT_FLOOR, Roles, Schedule, ScoredEvictionCache


class L2NormCache(ScoredEvictionCache):
    roles = Roles(budget="knorm_budget", n_sink="knorm_n_sink", recent="knorm_recent")
    schedule = Schedule(prefill_end=True, chunks=True, decode_every=EVICT_EVERY)
    batchable = True  # packed decode: evict/batch.py runs the base's decode steps for the batch
    token_state = ("key_norm",)
    recent_floor = RECENT_FLOOR  # the contract's default recent window is 0 (module docstring)

    def new_token_state(self, keys, values):
        return {"key_norm": mx.sqrt(mx.square(keys.astype(mx.float32)).sum(axis=-1))}

    def score(self, inputs):
        bits = (inputs.state("key_norm").view(mx.uint32) + (1 << 7)) >> 8  # norms >= 0: bits ascend
        if self.options.knorm_keep == "high":
            bits = (1 << 24) - bits
        later = (1 << 31) - 1 - inputs.positions.astype(mx.int64)
        order = mx.argsort((bits.astype(mx.int64) << 32) + later, axis=-1)  # best first
        return -mx.argsort(order, axis=-1).astype(mx.float32)
