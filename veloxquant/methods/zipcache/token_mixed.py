"""Precision by token: a quantized store whose tokens are split between two classes.

Every token of every KV head belongs to one class, ``hi`` or ``lo``, each a codec over
the rows ``x / c`` (``methods/zipcache/channel_scaled.py``: channel-separable token-wise
quantization; the per-channel scales ``c`` of keys and of values, per layer and KV head,
are computed from the first tokens compressed and then frozen, and stored). The classes
are decided per (batch, KV head) by a **saliency** (``quant/saliency.py``): of a span of
n tokens, the ``n_salient(fraction, n)`` most salient go to ``hi``, the others to ``lo``,
so every head holds the same number of each, but not the same tokens.

Layout: each class keeps its tokens of each head in arrival order in one growing packed
store (``PackedTokens``: keys and values in the same order; values in full precision when
``quantize_values`` is off), with one uint8 flag per token and head in position order
(1: hi) that puts them back in order (``history``). New decode tokens wait in full
precision in a buffer (written in place) until ``block`` have come; then the block is
scored with the current query and compressed (re-compression of decode blocks); a prompt
chunk compresses the buffer and itself at once, scored by its probe queries.

Attention. A prompt chunk attends over the history decoded in position order plus
itself (one float32 softmax per query: SDPA); the same keys give the probes' weights. A
decode step writes its token into the buffer, then attends over the hi class, the lo
class and the buffer under one float32 softmax: one part (``_JointRead``) of
``kernels/decode.py``'s joint path (the softmax does not depend on the order of the
keys, so the classes are attended as stored). Their keys are per-token rows, which the
fused kernels (per-channel keys) do not read, so the read is pure MLX on every device:
on the CPU one ``quantized_matmul`` over the packed codes for ``q Kᵀ`` and one for ``p V``
a class (a step dequantizes nothing), on a GPU the valid rows dequantized in float32 and
multiplied (``token_rows.TokenRows``' two paths). The channel scales are folded into the
query (``(q c) K'ᵀ``, once for both classes) and the output (``(p V') c``, once for both).
What the read takes from the classes (the valid rows of each packed buffer, the channel
scales in the query's and the output's layout) are views kept between flushes
(``ReadViews``): a step slices nothing of the history. The block-scoring step reuses that
step's scores (the whole cache's, the buffer last): the history is read once. On CUDA the
other steps, which score nothing, read both classes' rows decoded in the queries' dtype and
the buffer through one fused attention (``TokenMixedStore._decoded_attention``).
"""

from __future__ import annotations

import functools
import itertools

from typing import Any

import mlx.core as mx

from ...cache.buffers import GrowingArray
from ...kernels import kivi_decode as kd
from ...kernels.compiled import PerShape
from ...kernels.decode import DecodePart, decode_attention
from .channel_scaled import channel_scale
from ...quant.packed import GROWTH_TOKENS, PackedTokens
from ...quant.saliency import n_salient, salient_split
from ...quant.store import WINDOW_STEP, PackedStore, as_dtype, joined_history, paced
from ...quant.token_rows import (PlainRows, ReadViews, TokenGroups, TokenRows, held, mixed_into, row_mix,
                                 row_scores)


