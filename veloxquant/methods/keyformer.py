"""Keyformer: keep the key tokens, those with the largest accumulated Gumbel-softmax score.

Each token carries a score S (float32). After every attention call, S += the column sums
of softmax((x + zeta) / tau_t) over this update's queries, summed (not averaged) over the
query heads of its KV head, as the official ``_attn`` sums over queries and heads: x are
the real logits q.k * scale, causal by position, and zeta ~ Gumbel(0, 1) i.i.d. per
sequence, query head, query and key, added to the logits before dividing by tau. Noise
and temperature only score: the layer's output is the plain softmax over the stored
tokens. Scores when the prompt is in (keeping the top ``keyformer_budget``) and every
``EVICT_EVERY`` decode steps (``evict/base.py``: the lowest ``EVICT_EVERY`` S leave at once,
where the paper frees the slot of the lowest at every step; a step between adds its
noisy column sums to S); the sinks and the newest tokens are never
evicted: the ``keyformer_recent`` newest, and at least ``RECENT_FLOOR`` (``recent_floor``,
at most a quarter of the budget) in place of the paper's recent share of the cache, since
with none, as at the contract's default of 0, a new token, scored by its own attention
alone, is mostly the one evicted and the text degenerates. An evicted token's S leaves with it; a new token starts
from its own contribution. The prompt's queries are scored in blocks (``gumbel_mass``).

Temperature at step t (0 for the prompt, then 1, 2, ... for the decode steps after it):
``keyformer_tau`` when set; else tau_init + (tau_end - tau_init) * min(t, A) / A for
A = ``keyformer_anneal_steps`` > 0; else tau_init (tau_end then has no effect).

Noise comes from explicit MLX PRNG keys, never the global seed: each block of queries
draws with ``mx.random.key`` of a hash of ``keyformer_seed``, the layer and the position
of the block's first query (at a decode step, its token's position). It depends only on
the seed, the layer and the step, so a saved, loaded or copied cache draws what a fresh
one would.

Adapted: an absolute budget and protected sinks instead of the paper's prompt percentages
(kv_cache 60%, recent 30%); the anneal runs over ``keyformer_anneal_steps`` instead of
max_new_tokens; scores are kept per sequence (the official code sums over the batch).
``keyformer_rope_base`` is not used: the hook hands over the real post-RoPE queries, so
nothing is un-rotated or re-rotated for scoring.
"""

from __future__ import annotations

import mlx.core as mx

from ..evict.attention import reduce_query_blocks
from ..evict.base import EVICT_EVERY, RECENT_FLOOR, Roles, Schedule, ScoredEvictionCache
from ..evict.prng import step_key

SCORE_ELEMENTS = 2**21  # logits per scoring block (8 MiB in float32)
noise_key = step_key  # the noise of the query block that starts at a position


def gumbel_mass(queries, keys, scale, q_start, k_positions, tau, key_at=None) -> mx.array:
    """sum over queries and a KV group's heads of softmax((x + zeta) / tau): (B, Hkv, n).

    queries (B, Hq, N, D) at positions q_start .. q_start + N - 1; keys (B, Hkv, n, D) at
    ``k_positions`` (B, Hkv, n); ``key_at(position)`` gives the noise key of the block of
    queries starting at that position (None: no noise, softmax(x / tau)). A key a query
    cannot see adds 0 (keys are at most at the last query's position). Blocks hold at most
    SCORE_ELEMENTS logits, one block at a time (``reduce_query_blocks``); the noise of a
    block is drawn from its first query's position, so the block size is kept fixed.
    """
    b, hq, n_queries, d = queries.shape
    hkv = keys.shape[1]
    k = keys[:, :, None].astype(mx.float32).swapaxes(-1, -2)

    def block(q, start, stop):
        q = q.reshape(b, hkv, hq // hkv, stop - start, d).astype(mx.float32)
        x = (q * scale) @ k  # (B, Hkv, G, block, n)
        if key_at is not None:
            x = x + mx.random.gumbel(x.shape, key=key_at(q_start + start))
        x = x if tau == 1 else x / tau
        if start < n_queries - 1:  # the last query (a decode step's only one) sees every key
            q_positions = mx.arange(q_start + start, q_start + stop)[:, None]
            x = mx.where(k_positions[:, :, None, None, :] <= q_positions, x, -float("inf"))
        return mx.softmax(x, axis=-1, precise=True).sum(axis=(2, 3))

    return reduce_query_blocks(queries, keys.shape[2], block, elements=SCORE_ELEMENTS)


class KeyformerCache(ScoredEvictionCache):
    roles = Roles(budget="keyformer_budget", n_sink="keyformer_n_sink", recent="keyformer_recent")
    schedule = Schedule(prefill_end=True, decode_every=EVICT_EVERY)
    token_state = ("score",)
    recent_floor = RECENT_FLOOR  # the contract's default recent window is 0 (module docstring)
    state_from_queries = True
    gumbel_noise = True  # False (tests only): score with softmax(x / tau), no noise
    batchable = "per_sequence"  # its noise keys take the offset as a number (packed: one per sequence)

    def noise_key(self, position: int) -> mx.array:
        return noise_key(self.options.keyformer_seed, self.layer, position)

    def tau(self, step: int) -> float:
        o = self.options
        if o.keyformer_tau is not None:
            return o.keyformer_tau
        if o.keyformer_anneal_steps:
            frac = min(step, o.keyformer_anneal_steps) / o.keyformer_anneal_steps
            return o.keyformer_tau_init + (o.keyformer_tau_end - o.keyformer_tau_init) * frac
        return o.keyformer_tau_init

    def observe(self, inputs):
        prompt = inputs.n_new > 1 or self.in_prompt  # a prompt chunk, or the prompt's last token
        step = 0 if prompt else self.decode_steps + 1  # the base counts this step after observe
        mass = gumbel_mass(
            inputs.queries, inputs.keys, inputs.scale, self.offset - inputs.n_new, inputs.positions,
            self.tau(step), self.noise_key if self.gumbel_noise else None,
        )
        self.store.update("score", inputs.state("score") + mass)

    def score(self, inputs):
        return inputs.state("score")
