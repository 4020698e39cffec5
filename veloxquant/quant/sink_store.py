"""A quantized store with attention sinks and a flush that never takes the newest key.

``SinkQuantizedStore`` is ``QuantizedKVStore`` (``store.py``) with three differences:

- the first ``n_sink`` tokens of the sequence stay in full precision for good (StreamingLLM's
  sinks, kept by Kitty), attended as a part of their own (full-precision rows only);
- keys flush in blocks of ``key_block`` only once the full-precision tail holds more than
  ``key_block`` keys, so the block flushed never holds the newest token and the tail keeps
  1..key_block keys (Kitty's ``-L-1:-1`` slice); values slide one token at a time as in
  the parent, the newest ``window`` exact;
- the key storage is given, not built from a codec: ``PackedTokens`` or anything with its
  interface (``count``, ``append``, ``decode``, ``layout``, ``arrays``, ``expected_shapes``,
  ``codes``/``scales``, ``codec.bits``/``group``; ``plane_problems`` if it keeps more), such
  as ``promoted.PromotedKeys``.
"""

from __future__ import annotations

import mlx.core as mx

from ..cache.buffers import GrowingArray
from ..kernels.decode import DecodePart
from .packed import GROWTH_TOKENS, GroupAffine
from .store import QuantizedKVStore, _rows


class SinkQuantizedStore(QuantizedKVStore):
    def __init__(self, keys, value_codec: GroupAffine, *, window: int, key_block: int,
                 n_sink: int, step_tokens: int = GROWTH_TOKENS):
        # The parent's state, then the key storage given in place of one built from a codec.
        super().__init__(value_codec, value_codec, window=window, key_block=key_block,
                         step_tokens=step_tokens)
        self.keys, self.n_sink = keys, n_sink
        self.sink_k = GrowingArray(step=max(n_sink, 1), limit=n_sink)
        self.sink_v = GrowingArray(step=max(n_sink, 1), limit=n_sink)

    @property
    def length(self) -> int:
        return self.sink_k.length + super().length

    def commit(self, keys: mx.array, values: mx.array) -> None:
        n = min(self.n_sink - self.sink_k.length, keys.shape[2])
        if n > 0:  # the sequence's first tokens: sinks
            self.sink_k.append(keys[:, :, :n])
            self.sink_v.append(values[:, :, :n])
            if n == keys.shape[2]:
                return
            keys, values = keys[:, :, n:], values[:, :, n:]
        k_res = keys if self.k_res is None else mx.concatenate([self.k_res, keys], axis=2)
        n_flush = (k_res.shape[2] - 1) // self.key_block * self.key_block  # the newest stays
        if n_flush:
            self.keys.append(k_res[:, :, :n_flush])
            k_res = mx.contiguous(k_res[:, :, n_flush:])
        self.k_res = k_res
        v_res = values if self.v_res is None else mx.concatenate([self.v_res, values], axis=2)
        n_old = v_res.shape[2] - self.window
        if n_old > 0:
            self.values.append(v_res[:, :, :n_old])
            v_res = mx.contiguous(v_res[:, :, n_old:])
        self.v_res = v_res

    def history(self, dtype):
        keys, values = super().history(dtype)
        if not self.sink_k.length:
            return keys, values
        sink_k, sink_v = self.sink_k.view().astype(dtype), self.sink_v.view().astype(dtype)
        if keys is None:
            return sink_k, sink_v
        return mx.concatenate([sink_k, keys], axis=2), mx.concatenate([sink_v, values], axis=2)

    def decode_parts(self, empty: mx.array) -> list[DecodePart]:
        parts = []
        if self.sink_k.length:
            parts.append(DecodePart(None, self.sink_k.view(), None, self.sink_v.view()))
        return parts + super().decode_parts(empty)

    # -- a restored state must agree with the policy ------------------------------------------
    def layout_problems(self, head_dims: tuple[int, int]):
        """(field, found, expected) for arrays whose shapes contradict their codecs."""
        yield from super().layout_problems(head_dims)
        yield from getattr(self.keys, "plane_problems", lambda d: ())(head_dims[0])
        for rows, name, dim in ((self.sink_k, "sink keys", head_dims[0]), (self.sink_v, "sink values", head_dims[1])):
            if rows.buffer is not None and rows.buffer.shape[3] != dim:
                yield f"{name} head_dim", rows.buffer.shape[3], dim

    def problems(self, offset: int):
        """(field, found, expected) for each way the stored tokens contradict the policy."""
        n_sink, rest = self.sink_k.length, max(0, offset - self.n_sink)
        n_kq, n_vq = self.keys.count, self.values.count
        k_res, v_res = _rows(self.k_res), _rows(self.v_res)
        if n_sink != min(offset, self.n_sink) or self.sink_v.length != n_sink:
            yield "sink tokens", f"{n_sink} keys / {self.sink_v.length} values", f"min(offset {offset}, {self.n_sink})"
        if n_kq % self.key_block:
            yield "quantized keys", n_kq, f"a multiple of the key block {self.key_block}"
        if not (1 if rest else 0) <= k_res <= min(rest, self.key_block):
            yield "full-precision keys", k_res, f"1..{self.key_block} once past the sinks"
        if v_res != min(rest, self.window):
            yield "full-precision values", v_res, f"min({rest} tokens past the sinks, window {self.window})"
        if n_kq + k_res != rest or n_vq + v_res != rest:
            yield "tokens stored", f"{n_kq + k_res} keys / {n_vq + v_res} values past the sinks", f"{rest}"

    def arrays(self):
        return {**super().arrays(), "sink_k": self.sink_k, "sink_v": self.sink_v}
