"""A GEAR decode step's read as one part: the compressed chunks and the buffer under one softmax.

``GEARStore`` is the chunked store (``quant/chunk_store.py``) whose decode step hands
``kernels/decode.py`` one ``PackedScores`` part, ``JointRead``: the compressed chunks'
scores then the buffer's (one concatenation), and the mix of both from the one split of
the weights (the buffer's product added into the chunks' mix: ``addmm``). Where nothing
but the backbone is kept (rank 0, no outliers) the parts stay the chunked store's, which
the fused kernel reads.

The chunks are read two ways, to the same sums (float32 reassociation apart):

- the CPU's ``quantized_matmul`` path: ``reader.ErrorFeedbackScores`` (the backbone read
  packed, the low-rank and sparse terms added to the scores and the mix);
- the pure path of a GPU (no ``quantized_matmul`` there: the backbone is dequantized in
  float32 at every step anyway): the outliers scatter-added into the dequantized keys
  (values) before the one product with the queries (weights): one scatter of the table's
  own entries, no product per query row; the low-rank term as ``chunked.py`` computes it,
  ``q B_c`` gathered per group along its own axis and, for the mix, ``Σ_t p_t A_t`` per
  group as one product against A broadcast along the query rows, then B gathered per group.
  What it reads of the stored buffers (the valid rows, reshaped, broadcast, the chunk of
  each group) are views kept between flushes (``ReadViews``): a step slices nothing of
  the history.

On CUDA the float32 products of that path are what cuBLAS serves badly at decode shapes: a
step there rebuilds the rows in the queries' dtype instead (the backbone, the outliers
written in, each group's rows of A times its chunk's B) for one fused attention
(``GEARStore._decoded_attention``).
"""

from __future__ import annotations

import operator

import mlx.core as mx

from ...kernels import kivi_decode as kd
from ...kernels.decode import DecodePart, decode_attention, scaled_queries
from ...quant.chunk_store import ChunkedStore
from ...quant.store import absent_buffer, as_dtype, joined_history
from ...quant.token_rows import KeptRead, ReadViews, held
from .error_feedback import ErrorFeedbackTokens


def _has_terms(tokens) -> bool:
    return isinstance(tokens, ErrorFeedbackTokens) and (tokens.factors is not None or tokens.sparse is not None)


