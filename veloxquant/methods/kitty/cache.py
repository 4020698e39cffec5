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

Attention: a prompt chunk attends over the decoded history plus itself. A decode step
attends over two parts merged by log-sum-exp: the sinks (full precision), and the quantized
blocks with the full-precision tails, whose keys are read by ``PromotedScores`` on the
pure-MLX path on every device, the GPU included (the fused kernel would need an extra score
term for the promoted channels). With no channel promoted (``int(d * f) = 0``) the keys
are a plain group-affine layout and, at 2 or 4 bits, the fused kernel serves that part
on a GPU (``fused_attention``).
"""

from __future__ import annotations

from ...quant.cache import QuantizedCache
from ...quant.packed import GROWTH_TOKENS, GroupAffine
from .promoted import PromotedChannels, PromotedKeys
from ...quant.sink_store import SinkQuantizedStore
from ...quant.store import VALUE_ROOM

N_SINK = 32  # the repo's sink_length


class KittyCache(QuantizedCache):
    group_field = "kitty_group_size"
    batchable = "stacked"  # its rows never mix: sequences in the same state share one cache (cache/stacked.py)

    def make_store(self):
        o, block = self.config.options, self.config.residual_window
        codec = PromotedChannels(o.kitty_lo_bit, o.kitty_hi_bit, self.group, block, o.kitty_hi_fraction)
        step = max(GROWTH_TOKENS, block)
        return SinkQuantizedStore(
            PromotedKeys(codec, step), GroupAffine(o.kitty_lo_bit, self.group, "token"),
            window=block, key_block=block, n_sink=N_SINK, step_tokens=step, value_flush=VALUE_ROOM,
        )
