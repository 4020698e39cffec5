"""The eviction base's packed decode layout: one slot store for a batch of sequences.

A batch of ``ScoredEvictionCache`` sequences past their prompts (``cache/batch.py``
explains when a batch is packed) keeps every slot array (keys, values, positions, the
method's per-token state) as one (B, Hkv, slots, ...) array. Sequence b's slots are
slots 0 .. rows_b - 1, in the order its own cache had them (so extracting it gives back
that cache exactly); the slots after them are padding, position -1, which attention
masks and the score helpers (``evict/attention.py``) ignore, as they ignore the padding
slots of per-head budgets. A decode step:

- writes each sequence's new token into its free slot (the one its last eviction
  freed) or after its slots; the store grows by one row only when a sequence without a
  free slot has no padding left;
- attends once for the batch (mask: position >= 0, only when some sequence has padding);
- runs the method's ``observe`` and, for the sequences whose schedule scores at this
  step, its ``score`` once over the batch; eviction then follows each sequence's own
  budget (``budget`` of its own cache: per-layer budgets come from its own context):
  a sequence one token over its budget frees its worst slot (``argmin`` over its slots:
  the padding is protected, and slot 0 comes first for every sequence, so ties break as
  alone), one further over keeps its best ``budget`` (``top_k_sorted`` over its own slots,
  the call it makes alone).

Scores see per-sequence positions: ``ScoreInputs.query_positions`` is (B, 1, 1) and the
cache's ``offset`` (B, 1, 1) while a method's ``observe``/``score``/``protected`` run, so
code written against positions (H2O's mass, TOVA's last query, L2Norm's norms, the
sinks and the recent window) batches unchanged. A method class joins the packed layout
only if it changes none of the base's decode steps (``accepts``), or says in its own body
which of its overrides act as the base's (``same_at_decode``, while ``packs_now`` holds);
arrays a sequence keeps besides its store (``sequence_state``: QFilters' filter, MorphKV's
last queries) are joined for the worker; what a method does to its rows before an eviction
(``before_eviction``: CaM's merges) runs on a cache over each group of due sequences with
as many slots at the same position; its scores must not depend on anything else per
sequence (the batch conformance tests and tests/test_batched_eviction.py check each one).
"""

from __future__ import annotations

from functools import cached_property

import mlx.core as mx

from ..cache.base import CacheStateError, CompressedKVCache
from ..cache.buffers import take_rows
from ..cache.batch import PackedLayout, check_step_rows, grown_capacity, pad_rows, single_buffer
from ..kernels.decode import held_rows_decode_attention
from .attention import attention_weights
from .base import ScoredEvictionCache, ScoreInputs
from .layer_budgets import LayerBudgets
from .select import top_k_sorted
from .store import SlotStore

# The base's decode path, reimplemented here for a batch: a class that overrides any of
# these decodes differently and is batched per sequence instead.
DECODE_STEPS = (
    "update_and_fetch", "attend", "_evict", "_evict_per_head", "head_budgets", "protected",
    "_scores_now", "_rows_returned", "_padding_mask", "_valid_slots", "stored_length",
    "is_trimmable", "trim",
)
# Overrides known to leave decode steps as the base's (LayerBudgets resolves budgets at a
# prefill end, then calls the base's ``_evict``).
SAME_AT_DECODE = {"_evict": (LayerBudgets._evict,)}


class BatchScoreInputs(ScoreInputs):
    """``ScoreInputs`` of a packed batch: each sequence's query at its own position."""

    every_key_visible = False  # sequences shorter than the store have padding slots

    def __init__(self, cache, queries, scale, query_positions, decode_steps):
        super().__init__(cache, queries, scale)
        self.__dict__["query_positions"] = query_positions  # (B, 1, N)
        self.decode_steps = list(decode_steps)

    @cached_property
    def last_query_weights(self) -> mx.array:
        weights = attention_weights(
            self.queries[:, :, -1:], self.keys, self.scale, self.query_positions[..., -1:],
            self.positions, self.cache.logits_dtype,
        )
        return weights[:, :, :, 0]