def _run_views(tokens: ErrorFeedbackTokens, rows: int, keys: bool, lowrank: bool = True) -> dict:
    """The pure path's views of one run (keys per channel, values per token); ``lowrank``
    off: the backbone's and the outliers' only."""
    n, c = tokens.count, tokens.codec.base
    base = tokens.base
    if keys:  # (B, H, D, words), (B, H, D, groups)
        out = dict(codes=base.codes.buffer[..., : n * c.bits // 32], scales=base.scales.buffer[..., : n // c.group],
                   biases=base.biases.buffer[..., : n // c.group])
    else:  # (B, H, rows, ·)
        out = {name: getattr(base, name).buffer[:, :, :n] for name in ("codes", "scales", "biases")}
    f = tokens.factors
    if lowrank and f is not None and f.count:
        a, b = f.a.buffer[:, :, :n], f.b.view()  # (B, H, n, r), (B, H, C, d, r)
        bs, h, _, rank = a.shape
        groups, g = n // c.group, c.group
        a = a.reshape(bs, h, groups, g, rank)
        chunk = f.chunk.buffer[:n:g].reshape(1, 1, groups, 1, 1)  # each group's chunk
        if keys:  # along the query rows: (B, H, R, C, d, r), (B, H, R, groups, r, group)
            chunk = chunk.reshape(1, 1, 1, groups, 1, 1)
            out["lowrank"] = (_along_rows(b, rows), _along_rows(a.swapaxes(-1, -2), rows),
                              mx.broadcast_to(chunk, (bs, h, rows, groups, 1, rank)))
        else:
            d = b.shape[3]
            out["lowrank"] = (_along_rows(a, rows), b.swapaxes(-1, -2),
                              mx.broadcast_to(chunk, (bs, h, groups, rank, d)))
    s = tokens.sparse
    if s is not None and s.entries:
        delta, index = s.delta.view(), s.index.view()
        if not keys:
            delta, index = delta[:, :, :n], index[:, :, :n]
        # keys: a channel's token positions, values: a token's channels (distinct in a vector)
        out["sparse"] = (index, delta)
    return out


def _dense_views(tokens: ErrorFeedbackTokens, keys: bool) -> dict:
    """What a run's rows are rebuilt from (``_rows``): its backbone's and outliers' views as
    ``_run_views`` takes them, and its low-rank factors by group (A (B, H, groups, group,
    r), each chunk's Bᵀ (B, H, C, r, d), the chunk of each group (1, 1, groups, 1, 1))."""
    out = _run_views(tokens, 1, keys, lowrank=False)
    f, group = tokens.factors, tokens.codec.base.group
    if f is not None and f.count:
        n = tokens.count
        a = f.a.buffer[:, :, :n]
        out["lowrank"] = (a.reshape(*a.shape[:2], n // group, group, a.shape[-1]), f.b.view().swapaxes(-1, -2),
                          f.chunk.buffer[:n:group].reshape(1, 1, n // group, 1, 1))
    return out


def _rows(v: dict, keys: bool, bits: int, group: int, dtype) -> mx.array:
    """A run's rows (B, H, n, D) in ``dtype``: the backbone dequantized in its scales' dtype
    (the model's), the outliers written in, the low-rank term added group by group (each
    group's rows of A times its chunk's B)."""
    x = kd.dequantize(v["codes"], v["scales"], v["biases"], group, bits)
    if "sparse" in v:
        x = _outliers_added(x, *v["sparse"])
    x = x.swapaxes(-1, -2) if keys else x
    if "lowrank" in v:
        a, b_t, chunk = v["lowrank"]
        bs, h, groups, g, _ = a.shape
        low = a.astype(x.dtype) @ mx.take_along_axis(b_t, chunk, axis=2).astype(x.dtype)  # (B, H, groups, group, d)
        x = x + low.reshape(bs, h, groups * g, -1)
    return as_dtype(x, dtype)


def _along_rows(x: mx.array, rows: int) -> mx.array:
    """``x`` (B, H, ...) broadcast along ``rows`` query rows: (B, H, rows, ...), a view."""
    return mx.broadcast_to(x[:, :, None], (*x.shape[:2], rows, *x.shape[2:]))


def _float32(x: mx.array) -> mx.array:
    """A view of stored factors in float32 (a cast where they are kept in another dtype)."""
    if x.dtype == mx.float32:
        return x
    return x.astype(mx.float32)


def _outliers_added(x: mx.array, index: mx.array, delta: mx.array) -> mx.array:
    """``x`` (B, H, rows, n) plus ``delta`` (B, H, rows, k) at ``index`` along its last
    axis: a read of the entries, the add, a write back (a vector's entries are distinct
    positions: ``outliers.tail_indices``, offset per chunk)."""
    return mx.put_along_axis(x, index, mx.take_along_axis(x, index, axis=-1) + delta.astype(x.dtype), axis=-1)


def _key_scores(q: mx.array, v: dict, bits: int, group: int) -> mx.array:
    """(B, H, R, n) float32: the dequantized keys, the outliers added in, times ``q``, plus
    the low-rank term."""
    k = kd.dequantize(v["codes"], v["scales"].astype(mx.float32), v["biases"].astype(mx.float32), group, bits)
    if "sparse" in v:
        k = _outliers_added(k, *v["sparse"])
    s = q @ k  # (B, H, R, D) @ (B, H, D, n)
    if "lowrank" in v:
        b, a_t, chunk = v["lowrank"]
        b, a_t = _float32(b), _float32(a_t)  # views where the factors are kept in float32
        bs, h, r, groups, _, g = a_t.shape
        qb = q.reshape(bs, h, r, 1, 1, -1) @ b  # (B, H, R, C, 1, r): q B_c for every chunk
        lr = mx.take_along_axis(qb, chunk, axis=3) @ a_t  # (B, H, R, groups, 1, group): per group, its chunk's
        s = s + lr.reshape(bs, h, r, groups * g)
    return s


def _value_mix(p: mx.array, v: dict, bits: int, group: int) -> mx.array:
    """(B, H, R, D) float32: ``p`` times the dequantized values with the outliers added in,
    plus the low-rank term."""
    x = kd.dequantize(v["codes"], v["scales"].astype(mx.float32), v["biases"].astype(mx.float32), group, bits)
    if "sparse" in v:
        x = _outliers_added(x, *v["sparse"])
    o = kd.token_mix(p, x)
    if "lowrank" in v:
        a, b_t, chunk = v["lowrank"]  # (B, H, R, groups, group, r), (B, H, C, r, d), (B, H, groups, r, d)
        bs, h, r, groups, g, rank = a.shape
        per_group = p.reshape(bs, h, r, groups, 1, g) @ _float32(a)  # Σ_t p_t A_t per group
        b_g = _float32(mx.take_along_axis(b_t, chunk, axis=2))  # (B, H, groups, r, d)
        o = mx.addmm(o, per_group.reshape(bs, h, r, groups * rank), b_g.reshape(bs, h, groups * rank, -1))
    return o


class JointRead:
    """A decode step's read of a ``GEARStore`` as one ``PackedScores`` part (keys and
    values) of ``kernels/decode.py``: the compressed chunks, then the buffer's rows."""

    def __init__(self, store: "GEARStore", empty: mx.array):
        self.store, self.empty = store, empty
        self.n_packed = store.keys.count
        self.k_tail, self.v_tail = store.k_buf.view(), store.v_buf.view()
        self.count = self.n_packed + (0 if self.k_tail is None else self.k_tail.shape[2])
        self.n_heads = store.keys.base.codes.buffer.shape[1]

    def part(self) -> DecodePart:
        return DecodePart(self, None, self, None)

    def _pure(self) -> bool:
        return kd._pure_path() != "qmm"

    def scores(self, q: mx.array) -> mx.array:
        """float32 scores (B, H, R, count) for scaled float32 queries (B, H, R, D)."""
        keys = self.store.keys
        if self._pure():
            c = keys.codec.base
            s = _key_scores(q, self.store.read_views(q.shape[2])[0], c.bits, c.group)
        else:
            s = keys.layout(self.empty).scores(q)
        if self.k_tail is None:
            return s
        return mx.concatenate([s, q @ self.k_tail.astype(mx.float32).swapaxes(-1, -2)], axis=-1)

    def mix(self, p: mx.array) -> mx.array:
        """float32 ``p V`` (B, H, R, D) for weights (B, H, R, count) in ``scores``' order."""
        store = self.store
        if not store.quantize_values:  # every value in full precision, in the buffer
            return kd.token_mix(p, self.v_tail.astype(mx.float32))
        w, w_tail = mx.split(p, [self.n_packed], axis=-1) if self.v_tail is not None else (p, None)
        values = store.values
        if self._pure():
            c = values.codec.base
            o = _value_mix(w, store.read_views(p.shape[2])[1], c.bits, c.group)
        else:
            o = values.layout(self.empty).mix(w)
        if w_tail is None:
            return o
        return mx.addmm(o, w_tail, self.v_tail.astype(mx.float32))


class GEARStore(ChunkedStore):
    """The chunked store whose decode step reads one ``JointRead`` part where the chunks
    keep more than the backbone."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._views = ReadViews()  # the pure path's views of the runs (``read_views``)
        self._plan = KeptRead()  # a decode step's reads of the runs (``_step_plan``)

    def _flush(self, keys: mx.array, values: mx.array, decoding: bool = False) -> None:
        self._read_views_holder().clear()  # no view pins a buffer the appends below write in place
        held(self, "_dense", ReadViews).clear()
        self._plan_holder().value = None
        super()._flush(keys, values, decoding=decoding)

    def _plan_holder(self) -> "KeptRead":
        return held(self, "_plan", KeptRead)

    def _read_views_holder(self) -> ReadViews:
        return held(self, "_views", ReadViews)

    def read_views(self, rows: int) -> tuple:
        """(keys' views, values' views or None) for ``rows`` query rows a KV head."""
        runs = [self.keys] + ([self.values] if self.quantize_values else [])
        key = (rows,) + tuple(x for run in runs for x in _run_sources(run))

        def build():
            return (_run_views(self.keys, rows, keys=True),
                    _run_views(self.values, rows, keys=False) if self.quantize_values else None)

        return self._read_views_holder().get(self, key, build)

    def attend_parts(self, queries, *, scale, use_kernel, n_kv_heads: int) -> mx.array:
        """A decode step's attention: one ``JointRead`` part where the chunks keep more than
        the backbone (``decode_parts`` otherwise: the fused kernel's layouts), computed as
        ``kernels/decode.py``'s joint path computes that part (``_step``)."""
        if not self.keys.count or not _has_terms(self.keys) or (self.quantize_values and not _has_terms(self.values)):
            return super().attend_parts(queries, scale=scale, use_kernel=use_kernel, n_kv_heads=n_kv_heads)
        if use_kernel and kd.gpu_backend() == "cuda":
            return self._decoded_attention(queries, scale)
        return self._step(queries, scale, n_kv_heads)

    def _decoded_attention(self, queries, scale) -> mx.array:
        """On CUDA: the runs' rows rebuilt in the queries' dtype (``_rows``) and the buffer's,
        one fused attention. The float32 read's products are what cuBLAS serves badly at
        decode shapes (kitty's and skvq's reads, benchmarks/results/h200_s66). What the
        rebuild reads first (the codes, the outliers' positions, the rows of A) waits for
        the queries, so that MLX does not rebuild later layers' rows ahead of their
        attention and hold them all (``PackedStore.history_after``)."""
        views = [dict(v) for v in self.dense_views() if v is not None]  # keys', then values' if packed
        slots = [(v, name) for v in views for name in ("codes", "sparse", "lowrank") if name in v]
        firsts = [v[name] if name == "codes" else v[name][0] for v, name in slots]
        for (v, name), x in zip(slots, mx.depends(firsts, [queries])):
            v[name] = x if name == "codes" else (x, *v[name][1:])
        dtype = queries.dtype
        rows = [_rows(v, run is self.keys, run.codec.base.bits, run.codec.base.group, dtype)
                for v, run in zip(views, (self.keys, self.values))]
        k, v = joined_history(rows[:1], rows[1:], self.k_buf.view(), self.v_buf.view(), dtype)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale)

    def dense_views(self) -> tuple:
        """(keys' ``_dense_views``, values' or None), kept while the runs stay as they are."""
        runs = [self.keys] + ([self.values] if self.quantize_values else [])
        key = tuple(x for run in runs for x in _run_sources(run))
        return held(self, "_dense", ReadViews).get(self, key, lambda: (_dense_views(self.keys, keys=True),
                                                  _dense_views(self.values, keys=False) if self.quantize_values else None))

    def _step(self, queries, scale, n_kv_heads: int) -> mx.array:
        """``decode_attention`` of the one ``JointRead`` part (its joint path: no kernel reads
        the part), the same operations in the same order, with what the reads take of the
        runs kept between writes (``_step_plan``): the compiled passes and their inputs on
        the CPU's ``quantized_matmul`` path, the views on the pure path."""
        n_heads = self.keys.base.codes.buffer.shape[1]  # the part's heads (``JointRead.n_heads``)
        plan = self._step_plan(queries.shape[1] // n_heads, queries.dtype)
        q = scaled_queries(queries, n_heads, scale)
        if plan[0]:  # the pure path
            s = _key_scores(q, plan[1][0], plan[2], plan[3])
        else:
            s = plan[1](q, *plan[2])
            if plan[3] is not None:
                s = s[..., : plan[3]]
        k_tail = self.k_buf.view()
        if k_tail is not None:
            s = mx.concatenate([s, q @ k_tail.astype(mx.float32).swapaxes(-1, -2)], axis=-1)
        p = mx.softmax(s, axis=-1)
        v_tail = self.v_buf.view()
        if not self.quantize_values:  # every value in full precision, in the buffer
            o = kd.token_mix(p, v_tail.astype(mx.float32))
        else:
            w, w_tail = mx.split(p, [plan[7]], axis=-1) if v_tail is not None else (p, None)
            if plan[0]:
                o = _value_mix(w, plan[1][1], plan[5], plan[6])
            else:
                if plan[6] is not None:  # the weights of the rows past the count: zeros
                    w = mx.pad(w, plan[6])
                o = plan[4](w, *plan[5])
            if w_tail is not None:
                o = mx.addmm(o, w_tail, v_tail.astype(mx.float32))
        return o.reshape(queries.shape).astype(queries.dtype)

    def _step_plan(self, rows: int, dtype) -> tuple:
        """What a decode step reads of the runs for ``rows`` query rows a KV head, built at
        the first step after a write (``_flush`` drops it) and kept while the runs' buffers
        (by identity), counts and the read path stay: (pure, then the pure path's
        (views, None, key bits, key group, None, value bits, value group) or the CPU's (key
        pass, its inputs, the key count where it is cut from the room, value pass, its
        inputs, the weights' pad)), then the packed count."""
        path = kd._pure_path()
        keys, values = self.keys, self.values
        counts = (rows, path, keys.count, values.count)
        holder = self._plan_holder()
        plan = holder.value
        if plan is not None and plan[0] is keys and plan[1] is values and plan[2] == counts \
                and all(map(operator.is_, map(_BUFFER, plan[3]), plan[4])):
            return plan[5]
        grown = tuple(_grown(keys)) + (tuple(_grown(values)) if self.quantize_values else ())
        buffers = tuple(g.buffer for g in grown)
        lead = (*keys.base.codes.buffer.shape[:2], rows)
        if path != "qmm":
            kc = keys.codec.base
            vc = values.codec.base if self.quantize_values else kc
            step = (True, self.read_views(rows), kc.bits, kc.group, None, vc.bits, vc.group, keys.count)
        else:
            empty = absent_buffer(dtype)
            k_fn, k_in, k_cut = keys.layout(empty).score_pass(lead, path)
            v_fn = v_in = v_pad = None
            if self.quantize_values:
                v_fn, v_in, v_pad = values.layout(empty).mix_pass(lead, path)
            step = (False, k_fn, k_in, k_cut, v_fn, v_in, v_pad, keys.count)
        holder.value = (keys, values, counts, grown, buffers, step)
        return step


_BUFFER = operator.attrgetter("buffer")


def _grown(run) -> list:
    """Every growing buffer a run keeps (``arrays``), in a fixed order."""
    return list(run.arrays("").values())


def _run_sources(run: ErrorFeedbackTokens) -> tuple:
    """What a run's views are made from: its count and every buffer (by identity)."""
    out = [run.count, run.base.codes.buffer, run.base.scales.buffer, run.base.biases.buffer]
    if run.factors is not None:
        f = run.factors
        out += [f.count, f.n_chunks, f.a.buffer, f.b.buffer, f.chunk.buffer]
    if run.sparse is not None:
        out += [run.sparse.delta.length, run.sparse.delta.buffer, run.sparse.index.buffer]
    return tuple(out)
