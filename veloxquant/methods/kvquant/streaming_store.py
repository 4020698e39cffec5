"""A quantized store of attention sinks, key blocks and values encoded as they come.

``StreamingStore`` is ``SinkKVStore`` (``sink_store.py``: sinks in front of
``QuantizedKVStore``) with:

- key and value storage given, not built from a group-affine codec: ``PackedTokens`` or
  anything with its interface (``count``, ``append(x, decoding=False)``, ``decode``,
  ``layout``, ``arrays``), plus ``problems(name, head_dim)`` for what a restored state
  must satisfy, ``refit()`` when its codec can be refreshed, and ``rotary``/``start`` when
  it keeps keys pre-RoPE (``methods/kvquant/nonuniform.py``'s ``NonUniformTokens``);
- KIVI's flush rule past the sinks: keys in whole blocks of ``key_block`` (the newest
  ``n mod key_block`` stay exact), values past a window of ``window`` tokens, 0 allowed:
  every value is encoded as it comes (a token stream), or, with ``value_flush`` > 1, decode
  steps encode the values past the window that many at a time;
- a decode step (one token) written in place and, every ``refit_interval`` decode steps
  (0: never), ``refit()`` on both storages;
- a decode step's read as one part (``_JointRead``) of ``kernels/decode.py``'s joint path
  (no kernel reads these storages): the sinks, the packed keys and the exact key tail under
  one softmax, the values likewise, the sink keys read through a transposed view kept
  while they stay as they are, the three value products summed in one fused pass.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import mlx.core as mx

from ...kernels.decode import DecodePart, decode_attention, scaled_queries
from ...kernels.kivi_decode import token_mix
from ...quant.packed import GROWTH_TOKENS
from ...quant.sink_store import SinkKVStore
from ...quant.token_rows import ReadViews


class StreamingStore(SinkKVStore):
    def __init__(self, keys, values, *, n_sink: int, key_block: int, window: int = 0,
                 refit_interval: int = 0, step_tokens: int = GROWTH_TOKENS, value_flush: int = 1):
        super().__init__(keys, values, window=window, key_block=key_block, n_sink=n_sink, step_tokens=step_tokens,
                         value_flush=value_flush)
        self.refit_interval, self.steps = refit_interval, 0
        self._views = ReadViews()  # the sinks as a decode step reads them (``_sink_views``)

    # -- writing -------------------------------------------------------------------------
    def commit(self, keys: mx.array, values: mx.array) -> None:
        if self.sink_k.length < self.n_sink:
            self._views.clear()  # no view pins the sink buffers written in place below
        keys, values, n = self._take_sinks(keys, values)
        if keys.shape[2] == 1 and not n:
            self._step(keys, values)
        elif keys.shape[2]:
            super().commit(keys, values)

    def _step(self, keys: mx.array, values: mx.array) -> None:
        """A decode step: rows written in place, a block flushed when whole, maybe a refit."""
        self.k_win.append(keys)
        if self.k_win.held == self.key_block:
            self.keys.append(self.k_win.view(), decoding=True)
            self.k_win.truncate(0)  # its room stays: the next block fills it without growing
        if self.window or self.value_flush > 1:
            self._step_values(values)
        else:
            self.values.append(values, decoding=True)
        self.steps += 1
        if self.refit_interval and self.steps % self.refit_interval == 0:
            for storage in (self.keys, self.values):
                getattr(storage, "refit", lambda: None)()

    # -- reading -------------------------------------------------------------------------------
    def attend_parts(self, queries, *, scale, use_kernel, n_kv_heads: int) -> mx.array:
        """A decode step's attention: every stored token as one part (``_JointRead``)."""
        if self.segments:
            return super().attend_parts(queries, scale=scale, use_kernel=use_kernel, n_kv_heads=n_kv_heads)
        sink_kt, sink_v = self._sink_views()
        keys, values = self.keys, self.values
        n_keys, k_tail = keys.count, self.k_win.view()
        if sink_kt is None and not n_keys and k_tail is None:  # nothing stored
            read = _JointRead(self, n_kv_heads)
            return decode_attention(queries, [DecodePart(read, None, read, None)], scale=scale,
                                    use_kernel=use_kernel, n_kv_heads=n_kv_heads)
        # kernels/decode.py's joint path (no kernel reads these storages), the queries
        # scaled in one fused pass: ``_JointRead``'s scores and mix, their operations in
        # the same order, each run's compiled pass and inputs kept between its writes
        # (``NonUniformTokens.read_pass``)
        q = scaled_queries(queries, n_kv_heads, scale)
        out = []
        if sink_kt is not None:
            out.append(q @ sink_kt.astype(mx.float32))
        if n_keys:
            fn, args, capacity = keys.read_pass()
            s = fn(q, *args)
            out.append(s if capacity == n_keys else s[..., :n_keys])
        if k_tail is not None:
            out.append(q @ k_tail.astype(mx.float32).swapaxes(-1, -2))
        p = mx.softmax(out[0] if len(out) == 1 else mx.concatenate(out, axis=-1), axis=-1)
        n_values, v_tail = values.count, self.v_win.view()
        cuts = []  # where the weights of the sinks, the packed values and the tail meet
        if sink_v is not None:
            cuts.append(sink_v.shape[2])
        if n_values:
            cuts.append(n_values + (cuts[-1] if cuts else 0))
        if v_tail is None:
            cuts.pop()
        weights = mx.split(p, cuts, axis=-1) if cuts else [p]  # one node, not a slice a read
        outs, i = [], 0
        if sink_v is not None:
            outs.append(weights[0] @ sink_v.astype(mx.float32))
            i = 1
        if n_values:
            fn, args, capacity = values.read_pass()
            w = weights[i]
            if capacity > n_values:  # the weights of the rows past the count: zeros
                w = mx.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, capacity - n_values)])
            outs.append(fn(w, *args))
            i += 1
        if v_tail is not None:
            outs.append(token_mix(weights[i], v_tail.astype(mx.float32)))
        o = outs[0] if len(outs) == 1 else _summed(len(outs))(*outs)
        return o.reshape(queries.shape).astype(queries.dtype)

    def _sink_views(self):
        """(the sink keys transposed (B, H, D, n_sink), the sink values), views kept while the
        sinks stay as they are; (None, None) without sinks."""
        k, v = self.sink_k, self.sink_v
        if not k.length:
            return None, None
        key = (k.buffer, k.length, v.buffer, v.length)
        return self._views.get(self, key, lambda: (k.view().swapaxes(-1, -2), v.view()))

    # -- a restored state must agree with the policy ------------------------------------------
    def layout_problems(self, head_dims: tuple[int, int]):
        for storage, name, dim in ((self.keys, "key", head_dims[0]), (self.values, "value", head_dims[1])):
            yield from storage.problems(name, dim)
        yield from self._sink_layout_problems(head_dims)

    # -- what is kept ------------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        rotary = getattr(self.keys, "rotary", None)
        return {"steps": self.steps, "rotary": rotary.to_json() if rotary is not None else "none"}

    def restore(self, meta: dict[str, Any], arrays: dict[str, Any]) -> None:
        for storage, prefix in ((self.keys, "k"), (self.values, "v")):
            upgrade = getattr(storage, "with_batch_axis", None)  # a layout saved before the batch axis
            arrays = arrays if upgrade is None else upgrade(prefix, arrays)
        super().restore(meta, arrays)
        self.steps = int(meta.get("steps", 0))
        if meta.get("rotary", "none") != "none":
            from ...cache.rope import Rotary

            self.keys.rotary = Rotary.from_json(meta["rotary"])