class TokenClass:
    """The tokens of one precision class: keys (and values) of each head in arrival order."""

    def __init__(self, codec: TokenGroups, quantize_values: bool, step_tokens: int = GROWTH_TOKENS):
        self.keys = PackedTokens(codec, step_tokens)
        self.values = PackedTokens(codec, step_tokens) if quantize_values else None
        self.raw_values = None if quantize_values else GrowingArray(axis=2, step=step_tokens)

    @property
    def count(self) -> int:
        return self.keys.count

    @property
    def value_count(self) -> int:
        return self.values.count if self.values is not None else self.raw_values.length

    def append(self, keys, values, k_channel, v_channel, decoding: bool = False) -> None:
        """``decoding``: a decode block's tokens (shapes that recur: the compiled encoder)."""
        self.keys.append((keys.astype(mx.float32) / k_channel[:, :, None]).astype(keys.dtype), decoding)
        if self.values is not None:
            self.values.append((values.astype(mx.float32) / v_channel[:, :, None]).astype(values.dtype), decoding)
        else:
            self.raw_values.append(values)

    def valid(self):
        """What a decode step reads: ((key codes, scales, minima), (value codes, scales,
        minima) or the full-precision values), each the valid rows of its buffer (views)."""
        n = self.count
        keys = tuple(g.buffer[:, :, :n] for g in (self.keys.codes, self.keys.scales, self.keys.biases))
        if self.values is None:
            return keys, self.raw_values.buffer[:, :, :n]
        return keys, tuple(g.buffer[:, :, :n] for g in (self.values.codes, self.values.scales, self.values.biases))

    def sources(self) -> tuple:
        """The arrays ``valid`` views, and the count (what its views depend on)."""
        k, v = self.keys, self.values  # spelled out: a decode step builds it (``_class_views``' key)
        if v is None:
            return k.codes.buffer, k.scales.buffer, k.biases.buffer, self.raw_values.buffer, k.count
        return (k.codes.buffer, k.scales.buffer, k.biases.buffer, v.codes.buffer, v.scales.buffer,
                v.biases.buffer, k.count)

    def views(self) -> tuple:
        """The valid rows of what the class keeps: key codes, scales and minima, then the
        values' (or the full-precision values)."""
        keys = (self.keys.codes.view(), self.keys.scales.view(), self.keys.biases.view())
        if self.values is None:
            return (*keys, self.raw_values.view())
        return (*keys, self.values.codes.view(), self.values.scales.view(), self.values.biases.view())

    def readers(self, empty, k_channel, v_channel):
        keys = TokenRows(self.keys.layout(empty), k_channel)
        if self.values is None:
            return keys, PlainRows(self.raw_values.buffer, self.raw_values.length)
        return keys, TokenRows(self.values.layout(empty), v_channel)

    def arrays(self, prefix: str) -> dict[str, GrowingArray]:
        out = self.keys.arrays(f"{prefix}_k")
        if self.values is not None:
            out.update(self.values.arrays(f"{prefix}_v"))
        else:
            out[f"{prefix}_v_rows"] = self.raw_values
        return out


def _class_decoded(codec: TokenGroups, views: tuple, k_channel, v_channel, dtype):
    """A class's keys and values (B, H, count, D) in ``dtype`` from ``TokenClass.views``."""
    keys = (codec.decode(*views[:3], mx.float32) * k_channel[:, :, None]).astype(dtype)
    if len(views) == 4:
        return keys, views[3].astype(dtype)
    return keys, (codec.decode(*views[3:], mx.float32) * v_channel[:, :, None]).astype(dtype)


@functools.lru_cache(maxsize=None)
def _classes_decoded(codecs: tuple, quantize_values: bool, dtype):
    """Every compressed token (B, H, n, D) in position order, from the non-empty classes'
    views (hi first) and, with two, the flags (the k-th flagged token is the k-th hi one,
    and so on), one pass compiled for each shape (``kernels/compiled.py``)."""
    def decoded(views, k_channel, v_channel, flags):
        parts = [_class_decoded(c, v, k_channel, v_channel, dtype) for c, v in zip(codecs, views)]
        if len(parts) == 1:
            return parts[0]
        k, v = (mx.concatenate([p[i] for p in parts], axis=2) for i in (0, 1))
        hi = flags.astype(mx.int32)
        n_hi = parts[0][0].shape[2]
        source = mx.where(hi > 0, mx.cumsum(hi, axis=-1) - 1, n_hi + mx.cumsum(1 - hi, axis=-1) - 1)
        return _gather(k, source), _gather(v, source)

    return PerShape(decoded)


def _gather(x: mx.array, index: mx.array) -> mx.array:
    return mx.take_along_axis(x, index[..., None], axis=2)


