"""SpectralQuant: keys and values rotated into their eigenbasis, Lloyd-Max codes per
coordinate, and a 1-bit QJL sketch of the key residual inside the score.

A configuration of the eigenbasis store (``methods/spectral/eigen_store.py``). Per layer and KV head:

1. **Basis**, from one of two places:

   - with the config's ``calibration_file`` (the paper's procedure: offline, per layer and
     KV head): a file written by ``veloxquant calibrate --method spectral`` for this model,
     these ``calibration_fields`` and this key rotary (refused otherwise, naming the file,
     the field and both values; at once when the cache has a model context, and against
     the keys' (heads, head_dim) at the first ``update_and_fetch``). Per tensor ``k``/``v``
     it holds ``{k,v}_basis`` (1, H, D, D), ``{k,v}_eigenvalues`` (1, H, D) and
     ``{k,v}_tables`` (1, H, 2^head + 2^tail): exactly what the fit below takes from a
     one-chunk prompt of the calibration text (``SpectralQuantCache.calibrate``: keys
     de-rotated with the model's rotary at positions 0.., at most 4,096 evenly spaced
     rows), σ derived from the eigenvalues as the fit derives it. They are installed
     (broadcast over the batch) before the first token: no token is held exactly, no
     eigenproblem is solved and no codebook trained on the prefill path, no running moment
     is kept, and the bases are **never refitted** (the paper's offline arrays are fixed;
     spectral has no refit field to keep). The QJL sketch is not in the file (it comes
     from the layer's seed), so one file serves either ``spectral_apply_qjl``;
   - without it (adapted): the eigenvectors of the second moment of the unit keys
     (values) of the first head_dim tokens or more the cache stores (held exactly until
     then: the prompt chunk that brings the count there), fitted online, on at most 4,096
     evenly spaced rows; refitted each time the tokens held double since the end of the
     prompt or the last refit, from the running second moment of every row taken in, the
     rows after it coded on the new basis and stored ones kept on theirs (``EigenStore``'s
     runs).

   Keys are pre-RoPE when the cache knows the model's rotary settings (a
   ``make_prompt_cache`` context: de-rotated at their positions, ``quant/prerope.py``, the
   card's calibration domain), post-RoPE otherwise; a file records which
   (``key_rotary``, kvtc's form).
2. **Bits**: b = the config's ``kv_bits`` (the repo's ``total_bits``, 3 there; 2, 4 or 8
   here), ``e = min(d_eff, head_dim - 1)`` (``spectral_key_d_eff``, ``spectral_val_d_eff``,
   clamped, as the card asks for d <= 50), ``b_low = max(1, round(b - e/d))``,
   ``b_high = b_low + 1``: keys ``b_high - 1`` bits on the e semantic coordinates (one of
   b_high is the sign), values ``b_high``; both ``b_low`` on the tail.
3. **Encode** a prompt chunk's tokens as they come; a decode step's row is held exactly
   until 32 are held (``DECODE_FLUSH``), which are then coded in one batch (adapted: the
   paper codes each token as it comes; held rows are exact, and a steady decode step only
   writes its row, issue 30): ‖x‖ in float16,
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

``spectral_model_name`` has no effect here: the repo keys its saved calibration by it,
but here the config's ``calibration_file`` names the file, and the name changes none of
its arrays (a file is not checked against it).
Memory per token and head, in bits: keys ``e b_high + (d - e) b_low + 32`` with QJL,
``e (b_high - 1) + (d - e) b_low + 16`` without; values ``e_v b_high + (d - e_v) b_low + 16``;
each row padded to whole 32-bit words; plus the bases (float32 d x d), two σ, the two
codebooks (2^b_high + 2^b_low float32 centroids at most) and the e x e sketch per head and
tensor.
"""

from __future__ import annotations

import mlx.core as mx

from ...cache.calibration import layer_calibration
from ...quant.cache import QuantizedCache
from ...quant.prerope import args_rotary, model_rotary, rotary_name
from .eigen_store import CALIBRATED_ARRAYS, EigenCodec, EigenStore, EigenTokens, coded_rows, fitted_arrays

