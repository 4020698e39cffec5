"""RocketKV: SnapKV-style eviction once, then top-k sparse attention over key pages.

Budgets, from c = ``rocketkv_compression_ratio`` and the L tokens seen when a prompt ends
(the official ``get_params_for_token_budget``, with the token budget tau = L / c):
alpha = min(0.2 + 0.06 log2 c, 0.8); stage 1 keeps C1 = floor(L / c^alpha); with
c2 = max(1, C1 / tau), pages hold P = min(floor(c2), ceil(sqrt(c2))) tokens, the
approximate scores use r = min(d, max(1, round(d P / c2))) of the d head dimensions, and
a step attends to k2 = min(round(tau / 2), C1) tokens' worth of pages.

Stage 1 scores once, when the prompt is in (mlx-lm sends its last token alone): SnapKV's
vote (``window_vote``: the last ``rocketkv_obs_window`` queries' softmax attention over
all keys, causal inside the window, summed over the window), max-pooled with kernel 63;
the window and the ``rocketkv_n_sink`` sinks are kept, with the best other tokens up to
C1. Then the kept keys are cut into pages of P consecutive slots (the compacted kept
sequence), each summarised by its element-wise min and max key, stored at the model's
dtype and counted in ``nbytes``; each decode token updates its page or opens one.

Stage 2 runs at every decode step and evicts nothing (the cache grows by the decoded
tokens): this cache owns the step's attention. Per KV head with group queries q_j:
I1 = the r dims of largest sum_j |q_j|; on each, the page proxy is its max key if
sum_j q_j > 0, else its min (an upper bound of q.k there); x_j[p] = q_j[I1] . proxy[p];
s_j = softmax over tokens (a page's value for each of its tokens) of x_j / t_j with
t_j = sqrt(d sum_I1 |q_j| / sum |q_j|); the ceil(k2 / P) pages of largest sum_j s_j are
gathered, and the step attends exactly (scale 1/sqrt(d)) to their tokens only. When those
pages are every page, attention runs over every kept token: exact.

Adapted: sinks are protected in stage 1; C1 is at least sinks + window (the official
code asserts instead), a per-layer budget from the model context replaces C1; GQA heads
are averaged in the vote (the official code sums: the same ranking); pages are chosen
whole, the official top-k2 tokens by page score cut the last page at arbitrary tokens;
no reservation for generated tokens. ``rocketkv_page_size`` and ``rocketkv_head_topk1``
replace P and r (a given P enters r's formula); r above head_dim is refused. With P = 1
the stored keys are the pages (no copy; the official code keeps a transposed one).
"""

from __future__ import annotations

import functools
import json
import math

import mlx.core as mx

from ...cache.buffers import GrowingArray
from ...evict.base import Roles, Schedule, ScoredEvictionCache
from .window_vote import window_vote

POOL_KERNEL = 63  # max-pool, the official stage-1 kernel
TOKEN_STEP = 256  # the kept keys' growth step (SlotStore's), in tokens


def capacity(n_tokens: int, ratio: float) -> int:
    """C1 = floor(L / c^alpha): what stage 1 keeps of ``n_tokens``."""
    alpha = min(0.2 + 0.06 * math.log2(ratio), 0.8)
    return int(n_tokens / ratio**alpha)


def stage2_plan(n_tokens, ratio, head_dim, kept, page_size=None, topk1=None) -> tuple[int, int, int]:
    """(P, r, k2) for a prompt of ``n_tokens`` of which stage 1 kept ``kept``."""
    tau = n_tokens / ratio
    c2 = max(1.0, kept / tau)
    p = page_size or min(math.floor(c2), math.ceil(math.sqrt(c2)))
    r = topk1 or min(head_dim, max(1, round(head_dim * p / c2)))
    return p, r, max(1, min(round(tau / 2), kept))


