"""Kitty: KIVI-style 2-bit keys with a dynamic channel-wise precision boost.

A configuration of the sink store (``quant/sink_store.py``) with promoted-channel keys
(``methods/kitty/promoted.py``). Per key block of L tokens and per (batch, KV head), the
``int(d * kitty_hi_fraction)`` channels of largest mean |K| over the block are quantized at
``kitty_hi_bit``, the others at ``kitty_lo_bit``, in groups of ``kitty_group_size`` tokens
per channel; values per token at ``kitty_lo_bit`` in groups of ``kitty_group_size``
channels. The first 32 tokens (the repo's ``sink_length``: no config field holds it) stay
in full precision; L is the config's ``residual_window`` (the repo's ``buffer_length``,
128 by default). Keys flush a block once more than L wait, so the newest key is never
quantized and 1..L keys stay exact; the newest L values stay exact. A prompt of 32 tokens
or fewer is kept whole. The repo's prefill leaves 0..L-1 keys exact and, when that is 0,
quantizes the prompt's last block a second time at the first decode step; here prefill and
decode follow the one rule, so what is stored does not depend on how the prompt is chunked.
The repo attends each step over the cache as it was before that step's quantization; here,
as in kivi, a key block or value flushed at a decode step is attended quantized at once.

Storage (the paper's layout): a uniform lo-bit per-channel plane over every channel plus
the promoted channels' upper ``hi - lo`` bits with their channel indices per block, no
extra scales. Every ``kitty_hi_bit`` in 2..8 works, 7 included: what is packed is the lo
plane (1-4 bits) and the upper plane (1-7 bits, 7 packed by hand).

Attention: a prompt chunk attends over the decoded history plus itself. A decode step on
CUDA with channels promoted does the same: every stored row decoded in the queries' dtype
(the keys in one kernel launch, ``kernel.py``), one fused attention. Otherwise it attends over two parts merged by log-sum-exp: the sinks (full
precision), and the quantized blocks with the full-precision tails, whose keys are read by
``PromotedScores`` on the pure-MLX path (the fused kernel would need an extra score term
for the promoted channels). With no channel promoted (``int(d * f) = 0``) the keys
are a plain group-affine layout and, at 2 or 4 bits, the fused kernel serves that part
on a GPU (``fused_attention``).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ...kernels import kivi_decode as kd
from ...kernels.decode import scaled_queries
from ...quant.cache import QuantizedCache
from ...quant.packed import GROWTH_TOKENS, GroupAffine
from ...quant.sink_store import SinkQuantizedStore
from ...quant.store import VALUE_ROOM, joined_history
from ...quant.token_rows import ReadViews, held
from .kernel import kernel_backend, key_rows
from .promoted import PromotedChannels, PromotedKeys, RoomInputs

N_SINK = 32  # the repo's sink_length


class KittyStore(SinkQuantizedStore):
    """The sink store whose decode step, past the sinks with channels promoted, computes
    what ``kernels/decode.py``'s joint path computes for its two parts (the sinks; the
    promoted keys and packed values with the windows' rows), the same operations in the
    same order, the keys' compiled pass and its inputs kept between writes
    (``PromotedKeys.step_read``) and the three value products summed in one fused pass."""

    def attend_parts(self, queries, *, scale, use_kernel, n_kv_heads: int) -> mx.array:
        if use_kernel and self.keys.count and self.keys.up.buffer is not None and kd.gpu_backend() == "cuda":
            # promoted channels, which the fused kernel does not read: on CUDA the float32
            # read below spends its device time in products cuBLAS serves badly at decode
            # shapes, and every stored row decoded in the queries' dtype and one fused
            # attention take less (benchmarks/results/h200_s63)
            return self._decoded_attention(queries, scale)
        keys, values = self.keys, self.values
        read = None
        if not self.segments and self.sink_k.length and values.count and self.k_win.held and self.v_win.held:
            read = keys.step_read()  # None: no promoted channels (the fused kernel may read the part)
        if read is None:
            return super().attend_parts(queries, scale=scale, use_kernel=use_kernel, n_kv_heads=n_kv_heads)
        fn, args, cut = read
        sink_k, sink_v = self.sink_k.view(), self.sink_v.view()
        k_tail, v_tail = self.k_win.view(), self.v_win.view()
        q = scaled_queries(queries, sink_k.shape[1], scale)
        s = fn(q, *args)
        if cut is not None:
            s = s[..., :cut]
        s = mx.concatenate([q @ sink_k.astype(mx.float32).swapaxes(-1, -2), s,
                            q @ k_tail.astype(mx.float32).swapaxes(-1, -2)], axis=-1)
        p = mx.softmax(s, axis=-1)
        n_sink, n_values = sink_v.shape[2], values.count
        w_sink, w, w_tail = mx.split(p, [n_sink, n_sink + n_values], axis=-1)
        c = values.codec
        o = kd.affine_value_mix(w, values.codes.buffer, values.scales.buffer, values.biases.buffer, n_values,
                                c.bits, c.group)
        o = _summed3(kd.token_mix(w_sink, sink_v.astype(mx.float32)), o,
                     kd.token_mix(w_tail, v_tail.astype(mx.float32)))
        return o.reshape(queries.shape).astype(queries.dtype)

    def _decoded_attention(self, queries, scale) -> mx.array:
        """On CUDA: every stored row decoded in the queries' dtype, one fused attention. The
        stored keys come from one launch (``kernel.py``), or, where it does not run, from one
        compiled pass over their buffers' room cut to the count (``PromotedKeys.room_rows``);
        the values from views kept between their flushes; the
        codes are gated on the queries, so that MLX does not decode later layers' rows ahead
        of their attention and hold them all (``PackedStore.history_after``)."""
        keys, values, dtype = self.keys, self.values, queries.dtype
        v_codes, v_scales, v_biases = self._value_views()
        parts_k, parts_v = self._leading_history(dtype)
        backend = kernel_backend(dtype)
        if backend is not None:  # the stored keys in one launch (``kernel.py``)
            codes, scales, biases, up, index = keys.kernel_inputs()
            *words, v_codes = mx.depends([codes, *([] if up is None else [up]), v_codes], [queries])
            parts_k.append(key_rows(backend, words[0], scales, biases, words[1] if up is not None else None, index,
                                    codec=keys.codec, count=keys.count, dtype=dtype))
        else:
            room = keys.room_inputs()
            arrays = list(room.arrays)
            *words, v_codes = mx.depends([*(arrays[i] for i in room.words), v_codes], [queries])
            for i, w in zip(room.words, words):
                arrays[i] = w
            parts_k.append(keys.room_rows(dtype, RoomInputs(tuple(arrays), room.words))[:, :, : keys.count])
        parts_v.append(values.codec.decode(v_codes, v_scales, v_biases, dtype))
        k, v = joined_history(parts_k, parts_v, self.k_res, self.v_res, dtype)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale)

    def _value_views(self) -> tuple:
        """The packed values' valid codes, scales and minima, views kept while the buffers
        (by identity) and the count stay: a value flush comes every ``value_flush`` steps."""
        v = self.values
        key = (v.codes.buffer, v.scales.buffer, v.biases.buffer, v.count)
        return held(self, "_views", ReadViews).get(self, key, lambda: (v.codes.view(), v.scales.view(), v.biases.view()))


@functools.lru_cache(maxsize=None)
def _sum3():
    return mx.compile(lambda a, b, c: a + b + c)


def _summed3(a, b, c):
    """``a + b + c`` (in that order) as one fused pass."""
    return _sum3()(a, b, c)


class KittyCache(QuantizedCache):
    group_field = "kitty_group_size"
    batchable = "stacked"  # its rows never mix: sequences in the same state share one cache (cache/stacked.py)

    def make_store(self):
        o, block = self.config.options, self.config.residual_window
        codec = PromotedChannels(o.kitty_lo_bit, o.kitty_hi_bit, self.group, block, o.kitty_hi_fraction)
        step = max(GROWTH_TOKENS, block)
        return KittyStore(
            PromotedKeys(codec, step), GroupAffine(o.kitty_lo_bit, self.group, "token"),
            window=block, key_block=block, n_sink=N_SINK, step_tokens=step, value_flush=VALUE_ROOM,
        )
