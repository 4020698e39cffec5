"""VecInfer: product VQ of keys and values, keys smoothed per channel and rotated first.

A configuration of the codebook store (``quant/vq_store.py``, codecs in ``quant/vq.py``):

- **keys**: per KV head and channel, ``k / lambda`` with ``lambda_c = sqrt(max_t |K[t, c]|)``
  (floored at 1e-4), rotated by the orthonormal Walsh-Hadamard transform, cut into
  sub-vectors of ``key_sub_dim`` channels, each stored as the index of its nearest
  centroid in one codebook of ``2**key_codebook_bits`` centroids shared by every
  sub-vector position and head of the layer (the card's reading; per-head codebooks are
  its variant);
- **values**: raw sub-vectors of ``value_sub_dim`` channels, one codebook of
  ``2**value_codebook_bits`` centroids;
- **window**: the newest ``residual_length`` tokens stay in full precision (the card's
  inferred meaning), and up to 31 more while decoding: a token is coded once, when it
  leaves, 32 at a time (the window then holds ``residual_length`` to ``residual_length +
  31`` tokens), so that 31 decode steps of 32 code nothing; the codes are those of the
  tokens coded one a step (coding is per token).

Indices are bit-packed at their width (12 bits: 32 indices in 12 words at head_dim 128,
key_sub_dim 4). Codebooks are float16, the smoothing factors float32, per layer and
sequence, saved and counted in ``nbytes``.

**Codebooks** (the paper fits them offline): with the config's ``calibration_file``, a
file written by ``veloxquant calibrate --method vecinfer`` for this model and these
settings (refused otherwise, naming the file, the field and both values); without one,
fitted from the prompt: k-means (``PROMPT_ITERS`` Lloyd iterations at most, at most
``PROMPT_SAMPLE`` points per centroid, seeded by the layer index) on the tokens held when
the first tokens are coded (the prompt or its first chunk; the window plus one token when
the prompt fits in the window), then fixed. A prompt with fewer sub-vectors than
centroids makes each of them a centroid.

**Per sequence**: a fit from the prompt is each row's own, with the batch first
(``key_centroids`` (B, 2**key_codebook_bits, key_sub_dim), ``key_scale`` (B, H, 1, D),
``value_centroids`` (B, 2**value_codebook_bits, value_sub_dim)), fitted for every row at
once and row b's what the sequence alone is fitted; so sequences in the same state stack
(``cache/stacked.py``), their tables concatenated. A calibration's tables are one for
every sequence, as the file holds them (``key_centroids`` and ``value_centroids`` without
the batch axis, kept once by a stacked batch; ``key_scale`` (1, H, 1, D)). A state saved
before the batch axis gets it when restored.

**Attention**: a prompt chunk attends over the decoded history plus itself. A decode step
scores keys in the score domain: ``q~ = (q * lambda) H`` once per step, a table
``q~_j . C_K`` per sub-space, then a gather by index and a sum (``CodebookKeys``); values
are centroids gathered by index (``CodebookValues``); the window is the part's
full-precision tail. No fused kernel reads codebooks (the paper's CUDA kernels are not
ported); the steady state's step takes that arithmetic in few graph operations
(``quant/vq_store.py``). On CUDA a steady step instead gathers the coded keys' centroids in
the code space and the values' centroids (one kernel launch a tensor:
``kernels/codebook_rows.py``), takes the window's keys there, all in the queries' dtype, and
reads them with one fused attention by ``q~``. On a GPU the prompt's nearest centroids come
from one kernel that writes no distance (``kernels/nearest_centroid.py``). CPU time of the
lookup-table scores against dequantize-then-attend: ``benchmarks/vq_decode_cpu.py``
(results in ``benchmarks/results/vq_decode_cpu.md``).

``head_dim`` must be 2^k or 12 * 2^k (the rotation), and divisible by both sub widths.
"""

from __future__ import annotations

from ...cache.calibration import layer_calibration
from ...quant.vq import ProductVQ
from ...quant.vq_store import CodebookCache, CodebookFit, CodebookStore, codec_arrays

PROMPT_ITERS = 8  # Lloyd iterations of a fit from the prompt
PROMPT_SAMPLE = 8  # points per centroid a fit from the prompt looks at, at most
CALIBRATION_SAMPLE = 64  # the same for an offline calibration
ARRAYS = ("key_centroids", "key_scale", "value_centroids")


class VecInferCache(CodebookCache):
    sub_dim_fields = ("key_sub_dim", "value_sub_dim")
    calibration_fields = ("key_sub_dim", "value_sub_dim", "key_codebook_bits", "value_codebook_bits")
    # its rows never mix (each row fits its own codebooks); stacked, its steady step reads a
    # block of rows at a time (``vq_store._read_blocks``), so it holds about a block's reads,
    # not the batch's (benchmarks/notes/serving_batches.md, session 57)
    batchable = "stacked"

    @staticmethod
    def fit_spec(config, *, iters: int, sample: int, seed: int) -> CodebookFit:
        o = config.options
        return CodebookFit(o.key_sub_dim, o.key_codebook_bits, o.value_sub_dim,
                           o.value_codebook_bits, iters=iters, sample=sample, seed=seed)

    def make_store(self):
        fit = self.fit_spec(self.config, iters=PROMPT_ITERS, sample=PROMPT_SAMPLE, seed=self.layer)
        return CodebookStore(self.config.options.residual_length, fit)

    def _init_storage(self) -> None:
        super()._init_storage()
        if self.config.calibration_file and self.context is not None:  # refused at once
            self._calibrate_from_file(None)

    def _calibrate_from_file(self, kv_shape) -> None:
        arrays = layer_calibration(self.config, self.calibration_fields, ARRAYS, self.layer,
                                   model_args=getattr(self.context, "model_args", None),
                                   kv_shape=kv_shape)
        if self.store.key_codec is None:
            f = self.store.fitter
            self.store.install(ProductVQ(arrays["key_centroids"], f.key_bits, arrays["key_scale"], True),
                               ProductVQ(arrays["value_centroids"], f.value_bits), "calibration")

    def update_and_fetch(self, keys, values):
        if self.config.calibration_file and self.kv_shape is None:  # the file meets the keys
            self._calibrate_from_file((keys.shape[1], keys.shape[-1]))
        return super().update_and_fetch(keys, values)

    @classmethod
    def calibrate(cls, keys, values, config, *, iters: int, seed: int, progress=None, model_args=None):
        """A layer's calibration arrays from its keys and values (B, H, T, D); the codebooks
        are fitted post-RoPE, as the cache receives keys, so ``model_args`` is not needed."""
        fit = cls.fit_spec(config, iters=iters, sample=CALIBRATION_SAMPLE, seed=seed)
        return codec_arrays(*fit.fit(keys, values, progress))
