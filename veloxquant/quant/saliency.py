"""Token saliency from attention, for precision by token (salient tokens at more bits).

A prompt chunk's saliency is the **normalised attention of probe queries**: a few of the
chunk's queries (``probe_positions``: the newest ``recent`` fraction plus a ``random``
fraction drawn from the earlier ones) attend, causally and at their real positions, over
every key seen so far; their softmax weights are summed over the query heads of each KV
group (GQA) and over the probes, then divided by the number of queries that can attend
to each token, ``T - i`` (T tokens seen, token i), which takes out the head start early
tokens have in an accumulated sum (H2O's bias). ``T - i`` counts every query at or after
i, probes or not (ZipCache's code does this; the paper's ``nnz`` of the full matrix's
column is the same count).

A decode block's saliency is the current query's softmax weights over the whole cache,
restricted to the block and summed over the KV group, without normalisation (ZipCache's
re-compression step).

``salient_split`` turns scores ``(B, H, n)`` into, per (batch, KV head), the positions of
the ``n_hi`` largest and of the others, each increasing (their arrival order), and
``n_salient`` is how many of ``n`` tokens a fraction makes salient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from ..evict.attention import attention_weights, reduce_query_blocks

PROBE_SEED = 0x5A11E7  # random probes are drawn from a key of this seed and the chunk's start


def n_salient(fraction: float, n: int) -> int:
    """``round(fraction * n)``, halves up: how many of ``n`` tokens are salient."""
    return min(n, math.floor(fraction * n + 0.5))


def probe_positions(n: int, start: int, recent: float, random: float) -> mx.array:
    """Probe queries of a chunk of ``n`` queries (positions within it, increasing): the
    newest ``n - int(n - recent n)`` and ``int(random n)`` of the earlier ones, drawn
    without replacement from a key made of ``PROBE_SEED`` and the chunk's first position
    ``start`` (the same chunk gives the same probes, in every copy of the cache)."""
    cut = int(n - recent * n)
    newest = mx.arange(cut, n)
    n_random = min(int(random * n), cut)
    if not n_random:
        return newest
    key = mx.random.key(PROBE_SEED + start)
    drawn = mx.argsort(mx.random.uniform(shape=(cut,), key=key))[:n_random]
    return mx.concatenate([mx.sort(drawn), newest])


def probe_attention_sums(queries, keys, scale, q_positions) -> mx.array:
    """``S_i = sum_g sum_p softmax(q_p Kᵀ scale + causal)[g, p, i]``: (B, Hkv, N) float32.

    queries (B, Hq, P, D) at absolute positions ``q_positions`` (P,); keys (B, Hkv, N, D)
    at positions 0..N-1. Probes are taken in blocks (``reduce_query_blocks``)."""
    b, h, n = keys.shape[0], keys.shape[1], keys.shape[2]
    k_positions = mx.broadcast_to(mx.arange(n), (b, h, n))
    keys = keys.astype(mx.float32)  # once: a cast in every block left several alive at once

    def block(q, start, stop):
        return attention_weights(q, keys, scale, q_positions[start:stop], k_positions).sum(axis=(2, 3))

    return reduce_query_blocks(queries, n, block)


def normalized_by_visibility(sums: mx.array, first: int) -> mx.array:
    """``S_i / (T - i)`` for tokens ``first..T-1`` of sums (B, H, T)."""
    t = sums.shape[-1]
    return sums[..., first:] / mx.arange(t - first, 0, -1).astype(mx.float32)


def current_query_saliency(logits: mx.array, n_block: int) -> mx.array:
    """Sum over the KV group of the current query's softmax over every key, for the last
    ``n_block`` keys: logits (B, Hkv, G, N) float32 -> (B, Hkv, n_block)."""
    p = mx.softmax(logits, axis=-1, precise=True)[..., logits.shape[-1] - n_block :]
    return p.sum(axis=2)


def salient_split(scores: mx.array, n_hi: int) -> tuple[mx.array, mx.array]:
    """Per (batch, head): positions of the ``n_hi`` largest scores and of the rest, each
    increasing: (B, H, n_hi) and (B, H, n - n_hi) int32."""
    order = mx.argsort(-scores, axis=-1).astype(mx.int32)
    return mx.sort(order[..., :n_hi], axis=-1), mx.sort(order[..., n_hi:], axis=-1)


@dataclass(frozen=True)
class ProbeSaliency:
    """Prefill: the normalised attention of probe queries; decode blocks: the current
    query's attention, unnormalised. ``recent``/``random``: the probe fractions."""

    recent: float = 0.05
    random: float = 0.05

    def prefill(self, queries, keys, scale, first: int) -> mx.array:
        """Saliency (B, Hkv, N - first) of tokens ``first..N-1`` for a chunk of queries
        (B, Hq, n, D), the newest n of the N keys (B, Hkv, N, D)."""
        n, total = queries.shape[2], keys.shape[2]
        start = total - n
        probes = probe_positions(n, start, self.recent, self.random)
        sums = probe_attention_sums(queries[:, :, probes], keys, scale, probes + start)
        return normalized_by_visibility(sums, first)

    def decode(self, logits, n_block: int) -> mx.array:
        return current_query_saliency(logits, n_block)
