"""The quantized store's packed decode layout: one set of arrays for a batch of sequences.

A batch of ``QuantizedKVStore`` sequences past their prompts (``cache/batch.py`` says when a
batch is packed) keeps each of the store's quantities as one array with the batch first:

- packed keys (per channel) ``(B, H, D, words)`` and their scales/minima, sequence b's
  ``kq[b]`` tokens first, the rest room or padding;
- packed values (per token) ``(B, H, rows, ...)``, sequence b's ``vq[b]`` rows first;
- the full-precision key window ``(B, H, key_block, D)``, ``kw[b]`` rows held from row 0;
- the value window ``(B, H, window + value_flush, D)``, a ring per sequence: ``vheld[b]``
  rows from row ``ring[b]`` on (so that the values leaving the window are read, not the
  window moved).

A decode step writes each sequence's key and value into its own slots, attends once for
the batch, then flushes as each sequence's store would alone (attend first, then a full key
block into packed keys, ``value_flush`` values past the window into packed values).
Sequences reach a
flush at their own steps: a flush quantizes the windows of the whole batch and writes each
sequence's result after its own packed tokens; for a sequence not due, that write lands in
its padding (never read), which costs less than selecting rows and keeps the step's graph
one shape.

Attention is one launch of the fused frag kernel over the batch where it runs (CUDA,
float16: ``kivi_decode_attention_rows``, each sequence's counts and ring start passed to the
kernel), else the pure-MLX path (``kernels/kivi_decode.py``'s ``affine_key_scores`` and
``affine_value_mix``) with per-sequence masks: key scores over [packed keys | key window],
each sequence's own slots valid, one softmax; the probabilities are then gathered into the
values' order (the keys and the values are split at different tokens: KIVI flushes keys by
blocks and values ``value_flush`` at a time). Where a fused kernel reads one sequence but
none reads a packed batch (the simt and folded shapes, Metal), the batch stays per sequence.

Each sequence's host counters mirror the buffers its own store would hold alone
(``_Rows``: rows, start and capacity of every ``GrowingArray``), so that ``extract`` and
``unpack`` give back byte for byte the store of the sequence run alone.
"""

from __future__ import annotations

import mlx.core as mx

from ..cache.base import CompressedKVCache, causal_mask
from ..cache.batch import PackedLayout, check_step_rows, grown_capacity
from ..kernels import kivi_decode as kd
from .packed import GroupAffine
from .store import QuantizedKVStore


class _Rows:
    """Host mirror of one sequence's ``GrowingArray``/``RecentRows``: what its buffer would
    be alone (rows ``start .. length`` held, ``capacity`` allocated)."""

    __slots__ = ("start", "length", "capacity", "step", "limit", "geometric")

    def __init__(self, grown):
        self.start = getattr(grown, "start", 0)
        self.length, self.capacity = grown.length, grown.capacity
        self.step, self.limit, self.geometric = grown.step, grown.limit, grown.geometric

    @property
    def held(self) -> int:
        return self.length - self.start

    def append(self, n: int) -> None:
        if self.start and self.length + n > self.capacity:  # RecentRows moves its rows to the front
            self.start, self.length = 0, self.held
        self.capacity = grown_capacity(self.capacity, self.length, n, self.step, self.limit,
                                       self.geometric)
        self.length += n

    def empty(self) -> None:
        """``truncate(0)``: no rows, the room kept."""
        self.start = self.length = 0

    def compact(self) -> None:
        self.start, self.length = 0, self.held


