"""NestedKV: keep the keys that stand out at three time scales, with a head-adaptive split.

Key-only (no query, no attention weight, no calibration) and prefill-only: it scores once,
when the prompt is in (mlx-lm sends its last token alone), per layer, in float32, from the
stored keys alone. It could score at any time (it needs no query), but its global and
block anchors and its ranks are taken over the whole prompt and its split compares every
head of the layer, so it waits for the prompt's end: until then attention sees every token
(a long prompt is held whole, as with SnapKV). Decode only appends. Only the abstract of
the paper (arXiv 2605.26678, no venue, no code) could be read; every formula below is the
card's reconstruction from it and the field names (each a named helper, to be corrected
when the method section is available). Per KV head, with k^ = k / |k| and W =
``nestedkv_window``, over the kept tokens in position order:

1. Anchors, means of unit keys, the sinks left out (BOS keys are outliers): global (every
   token), block (the W-token block holding i, blocks aligned at the first token), sliding
   (the W tokens before i, causal; a token with none uses its own key).
2. Anomaly s_X(i) = 1 - cos(k_i, a_X(i)) in [0, 2]; a zero anchor counts as orthogonal (1).
3. Ranks per scale among the head's candidates (neither sink nor among the last W tokens):
   r = rank / (n - 1) in [0, 1], 1 the most anomalous, equal anomalies ranked by position
   (the later one higher).
4. Head-adaptive mixing: c_X = std of s_X over the candidates, standardized across the
   three scales (0 where the three are equal), w = softmax(``nestedkv_beta`` * c^) over
   scales (beta = 0: 1/3 each), m = sum_X w_X r_X.
5. Surprise gate on the fast scale u = r_S: g = sigmoid(``nestedkv_kappa`` (u -
   ``nestedkv_tau``)), z = (1 - g) m + g u in [0, 1].
6. Split (AdaKV's safeguard): the sinks and the last W tokens are kept; of the layer's
   H (B - n_sink - W) other slots (B = the layer's budget, its average per head), each
   head first takes its top floor(``nestedkv_safeguard_alpha`` (B - n_sink - W)) by z, the
   rest go to the best z left across the layer's heads (per sequence; z is a rank, so
   heads compare). Head h keeps b_h tokens; sum_h b_h = H B.

Storage: heads share one slot axis (MLX's attention takes one length for every head; a
ragged layout would need an attention call or a kernel per head), so every head holds
max_h b_h slots, the unused ones padding (position -1, masked in attention, counted in
``nbytes``): a layer stores H max_h b_h rows, not H B. z being a rank, the heads' top
tails look alike and the split stays near even: on the reference model (4k needle prompt,
defaults) heads keep 504-520 of 512 and the padding adds 0.9% to the stored rows (3.2% at
budget 1024). With alpha = 1 every head keeps B and nothing is padded. A second prompt
after decoding scores the kept tokens again (blocks and windows over the kept tokens in
position order) and sizes its padding afresh. A per-layer budget below n_sink + W keeps
the protected tokens only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from ..evict.base import Roles, Schedule, ScoredEvictionCache
from ..evict.select import gather_tokens

EPS = 1e-12
LAST = mx.iinfo(mx.int32).max  # padding slots sort after every kept token


def unit(x: mx.array) -> mx.array:
    """x / |x| along the last axis (a zero row stays zero)."""
    return x / mx.maximum(mx.sqrt(mx.square(x).sum(-1, keepdims=True)), EPS)


def cosine_anomaly(u: mx.array, anchor: mx.array) -> mx.array:
    """1 - cos(u, anchor) in [0, 2]; ``u`` unit rows, ``anchor`` any scale (zero: 1)."""
    norm = mx.sqrt(mx.square(anchor).sum(-1))
    return mx.clip(1.0 - (u * anchor).sum(-1) / mx.maximum(norm, EPS), 0.0, 2.0)


ANOMALY_ELEMENTS = 1 << 21  # float32 elements of (rows, D + 1) one block of windows handles (8 MiB)


def anomalies(u: mx.array, member: mx.array, window: int) -> mx.array:
    """(3, B, H, n): global, block and sliding anomalies of unit keys ``u`` (B, H, n, D) in
    position order; ``member`` (B, H, n) says which tokens the anchors average.

    The block and sliding anchors are (n, D) arrays, several of them at once: they are
    made for ``ANOMALY_ELEMENTS`` at a time, whole windows with the window before them,
    each block evaluated before the next is built (once a prompt, at its end; lazy, the
    scheduler computes the blocks together). A token's anomalies do not depend on the
    blocking."""
    b, h, n, d = u.shape
    glob = cosine_anomaly(u, (u * member[..., None]).sum(axis=2, keepdims=True))
    per_block = max(1, ANOMALY_ELEMENTS // (b * h * window * (d + 1)))  # windows a block
    local = []
    for first in range(0, -(-n // window), per_block):
        start = max(0, first - 1) * window  # the window before, for the first's sliding anchor
        stop = min(n, (first + per_block) * window)
        if local:
            mx.eval(local[-1])
        local.append(_local_anomalies(u[:, :, start:stop], member[:, :, start:stop], window)
                     [..., first * window - start:])
    return mx.stack([glob, *(local[0] if len(local) == 1 else mx.concatenate(local, axis=-1))])


def _local_anomalies(u: mx.array, member: mx.array, window: int) -> mx.array:
    """(2, B, H, n): block and sliding anomalies of tokens whose first is a window's first
    (its first window has none before it)."""
    b, h, n, d = u.shape
    x = mx.concatenate([u * member[..., None], member[..., None].astype(u.dtype)], -1)  # + count
    blocks = mx.pad(x, [(0, 0), (0, 0), (0, -n % window), (0, 0)]).reshape(b, h, -1, window, d + 1)
    total = blocks.sum(axis=3, keepdims=True)
    before = mx.cumsum(blocks, axis=3) - blocks  # the block's members before i
    shift = [(0, 0), (0, 0), (1, 0), (0, 0), (0, 0)]  # the previous block (none for the first)
    prev_total, prev_before = mx.pad(total, shift)[:, :, :-1], mx.pad(before, shift)[:, :, :-1]
    sliding = (before + prev_total - prev_before).reshape(b, h, -1, d + 1)[:, :, :n]  # W before i
    block = mx.broadcast_to(total, blocks.shape).reshape(b, h, -1, d + 1)[:, :, :n]
    sliding = mx.where(sliding[..., -1:] > 0, sliding[..., :-1], u)  # none before: its own key
    return mx.stack([cosine_anomaly(u, block[..., :-1]), cosine_anomaly(u, sliding)])


def rank_normalize(s: mx.array, candidate: mx.array) -> mx.array:
    """rank / (n - 1) among each row's n candidates, 1 the largest ``s`` (>= 0); ties by
    index, the later higher (exact: an int64 key of s's bits and the index); others 0."""
    n = s.shape[-1]
    bits = mx.view(s + 0.0, mx.int32).astype(mx.int64)  # monotone in s for s >= 0
    key = mx.where(candidate, bits * (1 << 32) + mx.arange(n, dtype=mx.int64), -1)
    order = mx.argsort(key, axis=-1)
    ranks = mx.put_along_axis(mx.zeros(s.shape, mx.int32), order.astype(mx.int32),
                              mx.broadcast_to(mx.arange(n, dtype=mx.int32), s.shape), axis=-1)
    count = candidate.sum(-1, keepdims=True)
    r = (ranks - (n - count)).astype(mx.float32) / mx.maximum(count - 1, 1).astype(mx.float32)
    return mx.where(candidate, r, 0.0)


def mixing_weights(s: mx.array, candidate: mx.array, beta: float) -> mx.array:
    """(3, B, H): softmax over scales of beta x each scale's anomaly spread (the std over a
    head's candidates), standardized across the three scales."""
    count = mx.maximum(candidate.sum(-1), 1).astype(mx.float32)
    mean = mx.where(candidate, s, 0.0).sum(-1) / count
    spread = mx.sqrt(mx.where(candidate, mx.square(s - mean[..., None]), 0.0).sum(-1) / count)
    centred = spread - spread.mean(axis=0)
    sd = mx.sqrt(mx.square(centred).mean(axis=0))
    standard = mx.where(sd > 1e-12, centred / mx.maximum(sd, 1e-12), 0.0)
    return mx.softmax(beta * standard, axis=0, precise=True)


def surprise_gate(u: mx.array, tau: float, kappa: float) -> mx.array:
    """g = sigmoid(kappa (u - tau)): how much of a token's score its fast-scale rank takes."""
    return mx.sigmoid(kappa * (u - tau))


def split_budget(z: mx.array, candidate: mx.array, guaranteed: int, pooled: int) -> mx.array:
    """Candidates kept per head (B, H): each head's ``guaranteed`` best by z, then the
    ``pooled`` best left across the heads of a sequence (fewer where fewer remain)."""
    b, h, n = z.shape
    ranked = mx.where(candidate, z, -float("inf"))
    chosen = mx.zeros((b, h, n), mx.bool_)
    if guaranteed > 0:
        top = mx.argpartition(-ranked, kth=min(guaranteed, n) - 1, axis=-1)[..., :guaranteed]
        chosen = mx.put_along_axis(chosen, top, mx.array(True), axis=-1) & candidate
    if pooled > 0:
        rest = mx.where(chosen, -float("inf"), ranked).reshape(b, h * n)
        top = mx.argpartition(-rest, kth=min(pooled, h * n) - 1, axis=-1)[..., :pooled]
        won = mx.put_along_axis(mx.zeros((b, h * n), mx.bool_), top, mx.array(True), axis=-1)
        chosen = chosen | (won.reshape(b, h, n) & candidate & ~chosen)
    return chosen.sum(-1).astype(mx.int32)


@dataclass
class Ensemble:
    """One scoring's intermediate values; per-token arrays in position order (``order``:
    the slots sorted by position, padding last), ``z`` in slot order."""

    order: mx.array  # (B, H, n) slot of each position-ordered token
    candidate: mx.array  # (B, H, n) neither padding nor protected
    anomalies: mx.array  # (3, B, H, n): global, block, sliding
    ranks: mx.array  # (3, B, H, n)
    weights: mx.array  # (3, B, H)
    gate: mx.array  # (B, H, n)
    scores: mx.array  # (B, H, n) z, position order
    z: mx.array  # (B, H, n) z, slot order (what the base ranks by)


class NestedKVCache(ScoredEvictionCache):
    roles = Roles(budget="nestedkv_budget", n_sink="nestedkv_n_sink", recent="nestedkv_window")
    schedule = Schedule(prefill_end=True)
    batchable = True
    # its own _evict and head_budgets run at a prompt's end only (decode only appends), which
    # a batch runs per sequence; packed decode steps mask its heads' padding slots
    same_at_decode = ("_evict", "head_budgets")

    def ensemble(self, inputs) -> Ensemble:
        """Steps 1-5 over the stored keys (computed once per scoring, shared by the split)."""
        if "_nestedkv" in inputs.__dict__:
            return inputs.__dict__["_nestedkv"]
        o, positions = self.options, inputs.positions
        order = mx.argsort(mx.where(positions >= 0, positions, LAST), axis=-1)
        pos = mx.take_along_axis(positions, order, axis=-1)
        valid = pos >= 0
        candidate = valid & ~self.protected(pos)
        u = unit(gather_tokens(inputs.keys, order).astype(mx.float32))
        s = anomalies(u, valid & (pos >= self.n_sink), o.nestedkv_window)
        ranks = mx.stack([rank_normalize(x, candidate) for x in s])
        weights = mixing_weights(s, candidate, o.nestedkv_beta)
        gate = surprise_gate(ranks[2], o.nestedkv_tau, o.nestedkv_kappa)
        scores = (1.0 - gate) * (weights[..., None] * ranks).sum(axis=0) + gate * ranks[2]
        z = mx.put_along_axis(mx.zeros(scores.shape, mx.float32), order, scores, axis=-1)
        e = Ensemble(order, candidate, s, ranks, weights, gate, scores, z)
        inputs.__dict__["_nestedkv"] = e
        return e

    def score(self, inputs):
        return self.ensemble(inputs).z

    def head_budgets(self, inputs):
        budget, alpha = self.budget, self.options.nestedkv_safeguard_alpha
        if not self.padded and (self.store.rows <= budget or alpha == 1):
            return None  # nothing to evict, or B for every head: the base's dense path
        e = self.ensemble(inputs)
        share = max(0, budget - self.n_sink - self.recent)  # B': per head, unprotected
        guaranteed = math.floor(alpha * share + 1e-9)
        heads = e.candidate.shape[1]
        counts = split_budget(e.scores, e.candidate, guaranteed, heads * (share - guaranteed))
        protected = (inputs.positions >= 0).sum(-1) - e.candidate.sum(-1)  # sinks + last W
        return protected.astype(mx.int32) + counts

    def _evict(self, inputs, decode_step):
        self.padded_rows = 0  # nothing evicts at decode: each prefill's split sizes its padding
        super()._evict(inputs, decode_step)
