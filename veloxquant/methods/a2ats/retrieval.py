"""Retrieval-based sparse attention: exact rows kept, VQ codes of their keys pick the top-K.

``RetrievalStore`` keeps a layer's keys and values exactly (model dtype, in growing
buffers: on this device's memory, since MLX has no host tier to offload them to; counted
in ``nbytes``) and, beside them, product-VQ codes of the keys in the frame the scores are
taken in (``frame``: e.g. keys rotated back to pre-RoPE). A decode step:

1. approximate scores of the candidates (every coded token but the first ``n_sink``;
   tokens are coded in blocks of ``window`` once they are past the newest ``window``, so
   the newest ``window`` to ``2 window - 1`` tokens are uncoded and always attended, and a
   decode step codes nothing but every ``window`` steps) through lookup tables: ``q~ . C[idx]`` (``vq.lookup_scores``) with
   the query in the same frame;
2. the top ``k`` candidates per query head (``k = floor(fraction * tokens)``, at most the
   candidates; ties at the k-th score to the latest tokens), their union over the query heads of each KV head (a fixed-size set of
   ``gqa * k`` indices per KV head, repeats masked);
3. exact attention over the sinks, the chosen tokens (gathered from the exact rows) and
   the window. With ``k`` covering every candidate this is exact attention over every
   token (``mx.fast.scaled_dot_product_attention`` over the stored rows).

A prompt chunk attends exactly over every stored row plus itself. The codebook is given
or fitted by k-means on the stored keys' sub-vectors when the first step retrieves
(before, codes are not needed); tokens are coded then and at each later step (exact rows
stay, so coding late changes nothing). Codes may be assigned under a metric ``H = L L^T``
(``(k - c) H (k - c)^T = ||kL - cL||^2``): given, or the second moment of the prompt's
queries in the score frame (accumulated at each prompt chunk, normalised to unit mean
eigenvalue) blended with the identity by ``beta`` (1: plain nearest centroid); the
codebook is then fitted in the L frame (k-means on ``kL``, ``C = C_L L^-1``).
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from ...cache.base import causal_mask
from ...cache.buffers import GrowingArray
from ...quant.packed import GROWTH_TOKENS
from ...quant.vq import kmeans, lookup_scores, nearest

FIT_ITERS = 10  # Lloyd iterations of a codebook fitted from the prompt
FIT_SAMPLE = 16  # points per centroid it looks at, at most


def top_k_ties_to_latest(scores: mx.array, k: int) -> mx.array:
    """Indices (..., k), in no order, of the ``k`` largest scores along the last axis; among
    scores equal to the k-th largest, the latest indices. Tokens with one code have equal
    scores to the bit, and ``argpartition`` leaves the choice among them to the back-end
    (the CPU takes the earliest): this way every device attends to the same tokens."""
    n = scores.shape[-1]
    kth = -mx.partition(-scores, kth=k - 1, axis=-1)[..., k - 1 : k]
    above, tied = scores > kth, scores == kth
    need = k - above.sum(axis=-1, keepdims=True)
    take = above | (tied & (mx.cumsum(tied, axis=-1, reverse=True) <= need))
    position = mx.arange(n, dtype=mx.int32)
    return mx.argpartition(mx.where(take, position, n + position), kth=k - 1, axis=-1)[..., :k]


EPS = 1e-6  # added to the metric's diagonal before its Cholesky factor


def metric_factor(h: mx.array) -> mx.array:
    """L (s, s) lower triangular with L L^T = H + eps I."""
    h = h.astype(mx.float32)
    return mx.linalg.cholesky(h + EPS * mx.eye(h.shape[0]), stream=mx.cpu)


def blended_metric(h_sum: mx.array, beta: float) -> mx.array:
    """beta I + (1 - beta) H / (trace(H) / s): the queries' second moment with unit mean
    eigenvalue, pulled towards the identity by beta."""
    s = h_sum.shape[0]
    trace = mx.maximum(mx.trace(h_sum), 1e-30)
    return beta * mx.eye(s) + (1 - beta) * h_sum * (s / trace)


class RetrievalStore:
    """``frame(x, positions)``: rows (B, H, n, D) at ``positions`` (n,) into the score frame,
    float32; queries are framed at their positions minus ``query_offset`` (A2ATS's
    windowed RoPE: every key as if ``query_offset`` tokens away)."""

    def __init__(self, *, bits: int, sub_dim: int, window: int, n_sink: int, fraction: float,
                 frame: Callable, query_offset: int = 0, codebook: mx.array | None = None,
                 metric: mx.array | None = None, learn_metric: bool = False, beta: float = 1.0,
                 seed: int = 0):
        self.bits, self.sub_dim, self.window, self.n_sink = bits, sub_dim, window, n_sink
        self.fraction, self.frame, self.query_offset, self.seed = fraction, frame, query_offset, seed
        # exact rows and their unpacked indices grow with what they hold (geometric): a short
        # prompt pays no 256-row step, and nothing reads them by whole steps
        self.keys = GrowingArray(axis=2, step=GROWTH_TOKENS, geometric=True)
        self.values = GrowingArray(axis=2, step=GROWTH_TOKENS, geometric=True)
        self.codes = GrowingArray(axis=2, step=GROWTH_TOKENS, geometric=True)
        self.centroids = codebook
        self.factor = None if metric is None else metric_factor(metric)  # L of the assignment metric
        self.beta = beta
        self.h_sum = mx.zeros((sub_dim, sub_dim), mx.float32) if learn_metric else None

    @property
    def length(self) -> int:
        return self.keys.length

    @property
    def index_dtype(self):
        return mx.uint8 if self.bits <= 8 else mx.uint16

    # -- writing ------------------------------------------------------------------------------
    def append(self, keys: mx.array, values: mx.array) -> None:
        self.keys.append(keys)
        self.values.append(values)

    def observe_queries(self, queries: mx.array, positions: mx.array) -> None:
        """Add the prompt's queries (B, Hq, n, D) in the score frame to the metric's sum."""
        if self.h_sum is None:
            return
        q = self.frame(queries, positions - self.query_offset)
        sub = q.reshape(-1, self.sub_dim)
        self.h_sum = self.h_sum + sub.T @ sub

    def _assignment_factor(self) -> mx.array | None:
        if self.factor is None and self.h_sum is not None and self.beta < 1:
            self.factor = metric_factor(blended_metric(self.h_sum, self.beta))
        return self.factor

    def _sub_vectors(self, start: int, stop: int) -> mx.array:
        keys = self.keys.buffer[:, :, start:stop]
        y = self.frame(keys, mx.arange(start, stop))
        return y.reshape(*y.shape[:-1], -1, self.sub_dim)

    def _code_up_to(self, n: int) -> None:
        """Codes for the first ``n`` tokens (fitting the codebook first if there is none)."""
        factor = self._assignment_factor()
        if self.centroids is None:
            x = self._sub_vectors(0, n).reshape(-1, self.sub_dim)
            x = x if factor is None else x @ factor
            c = kmeans(x, 1 << self.bits, iters=FIT_ITERS, key=mx.random.key(self.seed),
                       sample=FIT_SAMPLE << self.bits)
            self.centroids = c if factor is None else c @ mx.linalg.inv(factor, stream=mx.cpu)
        if self.codes.length < n:
            sub = self._sub_vectors(self.codes.length, n)
            c = self.centroids.astype(mx.float32)
            if factor is not None:
                sub, c = sub @ factor, c @ factor
            # one byte an index (two past 8 bits), not packed: a step reads them with no
            # unpacking, and beside the exact rows kept they are a rounding error
            self.codes.append(nearest(sub, c).astype(self.index_dtype))

    # -- attention ----------------------------------------------------------------------------
    def rows(self, n: int):
        return self.keys.buffer[:, :, :n], self.values.buffer[:, :, :n]

    def prefill_attention(self, queries, *, scale, mask):
        k, v = self.rows(self.length)
        if isinstance(mask, mx.array):
            mask = causal_mask(queries.shape[2], k.shape[2])
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)

    def coded_until(self) -> int:
        """Where the candidates end: the tokens coded so far, coding those past the newest
        ``window`` once a block of ``window`` of them (or the first) waits uncoded (the
        schedule reads only the Python counts)."""
        past = self.length - self.window
        coded = self.codes.length
        if past > self.n_sink and (not coded or past - coded >= max(1, self.window)):
            self._code_up_to(past)
        return self.codes.length

    def selected(self, queries: mx.array, position: int):
        """(top-k candidate indices (B, H, gqa * k), repeats (bool, same shape)) for a decode
        query (B, Hq, 1, D) at ``position``; None when every token is attended."""
        t = self.length
        first, stop = self.n_sink, t - self.window
        n_cand = stop - first
        k = min(int(self.fraction * t), n_cand)
        if n_cand <= 0 or k >= n_cand:
            return None
        b, hq, _, d = queries.shape
        h = self.keys.buffer.shape[1]
        if k == 0:
            return mx.zeros((b, h, 0), mx.uint32), mx.zeros((b, h, 0), mx.bool_)
        stop = self.coded_until()
        k = min(k, stop - first)
        q = self.frame(queries, mx.array([position - self.query_offset])).reshape(b, h, hq // h, d)
        idx = self.codes.buffer[:, :, first:stop]
        approx = lookup_scores(q, idx, self.centroids)  # (B, H, gqa, candidates)
        top = top_k_ties_to_latest(approx, k)
        union = mx.sort(top.reshape(b, h, -1), axis=-1)
        repeat = mx.concatenate([mx.zeros((b, h, 1), mx.bool_), union[..., 1:] == union[..., :-1]], axis=-1)
        return union + first, repeat

    def decode_attention(self, queries, *, scale, position: int) -> mx.array:
        chosen = self.selected(queries, position)
        t = self.length
        k_all, v_all = self.rows(t)
        if chosen is None:
            return mx.fast.scaled_dot_product_attention(queries, k_all, v_all, scale=scale)
        idx, repeat = chosen
        pick = lambda x: mx.take_along_axis(x, idx[..., None], axis=2)  # noqa: E731
        first, stop = self.n_sink, self.codes.length if idx.shape[-1] else t - self.window
        keys = mx.concatenate([k_all[:, :, :first], pick(k_all), k_all[:, :, stop:]], axis=2)
        values = mx.concatenate([v_all[:, :, :first], pick(v_all), v_all[:, :, stop:]], axis=2)
        b, h, m = repeat.shape
        keep = mx.concatenate([mx.ones((b, h, first), mx.bool_), ~repeat,
                               mx.ones((b, h, t - stop), mx.bool_)], axis=-1)
        gqa = queries.shape[1] // h
        mask = mx.repeat(keep[:, :, None, None, :], gqa, axis=2).reshape(b, h * gqa, 1, keep.shape[-1])
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    # -- what is kept -------------------------------------------------------------------------
    def arrays(self) -> dict[str, Any]:
        return {"keys": self.keys, "values": self.values, "codes": self.codes,
                "centroids": self.centroids, "factor": self.factor, "h_sum": self.h_sum}

    def restore(self, arrays: dict[str, Any]) -> None:
        for name in ("keys", "values", "codes"):
            getattr(self, name).reset(arrays.get(name))
        for name in ("centroids", "factor", "h_sum"):
            if name in arrays:
                setattr(self, name, arrays[name])

    def layout_problems(self, head_dim: int):
        n = head_dim // self.sub_dim
        codes = self.codes.view()
        if codes is not None and (codes.shape[3], codes.dtype) != (n, self.index_dtype):
            yield "key code indices per token", (codes.shape[3], codes.dtype), (n, self.index_dtype)
        if self.centroids is not None and tuple(self.centroids.shape) != (1 << self.bits, self.sub_dim):
            yield "codebook (centroids, sub_dim)", tuple(self.centroids.shape), (1 << self.bits, self.sub_dim)

    def problems(self, offset: int):
        if self.keys.length != offset or self.values.length != offset:
            yield "tokens stored", f"{self.keys.length} keys / {self.values.length} values", f"the offset {offset}"
        if self.codes.length > self.keys.length:
            yield "coded keys", self.codes.length, f"at most the {self.keys.length} stored"
        if self.codes.length and self.centroids is None:
            yield "codebook", None, f"a codebook for the {self.codes.length} coded keys"