class _JointRead:
    """A decode step's read of a ``TokenMixedStore`` as one ``PackedScores`` part (keys and
    values) of ``kernels/decode.py``: the hi class, the lo class and the buffer under the
    dispatcher's one softmax (its joint path: no kernel reads per-token keys). ``scores``
    keeps what it returns as ``logits`` (B, H, R, N): the classes' tokens in class order,
    then the buffer's, which the block scoring reads."""

    def __init__(self, store: "TokenMixedStore", q_shape, n_kv_heads: int):
        b, hq, _, d = q_shape
        self.classes, self.kc, self.vc, stored, self.ends = store._class_views(b, n_kv_heads, hq // n_kv_heads, d)
        self.k_tail, self.v_tail = store.k_buf.view(), store.v_buf.view()
        self.n_heads = n_kv_heads
        self.count = stored + (0 if self.k_tail is None else self.k_tail.shape[2])
        self.logits = None

    def part(self) -> DecodePart:
        return DecodePart(self, None, self, None)

    def scores(self, q: mx.array) -> mx.array:
        """float32 scores (B, H, R, N) for scaled float32 queries (B, H, R, D)."""
        out = []
        if self.classes:
            qc = q * self.kc  # keys are rows of x / c: (q c) (K / c)ᵀ = q Kᵀ, c once for both classes
            out += [row_scores(qc, keys, codec) for keys, codec, _, _ in self.classes]
        if self.k_tail is not None:
            out.append(q @ self.k_tail.astype(mx.float32).swapaxes(-1, -2))
        self.logits = out[0] if len(out) == 1 else mx.concatenate(out, axis=-1)
        return self.logits

    def mix(self, p: mx.array) -> mx.array:
        """float32 ``p V`` (B, H, R, D) for weights (B, H, R, N) in ``scores``' order."""
        cuts = self.ends if self.k_tail is not None else self.ends[:-1]  # each class's end, then the buffer's
        weights = mx.split(p, cuts, axis=-1) if cuts else [p]
        out = None
        for (_, _, values, codec), w in zip(self.classes, weights):
            out = row_mix(out, w, values, codec)
        if self.vc is not None:
            out = out * self.vc  # values are rows of x / c: (p V') c, c once for both classes
        if self.v_tail is not None:
            out = mixed_into(out, weights[-1], self.v_tail.astype(mx.float32))
        return out


@mx.compile
def _times_channels(x, c):
    """Rows (B, H, n, D) times channel scales ``c`` (B, H, 1, D) float32, in ``x``'s dtype."""
    return (x.astype(mx.float32) * c).astype(x.dtype)


class TokenMixedStore(PackedStore):
    """Two precision classes (``hi``, ``lo`` codecs) chosen per token and KV head by
    ``saliency`` (``prefill(queries, keys, scale, first)`` and ``decode(logits, n)``:
    scores of the tokens to compress), ``fraction`` of each span at hi; decode tokens wait
    in full precision until ``block`` have come."""

    def __init__(self, hi: TokenGroups, lo: TokenGroups, fraction: float, block: int,
                 saliency, quantize_values: bool = True, step_tokens: int = GROWTH_TOKENS):
        self.fraction, self.block, self.saliency = fraction, block, saliency
        self.quantize_values = quantize_values
        self.hi = TokenClass(hi, quantize_values, step_tokens)
        self.lo = TokenClass(lo, quantize_values, step_tokens)
        self.flags = GrowingArray(axis=2, step=step_tokens)  # (B, H, n) uint8, 1: hi
        self.k_channel: mx.array | None = None  # (B, H, D) float32, frozen at the first span
        self.v_channel: mx.array | None = None
        room = min(block, WINDOW_STEP)
        self.k_buf = GrowingArray(axis=2, step=room, limit=block, geometric=True)
        self.v_buf = GrowingArray(axis=2, step=room, limit=block, geometric=True)
        self._views = ReadViews()  # the decode read's views of the classes (``_class_views``)

    @property
    def compressed(self) -> int:
        return self.flags.length

    @property
    def length(self) -> int:
        return self.compressed + self.k_buf.length

    # -- writing ----------------------------------------------------------------------
    def commit(self, keys: mx.array, values: mx.array) -> None:
        """Take new tokens into the full-precision buffer (they are classified and
        compressed by the attention calls, which have the queries)."""
        self.k_buf.append(keys)
        self.v_buf.append(values)

    def compress(self, keys: mx.array, values: mx.array, scores: mx.array | None,
                 decoding: bool = False) -> None:
        """Store a span of tokens (B, H, n, D) by class: the ``n_salient`` largest
        ``scores`` (B, H, n) of each head at hi (scores are not read when one class
        takes every token). ``decoding``: a decode block (compiled encoders)."""
        self._views.clear()  # no view pins a buffer the appends below write in place
        n = keys.shape[2]
        n_hi = n_salient(self.fraction, n)
        if self.k_channel is None:
            self.k_channel = channel_scale(keys)
            self.v_channel = channel_scale(values) if self.quantize_values else None
        if 0 < n_hi < n:
            hi, lo = salient_split(scores, n_hi)
            flags = mx.put_along_axis(mx.zeros(keys.shape[:3], mx.uint8), hi, mx.array(1, mx.uint8), axis=-1)
            self.hi.append(_gather(keys, hi), _gather(values, hi), self.k_channel, self.v_channel, decoding)
            self.lo.append(_gather(keys, lo), _gather(values, lo), self.k_channel, self.v_channel, decoding)
        else:
            (self.hi if n_hi else self.lo).append(keys, values, self.k_channel, self.v_channel, decoding)
            flags = mx.full(keys.shape[:3], 1 if n_hi else 0, mx.uint8)
        self.flags.append(flags)

    def _flush_block(self, logits: mx.array) -> None:
        """The buffer is full: score it with the current query (``logits`` (B, H, R, N):
        this step's scores over the whole cache, the buffer last), compress it."""
        keys, values = self.k_buf.view(), self.v_buf.view()
        n = keys.shape[2]
        scores = None
        if 0 < n_salient(self.fraction, n) < n:
            scores = self.saliency.decode(logits, n)
        self.compress(keys, values, scores, decoding=True)
        self.k_buf.truncate(0)
        self.v_buf.truncate(0)

    # -- attention --------------------------------------------------------------------------
    def prefill_attention(self, queries, keys, values, *, scale, mask) -> mx.array:
        """A prompt chunk attends over the history (in order) plus itself; then the
        buffer and the chunk are compressed, scored by the chunk's probe queries."""
        first = self.compressed
        old_k, old_v = self.history(keys.dtype)
        all_k = keys if old_k is None else mx.concatenate([old_k, keys], axis=2)
        all_v = values if old_v is None else mx.concatenate([old_v, values], axis=2)
        out = mx.fast.scaled_dot_product_attention(queries, all_k, all_v, scale=scale, mask=mask)
        n = all_k.shape[2] - first
        scores = None
        if 0 < n_salient(self.fraction, n) < n:
            scores = self.saliency.prefill(queries, all_k, scale, first)
        self.compress(all_k[:, :, first:], all_v[:, :, first:], scores)
        self.k_buf.truncate(0)
        self.v_buf.truncate(0)
        return paced(mx.depends(out, self.written()))

    def decode_attention(self, queries, keys, values, *, scale, use_kernel) -> mx.array:
        """A decode step: the token joins the buffer, attention over the classes and the
        buffer; a full buffer is then scored (by this step's scores) and compressed."""
        self.commit(keys, values)
        if (use_kernel and self.k_buf.length < self.block and self.compressed
                and kd.gpu_backend() == "cuda"):  # no block to score at this step
            return self._decoded_attention(queries, scale, keys.shape[1])
        read = _JointRead(self, queries.shape, keys.shape[1])
        out = decode_attention(queries, [read.part()], scale=scale, use_kernel=use_kernel,
                               n_kv_heads=keys.shape[1])
        if self.k_buf.length >= self.block:
            self._flush_block(read.logits)
            # the next steps' views of the classes, made now: built with this step, not in
            # the next one's graph
            b, hq, _, d = queries.shape
            h = keys.shape[1]
            classes, kc, vc, _, _ = self._class_views(b, h, hq // h, d)
            views = [x for keys, _, values, _ in classes for r in (keys, values)
                     for x in (r if isinstance(r, tuple) else (r,))]
            # no later step reads the flags: generate_step evaluates them with this step's
            # logits, or their appends would chain from flush to flush
            out = mx.depends(out, [self.flags.buffer, *views, *(x for x in (kc, vc) if x is not None)])
        return out

    def _decoded_attention(self, queries, scale, h: int) -> mx.array:
        """On CUDA, a step that scores no block: both classes' rows decoded in the queries'
        dtype and multiplied by the channel scales (classes in turn: softmax does not depend
        on the keys' order), the buffer's rows as they are, one fused attention. The float32
        read's products are what cuBLAS serves badly at decode shapes
        (benchmarks/results/h200_s66). The codes are decoded only once the queries exist,
        so that MLX does not decode later layers' rows ahead of their attention and hold
        them all (``PackedStore.history_after``)."""
        b, hq, _, d = queries.shape
        classes = self._class_views(b, h, hq // h, d)[0]
        coded = [x[0] for keys, _, values, _ in classes for x in (keys, values) if isinstance(x, tuple)]
        gated = iter(mx.depends(coded, [queries]))
        k_rows, v_rows = self._channel_rows()
        dtype, rows_k, rows_v = queries.dtype, [], []
        for keys, k_codec, values, v_codec in classes:
            rows_k.append(_times_channels(k_codec.decode(next(gated), *keys[1:], dtype), k_rows))
            if isinstance(values, tuple):
                rows_v.append(_times_channels(v_codec.decode(next(gated), *values[1:], dtype), v_rows))
            else:
                rows_v.append(as_dtype(values, dtype))
        k, v = joined_history(rows_k, rows_v, self.k_buf.view(), self.v_buf.view(), dtype)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale)

    def _channel_rows(self) -> tuple:
        """The key and value channel scales as rows (B, H, 1, D) (values: None where they are
        kept in full precision), views kept while the scales stay."""
        k, v = self.k_channel, self.v_channel
        return held(self, "_channel_views", ReadViews).get(self, (k, v), lambda: (k[:, :, None], None if v is None else v[:, :, None]))

    def attend(self, queries, *, scale, use_kernel, n_kv_heads=None) -> mx.array:
        """A decode step's attention over what is stored (no token added, no flush)."""
        h = n_kv_heads or self.k_buf.buffer.shape[1]
        return decode_attention(queries, [_JointRead(self, queries.shape, h).part()], scale=scale,
                                use_kernel=use_kernel, n_kv_heads=h)

    def _class_views(self, b: int, h: int, r: int, d: int):
        """(the classes that hold tokens, each as (its keys' valid rows, their codec, its
        values' valid rows, their codec), the key channel scales (B, H, R, D), the value
        channel scales (B, H, R, D) or None, the tokens the classes hold, each class's end
        in their order), the arrays views, kept while the classes and the channel scales
        stay as they are."""
        key = (b, h, r, d, self.k_channel, self.v_channel) + self.hi.sources() + self.lo.sources()

        def build():
            classes = [c for c in (self.hi, self.lo) if c.count]
            shape = (b, h, r, d)
            kc = vc = None
            if classes:
                kc = mx.broadcast_to(self.k_channel[:, :, None, :], shape)
                if self.quantize_values:
                    vc = mx.broadcast_to(self.v_channel[:, :, None, :], shape)
            reads = []
            for c in classes:
                keys, values = c.valid()
                reads.append((keys, c.keys.codec, values, c.keys.codec if c.values is None else c.values.codec))
            ends = list(itertools.accumulate(c.count for c in classes))
            return reads, kc, vc, (ends[-1] if ends else 0), ends

        return self._views.get(self, key, build)

    # -- reading ----------------------------------------------------------------------------
    def history(self, dtype) -> tuple[mx.array | None, mx.array | None]:
        """Every stored token in ``dtype``, in position order (transient: prefill chunks
        and tests): the classes put back where their flags say, then the buffer."""
        parts_k, parts_v = [], []
        classes = [c for c in (self.hi, self.lo) if c.count]
        if classes:  # one pass compiled for the classes' shapes (kernels/compiled.py)
            k, v = _classes_decoded(tuple(c.keys.codec for c in classes), self.quantize_values, dtype)(
                [c.views() for c in classes], self.k_channel, self.v_channel,
                self.flags.view() if len(classes) > 1 else None)
            parts_k.append(k)
            parts_v.append(v)
        return joined_history(parts_k, parts_v, self.k_buf.view(), self.v_buf.view(), dtype)

    def decode_parts(self, empty) -> list[DecodePart]:
        """The hi class with the buffer as its tail, then the lo class (empty ones left out)."""
        tail_k = self.k_buf.view() if self.k_buf.length else None
        tail_v = self.v_buf.view() if self.k_buf.length else None
        parts = []
        for cls in (self.hi, self.lo):
            if cls.count or cls is self.hi:
                keys, values = cls.readers(empty, self.k_channel, self.v_channel) if cls.count else (None, None)
                parts.append(DecodePart(keys, tail_k, values, tail_v))
                tail_k = tail_v = None
        return [p for p in parts if p.length]

    # -- checks of a restored state ------------------------------------------------------------
    def layout_problems(self, head_dims: tuple[int, int]):
        """(field, found, expected) for stored arrays whose shapes contradict their codecs."""
        for name, cls in (("hi", self.hi), ("lo", self.lo)):
            stores = [(cls.keys, "key", head_dims[0])]
            if cls.values is not None:
                stores.append((cls.values, "value", head_dims[1]))
            for packed, what, dim in stores:
                if packed.codes.buffer is None:
                    continue
                found = tuple(packed.codes.view().shape[2:]), tuple(packed.scales.view().shape[2:])
                expected = packed.expected_shapes(dim)
                if found != expected:
                    c = packed.codec
                    yield (f"{name}-class {what} codes and scales", found,
                           f"{expected} ({c.bits}-bit codes, groups of {c.group})")
        for rows, what, dim in ((self.k_buf, "keys", head_dims[0]), (self.v_buf, "values", head_dims[1]),
                                (self.hi.raw_values, "hi-class values", head_dims[1]),
                                (self.lo.raw_values, "lo-class values", head_dims[1])):
            if rows is not None and rows.buffer is not None and rows.buffer.shape[3] != dim:
                yield f"full-precision {what}' head_dim", rows.buffer.shape[3], dim
        for scale, what, dim in ((self.k_channel, "key", head_dims[0]), (self.v_channel, "value", head_dims[1])):
            if scale is not None and scale.shape[-1] != dim:
                yield f"{what} channel scales' head_dim", scale.shape[-1], dim

    def problems(self, offset: int):
        """(field, found, expected) for each way the stored tokens contradict the policy."""
        if self.length != offset:
            yield "tokens stored", self.length, f"the offset {offset}"
        for name, cls in (("hi", self.hi), ("lo", self.lo)):
            if cls.value_count != cls.count:
                yield f"{name}-class tokens", f"{cls.count} keys / {cls.value_count} values", "as many values as keys"
        if self.hi.count + self.lo.count != self.compressed:
            yield ("compressed tokens", f"{self.hi.count} hi + {self.lo.count} lo",
                   f"the {self.compressed} tokens flagged")
        elif self.compressed:
            per_head = self.flags.view().astype(mx.int32).sum(axis=-1)
            if not bool(mx.all(per_head == self.hi.count)):
                yield "hi flags per head", per_head.tolist(), f"{self.hi.count} in every head"
            if self.k_channel is None or (self.quantize_values and self.v_channel is None):
                yield "channel scales", "missing", "saved with the compressed tokens"
        if self.k_buf.length != self.v_buf.length or self.k_buf.length >= self.block:
            yield ("full-precision buffer", f"{self.k_buf.length} keys / {self.v_buf.length} values",
                   f"as many values as keys, fewer than the block {self.block}")

    # -- what is kept ----------------------------------------------------------------------------
    def arrays(self) -> dict[str, Any]:
        return {**self.hi.arrays("hi"), **self.lo.arrays("lo"), "flags": self.flags,
                "k_channel": self.k_channel, "v_channel": self.v_channel,
                "k_buf": self.k_buf, "v_buf": self.v_buf}
