"""SpectralQuant: keys and values rotated into their eigenbasis, Lloyd-Max codes per
coordinate, and a 1-bit QJL sketch of the key residual inside the score.

A configuration of the eigenbasis store (``methods/spectral/eigen_store.py``). Per layer and KV head:

1. **Basis** (adapted: the repo calibrates offline): the eigenvectors of the second
   moment of the unit keys (values) of the first head_dim tokens or more the cache
   stores (held exactly until then: the prompt chunk that brings the count there),
   fitted online, on at most 4,096 evenly spaced rows; refitted each time the tokens
   held double since the end of the prompt or the last refit, from the running second
   moment of every row taken in, the rows after it coded on the new basis and stored
   ones kept on theirs (``EigenStore``'s runs); keys pre-RoPE when the cache knows the model's rotary
   settings (a ``make_prompt_cache`` context: de-rotated at their positions, ``quant/prerope.py``, the
   card's calibration domain), post-RoPE otherwise.
2. **Bits**: b = the config's ``kv_bits`` (the repo's ``total_bits``, 3 there; 2, 4 or 8
   here), ``e = min(d_eff, head_dim - 1)`` (``spectral_key_d_eff``, ``spectral_val_d_eff``,
   clamped, as the card asks for d <= 50), ``b_low = max(1, round(b - e/d))``,
   ``b_high = b_low + 1``: keys ``b_high - 1`` bits on the e semantic coordinates (one of
   b_high is the sign), values ``b_high``; both ``b_low`` on the tail.
3. **Encode** every token as it comes (prefill and decode, no window): ‖x‖ in float16,
   ``z = Vᵀ(x/‖x‖)``, nearest centroid per coordinate of its block's Lloyd-Max codebook,
   trained (as the paper does) on the coordinates the basis was fitted on, per KV head, in
   units of ``σ_head² = mean λ[:e]`` and ``σ_tail² = mean λ[e:]`` (the repo's engine
   takes the codebooks of ``N(0, σ²)`` instead, which clips coordinates far above their
   block's mean variance: ``eigen_store.py``).
4. **QJL** (``spectral_apply_qjl``): ``sign(S r)`` of the residual's semantic part and its
   norm (float16). Chosen against the repo (the card's pitfall): the stored norm is
   ``‖r_sem‖``, the semantic part's, not the whole residual's, which makes the correction
   an unbiased estimate of ``q_sem · r_sem`` (tests/test_spectral.py measures it);
   ``S`` is seeded by the layer index.
5. **Attention** is the cache's: decode scores ``q · k̂ + sqrt(π/2)/e ‖r‖ (S q_sem)·signs``
   over the packed rows (``EigenScores``, pure MLX on every device, a block of the history
   at a time); a prompt chunk after the first uses the same corrected scores over the
   history. Post-RoPE keys and all values are read in the rotated frame (no per-token
   rotation); pre-RoPE keys must be rotated back and re-RoPE'd at every step, one (D x D)
   product over the history (the QJL term folded into it). CPU cost against kivi:
   benchmarks/notes/spectral.md.

``spectral_model_name`` has no effect here: no calibration artifact is read or written
(the basis comes from the prompt), so there is nothing for the name to locate.
Memory per token and head, in bits: keys ``e b_high + (d - e) b_low + 32`` with QJL,
``e (b_high - 1) + (d - e) b_low + 16`` without; values ``e_v b_high + (d - e_v) b_low + 16``;
each row padded to whole 32-bit words; plus the bases (float32 d x d), two σ, the two
codebooks (2^b_high + 2^b_low float32 centroids at most) and the e x e sketch per head and
tensor.
"""

from __future__ import annotations

from ...quant.cache import QuantizedCache
from .eigen_store import EigenCodec, EigenStore, EigenTokens
from ...quant.prerope import model_rotary

SKETCH_SEED = 0x5BEC  # the QJL matrix of layer i is drawn from SKETCH_SEED + i


class SpectralQuantCache(QuantizedCache):
    # stacked since its reader decodes the history a block at a time (it ran slower than per
    # sequence while whole-history transients overflowed MLX's CPU buffer cache); H200, 24 x
    # 8k: 11.1 tok/s stacked against 5.5 per sequence (benchmarks/notes/serving_batches.md)
    batchable = "stacked"
    group = 1  # no quantization groups: every shape is accepted

    def make_store(self):
        o, bits = self.config.options, self.config.kv_bits
        keys = EigenCodec(bits, o.spectral_key_d_eff, key=True, qjl=o.spectral_apply_qjl)
        values = EigenCodec(bits, o.spectral_val_d_eff, key=False, qjl=False)
        return EigenStore(EigenTokens(keys, rotary=model_rotary(self.context), seed=SKETCH_SEED + self.layer),
                          EigenTokens(values))