class EvictionPacked(PackedLayout):
    """Decode steps of a batch of one eviction method's sequences, in one slot store."""

    # host lists with one entry a sequence, filtered and extended with the batch
    _PER_SEQUENCE = ("shells", "rows", "capacities", "limits", "has_free", "offsets", "decode_steps", "head_padded")

    @staticmethod
    def accepts(cls: type) -> bool:
        """``cls`` decodes with the base's steps only (the ones reimplemented here)."""
        if cls.window_in_decode and "window_queries" not in cls.sequence_state:
            return False
        for name in DECODE_STEPS:
            mine = getattr(cls, name)
            if mine is getattr(ScoredEvictionCache, name) or mine in SAME_AT_DECODE.get(name, ()):
                continue
            owner = next(k for k in cls.__mro__ if name in k.__dict__)
            if name not in owner.__dict__.get("same_at_decode", ()):
                return False
        return True

    @staticmethod
    def can_pack(single) -> bool:
        """A sequence past its prompt, nothing in flight (a class that keeps its last queries
        at decode steps: all ``window`` of them), no per-head padding that a decode step's
        eviction would move."""
        queries = single.window_queries
        window_ok = queries is None if not single.window_in_decode else (
            queries is not None and queries.shape[2] == single.window)
        # padding among a sequence's own slots (per-head budgets) is masked like the padding
        # after them, where no decode step evicts (NestedKV); an eviction would move it
        return (not single.in_prompt and window_ok and not (single.padded and single.schedule.decode_every)
                and single.store.rows > 0 and single.packs_now())

    # -- building ---------------------------------------------------------------------------
    @classmethod
    def pack(cls, singles) -> "EvictionPacked":
        self = cls.__new__(cls)
        first = singles[0].store
        self.names = first.names
        grown = first.arrays[self.names[0]]
        self.step, self.geometric = grown.step, grown.geometric
        self.shells = singles
        # Per sequence (host lists): slots held, the capacity and limit its own store would
        # have, whether its last eviction left a free slot (``free``: which, per head), the
        # tokens it has seen and its decode steps (its scoring schedule).
        self.rows = [s.store.rows for s in singles]
        self.capacities = [s.store.arrays[self.names[0]].capacity for s in singles]
        self.limits = [s.store.arrays[self.names[0]].limit for s in singles]
        self.has_free = [s.store.free is not None for s in singles]
        self.offsets = [s.offset for s in singles]
        self.decode_steps = [s.decode_steps for s in singles]
        self.head_padded = [s.padded for s in singles]  # per-head budgets: padding inside its slots
        room = max(self.capacities)
        store = SlotStore(self.names, step=self.step)
        for name in self.names:
            fill = -1 if name == "positions" else 0
            store.arrays[name].buffer = mx.concatenate([pad_rows(s.store.view(name), room, fill) for s in singles])
            store.arrays[name].length = max(self.rows)
        heads = first.view("positions").shape[1]
        self.free = mx.concatenate([
            s.store.free.astype(mx.int32) if s.store.free is not None else mx.zeros((1, heads), mx.int32)
            for s in singles
        ])
        self.worker = _worker(singles[0], store)
        for name in self.worker.sequence_state:  # joined for the worker, not kept twice
            setattr(self.worker, name, mx.concatenate([getattr(s, name) for s in singles]))
            for s in singles:
                setattr(s, name, None)
        for s in singles:  # the shells keep config, context, options and budgets; not the rows
            s.store = SlotStore(self.names, step=self.step)
        self._sync()
        return self

    def _sync(self) -> None:
        self.offset_array = mx.array(self.offsets, mx.int32)
        self._set_limit()

    @property
    def store(self) -> SlotStore:
        return self.worker.store

    @property
    def padded(self) -> bool:
        """Some sequence holds fewer slots than the store's rows, or padding among its own."""
        return any(self.head_padded) or len(set(self.rows)) > 1 or self.rows[0] != self.store.rows

    def _set_limit(self) -> None:
        self.store.set_limit(None if any(n is None for n in self.limits) else max(self.limits))

    def _mark_padding(self) -> None:
        """Slots after a sequence's own hold position -1."""
        grown = self.store.arrays["positions"]
        live = mx.arange(grown.capacity)[None, None] < mx.array(self.rows, mx.int32)[:, None, None]
        grown.buffer = mx.where(live, grown.buffer, -1)

    # -- a decode step ----------------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        w, store = self.worker, self.store
        b, h = keys.shape[:2]
        check_step_rows(w, keys, values)
        every = w.schedule.decode_every
        if every:  # each sequence's own store stops growing at its budget plus the steps between scorings
            self.limits = [s.budget + every for s in self.shells]
            self._set_limit()
        new = {"keys": keys, "values": values, **w.new_token_state(keys, values)}
        rows = store.rows
        if not any(self.has_free) and all(r == rows for r in self.rows):  # no padding, no free slot
            for name, grown in store.arrays.items():
                if name == "positions":  # written ahead by the store: mostly nothing to write
                    store.append_positions(b, h, tuple(self.offsets), 1)
                else:
                    grown.append(new[name])
        else:  # each sequence writes its free slot, or the slot after its own ones
            new["positions"] = mx.broadcast_to(self.offset_array.reshape(b, 1, 1), (b, h, 1))
            if any(not f and r == rows for f, r in zip(self.has_free, self.rows)):
                for name, grown in store.arrays.items():  # one more row, padding for the others
                    row = new[name]
                    grown.append(mx.full(row.shape, -1, row.dtype) if name == "positions" else mx.zeros_like(row))
            has_free = mx.array(self.has_free)[:, None]
            target = mx.where(has_free, self.free, mx.array(self.rows, mx.int32)[:, None])[:, :, None]
            for name, grown in store.arrays.items():
                row = new[name]
                index = target.reshape(*target.shape, *(1,) * (row.ndim - 3))
                grown.buffer = mx.put_along_axis(grown.buffer, index, row, axis=2)
        for i, free in enumerate(self.has_free):
            if free:
                self.has_free[i] = False
            else:
                self.capacities[i] = grown_capacity(self.capacities[i], self.rows[i], 1, self.step, self.limits[i],
                                                      self.geometric)
                self.rows[i] += 1
        self.offsets = [o + 1 for o in self.offsets]
        self.offset_array = self.offset_array + 1
        return store.view("keys"), store.view("values")

    def attend(self, queries, keys, values, *, scale, sinks=None):
        w = self.worker
        b = queries.shape[0]
        positions = self.store.view("positions")
        if self.padded and sinks is None:  # MLX's fused attention with a mask: 5-10x slower on CUDA
            out = held_rows_decode_attention(queries, keys, values, positions, scale=scale)
        else:
            mask = None
            if self.padded:
                visible = (positions >= 0)[:, :, None, :]
                mask = mx.repeat(visible, queries.shape[1] // positions.shape[1], axis=1)
            out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if w.window_in_decode:  # the last ``window`` queries, this step's included (as alone)
            w.window_queries = mx.concatenate([w.window_queries[:, :, 1:], queries], axis=2)
        w.offset = self.offset_array.reshape(b, 1, 1)  # what protected() and a score read
        inputs = BatchScoreInputs(w, queries, scale, (self.offset_array - 1).reshape(b, 1, 1), self.decode_steps)
        w.observe(inputs)
        every, scoring = w.schedule.decode_every, []
        for i in range(b):
            self.decode_steps[i] += 1
            if every and self.decode_steps[i] % every == 0:
                scoring.append(i)
        if scoring:
            self._evict(inputs, scoring)
        w.offset = None
        return out

    def _evict(self, inputs, scoring: list[int]) -> None:
        budgets = {i: self.shells[i].budget for i in scoring}
        one = [i for i in scoring if self.rows[i] == budgets[i] + 1]
        keep = [i for i in scoring if self.rows[i] > budgets[i] + 1]
        if not one and not keep:
            return
        w = self.worker
        if type(w).before_eviction is not ScoredEvictionCache.before_eviction:
            self._before_eviction(inputs, one + keep)
        scores = mx.where(w.protected(inputs.positions), float("inf"), w.score(inputs))
        b, h = inputs.positions.shape[:2]
        if one:  # padding is protected (position -1 < n_sink): never the worst
            worst = mx.broadcast_to(mx.argmin(scores, axis=-1), (b, h)).astype(mx.int32)
            chosen = mx.array([i in one for i in range(b)])[:, None]
            self.free = mx.where(chosen, worst, self.free)
            for i in one:
                self.has_free[i] = True
        if keep:
            self._keep(scores, {i: budgets[i] for i in keep}, h)

    def _before_eviction(self, inputs, due: list[int]) -> None:
        """The method's ``before_eviction`` on the sequences ``due``, as alone: a single cache of
        the method over each group of them that holds as many slots at the same position
        (their slots sliced out, joined), its changed arrays written back into their slots."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i in due:
            groups.setdefault((self.rows[i], self.offsets[i]), []).append(i)
        for (rows, offset), members in groups.items():
            index = mx.array(members, mx.int32)
            cache = type(self.worker).__new__(type(self.worker))
            cache.__dict__.update(self.worker.__dict__)
            cache.store, cache.offset = SlotStore(self.names, step=self.step), offset
            cache.rows_alone = True
            sliced = {}
            for name in self.names:
                sliced[name] = cache.store.arrays[name].buffer = self.store.arrays[name].buffer[index, :, :rows]
                cache.store.arrays[name].length = rows
            for name in self.worker.sequence_state:
                setattr(cache, name, getattr(self.worker, name)[index])
            cache.before_eviction(ScoreInputs(cache, inputs.queries[index], inputs.scale))
            for name in self.names:
                changed = cache.store.arrays[name].buffer
                if changed is not sliced[name]:
                    self.store.arrays[name].buffer[index, :, :rows] = changed

    def _keep(self, scores, budgets: dict[int, int], heads: int) -> None:
        """Sequences in ``budgets`` keep their best slots (as ``SlotStore.keep`` does
        alone); the others keep theirs, in place."""
        spare = self.worker.schedule.decode_every
        kept = [budgets.get(i, r) for i, r in enumerate(self.rows)]
        rows = max(kept)
        total = rows + spare
        index = []
        for i, n in enumerate(kept):
            if i in budgets:
                slots = top_k_sorted(scores[i : i + 1, :, : self.rows[i]], n)
                slots = mx.broadcast_to(slots, (1, heads, n)).astype(mx.int32)
            else:
                slots = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (1, heads, n))
            index.append(mx.concatenate([slots, mx.zeros((1, heads, total - n), mx.int32)], axis=-1))
        index = mx.concatenate(index)
        for name, grown in self.store.arrays.items():
            grown.buffer = take_rows(grown.buffer, index)
            grown.length = rows
        for i in budgets:
            self.capacities[i] = budgets[i] + spare
        self.rows = kept
        self._mark_padding()

    # -- what the batch cache asks ------------------------------------------------------------
    def make_mask(self, N, return_array):
        if N == 1 and not return_array:
            return None
        positions = self.store.view("positions")
        rows = positions.shape[2]
        visible = mx.concatenate([positions[:, :1] >= 0, mx.ones((positions.shape[0], 1, N), mx.bool_)], axis=-1)
        q = mx.arange(rows, rows + N)[:, None] >= mx.arange(rows + N)[None]
        return visible[:, :, None, :] & q[None, None]

    def filter(self, keep: list[int]) -> None:
        index = mx.array(keep, mx.int32)
        for name in self._PER_SEQUENCE:
            setattr(self, name, [getattr(self, name)[i] for i in keep])
        for grown in self.store.arrays.values():
            grown.buffer = grown.buffer[index]
            grown.length = max(self.rows)
        for name in self.worker.sequence_state:
            setattr(self.worker, name, getattr(self.worker, name)[index])
        self.free = self.free[index]
        self._sync()

    def extend(self, other: "EvictionPacked") -> None:
        room = max(self.store.arrays[self.names[0]].capacity, other.store.arrays[self.names[0]].capacity)
        for name in self.names:
            mine, theirs = self.store.arrays[name], other.store.arrays[name]
            fill = -1 if name == "positions" else 0
            mine.buffer = mx.concatenate([pad_rows(mine.buffer, room, fill), pad_rows(theirs.buffer, room, fill)])
            mine.length = max(mine.length, theirs.length)
        for name in self._PER_SEQUENCE:
            getattr(self, name).extend(getattr(other, name))
        for name in self.worker.sequence_state:
            setattr(self.worker, name, mx.concatenate([getattr(self.worker, name), getattr(other.worker, name)]))
        self.free = mx.concatenate([self.free, other.free])
        self._mark_padding()
        self._sync()

    def _single(self, i: int, cache):
        store = SlotStore(self.names, step=self.step)
        n = self.rows[i]
        for name in self.names:
            block = self.store.arrays[name].buffer[i : i + 1, :, :n]
            store.arrays[name] = single_buffer(block, self.capacities[i], self.step, self.limits[i], self.geometric)
        store.free = self.free[i : i + 1] if self.has_free[i] else None
        for name in self.worker.sequence_state:
            setattr(cache, name, mx.contiguous(getattr(self.worker, name)[i : i + 1]))
        cache.store = store
        cache.offset = self.offsets[i]
        cache.decode_steps = self.decode_steps[i]
        return cache

    def is_trimmable(self) -> bool:
        cls = type(self.worker)
        if cls.state_from_queries and any(self.offsets):
            return False
        return all(r == o and not f for r, o, f in zip(self.rows, self.offsets, self.has_free))

    def size(self) -> int:
        return max(r - f for r, f in zip(self.rows, self.has_free))

    @property
    def kept(self) -> list[int]:
        """Tokens each sequence keeps (its slots, less a free one)."""
        return [r - f for r, f in zip(self.rows, self.has_free)]

    @property
    def nbytes(self) -> int:
        joined = sum(getattr(self.worker, name).nbytes for name in self.worker.sequence_state)
        return sum(g.nbytes for g in self.store.arrays.values()) + self.free.nbytes + self.offset_array.nbytes + joined

    @property
    def state(self):
        return [*(self.store.view(n) for n in self.names), self.free]

    def step_writes(self) -> list[mx.array]:
        """The slots' buffers (positions, scores, token state), the free slot, the recent
        queries and each sequence's state: what a step or an eviction writes."""
        w = self.worker
        written = [g.buffer for g in self.store.arrays.values() if g.buffer is not None]
        written += [a for a in (self.free, w.window_queries, *(getattr(w, n) for n in w.sequence_state))
                    if a is not None]
        return written

    __deepcopy__ = CompressedKVCache.__deepcopy__  # dtypes shared (they cannot be copied)


def _worker(single, store: SlotStore):
    """An instance of the method's class over the packed store: the method's ``score``,
    ``observe``, ``new_token_state`` and the base's ``protected`` run on it."""
    worker = type(single).__new__(type(single))
    worker.__dict__.update(single.__dict__)
    worker.store = store
    worker.window_queries = None
    if worker.kv_shape is None:
        raise CacheStateError(f"layer {single.layer}: a cache packed before any update")
    return worker


__all__ = ["BatchScoreInputs", "EvictionPacked"]
