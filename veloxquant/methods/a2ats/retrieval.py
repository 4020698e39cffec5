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

Steps 1-3 are one compiled pass (``_step_graph``) over the buffers' allocated room: its
shapes change only when the buffers grow (the counts and k come in as arrays), the room past
the coded tokens is keyed below every candidate, and a fixed number of rows (what k and the
window can keep at most in that room) is gathered, those past the kept ones masked. What it
reads of the codes and the codebook are views kept between codings (``_step_views``), and
the top k of a query head are those whose key (the score's bits ordered as the floats, the
position below them) is at least the k-th largest: one sort, no tie pass. ``selected`` is
the same choice made directly (the indices themselves: tests and inspection).

A prompt chunk attends exactly over every stored row plus itself. The codebook is given
or fitted by k-means on the stored keys' sub-vectors when the first step retrieves
(before, codes are not needed); tokens are coded then and at each later step (exact rows
stay, so coding late changes nothing). Codes may be assigned under a metric ``H = L L^T``
(``(k - c) H (k - c)^T = ||kL - cL||^2``): given (H, or its factor L), or the second
moment of the prompt's queries in the score frame (accumulated at each prompt chunk,
normalised to unit mean eigenvalue) blended with the identity by ``beta`` (1: plain
nearest centroid); the codebook is then fitted in the L frame (k-means on ``kL``,
``C = C_L L^-1``). ``fit_tables`` is that fit, alone (a calibration runs it on a text).

