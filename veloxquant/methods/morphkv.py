"""MorphKV: a constant-size cache, kept by what the last W queries attended to.

Scores when the prompt is in and at every decode step, after attention (which sees the
``morphkv_budget`` kept tokens plus the new one), with the W = ``morphkv_window`` most
recent queries, this step's included (the base keeps them, ``window_in_decode``). For
KV head h, window query r and candidate token j, the logits q·k·scale are summed over
the query heads of h (the official GQA reduction: raw logits, before any softmax), a
softmax is taken over the candidates only (the summed logits are those of the group's
summed query: one matmul per KV head), and the W rows are fused by a sum:

    score_j = sum_r softmax_{j in candidates}( sum_{g in group(h)} q_{g,r} · k_j · scale )

Candidates are every token but the ``morphkv_n_sink`` sinks and the W newest tokens,
which are always kept. At the prefill end the top ``budget`` are kept (the card's
prune-at-prefill-end, equivalent to the official first-decode-step prune: both use the
last W prompt queries); every ``EVICT_EVERY`` decode steps (``evict/base.py``) the cache
keeps the top ``budget`` again, so it holds ``budget`` to ``budget + EVICT_EVERY - 1``
tokens and a step attends over up to ``budget + EVICT_EVERY``. The official code frees the
argmin's slot at every step (C + 1 attended, C = budget); here the ``EVICT_EVERY``
lowest leave at once and the steps between only keep their queries. Evicting after this step's attention with a window
that ends at this step's query is the official order (evict before the next step's
attention, scored by the previous W queries), shifted by one call. A packed batch (``evict/batch.py``) keeps each sequence's W queries
joined and scores each window at its own positions.

Adapted or inferred: sinks (the official runs use none); the fusion is a sum (the card's
default, inferred: no field selects it; the official max fusion is ``fusion = "max"``,
a class attribute tests use). Instead of the official logit buffer (Hq x W x budget
float32 per layer) the W queries are kept (Hq x W x head_dim at the model's dtype, in
``nbytes``) and their logits recomputed at each step: the same numbers, since a kept
key never changes, for a W x budget logit matmul per KV head and step.
"""

from __future__ import annotations

import mlx.core as mx

from ..evict.base import EVICT_EVERY, Roles, Schedule, ScoredEvictionCache


def window_logits(queries, keys, scale, q_positions, k_positions) -> mx.array:
    """The card's buffer A: q·k·scale of each window query over the kept keys, float32,
    -inf where the key comes after the query: (B, Hq, W, rows); q_positions (W,), or
    (B, 1, W) where each sequence's window ends at its own position (a packed batch)."""
    b, hq, w, d = queries.shape
    hkv = keys.shape[1]
    q = queries.reshape(b, hkv, hq // hkv, w, d).astype(mx.float32)
    logits = (q * scale) @ keys[:, :, None].astype(mx.float32).swapaxes(-1, -2)
    k = k_positions[:, :, None, None, :]
    q_at = q_positions[:, None] if q_positions.ndim == 1 else q_positions.reshape(b, 1, 1, w, 1)
    visible = (k >= 0) & (k <= q_at)
    return mx.where(visible, logits, -float("inf")).reshape(b, hq, w, -1)


def fused_profile(logits, candidates, fusion="sum") -> mx.array:
    """Group-summed logits (B, Hkv, W, rows) -> softmax over ``candidates`` (B, Hkv, rows)
    per window row -> fused over the rows by sum or max: (B, Hkv, rows), 0 off candidates."""
    probs = mx.softmax(mx.where(candidates[:, :, None], logits, -float("inf")), axis=-1, precise=True)
    probs = mx.where(candidates[:, :, None], probs, 0.0)
    return probs.sum(axis=2) if fusion == "sum" else probs.max(axis=2)


class MorphKVCache(ScoredEvictionCache):
    roles = Roles(budget="morphkv_budget", n_sink="morphkv_n_sink", recent="morphkv_window",
                  window="morphkv_window")
    schedule = Schedule(prefill_end=True, decode_every=EVICT_EVERY)
    batchable = True
    window_in_decode = True
    sequence_state = ("window_queries",)  # a packed batch keeps each sequence's last W queries
    fusion = "sum"  # "max": the official max_fused variant (tests only; no field selects it)

    def score(self, inputs):
        queries, positions = inputs.window_queries, inputs.positions
        b, hq, w, d = queries.shape
        # sum_g q_g . k = (sum_g q_g) . k: A summed over a group is one query's logits
        summed = queries.reshape(b, positions.shape[1], -1, w, d).astype(mx.float32).sum(axis=2)
        logits = window_logits(summed, inputs.keys, inputs.scale, self.offset - w + mx.arange(w), positions)
        candidates = ~self.protected(positions) & (positions >= 0)
        return fused_profile(logits, candidates, self.fusion)
