"""ZipCache: token-level mixed precision from the normalised attention of probe queries.

A configuration of the token-mixed store (``methods/zipcache/token_mixed.py``) with probe saliency
(``quant/saliency.py``) and channel-separable token-wise codecs (``methods/zipcache/channel_scaled.py``,
``quant/token_rows.py``):

1. **Saliency at prefill.** Of each prompt chunk of n queries, the probes are the newest
   ``n - int(0.95 n)`` and ``int(0.05 n)`` drawn from the earlier ones (the repo's
   ``torch.randint``, here without replacement, from a key made of the chunk's first
   position). They attend with the model's scale over the post-RoPE keys (the history as
   the model sees it, and the chunk), causally at their real positions; the softmax
   weights are summed over the query heads of each KV group and over the probes, then
   divided by ``T - i`` (T tokens seen, token i), as the repo does even with probes.
2. **Classes.** Of the tokens compressed at once (the chunk, and any decode tokens still
   waiting in the buffer), per KV head the ``round(f n)`` most salient (halves up;
   f = ``zipcache_hi_fraction``) are stored at ``zipcache_hi_bits``, the others at
   ``zipcache_lo_bits``. A chunked prompt is classified chunk by chunk (each chunk by its
   own probes, over everything before it); one prompt in one chunk is the repo's prefill.
3. **Quantizer** (the card's adaptation; the paper quantizes keys channel-wise per class
   and values "channel-separable token-wise"): keys and values alike are divided by a
   per-channel scale ``c_j = sqrt(max_t |x_tj|)`` (per layer and KV head, from the first
   tokens compressed, then frozen; a near-zero channel is floored at 1e-3 of the head's
   largest), then min-max quantized per token in groups of ``zipcache_group_size``
   channels (any divisor of head_dim; any width 1-8). Token-wise codes are what lets a
   token take its own precision alone: per-channel groups would need ``G`` tokens of one
   class before any could be stored.
4. **Decode** (re-compression of decode blocks): new tokens wait in full precision until
   ``gap`` have come, gap = the config's ``residual_window`` (the repo's
   ``streaming_gap``, 100 there; at least 1). At the step that fills the buffer, after
   that step's attention, the block is scored by that step's query (its softmax over
   the whole cache, restricted to the block, summed over the KV group, not normalised)
   and compressed like a span: ``round(f gap)`` hi tokens per head. Stored tokens are
   never re-quantized: with token-wise codes and frozen channel scales, the repo's
   re-compression of the whole cache would give them the same codes.
5. ``zipcache_quantize_values=False`` keeps values in the model's dtype (stored with
   their tokens' class, in its order); keys stay mixed precision.

Storage: per token and KV head, for K and V each, ``b d/8 + 2 * 2 d/G`` bytes at the
token's width (16-bit scales and minima in the model's dtype), one uint8 class flag per
token and head (the card's 1 bit or int32 index: a byte, so that spans of any length
append in place), the channel scales (float32, per layer) and the buffer (up to ``gap``
rows in full precision).

Attention: a prompt chunk attends over the history decoded in position order plus
itself. A decode step attends over the two classes (the buffer riding as the tail of the
hi one) merged by log-sum-exp. The keys are per-token rows, which the fused kernels (per
channel keys) do not read, so every part takes the pure-MLX path on every device (one
``quantized_matmul`` pass over the packed codes for ``q Kᵀ`` and for ``p V`` on the CPU,
the channel scales folded into the query and the output); ``fused_attention`` has no
effect here. ZipCache does not support trimming (a trimmed token's class and the
channel scales would have to be undone).
"""

from __future__ import annotations

from ...quant.cache import QuantizedCache
from ...quant.groups import check_divides
from ...quant.saliency import ProbeSaliency
from .token_mixed import TokenMixedStore
from ...quant.token_rows import TokenGroups, packs

PROBE_RECENT = PROBE_RANDOM = 0.05  # the repo's probe fractions: newest 5%, 5% drawn earlier


class ZipCacheKVCache(QuantizedCache):
    group_field = "zipcache_group_size"
    batchable = "stacked"  # its rows never mix: sequences in the same state share one cache (cache/stacked.py)

    def make_store(self):
        o = self.config.options
        return TokenMixedStore(
            TokenGroups(o.zipcache_hi_bits, self.group), TokenGroups(o.zipcache_lo_bits, self.group),
            fraction=o.zipcache_hi_fraction, block=max(1, self.config.residual_window),
            saliency=ProbeSaliency(PROBE_RECENT, PROBE_RANDOM),
            quantize_values=o.zipcache_quantize_values,
        )

    def update_and_fetch(self, keys, values):
        d_k, d_v = keys.shape[-1], values.shape[-1]
        o = self.config  # its flat fields: ``config.options`` builds and validates an object a read
        check_divides(self.group_field, self.group, d_k, d_v)
        for name in ("zipcache_hi_bits", "zipcache_lo_bits"):
            bits = getattr(o, name)
            if not (packs(d_k, bits) and packs(d_v, bits)):
                allowed = [b for b in range(1, 9) if packs(d_k, b) and packs(d_v, b)]
                raise ValueError(f"{name}={bits}: {bits}-bit codes of head_dim={d_k} (values: "
                                 f"{d_v}) do not fill whole 32-bit words; allowed here: {allowed}")
        return super().update_and_fetch(keys, values)

    @property
    def class_counts(self) -> tuple[int, int]:
        """Tokens stored at hi and at lo bits, per KV head (the buffer not included)."""
        return self.store.hi.count, self.store.lo.count