The codebook, the metric's factor and the query moment are per row of the batch (B first):
each row's are fitted from its own keys and queries and read by its own codes and scores
(``quant/vq.py``'s functions with a codebook per row: every product one per row, of the
shape it has alone), so rows never mix: a store fed B rows holds each row as it would
alone. The fit runs inside a decode step (the first that retrieves), so its k-means reads
nothing on the host (``read_host=False``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

from ...cache.base import causal_mask
from ...cache.buffers import GrowingArray, row_indices, row_starts
from ...cache.rope import Rotary
from ...quant.packed import GROWTH_TOKENS
from ...quant.token_rows import ReadViews
from ...quant.vq import kmeans_rows, lookup_scores, nearest

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
    """L (..., s, s) lower triangular with L L^T = H + eps I (each of a batch of H's)."""
    h = h.astype(mx.float32)
    return mx.linalg.cholesky(h + EPS * mx.eye(h.shape[-1]), stream=mx.cpu)


def blended_metric(h_sum: mx.array, beta: float) -> mx.array:
    """beta I + (1 - beta) H / (trace(H) / s) for each H (..., s, s): the queries' second
    moment with unit mean eigenvalue, pulled towards the identity by beta."""
    s = h_sum.shape[-1]
    trace = mx.maximum(mx.trace(h_sum, axis1=-2, axis2=-1), 1e-30)[..., None, None]
    return beta * mx.eye(s) + (1 - beta) * h_sum * (s / trace)


class RetrievalStore:
    """``frame(x, positions)``: rows (B, H, n, D) at ``positions`` (n,) into the score frame,
    float32; queries are framed at their positions minus ``query_offset`` (A2ATS's
    windowed RoPE: every key as if ``query_offset`` tokens away). ``batch``: the rows the
    store is fed (B), each with tables of its own."""

    def __init__(self, *, bits: int, sub_dim: int, window: int, n_sink: int, fraction: float,
                 frame: Callable, query_offset: int = 0, codebook: mx.array | None = None,
                 metric: mx.array | None = None, factor: mx.array | None = None,
                 learn_metric: bool = False, beta: float = 1.0, seed: int = 0,
                 rotary: Rotary | None = None, batch: int = 1):
        self.rotary = rotary  # when given, ``frame`` is ``derotate`` with it (queries framed in the step's pass)
        self.bits, self.sub_dim, self.window, self.n_sink = bits, sub_dim, window, n_sink
        self.fraction, self.frame, self.query_offset, self.seed = fraction, frame, query_offset, seed
        # exact rows and their unpacked indices grow with what they hold (geometric): a short
        # prompt pays no 256-row step, and nothing reads them by whole steps
        self.keys = GrowingArray(axis=2, step=GROWTH_TOKENS, geometric=True)
        self.values = GrowingArray(axis=2, step=GROWTH_TOKENS, geometric=True)
        self.codes = GrowingArray(axis=2, step=GROWTH_TOKENS, geometric=True)
        # the tables are per row (B first), each row's own: a given one is copied to every row
        self.centroids = None if codebook is None else _per_row(codebook, batch)  # (B, 2**bits, s)
        if metric is not None:
            factor = metric_factor(metric)
        self.factor = None if factor is None else _per_row(factor, batch)  # L (B, s, s)
        self.beta = beta
        self.h_sum = mx.zeros((batch, sub_dim, sub_dim), mx.float32) if learn_metric else None
        # the retrieving step's views of the codes and of the codebook (``_step_views``): kept
        # between codings (cleared before the codes buffer is written in place) and fits
        self._views, self._table_views = ReadViews(), ReadViews()

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
        """Add the prompt's queries (B, Hq, n, D) in the score frame to each row's metric sum."""
        if self.h_sum is None:
            return
        q = self.frame(queries, positions - self.query_offset)
        sub = q.reshape(q.shape[0], -1, self.sub_dim)
        self.h_sum = self.h_sum + sub.swapaxes(1, 2) @ sub

    def _assignment_factor(self) -> mx.array | None:
        if self.factor is None and self.h_sum is not None and self.beta < 1:
            self.factor = metric_factor(blended_metric(self.h_sum, self.beta))
        return self.factor

    def _sub_vectors(self, start: int, stop: int) -> mx.array:
        keys = self.keys.buffer[:, :, start:stop]
        y = self.frame(keys, mx.arange(start, stop))
        return y.reshape(*y.shape[:-1], -1, self.sub_dim)

    def fit_tables(self, n: int) -> mx.array | None:
        """Each row's tables where they are missing: the metric's factor (from the query
        moment, once) and the codebook, by k-means on the first ``n`` tokens' sub-vectors
        (B, H n D/s, s) in the factor's frame. The factor (None: plain nearest centroid).
        What the first coding step fits, and what a calibration file holds."""
        factor = self._assignment_factor()
        if self.centroids is None:
            x = self._sub_vectors(0, n).reshape(self.keys.buffer.shape[0], -1, self.sub_dim)
            x = x if factor is None else x @ factor
            c = kmeans_rows(x, 1 << self.bits, iters=FIT_ITERS, key=mx.random.key(self.seed),
                            sample=FIT_SAMPLE << self.bits, read_host=False)
            self.centroids = c if factor is None else c @ mx.linalg.inv(factor, stream=mx.cpu)
        return factor

    def _code_up_to(self, n: int) -> None:
        """Codes for the first ``n`` tokens (fitting each row's tables first if there are
        none), each row's sub-vectors (B, H T D/s, s) against its own tables."""
        factor = self.fit_tables(n)
        b = self.keys.buffer.shape[0]
        if self.codes.length < n:
            sub = self._sub_vectors(self.codes.length, n)
            shape, sub = sub.shape[:-1], sub.reshape(b, -1, self.sub_dim)
            c = self.centroids.astype(mx.float32)
            if factor is not None:
                sub, c = sub @ factor, c @ factor
            # one byte an index (two past 8 bits), not packed: a step reads them with no
            # unpacking, and beside the exact rows kept they are a rounding error
            self._views.clear()  # no view pins the buffer the append writes in place
            self.codes.append(nearest(sub, c).reshape(shape).astype(self.index_dtype))

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
        """Attention of a decode query (B, Hq, 1, D) at ``position``: a retrieving step is one
        compiled pass (``_step_graph``) over the buffers' room; the schedule (how many
        to pick, whether to code) reads only the Python counts."""
        t, first = self.length, self.n_sink
        n_cand = t - self.window - first
        k = min(int(self.fraction * t), n_cand)
        if n_cand <= 0 or k >= n_cand:
            k_all, v_all = self.rows(t)
            return mx.fast.scaled_dot_product_attention(queries, k_all, v_all, scale=scale)
        if k == 0:  # the sinks and the window
            k_all, v_all = self.rows(t)
            keys = mx.concatenate([k_all[:, :, :first], k_all[:, :, t - self.window:]], axis=2)
            values = mx.concatenate([v_all[:, :, :first], v_all[:, :, t - self.window:]], axis=2)
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale)
        stop = self.coded_until()
        k = min(k, stop - first)
        b, hq, _, d = queries.shape
        keys, values = self.keys.buffer, self.values.buffer
        h, room = keys.shape[1], keys.shape[2]
        rotary = self.rotary  # when given, the query is framed in the pass, else by ``frame`` here
        parts = 2 if rotary is not None and not rotary.traditional and (d // 2) % self.sub_dim == 0 else 1
        codes, table = self._step_views(hq // h, parts)
        room_c = codes.shape[-1]
        fn, constants = _step_plan(rotary, first, self.fraction, self.window, float(scale), self.sub_dim, parts,
                                   b, h, d, room, room_c)
        pos = float(position - self.query_offset)
        framed = queries if rotary is not None else self.frame(queries, mx.array([pos]))
        return fn(queries, framed, keys, values, codes, table, _scalar(t), _scalar(stop), _scalar((room_c - k,)),
                  _scalar(pos), *constants)

    def _step_views(self, gqa: int, parts: int):
        """The codes (B, H, Rc, D/s) as the step's gather reads them, (B, H, gqa, parts,
        D/(s parts), Rc), and the codebook as its product reads it, (B, H, gqa, parts, s, 2**bits)
        float32: views (a transpose and broadcasts), each built when what it views changes
        (the codes at a coding, the codebook at its fit or a restore) and kept until then."""
        codes, centroids = self.codes.buffer, self.centroids
        b, h, room, n = codes.shape

        def codes_view():
            c = codes.reshape(b, h, 1, room, parts, n // parts).transpose(0, 1, 2, 4, 5, 3)
            return mx.broadcast_to(c, (b, h, gqa, parts, n // parts, room))

        def table_view():
            t = centroids.astype(mx.float32).swapaxes(-1, -2)[:, None, None, None]  # (B, 1, 1, 1, s, K)
            return mx.broadcast_to(t, (b, h, gqa, parts, *t.shape[-2:]))

        return (self._views.get(self, (codes, gqa, parts), codes_view),
                self._table_views.get(self, (centroids, b, h, gqa, parts), table_view))

    # -- what is kept -------------------------------------------------------------------------
    def arrays(self) -> dict[str, Any]:
        return {"keys": self.keys, "values": self.values, "codes": self.codes,
                "centroids": self.centroids, "factor": self.factor, "h_sum": self.h_sum}

    def restore(self, arrays: dict[str, Any], batch: int) -> None:
        """The saved arrays back; a table saved without the batch axis (the layout before
        tables were per row: one sequence's, or one shared by a cache's rows) is every
        row's. (The cache gives each buffer its saved room back: ``CompressedKVCache.state``.)"""
        self._views.clear()
        self._table_views.clear()
        for name in ("keys", "values", "codes"):
            getattr(self, name).reset(arrays.get(name))
        for name in ("centroids", "factor", "h_sum"):
            if name in arrays:
                table = arrays[name]
                setattr(self, name, table if table is None or table.ndim == 3 else _per_row(table, batch))

    def layout_problems(self, head_dim: int, batch: int):
        n = head_dim // self.sub_dim
        codes = self.codes.view()
        if codes is not None and (codes.shape[3], codes.dtype) != (n, self.index_dtype):
            yield "key code indices per token", (codes.shape[3], codes.dtype), (n, self.index_dtype)
        tables = {"codebook (rows, centroids, sub_dim)": (self.centroids, 1 << self.bits),
                  "metric factor (rows, sub_dim, sub_dim)": (self.factor, self.sub_dim),
                  "query moment (rows, sub_dim, sub_dim)": (self.h_sum, self.sub_dim)}
        for field, (table, rows) in tables.items():
            if table is not None and tuple(table.shape) != (batch, rows, self.sub_dim):
                yield field, tuple(table.shape), (batch, rows, self.sub_dim)

    def problems(self, offset: int):
        if self.keys.length != offset or self.values.length != offset:
            yield "tokens stored", f"{self.keys.length} keys / {self.values.length} values", f"the offset {offset}"
        if self.codes.length > self.keys.length:
            yield "coded keys", self.codes.length, f"at most the {self.keys.length} stored"
        if self.codes.length and self.centroids is None:
            yield "codebook", None, f"a codebook for the {self.codes.length} coded keys"


def _per_row(table: mx.array, batch: int) -> mx.array:
    """One table (..., m) as every row's: (batch, ..., m), a copy a row (a broadcast one
    would be read as one table of the rows together: another product than each row's)."""
    return mx.contiguous(mx.broadcast_to(table[None], (batch, *table.shape)))


# -- the retrieving decode step, one compiled pass ----------------------------------------------
@dataclass(frozen=True)
class _Step:
    """What a retrieving step's pass depends on besides its inputs' shapes."""

    first: int  # sinks
    fraction: float
    window: int
    scale: float
    rotary: bool  # the query framed in the pass (by the ``_frame_tables``), else it comes framed
    parts: int  # 2: each rotary pair's halves in sub-spaces D/2 apart (the query split in halves)
    traditional: bool  # rotary pairs adjacent


@functools.lru_cache(maxsize=8)
def _frame_tables(rotary: Rotary, dims: int, sub_dim: int, parts: int):
    """``derotate`` at one position p as ``x cos(p w) + x' sign sin(p w)``, with x' each
    channel's rotary partner (x2 for x1, x1 for x2: the query's halves, or its adjacent
    pairs, reversed): w, each channel's angle per position, and the sign (+1 for a pair's
    first member, -1 for its second), shaped as the step splits the query (``parts`` 2: (2,
    D/(2s), s); else (2, D/2), or (D/2, 2) when the pairs are adjacent); built once per
    rotary setting, evaluated with the first step."""
    w = rotary.inverse_frequencies(dims)
    half = dims // 2
    pair = mx.arange(dims) // 2 if rotary.traditional else mx.arange(dims) % half
    second = (mx.arange(dims) % 2 == 1) if rotary.traditional else (mx.arange(dims) >= half)
    sign = mx.where(second, -1.0, 1.0)
    split = (2, half // sub_dim, sub_dim) if parts == 2 else ((half, 2) if rotary.traditional else (2, half))
    return w[pair].reshape(split), sign.reshape(split)


# a float's bits as an unsigned integer ordered as the floats are (-0 as +0): negative ones
# inverted, the sign bit set on the others
_SIGN = 0x80000000


def _ordered_bits(x: mx.array) -> mx.array:
    u = mx.view(x, mx.uint32)
    top = mx.array(_SIGN, mx.uint32)
    return mx.where(u == top, top, mx.where(u >= top, ~u, u | top))


def _step_graph(how: _Step, queries, framed, keys, values, codes, table, t, stop, kth_at, pos,
                cand, rows, starts, *frame):
    """Sparse attention of a decode query over the buffers' room (``RetrievalStore.selected``
    and the attention over its choice, with static shapes): ``t`` tokens stored, ``stop``
    coded, the query framed at ``pos``; ``codes`` and ``table`` the views of
    ``RetrievalStore._step_views``, ``cand`` and ``rows`` the positions of the codes' room
    and the buffers', ``starts`` (B, H, 1, 1) where each head's rows start in the flattened
    buffers.

    The candidates' (coded tokens past the sinks) scores by lookup tables, a sub-space's
    table by one product a query head; each scored token keyed by its score's bits, ordered
    as the floats, and its position below them (the room past the candidates keyed by its
    position alone, below every candidate): per query head the top ``k`` keys, those from
    the one at ``kth_at`` of the sorted keys, are the top ``k`` scores with ties at the k-th
    to the latest tokens. Their union over the KV head's query heads, the sinks and the
    window (coded..stored) are gathered in token order: one sort of the room with kept rows
    first, each row's flat index (kept ones less the flattened buffers' size: negative, an
    index from the end, which the take wraps to the row). The number gathered is fixed by
    the room, rows past those kept masked out. The KV head's query heads attend as its rows
    of queries."""
    b, hq, _, d = queries.shape
    h, room = keys.shape[1], keys.shape[2]
    gqa, first, parts = hq // h, how.first, how.parts
    _, _, _, _, n_part, room_c = codes.shape
    sub = d // (parts * n_part)
    if how.rotary:
        w, sign = frame
        split = (b, h, gqa, *w.shape)
        x = queries.reshape(split)
        partner = x[..., ::-1] if how.traditional else x[:, :, :, ::-1]
        angle = pos * w
        q = x.astype(mx.float32) * mx.cos(angle) + partner.astype(mx.float32) * (sign * mx.sin(angle))
    else:
        q = framed.astype(mx.float32)
    shape = (b, h, gqa, parts, n_part, sub)
    q = q if q.shape == shape else q.reshape(shape)
    # each sub-space's score of every centroid, taken at each token's code, summed
    scores = mx.take_along_axis(q @ table, codes, axis=-1).sum(axis=(3, 4))  # (B, H, gqa, Rc)
    scored = (cand >= first) & (cand < stop)
    key = (mx.where(scored, _ordered_bits(scores), 0).astype(mx.uint64) << 32) | cand.astype(mx.uint64)
    kth = mx.slice(mx.sort(key, axis=-1), kth_at, axes=(3,), slice_size=(b, h, gqa, 1))
    chosen = (key >= kth).any(axis=2, keepdims=True)  # (B, H, 1, Rc)
    if room_c < room:
        chosen = mx.pad(chosen, [(0, 0), (0, 0), (0, 0), (0, room - room_c)], constant_values=False)
    elif room_c > room:
        chosen = chosen[..., :room]
    keep = chosen | (rows < first) | ((rows >= stop) & (rows < t))
    # at most k a query head (k <= fraction * room), and the window under 2 windows
    n = room_c - first
    most = min(room, first + min(gqa * int(how.fraction * room), n) + how.window + max(1, how.window) - 1)
    flat = b * h * room
    order = mx.sort(mx.where(keep, rows - flat, rows) + starts, axis=-1)[..., :most]  # (B, H, 1, most)
    # whole rows by one index a row from the flattened (B H room, D) buffers: take_along_axis
    # with the index broadcast over D reads an index an element, and its CUDA kernel slowed
    # with the rows' count (benchmarks/notes/serving_batches.md)
    at = order.reshape(b, h, most)
    k_sel, v_sel = mx.take(keys.reshape(-1, d), at, axis=0), mx.take(values.reshape(-1, d), at, axis=0)
    out = mx.fast.scaled_dot_product_attention(queries.reshape(b, h, gqa, d), k_sel, v_sel,
                                               scale=how.scale, mask=order < 0)
    return out.reshape(b, hq, 1, d)


@functools.lru_cache(maxsize=None)
def _step_fn(how: _Step):
    return mx.compile(functools.partial(_step_graph, how))


@functools.lru_cache(maxsize=32)
def _step_plan(rotary: Rotary | None, first: int, fraction: float, window: int, scale: float, sub_dim: int,
               parts: int, b: int, h: int, d: int, room: int, room_c: int):
    """A retrieving step's pass and its constant inputs for the buffers' rooms: the
    positions of the codes' room and of the buffers', where each head's rows start in the
    flattened buffers (B, H, 1, 1), and the rotation's tables (each built once a shape,
    evaluated with the first step that reads it)."""
    inside = rotary is not None
    how = _Step(first, fraction, window, scale, inside, parts, inside and rotary.traditional)
    frame = _frame_tables(rotary, d, sub_dim, parts) if inside else ()
    return _step_fn(how), (row_indices(room_c), row_indices(room), row_starts(b, h, room)[..., None], *frame)


@functools.lru_cache(maxsize=64, typed=True)
def _scalar(value) -> mx.array:
    """``value`` as an array (a tuple: int32 (n,)), made once a value: every layer's step at
    one position reads the same counts."""
    return mx.array(list(value), mx.int32) if isinstance(value, tuple) else mx.array(value)