def approximate_logits(queries, pages, r):
    """x_j[p] = q_j[I1] . proxy[p] (B, Hkv, G, pages), float32, with the softmax temperature
    t_j (B, Hkv, G, 1) and I1 (B, Hkv, r, 1). queries (B, Hq, 1, D); ``pages`` (B, Hkv, 2D,
    pages): each page's min key over its D rows, then its max (D rows: single-token pages,
    the keys themselves)."""
    q_r, index, t, dims = _query_side(pages.shape[1], r, pages.shape[2] == queries.shape[-1])(queries)
    proxy = mx.take_along_axis(pages, index, axis=2).astype(mx.float32)  # (B, Hkv, r, pages)
    return q_r @ proxy, t, dims


@functools.lru_cache(maxsize=None)
def _query_side(hkv: int, r: int, keys_are_pages: bool):
    """What the approximate logits take of the query alone, compiled (one call for some
    twenty operations a step; the query's shape is the same at every step, so it is
    traced once): q_j[I1] (B, Hkv, G, r) float32, the proxy rows to gather (B, Hkv, r, 1),
    the temperature t_j (B, Hkv, G, 1) and I1 (B, Hkv, r, 1)."""

    def side(queries):
        b, hq, _, d = queries.shape
        q = queries.reshape(b, hkv, hq // hkv, d).astype(mx.float32)
        magnitude = mx.abs(q)
        dims = mx.argpartition(-magnitude.sum(axis=2), kth=r - 1, axis=-1)[..., :r]  # I1
        q_r = mx.take_along_axis(q, dims[:, :, None], axis=-1)  # (B, Hkv, G, r)
        index = dims if keys_are_pages else dims + d * (q_r.sum(axis=2) > 0)  # max if the group leans up
        t = mx.sqrt(d * mx.abs(q_r).sum(-1, keepdims=True) / mx.maximum(magnitude.sum(-1, keepdims=True), 1e-30))
        return q_r, index[..., None], mx.maximum(t, 1e-30), dims[..., None]

    return mx.compile(side)


def page_scores(queries, pages, r, counts) -> mx.array:
    """sum over a KV group's queries of the approximate softmax of one token of each page
    (a page's logit stands for each of its ``counts`` tokens): (B, Hkv, pages)."""
    q_r, index, t, _ = _query_side(pages.shape[1], r, pages.shape[2] == queries.shape[-1])(queries)
    return _page_scores(q_r, index, t, pages, counts)


def _page_scores(q_r, index, t, pages, counts) -> mx.array:
    proxy = mx.take_along_axis(pages, index, axis=2).astype(mx.float32)  # (B, Hkv, r, pages)
    logits = (q_r @ proxy) / t
    lse = mx.logsumexp(logits + mx.log(counts.astype(mx.float32)), axis=-1, keepdims=True)
    return mx.exp(logits - lse).sum(axis=2)


@functools.lru_cache(maxsize=8)
def _page_starts(p: int, n_pages: int) -> mx.array:
    """``p arange(n_pages)`` int32: each page's first row (built when a page opens; a
    shapeless compiled page choice was tried instead and crashed at one query head per KV
    head: not kept)."""
    return p * mx.arange(n_pages)


@mx.compile
def _opened_page(key):
    """A page of one token (B, Hkv, 2D, 1): its key as both the min and the max."""
    column = key.swapaxes(-1, -2)  # (B, Hkv, D, 1)
    return mx.concatenate([column, column], axis=2)


@mx.compile
def _joined_page(page, key):
    """The last page (B, Hkv, 2D, 1) with the token's key joined to its min and max."""
    column = key.swapaxes(-1, -2)
    d = column.shape[2]
    return mx.concatenate([mx.minimum(page[:, :, :d], column), mx.maximum(page[:, :, d:], column)], axis=2)


@functools.lru_cache(maxsize=None)
def _page_slots(p: int, repeats: int, masked: bool):
    """The stored slots of the chosen pages (B, Hkv, n P, 1), compiled (the chosen pages'
    shape is the same at every step); ``masked`` (the last page not full): also the mask
    of the slots up to the ``rows`` stored (B, Hq, 1, n P), the slots past them clamped to
    the last."""

    def slots_of(pages, rows=None):
        slots = (pages[..., None] * p + mx.arange(p)).reshape(*pages.shape[:2], -1)
        if not masked:
            return slots[..., None]
        mask = mx.repeat((slots < rows)[:, :, None], repeats, axis=1)
        return mx.minimum(slots, rows - 1)[..., None], mask

    return mx.compile(slots_of)


class RocketKVCache(ScoredEvictionCache):
    # the compression ratio is what sets the budget (``budget`` derives it)
    roles = Roles(budget="rocketkv_compression_ratio", n_sink="rocketkv_n_sink",
                  recent="rocketkv_obs_window", window="rocketkv_obs_window")
    schedule = Schedule(prefill_end=True)
    kept_count_follows_budget = False  # the budget is a ratio of the tokens seen
    batchable = "stacked"  # its rows never mix: sequences in the same state share one cache (cache/stacked.py)

    def _init_storage(self) -> None:
        super()._init_storage()
        self.pages = GrowingArray(axis=3, geometric=True)  # (B, Hkv, 2D, pages): min keys, then max keys
        self.paged_rows = 0  # the stored rows the pages summarise
        self.plan = None  # (P, r, k2), fixed when a prompt ends

    @property
    def budget(self) -> int:
        """Stage 1's C1 for the tokens seen so far (at least sinks + window), or the layer's
        budget from the model context."""
        per_layer = getattr(self.context, "layer_budgets", None) or {}
        if self.layer in per_layer:
            return per_layer[self.layer]
        return max(capacity(self.offset, self.options.rocketkv_compression_ratio), self.n_sink + self.window)

    def score(self, inputs):
        return window_vote(inputs, POOL_KERNEL)

    # -- stage 1, at a prefill end: evict, then summarise the kept keys in pages ---------------
    def _evict(self, inputs, decode_step):
        super()._evict(inputs, decode_step)
        o = self.options
        self._set_plan(stage2_plan(self.offset, o.rocketkv_compression_ratio, inputs.keys.shape[-1],
                                   self.store.kept, o.rocketkv_page_size, o.rocketkv_head_topk1))
        self._build_pages()

    def stop_evicting(self) -> None:
        """The base's, and stage 2 off: decode steps attend to every kept token (its pages
        summarise the tokens kept at the prompt's end only)."""
        super().stop_evicting()
        self._set_plan(None)
        self.pages.reset(None)

    def _set_plan(self, plan) -> None:
        self.plan = None if plan is None else tuple(plan)
        if plan is not None:  # pages grow by room for TOKEN_STEP tokens, as the kept keys do
            self.pages.step = max(1, TOKEN_STEP // plan[0])

    def _build_pages(self) -> None:
        keys, p = self.store.view("keys"), self.plan[0]
        self.paged_rows = rows = keys.shape[2]
        if p == 1:  # the keys are the pages
            return self.pages.reset(None)
        b, h, _, d = keys.shape
        n_pages = -(-rows // p)
        pad = [(0, 0), (0, 0), (0, n_pages * p - rows), (0, 0)]
        lo = mx.pad(keys, pad, constant_values=float("inf")).reshape(b, h, n_pages, p, d).min(axis=3)
        hi = mx.pad(keys, pad, constant_values=-float("inf")).reshape(b, h, n_pages, p, d).max(axis=3)
        self.pages.reset(mx.contiguous(mx.concatenate([lo, hi], axis=-1).swapaxes(-1, -2)))

    def update_and_fetch(self, keys, values):
        topk1 = self.options.rocketkv_head_topk1
        if topk1 is not None and topk1 > keys.shape[-1]:
            raise ValueError(f"rocketkv_head_topk1={topk1!r}: the model's head_dim is {keys.shape[-1]}; "
                             f"allowed: 1 to {keys.shape[-1]} or None")
        rows = self.store.rows
        out = super().update_and_fetch(keys, values)
        if keys.shape[2] == 1 and not self.in_prompt and self.plan is not None:  # a decode step
            self._extend_pages(rows, keys)
        return out

    def _extend_pages(self, rows: int, key: mx.array) -> None:
        """The token written at slot ``rows`` joins the last page, or opens a new one."""
        p = self.plan[0]
        if p > 1 and rows % p == 0:
            self.pages.append(_opened_page(key))
        elif p > 1:
            buffer, last = self.pages.buffer, self.pages.length - 1
            buffer[..., last : last + 1] = _joined_page(buffer[..., last : last + 1], key)
        self.paged_rows = rows + 1

    # -- stage 2, at a decode step: attend to the chosen pages' tokens --------------------------
    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        pages = None
        if queries.shape[2] == 1 and not self.in_prompt and self.plan is not None:
            pages = self.chosen_pages(queries, keys)
        if pages is None:  # a prompt chunk or its end (then stage 1), or k covers every page
            return super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        keys, values, mask = self.gather_pages(pages, keys, values, queries.shape[1])
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        self._awaiting_attend = False
        self.decode_steps += 1  # what the base counts at a decode step; nothing is scored
        return mx.depends(out, self._step_writes())

    def _step_writes(self) -> list[mx.array]:
        return super()._step_writes() + ([self.pages.buffer] if self.pages.buffer is not None else [])

    def chosen_pages(self, queries, keys) -> mx.array | None:
        """The ceil(k2 / P) best pages per KV head (B, Hkv, n); None when that is every page."""
        p, r, k2 = self.plan
        rows = keys.shape[2]
        n_pages, n = -(-rows // p), -(-k2 // p)
        if n >= n_pages:
            return None
        pages = keys.swapaxes(-1, -2) if p == 1 else self.pages.view()
        counts = mx.minimum(rows - _page_starts(p, n_pages), p)  # the starts kept while no page opens
        q_r, index, t, _ = _query_side(pages.shape[1], r, pages.shape[2] == queries.shape[-1])(queries)
        return mx.argpartition(-_page_scores(q_r, index, t, pages, counts), kth=n - 1, axis=-1)[..., :n]

    def gather_pages(self, pages, keys, values, n_heads):
        """The chosen pages' keys and values (B, Hkv, n P, D) and the mask that hides the
        slots past the last token (None when the last page is full)."""
        p, rows = self.plan[0], keys.shape[2]
        mask = None
        if rows % p:
            index, mask = _page_slots(p, n_heads // keys.shape[1], True)(pages, mx.array(rows))
        else:
            index = _page_slots(p, 1, False)(pages)
        return mx.take_along_axis(keys, index, axis=2), mx.take_along_axis(values, index, axis=2), mask

    # -- storage and state ---------------------------------------------------------------------
    def trim(self, n):
        n = super().trim(n)
        if n and self.plan is not None:
            self._build_pages()
        return n

    def _arrays(self):
        return {**super()._arrays(), "pages": self.pages}

    def _restore_arrays(self, arrays):
        super()._restore_arrays(arrays)
        self.pages.reset(arrays.get("pages"))

    def _meta(self):
        return {**super()._meta(), "plan": json.dumps(self.plan), "paged_rows": self.paged_rows}

    def _restore_meta(self, meta):
        super()._restore_meta(meta)
        self._set_plan(json.loads(meta["plan"]))
        self.paged_rows = int(meta["paged_rows"])

    def _state_problems(self):
        yield from super()._state_problems()
        if self.plan is None or self.plan[0] == 1:
            return
        expected = -(-self.paged_rows // self.plan[0])
        if self.pages.length != expected or self.paged_rows > self.store.rows:
            yield ("pages", self.pages.length,
                   f"{expected} ({self.paged_rows} of the {self.store.rows} stored tokens in pages of {self.plan[0]})")
