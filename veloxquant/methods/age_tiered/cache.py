"""AgeTieredKV: precision by token age, tokens demoted as they age (no paper: a project method).

A configuration of the tiered store (``methods/age_tiered/tiers.py``): three tiers, oldest first, at
``age_bits_old`` / ``age_bits_mid`` / ``age_bits_recent`` (16 = the model's dtype,
unquantized), split at ages ``age_mid_boundary`` and ``age_recent_boundary`` (the newest
token has age 0; a token of age a < R is recent, R <= a < M mid, a >= M old).

Choices where the card is inferred or open (recorded in the spec's docs too):

- Keys are quantized per channel (groups of ``age_group_size`` tokens of one channel,
  KIVI's layout) and values per token (groups of ``age_group_size`` channels), not the
  card's inferred per-token keys, so that the fused GPU kernel serves the tiers.
- Demotion is block-wise, the card's listed option: blocks of G = ``age_group_size``
  tokens (position-aligned) move once every G steps, when a block's youngest token
  reaches a boundary. A tier therefore overshoots its boundary by up to G - 1 tokens,
  and the newest ``N mod G`` tokens wait in full precision (a per-channel key group needs
  G tokens; KIVI's tail). Tier sizes are functions of N alone, so a prefill of T tokens
  then k decode steps gives the same tiers as a prefill of T + k.
- A prompt (each chunk) is quantized straight from full precision into each token's
  tier, as the card's prefill says; a block that crosses a boundary later is
  re-quantized from its current reconstruction (8 -> 4 -> 2 cascades; no full-precision
  copy is kept), directly to the oldest tier it reaches when a chunk skips one.
  Adjacent tiers of equal width move codes as they are (no re-quantization).

Attention: a prompt chunk attends over the decoded history plus itself; a decode step
over one part per tier merged by log-sum-exp (``kernels/decode.py``): the 2, 4 and 8-bit
tiers through the fused kernel on Metal, 3-bit and 16-bit tiers on the pure-MLX path
(the full-precision tail rides with the youngest tier's part). On CUDA a decode step
decodes every stored row in the model's dtype and reads them with one fused attention
(``TieredStore.attend_parts``).
"""

from __future__ import annotations

from ...quant.cache import QuantizedCache
from .tiers import TieredStore


class AgeTieredKVCache(QuantizedCache):
    group_field = "age_group_size"
    batchable = "stacked"  # its rows never mix: sequences in the same state share one cache (cache/stacked.py)

    def make_store(self):
        o = self.config.options
        return TieredStore(bits=[o.age_bits_old, o.age_bits_mid, o.age_bits_recent],
                           ages=[o.age_mid_boundary, o.age_recent_boundary], block=self.group)

    @property
    def tier_counts(self) -> tuple[int, int, int]:
        """Tokens in the old, mid and recent tiers; the recent one counts the tail."""
        old, mid, recent = self.store.counts
        return old, mid, recent + self.store.k_tail.length
