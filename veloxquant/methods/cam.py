"""CaM: cache merging. A token that leaves the cache is merged into the kept ones, not dropped.

Layout (the official code's, StreamingLLM's): the ``cam_n_sink`` first tokens and the
newest ``cam_budget - cam_n_sink``, so the score is recency. It scores when the prompt is
in and every ``EVICT_EVERY`` decode steps (``evict/base.py``; CaM acts at every generation
step, one token leaving each time: here the ``EVICT_EVERY`` oldest leave at once and are
merged as the prompt's end merges its middle, below, with that step's query; a step in
between writes and attends over up to budget + ``EVICT_EVERY`` tokens, exact). A token e
that leaves has, before its slot is freed, its value sent to targets j among the kept
non-sink tokens (never a sink), in float32, rounded once into the stored dtype:

    v_j <- v_j + M * w_j * v_e        (keys are never touched, unless cam_merge_keys)

ā is the attention of this update's last query over every stored token (the step in
which e is still visible), averaged over the query heads of a KV head; m = 32 targets
(the official ``merge_budget``), fewer if fewer are kept.

- weights ``cam_merge``: 'uniform' (CaM) w_j = 1/m on the m tokens right after e (the
  oldest kept ones); 'sim_weighted' (inferred) c_j = cos(k_e, k_j) per KV head, the m
  targets of largest c_j, w_j = max(c_j, 0) / sum (all <= 0: 1/m on the m oldest, gated
  by their mean); 'none' merges nothing (plain eviction in this layout, bit for bit).
- gate p = clamp(ā_e / d, 0, 1): d = the mean of ā over the kept window ('uniform': the
  official code's mean over the recent window, where the card writes the targets' mean)
  or sum_j w_j ā_j ('sim_weighted', the card's weighted mean). As the official code: a
  0/0 ratio gives 0, x/0 (inf) gives 1. ``cam_merge_gate``: M ~ Bernoulli(p), drawn as
  u < p with u uniform from an explicit key of (``gate_seed``, layer, the query's
  position), never the global seed, so runs, copies and reloads reproduce (the spec has
  no seed field: ``gate_seed`` is 0 and travels with the state); False: M = p, the
  expectation (inferred; the card's unbiased reading, not "always merge").
- ``cam_merge_keys`` (inferred): k_j <- k_j + M w_j λ_j (k_e - k_j), λ_j = ā_e/(ā_e + ā_j),
  a convex pull (an added key would blow its norm up).

The prompt's end (adapted): a prompt longer than the budget loses its middle at once.
The official code drops those tokens unmerged; here they are merged too ("merge, not
drop"), vectorised: each goes straight into the kept window by the same rule and gate,
with the last prompt query's attention (the cascade of one eviction per step, through
tokens that are themselves about to leave, is not replayed). Several victims pulling one
key pull it toward their weighted mean with strength min(1, their summed pull): convex.
Victims are taken in blocks, so the victim x window weights stay bounded.

A packed batch (``evict/batch.py``) merges before its eviction step as each sequence alone:
``before_eviction`` on a cache over each group of due sequences that hold as many slots at
the same position (``rows_alone``: each row draws the gate its sequence draws alone).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..evict.base import EVICT_EVERY, Roles, Schedule, ScoredEvictionCache
from ..evict.prng import step_key
from ..evict.select import gather_tokens

MERGE_TARGETS = 32  # m, the official code's merge_budget
MERGE_ELEMENTS = 2**22  # victim x target weights per block at the prompt's end (16 MiB)


def cosine(k_e: mx.array, k: mx.array) -> mx.array:
    """cos(k_e, k_j), float32: k_e (B, H, nb, D), k (B, H, n, D) -> (B, H, nb, n)."""
    a, b = k_e.astype(mx.float32), k.astype(mx.float32)
    dots = a @ b.swapaxes(-1, -2)
    norms = mx.linalg.norm(a, axis=-1)[..., None] * mx.linalg.norm(b, axis=-1)[..., None, :]
    return mx.where(norms > 0, dots / mx.where(norms > 0, norms, 1.0), 0.0)


def merge_weights(mode: str, cos: mx.array | None, shape: tuple[int, ...], m: int):
    """Targets (indices into the kept window, oldest first) and weights: (*shape, m) each."""
    oldest = mx.broadcast_to(mx.arange(m), (*shape, m))
    uniform = mx.full((*shape, m), 1.0 / m)
    if mode == "uniform":
        return oldest, uniform
    idx = mx.argpartition(-cos, kth=m - 1, axis=-1)[..., :m]
    c = mx.maximum(mx.take_along_axis(cos, idx, axis=-1), 0.0)
    total = c.sum(axis=-1, keepdims=True)
    fallback = total <= 0  # no target points the victim's way
    return (mx.where(fallback, oldest, idx),
            mx.where(fallback, uniform, c / mx.where(fallback, 1.0, total)))


def merge_gate(a_e: mx.array, mean: mx.array) -> mx.array:
    """p = clamp(ā_e / mean, 0, 1); 0/0 -> 0, x/0 -> 1."""
    ratio = a_e / mean
    return mx.clip(mx.where(mx.isnan(ratio), 0.0, ratio), 0.0, 1.0)


def merge_plan(mode: str, merge_keys: bool, cos, a_e, a_w, u, m):
    """Victims (B, H, nb): targets (B, H, nb, m) in the window, M * w_j, and the keys'
    pull M * w_j * λ_j (None unless ``merge_keys``)."""
    idx, w = merge_weights(mode, cos, a_e.shape, m)
    a_j = mx.take_along_axis(mx.broadcast_to(a_w[:, :, None], (*a_e.shape, a_w.shape[-1])), idx, -1)
    mean = (w * a_j).sum(-1) if mode == "sim_weighted" else a_w.mean(-1, keepdims=True)
    p = merge_gate(a_e, mean)
    coef = (p if u is None else (u < p).astype(mx.float32))[..., None] * w
    if not merge_keys:
        return idx, coef, None
    lam = a_e[..., None] / (a_e[..., None] + a_j)
    return idx, coef, coef * mx.where(mx.isnan(lam), 0.0, lam)


@functools.lru_cache(maxsize=None)
def _block_fn(mode: str, merge_keys: bool, m: int):
    """One block of victims' contribution to the window, compiled: (the values' increment,
    the keys' pull-weighted sum and the pulls' sum; zeros without ``merge_keys``), from
    (keys, values, victim ids, the window's keys, ā, the window's ā[, the gate's draws])."""

    def contribution(keys, values, ids, k_w, a, a_w, u=None):
        b, h, n_w = a_w.shape
        k_e, v_e = gather_tokens(keys, ids), gather_tokens(values, ids)
        cos = cosine(k_e, k_w) if mode == "sim_weighted" else None
        idx, coef, pull = merge_plan(mode, merge_keys, cos, mx.take_along_axis(a, ids, -1), a_w, u, m)
        zeros = mx.zeros((b, h, ids.shape[-1], n_w), mx.float32)  # victims x window
        dv = mx.put_along_axis(zeros, idx, coef, axis=-1).swapaxes(-1, -2) @ v_e.astype(mx.float32)
        if pull is None:
            return dv, mx.zeros(k_w.shape, mx.float32), mx.zeros((b, h, n_w), mx.float32)
        dense = mx.put_along_axis(zeros, idx, pull, axis=-1)
        return dv, dense.swapaxes(-1, -2) @ k_e.astype(mx.float32), dense.sum(axis=-2)

    return mx.compile(contribution)


class CaMCache(ScoredEvictionCache):
    roles = Roles(budget="cam_budget", n_sink="cam_n_sink")
    schedule = Schedule(prefill_end=True, decode_every=EVICT_EVERY)
    batchable = True
    same_at_decode = ("_evict",)  # the base's after ``before_eviction``, which a packed batch runs
    gate_seed = 0  # the spec has no seed field: a fixed seed, kept in the saved state

    def score(self, inputs):  # recency: the oldest non-sink token leaves first
        return inputs.positions.astype(mx.float32)

    def _meta(self):
        return {**super()._meta(), "gate_seed": self.gate_seed}

    def _restore_meta(self, meta):
        super()._restore_meta(meta)
        self.gate_seed = int(meta.get("gate_seed", CaMCache.gate_seed))

    def before_eviction(self, inputs):
        if self.options.cam_merge != "none" and self.store.rows > self.budget:
            self._merge(inputs)

    def _evict(self, inputs, decode_step):
        self.before_eviction(inputs)
        super()._evict(inputs, decode_step)  # frees (or gathers away) the same victims

    def _merge(self, inputs):
        """Merge the tokens about to leave into the kept window, while their slots hold them."""
        gone, s = self.store.rows - self.budget, self.n_sink
        order = mx.argsort(inputs.positions, axis=-1)  # sinks, the victims, the kept window
        victims, window = order[..., s : s + gone], order[..., s + gone :]
        a = inputs.last_query_weights.mean(axis=2)  # ā: (B, H, rows) float32
        u = None
        if self.options.cam_merge_gate:  # one draw per sequence, KV head and victim
            key = step_key(self.gate_seed, self.layer, self.offset - 1)  # this query's position
            shape = (1, *victims.shape[1:]) if self.rows_alone else victims.shape
            u = mx.broadcast_to(mx.random.uniform(shape=shape, key=key), victims.shape)
        merge = self._merge_one if gone == 1 else self._merge_many
        merge(inputs.keys, inputs.values, victims, window, a, u, min(MERGE_TARGETS, window.shape[-1]))

    def _merge_one(self, keys, values, victim, window, a, u, m):
        """A decode step: the victim's m targets are the only rows written."""
        k_e, v_e = gather_tokens(keys, victim), gather_tokens(values, victim)
        cos = None
        if self.options.cam_merge == "sim_weighted":  # over every stored key, then the window's
            cos = mx.take_along_axis(cosine(k_e, keys), window[:, :, None], axis=-1)
        a_w = mx.take_along_axis(a, window, axis=-1)
        o = self.options
        idx, coef, pull = merge_plan(o.cam_merge, o.cam_merge_keys, cos, mx.take_along_axis(a, victim, -1), a_w, u, m)
        slots = mx.take_along_axis(window, idx[:, :, 0], axis=-1)  # (B, H, m)
        self._put_rows("values", slots, gather_tokens(values, slots).astype(mx.float32)
                       + coef[:, :, 0, :, None] * v_e.astype(mx.float32))
        if pull is not None:
            k = gather_tokens(keys, slots).astype(mx.float32)
            self._put_rows("keys", slots, k + pull[:, :, 0, :, None] * (k_e.astype(mx.float32) - k))

    def _merge_many(self, keys, values, victims, window, a, u, m):
        """Every victim straight into the window, in blocks of victims (a decode step's
        ``EVICT_EVERY`` victims are one block: one compiled pass, traced once)."""
        k_w, v_w = gather_tokens(keys, window), gather_tokens(values, window)
        a_w = mx.take_along_axis(a, window, axis=-1)
        b, h, n_w = window.shape
        gone = victims.shape[-1]
        block = max(1, MERGE_ELEMENTS // (b * h * n_w))
        merge_keys = self.options.cam_merge_keys
        contribution = _block_fn(self.options.cam_merge, merge_keys, m)
        dv = k_num = k_sum = None
        for start in range(0, gone, block):
            ids = victims[..., start : start + block]
            drawn = () if u is None else (u[..., start : start + block],)
            parts = contribution(keys, values, ids, k_w, a, a_w, *drawn)
            dv, k_num, k_sum = parts if dv is None else [x + y for x, y in zip((dv, k_num, k_sum), parts)]
            if start + block < gone:  # bound the graph: one block's weights at a time
                mx.eval(dv, k_num, k_sum)
        self._put_rows("values", window, v_w.astype(mx.float32) + dv)
        if merge_keys:  # toward the pull-weighted mean, at most all the way
            strength = mx.minimum(k_sum, 1.0) / mx.where(k_sum > 0, k_sum, 1.0)
            k = k_w.astype(mx.float32)
            self._put_rows("keys", window, k + strength[..., None] * (k_num - k_sum[..., None] * k))

    def _put_rows(self, name, slots, rows):
        """Overwrite the rows at ``slots`` (B, H, n) of one stored array."""
        grown = self.store.arrays[name]
        rows = rows.astype(grown.buffer.dtype)  # float32 arithmetic, rounded once
        grown.buffer = mx.put_along_axis(grown.buffer, slots[..., None], rows, axis=2)