SKETCH_SEED = 0x5BEC  # the QJL matrix of layer i is drawn from SKETCH_SEED + i
CALIBRATED = tuple(f"{prefix}_{name}" for prefix in "kv" for name in CALIBRATED_ARRAYS)


class SpectralQuantCache(QuantizedCache):
    # stacked since its reader decodes the history a block at a time (it ran slower than per
    # sequence while whole-history transients overflowed MLX's CPU buffer cache); H200, 24 x
    # 8k: 11.1 tok/s stacked against 5.5 per sequence (benchmarks/notes/serving_batches.md)
    batchable = "stacked"
    group = 1  # no quantization groups: every shape is accepted
    # the fields a calibration file's arrays depend on: the bit split (b, e) sizes and
    # blocks the codebooks; the bases and eigenvalues depend on none, the QJL sketch is not kept
    calibration_fields = ("kv_bits", "spectral_key_d_eff", "spectral_val_d_eff")

    @staticmethod
    def codecs(config) -> tuple[EigenCodec, EigenCodec]:
        """(keys, values) codecs of ``config``."""
        o, bits = config.options, config.kv_bits
        return (EigenCodec(bits, o.spectral_key_d_eff, key=True, qjl=o.spectral_apply_qjl),
                EigenCodec(bits, o.spectral_val_d_eff, key=False, qjl=False))

    def make_store(self):
        keys, values = self.codecs(self.config)
        return EigenStore(EigenTokens(keys, rotary=model_rotary(self.context), seed=SKETCH_SEED + self.layer),
                          EigenTokens(values))

    # -- a calibration file ----------------------------------------------------------------
    def _init_storage(self) -> None:
        super()._init_storage()
        if self.config.calibration_file and self.context is not None:  # a wrong file fails at once
            self._calibration(None)

    def _calibration(self, kv_shape) -> dict[str, mx.array]:
        """This layer's arrays in ``calibration_file``, checked against the config, the
        model, the keys' (heads, head_dim) when known and the rotary the keys are coded under."""
        return layer_calibration(self.config, self.calibration_fields, CALIBRATED, self.layer,
                                 model_args=getattr(self.context, "model_args", None), kv_shape=kv_shape,
                                 cache_metadata={"key_rotary": rotary_name(self.store.keys.rotary)})

    def update_and_fetch(self, keys, values):
        if self.config.calibration_file and self.kv_shape is None:  # the file meets the keys
            calibrated = self._calibration((keys.shape[1], keys.shape[-1]))
            if self.store.keys.basis is None:
                self.store.calibrated = calibrated
        return super().update_and_fetch(keys, values)

    @classmethod
    def calibrate(cls, keys, values, config, *, iters: int, seed: int, progress=None, model_args=None):
        """A layer's arrays from its post-RoPE keys and values (1, H, T, D) of a text: the fit
        a one-chunk prompt of those tokens gets (keys de-rotated with ``model_args``' rotary,
        as a cache in that model's context codes them): per tensor the eigenbasis, its
        eigenvalues and the trained codebooks (``eigen_store.fitted_arrays``). ``iters`` and
        ``seed`` change nothing: the fit is deterministic and its Lloyd steps fixed."""
        t, d = keys.shape[2], keys.shape[-1]
        if t < d:
            raise ValueError(f"{t} calibration tokens: an eigenbasis of head_dim {d} needs at least {d} "
                             f"(use more --tokens)")
        key_codec, value_codec = cls.codecs(config)
        tensors = (("k", key_codec, coded_rows(keys, 0, args_rotary(model_args))),
                   ("v", value_codec, coded_rows(values, 0, None)))
        arrays = {}
        for done, (prefix, codec, x) in enumerate(tensors):
            arrays.update(zip((f"{prefix}_{name}" for name in CALIBRATED_ARRAYS), fitted_arrays(codec, x)))
            if progress:
                progress("keys and values", done + 1, len(tensors))
        return arrays

    @classmethod
    def calibration_metadata(cls, model_args) -> dict[str, str]:
        """What the file's key arrays depend on besides the fields: the rotary the keys were
        de-rotated with ('none': post-RoPE); a cache whose keys are coded otherwise refuses it."""
        return {"key_rotary": rotary_name(args_rotary(model_args))}
