"""GEAR: error feedback on a KIVI-style quantizer, a low-rank plus a sparse residual.

A configuration of the chunked store (``quant/chunk_store.py``) with error-feedback codecs
(``methods/gear/error_feedback.py``): per chunk and per (batch, head), ``X ~ D_hat + A Bᵀ + S``.

- **Backbone** ``D_hat``: min-max at ``gear_bits``, keys per channel in groups of
  ``gear_group_size`` tokens, values per token in groups of ``gear_group_size`` channels
  (GEAR-KIVI), the outliers replaced by their vector's mean first (GEAR's repo). Widths:
  2-6 and 8 (what mx.quantize packs; 7 is refused by the spec).
- **Sparse** ``S``: per vector (a key channel across the chunk's tokens, a value token
  across its channels) the ``ceil(s * len / 2)`` largest and as many smallest entries,
  s = ``gear_sparse_fraction``, kept as the exact correction at those entries (model
  dtype), with int32 token positions (keys) or uint8 channel indices (values). The card
  and the paper pick outliers by value, before quantizing, not the largest residuals.
- **Low rank** ``A Bᵀ`` of ``R = X - D_hat`` (zero at the outliers): with ``gear_rank``
  set, that rank (clipped to min(chunk tokens, head_dim)) by randomized subspace
  iteration, 3 products from a seeded Gaussian (the repo's ``--loop 3``) on R's Gram
  matrix and a Rayleigh-Ritz step (``error_feedback.py``); 0 disables it. With
  ``gear_rank=None`` (inferred, the card's rule): the smallest rank holding
  ``gear_energy_threshold`` of R's spectral energy, the largest over the chunk's heads,
  capped at ``ceil(0.05 * min(chunk tokens, head_dim))``, from the same randomized fit
  at the cap (within 2% of the exact SVD's error in tests).
  One rank for prefill and decode chunks (the repo's prefill/decode ranks 4/2 are not
  in the signature). A and B are kept in the model dtype; never the dense L.
- **Streaming**: tokens wait in full precision. A prompt chunk is compressed at once as
  one chunk of its whole groups (buffer included; fewer than a group stay exact); decode
  tokens are compressed n_b at a time, n_b the config's ``residual_window`` (the
  repo's ``streaming_gap`` is 64; ``residual_window=0`` means one group).
- ``gear_quantize_values=False``: values stay in full precision, keys alone compressed.

Attention: a prompt chunk attends over the reconstructed history plus itself. A decode
step attends over one part, the compressed chunks then the buffer: the backbone through
the shared group-affine readers (``quantized_matmul`` on the CPU), plus the low-rank
term (``q B_c`` then ``A_t``, rank r) and the sparse term (gathers and a scatter-add of
its few entries) added to the scores and mixes: ``ResidualScores``, read by the pure-MLX
path on every device, a GPU included. With ``gear_rank=0`` and
``gear_sparse_fraction=0`` the chunks are plain KIVI layouts (bit for bit) and, at 2, 4
or 8 bits, the fused kernel serves them on a GPU (``fused_attention``).
"""

from __future__ import annotations

from ...quant.cache import QuantizedCache
from .joint import GEARStore
from .error_feedback import ErrorFeedback, ErrorFeedbackTokens
from ...quant.packed import GROWTH_TOKENS, GroupAffine, PackedTokens


class GEARCache(QuantizedCache):
    group_field = "gear_group_size"
    batchable = "stacked"  # its rows never mix: sequences in the same state share one cache (cache/stacked.py)

    def make_store(self):
        o = self.config.options
        block = self.config.residual_window or self.group  # n_b, a config field (the spec)
        step = max(GROWTH_TOKENS, block)

        def codec(axis):
            return ErrorFeedback(GroupAffine(o.gear_bits, self.group, axis), o.gear_rank,
                                 o.gear_energy_threshold, o.gear_sparse_fraction)

        keys = ErrorFeedbackTokens(codec("channel"), step)
        values = (ErrorFeedbackTokens(codec("token"), step) if o.gear_quantize_values
                  else PackedTokens(GroupAffine(o.gear_bits, self.group, "token")))  # stays empty
        return GEARStore(keys, values, block=block, group=self.group,
                            quantize_values=o.gear_quantize_values, step_tokens=step)