class _JointRead:
    """A decode step's read of a ``StreamingStore`` as one ``PackedScores`` part (keys and
    values) of ``kernels/decode.py``'s joint path: scores over the sinks, the packed keys and
    the exact key tail, in the tokens' order, under its one softmax; ``mix`` takes the
    weights in the same order and cuts them where the values' sinks, packed run and exact
    tail meet (the keys' and the values' packed runs may hold different counts)."""

    def __init__(self, store: StreamingStore, n_kv_heads: int):
        self.sink_kt, self.sink_v = store._sink_views()
        self.keys = store.keys.layout(None) if store.keys.count else None
        self.values = store.values.layout(None) if store.values.count else None
        self.k_tail, self.v_tail = store.k_win.view(), store.v_win.view()
        self.n_heads = n_kv_heads
        self.count = store.length

    def scores(self, q: mx.array) -> mx.array:
        """float32 scores (B, H, R, count) for scaled float32 queries (B, H, R, D)."""
        out = []
        if self.sink_kt is not None:
            out.append(q @ self.sink_kt.astype(mx.float32))
        if self.keys is not None:
            out.append(self.keys.scores(q))
        if self.k_tail is not None:
            out.append(q @ self.k_tail.astype(mx.float32).swapaxes(-1, -2))
        return out[0] if len(out) == 1 else mx.concatenate(out, axis=-1)

    def mix(self, p: mx.array) -> mx.array:
        """float32 ``p V`` (B, H, R, D) for weights (B, H, R, count) in ``scores``' order."""
        reads = [(x.shape[2], lambda w, x=x: w @ x.astype(mx.float32)) for x in (self.sink_v,) if x is not None]
        if self.values is not None:
            reads.append((self.values.count, self.values.mix))
        if self.v_tail is not None:
            reads.append((self.v_tail.shape[2], lambda w, x=self.v_tail: token_mix(w, x.astype(mx.float32))))
        cuts = list(itertools.accumulate(n for n, _ in reads[:-1]))
        weights = mx.split(p, cuts, axis=-1) if cuts else [p]  # one node, not a slice a read
        outs = [read(w) for (_, read), w in zip(reads, weights)]
        return outs[0] if len(outs) == 1 else _summed(len(outs))(*outs)



@functools.lru_cache(maxsize=None)
def _summed(n: int):
    """The sum of ``n`` arrays as one fused pass (in the order given)."""
    def total(*xs):
        out = xs[0]
        for x in xs[1:]:
            out = out + x
        return out

    return mx.compile(total)
