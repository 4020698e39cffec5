"""The scorer base: an eviction method is its options mapping and its ``score``.

``ScoredEvictionCache`` owns everything eviction methods share (kvpress's ``ScorerPress``
is the model): the kept keys, values and positions (a ``SlotStore``), when scoring
happens (``Schedule``), the inputs a score may use (``ScoreInputs``, each computed only
when asked for), protection of sinks and of a recent window, the budget (one for every
layer, or per layer from the model context), top-k and gather, eviction at decode time
by slot reuse, trim and state. A method subclass declares:

- ``roles``: which of its options fields are the budget, the sinks, the recent window
  and the observation window (``Roles``);
- ``schedule``: when it scores;
- ``token_state``: per-token float32 arrays that travel with their token (a running
  attention mass, a cached norm), with ``new_token_state`` and ``observe`` to fill them;
- ``score(inputs)``: (B, Hkv or 1, rows), higher is kept; a score with one row for all
  heads selects the same tokens in every head.

Attention always runs over every stored token plus the new ones (``budget + 1`` at a
decode step); eviction follows it, as in H2O, TOVA and SnapKV.

A method may set ``recent_floor``: its recent window is then never smaller than that (nor
than a quarter of the budget), whatever its option says. A method whose score favours
tokens many queries have seen, or ignores queries, needs one: with no recent window it
evicts the prompt's last tokens and each generated token the moment it arrives, and the
text degenerates.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import mlx.core as mx

from ..cache.base import CompressedKVCache, causal_mask
from ..kernels.decode import held_rows_decode_attention
from .attention import attention_mass, attention_weights
from .quantized_slots import QuantizedSlots, slot_store
from .select import top_k_sorted


@functools.lru_cache(maxsize=8)
def _zeros(shape: tuple[int, ...]) -> mx.array:
    """float32 zeros of ``shape``, built once (a decode step's new token state: no op a step)."""
    return mx.zeros(shape, mx.float32)


RECENT_FLOOR = 32  # newest tokens kept by a method that sets recent_floor, at least
# Decode steps between two evictions of a method whose paper evicts a token every step:
# the store holds up to budget + EVICT_EVERY - 1 tokens and the EVICT_EVERY lowest leave at
# once (kvpress's DecodingPress compresses at an interval the same way), so a step is one
# write, one attention and at most a score update, and the gather runs once an interval.
EVICT_EVERY = 32


@dataclass(frozen=True)
class Schedule:
    """When a method scores and evicts.

    ``prefill_end``: once the prompt is in (mlx-lm sends a prompt's last token alone, so
    the first single-token update after a multi-token one ends a prefill);
    ``chunks``: after every multi-token update too (a long prompt then never holds more
    than budget + one chunk); ``decode_every``: every N single-token steps (0: never).
    """

    prefill_end: bool = True
    chunks: bool = False
    decode_every: int = 0


@dataclass(frozen=True)
class Roles:
    """Names of the options fields that play the base's roles (None: not an option)."""

    budget: str
    n_sink: str | None = None
    recent: str | None = None
    window: str | None = None  # observation window: the last prompt queries are kept


class ScoreInputs:
    """What a score may use. Everything beyond the stored arrays is computed on request."""

    def __init__(self, cache: "ScoredEvictionCache", queries: mx.array, scale: float):
        self.cache = cache
        self.queries = queries  # this update's queries (B, Hq, N, D)
        self.scale = scale

    # Built only when a score or an observer reads them: a decode step that neither scores
    # nor observes adds no array operation.
    @cached_property
    def keys(self) -> mx.array:
        return self.cache.store.view("keys")

    @cached_property
    def values(self) -> mx.array:
        return self.cache.store.view("values")

    @cached_property
    def positions(self) -> mx.array:
        """(B, Hkv, rows) int32: the token each slot holds (-1: padding)."""
        return self.cache.store.view("positions")

    @cached_property
    def query_positions(self) -> mx.array:
        offset = self.cache.offset
        return mx.arange(offset - self.queries.shape[2], offset)

    @property
    def n_new(self) -> int:
        return self.queries.shape[2]

    def state(self, name: str) -> mx.array:
        return self.cache.store.view(name)

    @property
    def window_queries(self) -> mx.array | None:
        """The last observation-window queries of the prompt, this update's included."""
        return self.cache.window_queries

    @property
    def every_key_visible(self) -> bool:
        """A decode query over a store with no padding sees every stored token: no mask."""
        return self.n_new == 1 and not self.cache.padded

    #: a packed batch's decode step (``evict/batch.py``): per sequence, the decode steps
    #: counted before this one (its own schedule); None for a single cache
    decode_steps: list[int] | None = None

    def mass(self, queries=None, query_positions=None, query_weights=None, dtype=mx.float32):
        """Attention mass per kept token (B, Hkv, rows) of ``queries`` (default: this update's)."""
        if queries is None:
            if self.every_key_visible:  # the same numbers, without building the mask
                return attention_mass(self.queries, self.keys, self.scale, None, None, query_weights, dtype)
            queries, query_positions = self.queries, self.query_positions
        return attention_mass(
            queries, self.keys, self.scale, query_positions, self.positions, query_weights, dtype
        )

    @cached_property
    def last_query_weights(self) -> mx.array:
        """Attention of this update's last query over the kept tokens: (B, Hkv, G, rows)."""
        weights = attention_weights(
            self.queries[:, :, -1:], self.keys, self.scale, self.query_positions[-1:],
            self.positions, self.cache.logits_dtype,
        )
        return weights[:, :, :, 0]


class ScoredEvictionCache(CompressedKVCache):
    """Keeps at most ``budget`` tokens per layer and KV head, chosen by the method's score."""

    requires_attention_hook = True
    evicts_tokens = True
    takes_storage = True  # config.storage: kept tokens quantized (evict/quantized_slots.py)
    roles: Roles
    schedule: Schedule = Schedule()
    token_state: tuple[str, ...] = ()
    state_from_queries = False  # token_state accumulates what queries paid: trim is inexact
    logits_dtype = mx.float32  # dtype of the score's logits matmul (the softmax is float32)
    # a decode step's observer reads the step's own attention weights over packed slots
    # (``QuantizedSlots.step_weights``), which attention then hands over
    reads_step_weights = False
    window_in_decode = False  # keep the last ``window`` queries at decode steps too
    # The kept count follows from the budget and the schedule (false where an eviction keeps
    # whole chunks below the budget, or the budget moves with the offset).
    kept_count_follows_budget = True
    recent_floor = 0  # the recent window is at least min(this, budget // 4)
    # A packed batch (evict/batch.py): arrays of a sequence besides its store (batch first)
    # that the batch keeps joined for its worker; overrides of the base's decode steps that
    # the class declaring them (in its own body) vouches act as the base's while
    # ``packs_now`` holds.
    sequence_state: tuple[str, ...] = ()
    same_at_decode: tuple[str, ...] = ()
    # True on the cache a packed batch builds over a group of its sequences for
    # ``before_eviction``: its rows are sequences that must each do what they do alone
    # (a draw per row is the one a sequence alone makes), not one batch of rows
    rows_alone = False

    def packs_now(self) -> bool:
        """Whether this sequence's cache may join a packed batch now."""
        return True

    def before_eviction(self, inputs: ScoreInputs) -> None:
        """What a method does to its kept rows before an eviction takes the lowest scored
        (CaM merges the leaving tokens into the kept ones); nothing by default. A packed
        batch runs it on the sequences due, grouped by their rows and positions."""

    @classmethod
    def packed_layout(cls):
        from .batch import EvictionPacked  # evict/batch.py imports this module

        return EvictionPacked if EvictionPacked.accepts(cls) else None

    def _init_storage(self) -> None:
        self.options = self.config.options
        self.store = slot_store(self.config, ("keys", "values", "positions", *self.token_state))
        if isinstance(self.store, QuantizedSlots):
            self.store.keeps_weights = self.reads_step_weights
        self.window_queries = None  # (B, Hq, <= window, D) during a prefill
        self.in_prompt = True  # the last update was a prompt chunk (or nothing came yet)
        self.decode_steps = 0  # single-token steps since the last prefill ended
        self.evicting = True  # False after ``stop_evicting``: every later token is kept
        self.padded = False  # some slots are padding (per-head budgets): attention masks them
        self.padded_rows = 0  # slots per head under per-head budgets (the largest budget)

    # -- the options' roles --------------------------------------------------------------
    def _option(self, role: str, default: int = 0) -> int:
        name = getattr(self.roles, role)
        return default if name is None else getattr(self.options, name)

    @property
    def budget(self) -> int:
        """Tokens kept per KV head: the options' budget, or this layer's from the context."""
        per_layer = getattr(self.context, "layer_budgets", None) or {}
        return per_layer.get(self.layer, self._option("budget"))

    @property
    def n_sink(self) -> int:
        return self._option("n_sink")

    @property
    def recent(self) -> int:
        return max(self._option("recent"), min(self.recent_floor, self.budget // 4))

    @property
    def window(self) -> int:
        return self._option("window")

    # -- what a method provides ---------------------------------------------------------------
    def score(self, inputs: ScoreInputs) -> mx.array:
        raise NotImplementedError

    def head_budgets(self, inputs: ScoreInputs) -> mx.array | None:
        """Tokens each KV head keeps, (B, Hkv) int32, when heads differ; None: ``budget``
        for every head. Heads below the largest budget hold padding slots (position -1,
        never attended, counted in ``nbytes``: they are stored)."""
        return None

    def new_token_state(self, keys: mx.array, values: mx.array) -> dict[str, mx.array]:
        """Initial per-token state of new tokens (B, Hkv, N); zeros unless overridden."""
        b, h, n, _ = keys.shape
        return {name: _zeros((b, h, n)) for name in self.token_state}

    def observe(self, inputs: ScoreInputs) -> None:
        """After every attention call: accumulate ``token_state`` (default: nothing)."""

    def key_room(self) -> mx.array | None:
        """Every slot's keys over the buffer's whole room (rows past ``store.rows``: spare
        room), dequantized where the store is packed; None before there is a buffer. A
        decode step's compiled score over it (rows past the count masked) keeps one shape
        until the buffer grows, so it is traced again only then, and the layers of a step
        replay one trace."""
        if isinstance(self.store, QuantizedSlots):
            return self.store.room_keys()
        return self.store.arrays["keys"].buffer

    # -- storage ---------------------------------------------------------------------------
    @property
    def stored_length(self) -> int:
        """Tokens kept per KV head (under per-head budgets, by the head that keeps most)."""
        if not self.padded:
            return self.store.kept
        return int(self._valid_slots().sum(axis=-1).max())

    def _valid_slots(self) -> mx.array:
        """Slots holding a kept token: not padding, not the freed slot."""
        positions = self.store.view("positions")
        valid = positions >= 0
        if self.store.free is not None:
            valid = valid & (mx.arange(positions.shape[2]) != self.store.free[..., None])
        return valid

    def _arrays(self) -> dict[str, Any]:
        return {**self.store.arrays, **getattr(self.store, "side_arrays", {}),  # quantized_slots' ring
                "free_slot": self.store.free, "window_queries": self.window_queries}

    def _restore_arrays(self, arrays: dict[str, Any]) -> None:
        self.store.restore(arrays, arrays.get("free_slot"))
        self.window_queries = arrays.get("window_queries")

    def _meta(self) -> dict[str, Any]:
        return {"in_prompt": self.in_prompt, "decode_steps": self.decode_steps,
                "padded": self.padded, "padded_rows": self.padded_rows,
                **({} if self.evicting else {"evicting": False}),
                **getattr(self.store, "meta", {})}

    def _restore_meta(self, meta: dict[str, Any]) -> None:
        self.in_prompt = bool(meta["in_prompt"])
        self.decode_steps = int(meta["decode_steps"])
        self.padded, self.padded_rows = bool(meta["padded"]), int(meta["padded_rows"])
        self.evicting = bool(meta.get("evicting", True))
        if isinstance(self.store, QuantizedSlots):
            self.store.restore_meta(meta)

    @property
    def kept_positions(self) -> mx.array | None:
        """Positions of the kept tokens, sorted, per sequence and KV head; None before any eviction."""
        if self.stored_length == self.offset:
            return None
        gone = mx.iinfo(mx.int32).max  # freed and padding slots sort last
        kept = mx.sort(mx.where(self._valid_slots(), self.store.view("positions"), gone), axis=-1)
        kept = kept[..., : self.stored_length]
        return mx.where(kept == gone, -1, kept) if self.padded else kept

    # -- the protocol ------------------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        self._expect_attend()
        self._check_shape(keys, values)
        n = keys.shape[2]
        if self.schedule.decode_every and self.evicting:  # steady state: the budget plus the steps between scorings
            self.store.set_limit(self.budget + self.schedule.decode_every)
        self.store.write({"keys": keys, "values": values, **self.new_token_state(keys, values)},
                         first_position=self.offset)
        self.offset += n
        if self._packed_step(n):  # attend reads the packed rows: no dequantized views to build
            return keys, values
        return self.store.view("keys"), self.store.view("values")

    def _packed_step(self, n: int) -> bool:
        """A decode token over kept rows held quantized: ``update_and_fetch`` returns the
        token's own rows and ``attend`` reads the store."""
        return n == 1 and isinstance(self.store, QuantizedSlots) and self.store.quantized

    def _rows_returned(self, n_new: int) -> int:
        return self.store.rows + n_new - (self.store.free is not None and n_new > 0)

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        self._awaiting_attend = False
        n = queries.shape[2]
        prefill_end = n == 1 and self.in_prompt
        packed = self._packed_step(n)
        if packed and (self.padded or sinks is not None):  # update_and_fetch gave the token's rows
            keys, values = self.store.view("keys"), self.store.view("values")
        if packed and not self.padded and sinks is None:
            out = self.store.attend_one(queries, scale, self.offset)  # reads the packed rows
        elif self.padded and n == 1 and sinks is None:
            # every kept position precedes the query: only the padding (position -1) is hidden,
            # without MLX's masked fused attention (5-10x its unmasked time on CUDA)
            out = held_rows_decode_attention(queries, keys, values, self.store.view("positions"), scale=scale)
        else:  # full precision, or a quantized store's rows dequantized (a prompt chunk)
            if self.padded:  # some heads keep fewer tokens: their padding slots are masked
                mask = self._padding_mask(queries)
            elif isinstance(mask, mx.array):  # mlx-lm's mask is sized by layer 0's rows
                mask = causal_mask(queries.shape[2], keys.shape[2])
            out = mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=scale, mask=mask, sinks=sinks
            )
        if self.window and (n > 1 or prefill_end or self.window_in_decode):
            q = queries if self.window_queries is None else mx.concatenate([self.window_queries, queries], 2)
            self.window_queries = mx.contiguous(q[:, :, -self.window :])  # a view would pin all of q
        inputs = ScoreInputs(self, queries, scale)
        self.observe(inputs)
        if self._scores_now(n, prefill_end):
            self._evict(inputs, decode_step=n == 1 and not prefill_end)
        if prefill_end and not self.window_in_decode:
            self.window_queries = None
        if prefill_end and isinstance(self.store, QuantizedSlots):
            self.store.pack(self.recent)  # scored over the model's own keys: now the kept ones are quantized
        self.in_prompt = n > 1
        return mx.depends(out, self._step_writes() + self._queries_kept())

    def _queries_kept(self) -> list[mx.array]:
        """Queries this step keeps for later scoring, each a copy of a few rows of the
        step's queries: computed with the step's output, so that no layer's whole queries
        stay alive until the state is evaluated (a prompt chunk's peak held every layer's
        otherwise)."""
        return [] if self.window_queries is None else [self.window_queries]

    def _step_writes(self) -> list[mx.array]:
        """What a step writes: generate_step evaluates only the logits, so a slot write
        attention did not read (positions, token state) would stay lazy and chain onto the
        next step's; attention's output depends on these (one node a layer)."""
        written = self.store.buffers()
        if self.store.free is not None:
            written.append(self.store.free)
        return written

    def _padding_mask(self, queries) -> mx.array:
        """Causal by position, padding (position -1) hidden: (B, Hq, N, rows)."""
        positions = self.store.view("positions")
        n, offset = queries.shape[2], self.offset
        q = mx.arange(offset - n, offset)[None, None, :, None]
        k = positions[:, :, None, :]
        visible = (k >= 0) & (k <= q)
        return mx.repeat(visible, queries.shape[1] // positions.shape[1], axis=1)

    def stop_evicting(self) -> None:
        """Keep every token from here on: no scoring, no eviction, no budget. The
        leaderboard's question-after protocol (kvpress's pipeline): the context is
        compressed as the method does, then the question is read and the answer written
        with nothing more evicted."""
        self.evicting = False
        self.store.set_limit(None)

    def _scores_now(self, n: int, prefill_end: bool) -> bool:
        s = self.schedule
        if not self.evicting:
            return False
        if prefill_end:
            self.decode_steps = 0
            return s.prefill_end
        if n > 1:
            return s.chunks
        self.decode_steps += 1
        return bool(s.decode_every) and self.decode_steps % s.decode_every == 0

    def protected(self, positions: mx.array) -> mx.array:
        """Tokens never evicted: the sinks and the ``recent`` newest tokens."""
        keep = positions < self.n_sink
        if self.recent:
            keep = keep | (positions >= self.offset - self.recent)
        return keep

    def _evict(self, inputs: ScoreInputs, decode_step: bool) -> None:
        """Keep the ``budget`` best tokens: at a decode step by freeing the worst one's slot
        (one token over budget), otherwise by gathering the kept ones (one copy)."""
        per_head = self.head_budgets(inputs)
        if per_head is not None:
            return self._evict_per_head(inputs, per_head, decode_step)
        budget, rows = self.budget, self.store.rows
        if rows <= budget:
            return
        scores = mx.where(self.protected(inputs.positions), float("inf"), self.score(inputs))
        b, h = inputs.positions.shape[:2]
        if decode_step and rows == budget + 1:
            self.store.evict_one(mx.broadcast_to(mx.argmin(scores, axis=-1), (b, h)))
        else:
            slots = mx.broadcast_to(top_k_sorted(scores, budget), (b, h, budget))
            self.store.keep(slots, spare=self.schedule.decode_every)

    def _evict_per_head(self, inputs: ScoreInputs, per_head: mx.array, decode_step: bool) -> None:
        """Head h keeps ``per_head[b, h]`` tokens; slots are shared, the rest is padding."""
        positions = inputs.positions
        b, h, rows = positions.shape
        per_head = mx.broadcast_to(per_head.astype(mx.int32), (b, h))
        self.padded_rows = self.padded_rows or int(per_head.max())
        capacity = self.padded_rows
        padding = positions < 0
        scores = mx.where(self.protected(positions), float("inf"), self.score(inputs))
        scores = mx.broadcast_to(scores, (b, h, rows))
        if decode_step:
            over = (rows - padding.sum(axis=-1)) > per_head
            worst = mx.argmin(mx.where(padding, float("inf"), scores), axis=-1)
            if rows == capacity + 1:  # the next token takes a slot: the worst, or padding
                self.store.evict_one(mx.where(over, worst, mx.argmax(padding, axis=-1)))
            else:  # room to grow: a head over its budget turns its worst token into padding
                dropped = (mx.arange(rows) == worst[..., None]) & over[..., None]
                self.store.update("positions", mx.where(dropped, -1, positions))
        else:  # the best of each head, up to its own budget; the rest of its slots padding
            ranked = mx.where(padding, -float("inf"), scores)
            slots = top_k_sorted(ranked, min(capacity, rows))
            chosen = mx.take_along_axis(ranked, slots, axis=-1)
            rank = mx.argsort(mx.argsort(-chosen, axis=-1), axis=-1)
            self.store.keep(slots, spare=self.schedule.decode_every)
            kept = self.store.view("positions")
            self.store.update("positions", mx.where(rank < per_head[..., None], kept, -1))
        self.padded = True

    # -- a saved state must agree with itself and its config --------------------------------
    def _layout_problems(self):
        if isinstance(self.store, QuantizedSlots) and self.kv_shape is not None:
            yield from self.store.layout_problems(self.kv_shape[2:])

    def _state_problems(self):
        rows = {name: grown.length for name, grown in self.store.arrays.items()}
        if len(set(rows.values())) > 1:
            yield "rows of the kept arrays", rows, "one slot count for all"
            return
        positions = self.store.view("positions")
        if positions is None or not positions.size:
            return
        held = mx.where(positions < 0, mx.iinfo(mx.int32).max, positions) if self.padded else positions
        low, newest = int(held.min()), int(positions.max())
        if low < 0 or newest >= self.offset:
            yield "kept positions", f"[{low}, {newest}]", f"within [0, offset {self.offset})"
            return
        if self.store.free is not None and not 0 <= int(self.store.free.max()) < self.store.rows:
            yield "free slot", int(self.store.free.max()), f"a slot below {self.store.rows}"
        if self._newest_token_held() and newest != self.offset - 1:
            yield "offset", self.offset, f"{newest + 1}, one past the newest token held (position {newest})"
        expected = self._expected_kept()
        if expected is not None and self.stored_length != expected:
            yield "stored tokens", self.stored_length, (
                f"{expected} for budget {self.budget} at offset {self.offset} "
                f"({self.decode_steps} decode steps since the prompt)")

    def _newest_token_held(self) -> bool:
        """Whether the last update's token is still in a slot (kept, or in the free slot
        that a decode step's eviction leaves it in until the next write)."""
        if self.recent:  # protected from every eviction
            return True
        if self.padded:  # per-head choices (kvzip's pass among them) may drop it in a head
            return False
        if self.in_prompt:  # a prompt chunk is appended; only chunk scoring may drop it
            return not self.schedule.chunks
        return self.decode_steps > 0

    def _expected_kept(self) -> int | None:
        """Tokens kept per head after the last update, where the schedule fixes it."""
        if self.in_prompt or self.padded or not self.kept_count_follows_budget or not self.evicting:
            return None
        prompt = self.offset - self.decode_steps  # evicted once at the prompt's end, then appends
        every = self.schedule.decode_every
        # down to the budget at each scoring step (every ``every`` steps), appends between
        since = self.decode_steps % every if every else self.decode_steps
        return min(self.budget, self.offset - since) + since

    # -- trim: exact only while nothing was evicted ------------------------------------------
    def is_trimmable(self) -> bool:
        # quantized slots: only while every token is still held exactly (in the ring), or a
        # reused prefix would differ from a fresh cache's full-precision prompt
        exact = not isinstance(self.store, QuantizedSlots) or self.store.exact_history(self.stored_length)
        return self.stored_length == self.offset and not (self.state_from_queries and self.offset) and exact

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        n = min(n, self.offset)
        self.store.truncate(self.store.rows - n)
        self.offset -= n
        # A cache is trimmed to be reused for a new prompt (the server's prompt cache,
        # mlx-lm's rewind): the next single token ends that prompt, it is not a decode step.
        self.in_prompt = self.in_prompt or n > 0
        if self.window_queries is not None:
            left = self.window_queries.shape[2] - n
            self.window_queries = self.window_queries[:, :, :left] if left > 0 else None
        return n