def _room(x: mx.array, axis: int, need: int, step: int) -> mx.array:
    """``x`` with at least ``need`` entries along ``axis`` (grown by whole ``step``s)."""
    have = x.shape[axis]
    if have >= need:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, -(-(need - have) // step) * step)
    return mx.pad(x, widths)


def _placed(rows: mx.array, axis: int, start: int, capacity: int) -> mx.array | None:
    """A single store's buffer: ``rows`` at ``start`` in ``capacity`` entries along ``axis``."""
    if capacity == 0:
        return None
    widths = [(0, 0)] * rows.ndim
    widths[axis] = (start, capacity - start - rows.shape[axis])
    return mx.contiguous(mx.pad(rows, widths))


def _scatter(buffer: mx.array, rows: mx.array, at: mx.array, axis: int) -> mx.array:
    """``rows`` written into ``buffer`` along ``axis`` from ``at[b]`` on, per sequence b."""
    n, ndim = rows.shape[axis], rows.ndim
    along = [1] * ndim
    along[axis % ndim] = n
    index = at.reshape([-1] + [1] * (ndim - 1)) + mx.arange(n, dtype=mx.int32).reshape(along)
    return mx.put_along_axis(buffer, mx.broadcast_to(index, rows.shape), rows, axis=axis)


class QuantizedPacked(PackedLayout):
    """Decode steps of a batch of KIVI-layout quantized stores (see the module docstring)."""

    @staticmethod
    def accepts(cls: type) -> bool:
        """``cls`` decodes with ``QuantizedCache``'s own steps (the ones redone here)."""
        from .cache import QuantizedCache

        return all(getattr(cls, name) is getattr(QuantizedCache, name)
                   for name in ("update_and_fetch", "attend", "observe", "_take_chunk"))

    @staticmethod
    def _rows_kernel(single) -> bool:
        """Whether a packed batch of ``single``'s sequences attends through the fused kernel's
        packed launch (``kd.kivi_decode_attention_rows``)."""
        store = single.store
        kc, vc = store.keys.codec, store.values.codec
        _, _, d_k, d_v = single.kv_shape
        return (single.use_kernel and d_k == d_v and (kc.bits, kc.group) == (vc.bits, vc.group)
                and kd.rows_kernel_applies(d_k, kc.bits, kc.group, store.v_win.buffer.dtype))

    @classmethod
    def can_pack(cls, single) -> bool:
        if not cls._layout_fits(single):
            return False
        # where a fused kernel reads one sequence but no packed launch reads the batch, per
        # sequence beat this layout's pure-MLX read on the H200 (8B shape, 32k prompts: 280
        # against 66 tokens a second, benchmarks/results/serve_h200_s54/README.md)
        return not (single.use_kernel and kd.gpu_backend() is not None) or cls._rows_kernel(single)

    @staticmethod
    def _layout_fits(single) -> bool:
        store = getattr(single, "store", None)
        return (type(store) is QuantizedKVStore and store.attend_then_flush and store.window > 0
                and store.value_flush <= store.window
                and not store.segments and single.offset > 0 and store.v_win.held > 0
                and isinstance(store.keys.codec, GroupAffine) and store.keys.codec.axis == "channel"
                and isinstance(store.values.codec, GroupAffine) and store.values.codec.axis == "token")

    @classmethod
    def pack(cls, singles) -> "QuantizedPacked":
        self = cls.__new__(cls)
        self.shells = singles
        first = singles[0].store
        self.key_codec, self.value_codec = first.keys.codec, first.values.codec
        self.window, self.key_block, self.value_flush = first.window, first.key_block, first.value_flush
        self.step_tokens = first.keys.scales.step * self.key_codec.group
        self.rows_kernel = self._rows_kernel(singles[0])
        self.mirrors = [{name: _Rows(g) for name, g in s.store.arrays().items()} for s in singles]
        self.offsets = [s.offset for s in singles]
        _, h, d_k, d_v = singles[0].kv_shape
        dtype = first.v_win.buffer.dtype
        kc, vc = self.key_codec, self.value_codec
        self.k_words, self.k_groups = self.key_block * kc.bits // 32, self.key_block // kc.group

        def joined(get, empty_shape, dt, axis, pad_to):
            blocks = []
            for s in singles:
                x = get(s.store)
                x = mx.zeros(empty_shape, dt) if x is None else x
                widths = [(0, 0)] * x.ndim
                widths[axis] = (0, pad_to - x.shape[axis])
                blocks.append(mx.pad(x, widths))
            return mx.concatenate(blocks)

        kq = [s.store.keys.count for s in singles]
        k_tokens = max(kq) + self.key_block  # room for every sequence's next block
        words, groups = k_tokens * kc.bits // 32, k_tokens // kc.group
        self.kc = joined(lambda st: st.keys.codes.view(), (1, h, d_k, 0), mx.uint32, 3, words)
        self.ks = joined(lambda st: st.keys.scales.view(), (1, h, d_k, 0), dtype, 3, groups)
        self.kb = joined(lambda st: st.keys.biases.view(), (1, h, d_k, 0), dtype, 3, groups)
        rows = max(s.store.values.count for s in singles) + self.value_flush
        self.vc = joined(lambda st: st.values.codes.view(), (1, h, 0, d_v * vc.bits // 32), mx.uint32, 2, rows)
        self.vs = joined(lambda st: st.values.scales.view(), (1, h, 0, d_v // vc.group), dtype, 2, rows)
        self.vb = joined(lambda st: st.values.biases.view(), (1, h, 0, d_v // vc.group), dtype, 2, rows)
        self.kwin = joined(lambda st: st.k_win.view(), (1, h, 0, d_k), dtype, 2, self.key_block)
        self.vwin = joined(lambda st: st.v_win.view(), (1, h, 0, d_v), dtype, 2, self.ring_size)
        self.ring = [0] * len(singles)
        self._pending = None
        for s in singles:  # the shells keep their config, context and layer; not their rows
            s.store = s.make_store()
        self._sync()
        return self

    # -- counters --------------------------------------------------------------------------
    def _counts(self, name: str) -> list[int]:
        if name == "kq":
            return [m["k_scales"].length * self.key_codec.group for m in self.mirrors]
        if name == "vq":
            return [m["v_codes"].length for m in self.mirrors]
        return [m[{"kw": "k_res", "vheld": "v_res"}[name]].held for m in self.mirrors]

    def _sync(self) -> None:
        self.offset_array = mx.array(self.offsets, mx.int32)

    # -- a decode step ---------------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        check_step_rows(self.shells[0], keys, values)
        self._pending = (keys, values)
        self.offsets = [o + 1 for o in self.offsets]
        self.offset_array = self.offset_array + 1
        return keys, values

    def attend(self, queries, keys, values, *, scale, sinks=None):
        self.shells[0]._own_attention_begins(sinks)
        new_k, new_v = self._pending
        self._pending = None
        cap = self.ring_size
        kw, vheld = self._counts("kw"), self._counts("vheld")
        at = mx.array([kw, [(r + v) % cap for r, v in zip(self.ring, vheld)]], mx.int32)
        self.kwin = _scatter(self.kwin, new_k.astype(self.kwin.dtype), at[0], 2)
        self.vwin = _scatter(self.vwin, new_v.astype(self.vwin.dtype), at[1], 2)
        for m in self.mirrors:
            m["k_res"].append(1)
            m["v_res"].append(1)
        out = self._attention(queries, scale)
        self._flush()
        return out

    def _attention(self, queries, scale) -> mx.array:
        b, hq, _, d_k = queries.shape
        h = self.kwin.shape[1]
        kq, kw, vq, vheld = (self._counts(n) for n in ("kq", "kw", "vq", "vheld"))
        if self.rows_kernel:
            kc = self.key_codec
            out = kd.kivi_decode_attention_rows(
                queries, self.kc, self.ks, self.kb, self.kwin, self.vc, self.vs, self.vb,
                self.vwin, tuple(zip(kq, kw, vq, vheld, self.ring)), scale=scale, bits=kc.bits,
                group_size=kc.group)
            if out is not None:
                return out
        n_kq, n_vq, cap = max(kq), max(vq), self.ring_size
        c = mx.array([kq, kw, vq, vheld, self.ring], mx.int32)[..., None]  # (5, B, 1)
        q = queries.astype(mx.float32).reshape(b, h, hq // h, d_k) * scale
        kc, vc = self.key_codec, self.value_codec
        scores = []
        if n_kq:
            scores.append(kd.affine_key_scores(q, self.kc, self.ks, self.kb, n_kq, kc.bits, kc.group))
        scores.append(q @ self.kwin.astype(mx.float32).swapaxes(-1, -2))
        s = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
        valid = mx.concatenate([mx.arange(n_kq)[None] < c[0], mx.arange(self.key_block)[None] < c[1]], axis=-1)
        p = mx.softmax(mx.where(valid[:, None, None], s, -mx.inf), axis=-1)
        # each value slot's token, then that token's place among the key scores
        in_ring = (mx.arange(cap)[None] - c[4]) % cap
        token = mx.concatenate([mx.broadcast_to(mx.arange(n_vq)[None], (b, n_vq)), c[2] + in_ring], axis=-1)
        held = mx.concatenate([mx.arange(n_vq)[None] < c[2], in_ring < c[3]], axis=-1)
        place = mx.where(token < c[0], token, n_kq + token - c[0])
        place = mx.where(held, place, 0)[:, None, None]
        pv = mx.take_along_axis(p, mx.broadcast_to(place, (*p.shape[:3], place.shape[-1])), axis=-1)
        pv = mx.where(held[:, None, None], pv, 0.0)
        o = pv[..., n_vq:] @ self.vwin.astype(mx.float32)
        if n_vq:
            o = o + kd.affine_value_mix(pv[..., :n_vq], self.vc, self.vs, self.vb, n_vq, vc.bits, vc.group)
        return o.reshape(b, hq, 1, o.shape[-1]).astype(queries.dtype)

    def _flush(self) -> None:
        """What each store does after attending: a full key block into packed keys, the
        value past the window into packed values; all rows written, each into its own."""
        kc = self.key_codec
        if any(m["k_res"].held == self.key_block for m in self.mirrors):
            due = [m["k_res"].held == self.key_block for m in self.mirrors]
            kq = self._counts("kq")
            tokens = max(kq) + self.key_block
            self.kc = _room(self.kc, 3, tokens * kc.bits // 32, self.step_tokens * kc.bits // 32)
            self.ks = _room(self.ks, 3, tokens // kc.group, self.step_tokens // kc.group)
            self.kb = _room(self.kb, 3, tokens // kc.group, self.step_tokens // kc.group)
            codes, scales, biases = kc.encode(self.kwin)
            at = mx.array(kq, mx.int32)
            self.kc = _scatter(self.kc, codes, at * kc.bits // 32, 3)
            self.ks = _scatter(self.ks, scales, at // kc.group, 3)
            self.kb = _scatter(self.kb, biases, at // kc.group, 3)
            for m, flush in zip(self.mirrors, due):
                if flush:
                    m["k_codes"].append(self.k_words)
                    m["k_scales"].append(self.k_groups)
                    m["k_biases"].append(self.k_groups)
                    m["k_res"].empty()
        n = self.value_flush
        if any(m["v_res"].held >= self.window + n for m in self.mirrors):
            due = [m["v_res"].held >= self.window + n for m in self.mirrors]
            vq = self._counts("vq")
            self.vc, self.vs, self.vb = (_room(x, 2, max(vq) + n, self.step_tokens)
                                         for x in (self.vc, self.vs, self.vb))
            cap = self.ring_size
            oldest = (mx.array(self.ring, mx.int32)[:, None] + mx.arange(n, dtype=mx.int32)) % cap
            oldest = mx.broadcast_to(oldest[:, None, :, None], (*self.vwin.shape[:2], n, 1))
            rows = mx.take_along_axis(self.vwin, oldest, axis=2)
            codes, scales, biases = (self.value_codec.encode_one(rows) if n == 1
                                     else self.value_codec.encode(rows))
            at = mx.array(vq, mx.int32)
            self.vc = _scatter(self.vc, codes, at, 2)
            self.vs = _scatter(self.vs, scales, at, 2)
            self.vb = _scatter(self.vb, biases, at, 2)
            for i, (m, flush) in enumerate(zip(self.mirrors, due)):
                if flush:
                    m["v_res"].start += n
                    m["v_res"].compact()
                    for name in ("v_codes", "v_scales", "v_biases"):
                        m[name].append(n)
                    self.ring[i] = (self.ring[i] + n) % cap

    @property
    def ring_size(self) -> int:
        return self.window + self.value_flush

    # -- what BatchGenerator calls -------------------------------------------------------------
    _ARRAYS = ("kc", "ks", "kb", "vc", "vs", "vb", "kwin", "vwin")

    def make_mask(self, N, return_array):
        if N == 1:
            return None
        if not return_array:
            return "causal"
        return causal_mask(N, max(self.offsets) + N)

    def filter(self, keep: list[int]) -> None:
        index = mx.array(keep, mx.int32)
        for name in self._ARRAYS:
            setattr(self, name, getattr(self, name)[index])
        for name in ("shells", "mirrors", "offsets", "ring"):
            setattr(self, name, [getattr(self, name)[i] for i in keep])
        self._sync()

    def extend(self, other: "QuantizedPacked") -> None:
        for name in self._ARRAYS:
            mine, theirs = getattr(self, name), getattr(other, name)
            axis = 3 if name in ("kc", "ks", "kb") else 2
            n = max(mine.shape[axis], theirs.shape[axis])
            setattr(self, name, mx.concatenate([_room(mine, axis, n, 1), _room(theirs, axis, n, 1)]))
        for name in ("shells", "mirrors", "offsets", "ring"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._sync()

    def _single(self, b: int, shell):
        store, m = shell.make_store(), self.mirrors[b]
        kc, vc, cap = self.key_codec, self.value_codec, self.ring_size
        one = slice(b, b + 1)
        held_v = m["v_res"].held
        ring = (self.ring[b] + mx.arange(held_v)) % cap
        sources = {
            "k_codes": (self.kc[one, ..., : m["k_codes"].length], 3),
            "k_scales": (self.ks[one, ..., : m["k_scales"].length], 3),
            "k_biases": (self.kb[one, ..., : m["k_biases"].length], 3),
            "v_codes": (self.vc[one, :, : m["v_codes"].length], 2),
            "v_scales": (self.vs[one, :, : m["v_scales"].length], 2),
            "v_biases": (self.vb[one, :, : m["v_biases"].length], 2),
            "k_res": (self.kwin[one, :, : m["k_res"].held], 2),
            "v_res": (self.vwin[one, :, ring], 2),
        }
        for name, grown in store.arrays().items():
            rows, axis = sources[name]
            mirror = m[name]
            grown.buffer = _placed(rows, axis, mirror.start, mirror.capacity)
            grown.length = mirror.length if mirror.capacity else 0
            if hasattr(grown, "start"):
                grown.start = mirror.start if mirror.capacity else 0
        shell.store = store
        shell.offset = self.offsets[b]
        return shell

    def is_trimmable(self) -> bool:
        return False

    def size(self) -> int:
        return max(self.offsets)

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, n).nbytes for n in self._ARRAYS) + self.offset_array.nbytes

    @property
    def state(self):
        return [getattr(self, n) for n in self._ARRAYS]

    __deepcopy__ = CompressedKVCache.__deepcopy__
