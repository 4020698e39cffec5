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
re-rotated for scoring. With kept tokens held packed (``storage``), a decode step's column
is attention's own weights (over the packed rows and the exact recent ones), taken from
the attention that read them rather than computed again over the packed copies.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..cache.buffers import row_indices
from ..evict.base import EVICT_EVERY, Roles, Schedule, ScoredEvictionCache
from ..evict.quantized_slots import QuantizedSlots


class H2OCache(ScoredEvictionCache):
    roles = Roles(budget="h2o_budget", n_sink="h2o_n_sink", recent="h2o_grace")
    schedule = Schedule(prefill_end=True, decode_every=EVICT_EVERY)
    batchable = True  # packed decode: evict/batch.py runs the base's decode steps for the batch
    token_state = ("mass",)
    state_from_queries = True
    reads_step_weights = True  # kept tokens held packed: a step's mass is attention's own weights

    def observe(self, inputs):
        decay, n = self.options.h2o_decay, inputs.n_new
        weights = (self.store.step_weights() if n == 1 and inputs.every_key_visible
                   and isinstance(self.store, QuantizedSlots) else None)
        if weights is not None:  # attention's weights over the packed rows and the ring
            grown, (p, ring) = self.store.grown("mass"), weights
            if ring is None:
                grown.buffer = _mass_from_weights(float(decay), 0)(p, grown.buffer)
            else:
                p_ring, positions, ring_start, base, window = ring
                grown.buffer = _mass_from_weights(float(decay), window)(
                    p, grown.buffer, p_ring, positions, mx.array(ring_start, mx.int32), mx.array(base, mx.int32))
            return
        room = self.key_room() if n == 1 and inputs.every_key_visible else None
        if room is not None:  # a decode step: one compiled pass over the keys' whole room
            grown = self.store.grown("mass")
            step = _decode_mass(float(inputs.scale), float(decay))
            grown.buffer = step(inputs.queries, room, grown.buffer, mx.array(self.store.rows, mx.int32),
                                row_indices(room.shape[2]))
            return
        # a decode step's one query needs no weight (decay ** 0)
        new = inputs.mass(query_weights=None if n == 1 else decay ** mx.arange(n - 1, -1, -1, dtype=mx.float32))
        old = inputs.state("mass")
        self.store.update("mass", (old if decay == 1.0 else old * decay**n) + new)

    def score(self, inputs):
        return inputs.state("mass")


@functools.lru_cache(maxsize=None)
def _mass_from_weights(decay: float, window: int):
    """A decode step's ``observe`` from attention's own weights over packed slots
    (``QuantizedSlots.step_weights``): the weights over the slots' room averaged over the
    query rows, plus, for a slot whose token is in the ring of ``window`` rows, its ring
    row's; added to the decayed mass. Returns the mass buffer (rows past the count: spare
    room, never read)."""

    def step(p, mass, p_ring=None, positions=None, ring_start=None, base=None):
        new = p.mean(axis=2)
        if window:
            ring_row = mx.remainder(positions - base, window)
            from_ring = mx.take_along_axis(p_ring.mean(axis=2), ring_row, axis=-1)
            new = new + mx.where(positions >= ring_start, from_ring, 0.0)
        return (mass if decay == 1.0 else mass * decay) + new

    return mx.compile(step)


@functools.lru_cache(maxsize=None)
def _decode_mass(scale: float, decay: float):
    """A decode step's ``observe`` over the store's room: ``attention_mass`` of the one
    query over the keys of every slot (rows past the slot count masked: their weight is 0,
    and the kept rows' weights equal the unmasked softmax's, bit for bit on the CPU:
    tests/test_compiled_decode_scores.py), added to the decayed mass; returns the mass
    buffer (rows past the count: spare room, never read). One compiled graph; its shapes
    change only when the buffers grow."""

    def step(queries, keys, mass, rows, row_ids):
        b, hq, _, d = queries.shape  # one query a sequence and head
        hkv = keys.shape[1]
        q = queries.reshape(b, hkv, hq // hkv, d).astype(mx.float32)
        logits = (q * scale) @ keys.astype(mx.float32).swapaxes(-1, -2)
        logits = mx.where(row_ids < rows, logits, -float("inf"))
        new = mx.softmax(logits, axis=-1, precise=True).mean(axis=2)
        return (mass if decay == 1.0 else mass * decay) + new

    return mx.compile(step)
