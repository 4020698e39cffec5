"""KVQuant-NUQ: a non-uniform codebook per layer, dense-and-sparse outliers, attention sinks.

A configuration of the streaming store (``methods/kvquant/streaming_store.py``) over two
``NonUniform`` runs (``methods/kvquant/nonuniform.py``), one per tensor, each with its own codebook:

- the first ``kvquant_n_sink`` tokens stay in the model's dtype (the repo's
  ``first_few_fp16``);
- keys per channel, pre-RoPE when the cache knows the model's rotary settings (a
  ``make_prompt_cache`` context; de-rotated at their positions before encoding, rotated
  again when read, ``quant/prerope.py``), post-RoPE otherwise (a cache built without a
  context, or a rotary scaling that cannot be undone; the deviation the card allows).
  Statistics per channel over groups of G = ``kvquant_group_size`` tokens (any divisor of
  head_dim; ``quant/groups.py`` names them when one is refused); keys wait in the model's
  dtype until a block of lcm(G, 32) tokens is whole (G for G = 32, 64, 128);
- values per token, statistics per group of G channels, each encoded as it comes;
- per group: outliers out first, then ``o = (M + m) / 2``, ``rho = (M - m) / 2`` over the
  rest (the repo's ``quant_fn_nuq_recon``), ``z = (x - o) / rho``, the index of the nearest
  of the tensor's 2^``kvquant_bits`` centroids; o and rho in the model's dtype;
- outliers (``kvquant_outlier_fraction`` f, ``quant/outliers.py``): per value token the
  ceil(f d / 2) largest and smallest of its d entries; per key group of G tokens, G times
  as many per tail, the entries farthest from their own channel's median in units of its
  interquartile range (a per-channel threshold, as the paper's per-channel calibrated
  ones; inferred, the card says "the same per channel"). Kept exactly: uint16 position and
  the value in the model's dtype (pre-RoPE keys: the de-rotated value, rounded to it);
- the codebook: one per sequence (a batch axis: a cache fed B rows fits B, each on its
  row alone, so sequences in the same state stack), fitted on the first tokens a tensor
  encodes (its non-outlier z, a seeded sample of at most 65536), from the quantile grid (or
  the uniform one where that fits the sample better: never worse than uniform levels),
  then ``kvquant_lloyd_iters`` unweighted Lloyd steps (the paper's offline k-means is
  Fisher-weighted, which needs gradients: the deviation), then frozen for later prompt
  chunks; ``kvquant_refit_interval`` R > 0: every R decode steps a warm-started Lloyd on
  each row's histogram of what was encoded since the last fit (every row in one batched
  step) gives each row a new codebook, used by the tokens encoded afterwards (each token
  or key group keeps its codebook id; stored indices never change meaning).

Attention: a prompt chunk attends over the decoded history plus itself; a decode step over
two parts merged by log-sum-exp: the sinks, and the packed run (plus the keys' exact
tail), read by ``NonUniformScores`` on the pure-MLX path on every device (no fused kernel
reads codebooks or sparse outliers): codes unpacked and looked up in the codebook, scaled,
the outlier table scattered over that, one matrix product for ``q K^T`` and one for
``p V``. No part is kernel-served (``fused_attention`` has nothing to route here).
"""

from __future__ import annotations

import math

from ...quant.cache import QuantizedCache
from ...quant.groups import check_divides
from .nonuniform import NonUniform, NonUniformTokens
from ...quant.packed import GROWTH_TOKENS
from ...quant.prerope import model_rotary
from ...quant.store import VALUE_ROOM
from .streaming_store import StreamingStore


class KVQuantCache(QuantizedCache):
    group_field = "kvquant_group_size"
    batchable = "stacked"  # its rows never mix (each row fits and refits its own codebooks): sequences in the same state share one cache (cache/stacked.py)

    def make_store(self):
        o, g = self.config.options, self.group
        block = math.lcm(g, 32)  # whole groups, whole words of packed indices
        step = -(-max(GROWTH_TOKENS, block) // block) * block
        refits = o.kvquant_refit_interval > 0

        def run(axis, rotary=None):
            codec = NonUniform(o.kvquant_bits, g, axis, o.kvquant_outlier_fraction, o.kvquant_lloyd_iters)
            return NonUniformTokens(codec, refits=refits, rotary=rotary, start=o.kvquant_n_sink,
                                    step_tokens=step)

        return StreamingStore(run("channel", model_rotary(self.context)), run("token"),
                              n_sink=o.kvquant_n_sink, key_block=block, window=0,
                              refit_interval=o.kvquant_refit_interval, step_tokens=step,
                              value_flush=VALUE_ROOM)

    def update_and_fetch(self, keys, values):
        check_divides(self.group_field, self.group, keys.shape[-1], values.shape[-1])
        return super().update_and_fetch(keys, values)
