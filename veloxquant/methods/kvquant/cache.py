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
- the codebook, one per tensor (keys, values) and sequence (a batch axis: a cache fed B
  rows holds B, each its row's own, so sequences in the same state stack), from one of two
  places:

  - with the config's ``calibration_file`` (the paper's procedure: the datatype is fixed
    offline): a file written by ``veloxquant calibrate --method kvquant`` for this model,
    these settings (``calibration_fields``) and this key rotary (pre-RoPE keys give
    another codebook; refused otherwise, naming the file, the field and both values;
    at once when the cache has a model context, else at its first update against the
    keys' shape). It holds per layer the key and value codebooks (``k_centroids``,
    ``v_centroids``: 2^bits sorted float32 centroids each), fitted as below on the
    calibration text's tokens as one prompt chunk of it would be
    (``KVQuantCache.calibrate``). Every row of the cache starts on them before its
    first tokens: no quantile grid, no Lloyd on the prefill path;
  - without it (adapted): fitted on the first tokens a tensor encodes (its non-outlier
    z, a seeded sample of at most 65536), from the quantile grid (or the uniform one
    where that fits the sample better: never worse than uniform levels), then
    ``kvquant_lloyd_iters`` unweighted Lloyd steps (the paper's offline k-means is
    Fisher-weighted, which needs gradients: the deviation, in the file's fit too);

  then frozen for later prompt chunks and decode tokens. ``kvquant_refit_interval``
  R > 0 (0 by default, the paper's fixed datatype, with or without a file): every R
  decode steps a warm-started Lloyd on each row's histogram of what was encoded since
  the last fit (every row in one batched step) gives each row a new codebook, used by the
  tokens encoded afterwards (each token or key group keeps its codebook id; stored
  indices never change meaning). With a file the file's codebook is that last fit: the
  first refit starts from it, over everything encoded so far (the prompt included).

Attention: a prompt chunk attends over the decoded history plus itself; a decode step over
two parts merged by log-sum-exp: the sinks, and the packed run (plus the keys' exact
tail), read by ``NonUniformScores`` on the pure-MLX path on every device (no fused kernel
reads codebooks or sparse outliers): codes unpacked and looked up in the codebook, scaled,
the outlier table scattered over that, one matrix product for ``q K^T`` and one for
``p V``. No part is kernel-served (``fused_attention`` has nothing to route here).
"""

from __future__ import annotations

import math

import mlx.core as mx

from ...cache.calibration import batch_rows, layer_calibration
from ...quant.cache import QuantizedCache
from ...quant.groups import check_divides
from .nonuniform import NonUniform, NonUniformTokens
from ...quant.packed import GROWTH_TOKENS
from ...quant.prerope import args_rotary, model_rotary, rotary_name
from ...quant.store import VALUE_ROOM
from .streaming_store import StreamingStore

CALIBRATED = ("k_centroids", "v_centroids")  # a layer's arrays in a calibration file


def _codec(options, axis: str) -> NonUniform:
    o = options
    return NonUniform(o.kvquant_bits, o.kvquant_group_size, axis, o.kvquant_outlier_fraction, o.kvquant_lloyd_iters)


def _key_block(group: int) -> int:
    return math.lcm(group, 32)  # whole groups, whole words of packed indices


class KVQuantCache(QuantizedCache):
    group_field = "kvquant_group_size"
    batchable = "stacked"  # its rows never mix (each row fits and refits its own codebooks): sequences in the same state share one cache (cache/stacked.py)
    # what a calibration file's codebooks depend on: the codec, and the sinks, which decide
    # the tokens fitted and the positions keys are de-rotated at (the refit interval does
    # not: a file serves every R)
    calibration_fields = ("kvquant_bits", "kvquant_group_size", "kvquant_outlier_fraction",
                          "kvquant_lloyd_iters", "kvquant_n_sink")

    def make_store(self):
        o, g = self.config.options, self.group
        block = _key_block(g)
        step = -(-max(GROWTH_TOKENS, block) // block) * block
        refits = o.kvquant_refit_interval > 0

        def run(axis, rotary=None):
            return NonUniformTokens(_codec(o, axis), refits=refits, rotary=rotary, start=o.kvquant_n_sink,
                                    step_tokens=step)

        return StreamingStore(run("channel", model_rotary(self.context)), run("token"),
                              n_sink=o.kvquant_n_sink, key_block=block, window=0,
                              refit_interval=o.kvquant_refit_interval, step_tokens=step,
                              value_flush=VALUE_ROOM)

    def _init_storage(self) -> None:
        super()._init_storage()
        if self.config.calibration_file and self.context is not None:  # a wrong file fails at once
            self._calibration(None)

    def update_and_fetch(self, keys, values):
        check_divides(self.group_field, self.group, keys.shape[-1], values.shape[-1])
        if self.config.calibration_file and self.kv_shape is None:  # the file meets the keys
            self._install(keys.shape[0], self._calibration((keys.shape[1], keys.shape[-1])))
        return super().update_and_fetch(keys, values)

    # -- offline calibration (``veloxquant calibrate --method kvquant``) -----------------------
    def _calibration(self, kv_shape) -> dict[str, mx.array]:
        """This layer's codebooks in ``calibration_file``, checked against the config, the
        model, the keys' shape (when known) and the rotary the keys are coded under."""
        return layer_calibration(self.config, self.calibration_fields, CALIBRATED, self.layer,
                                 model_args=getattr(self.context, "model_args", None), kv_shape=kv_shape,
                                 cache_metadata={"key_rotary": rotary_name(self.store.keys.rotary)})

    def _install(self, rows: int, arrays: dict[str, mx.array]) -> None:
        """Every row's runs start on the file's codebooks (a run that already has its own,
        restored, keeps it)."""
        for run, prefix in ((self.store.keys, "k"), (self.store.values, "v")):
            if not run.books.length:
                book = arrays[f"{prefix}_centroids"].astype(mx.float32)
                run.install(batch_rows(book[None], rows))

    @classmethod
    def calibrate(cls, keys, values, config, *, iters: int, seed: int, progress=None, model_args=None):
        """A layer's key and value codebooks (2^bits,) from its post-RoPE keys and values
        (1, H, T, D) of a text: what a one-chunk prompt of those tokens fits, on the values
        past the sinks and on the keys past them in whole key blocks (the flush rule's; the
        keys rotated back with ``model_args``' rotary, as the cache does). ``iters`` and
        ``seed`` change nothing: the Lloyd steps are ``kvquant_lloyd_iters`` and the sample
        is the cache's own, so that the file is the prompt fit. Rows past the first are
        pooled as more heads."""
        o = config.options
        check_divides(cls.group_field, o.kvquant_group_size, keys.shape[-1], values.shape[-1])
        keys, values = (x.reshape(1, -1, *x.shape[2:]) for x in (keys, values))
        n_sink, block = o.kvquant_n_sink, _key_block(o.kvquant_group_size)
        n_keys = (keys.shape[2] - n_sink) // block * block
        if n_keys <= 0:
            raise ValueError(f"{keys.shape[2]} calibration tokens: kvquant fits its key codebook on whole blocks of "
                             f"{block} keys past its {n_sink} sink(s), so it needs at least {n_sink + block} "
                             f"(use more --tokens)")
        runs = (("k", NonUniformTokens(_codec(o, "channel"), rotary=args_rotary(model_args), start=n_sink),
                 keys[:, :, n_sink : n_sink + n_keys]),
                ("v", NonUniformTokens(_codec(o, "token"), start=n_sink), values[:, :, n_sink:]))
        arrays = {}
        for done, (prefix, run, x) in enumerate(runs):
            arrays[f"{prefix}_centroids"] = run.fit_codebook(x)[0]
            if progress:
                progress("keys and values", done + 1, 2)
        return arrays

    @classmethod
    def calibration_metadata(cls, model_args) -> dict[str, str]:
        """What the codebooks depend on besides the fields: the rotary the keys were fitted
        under (pre-RoPE keys normalise to another distribution than post-RoPE ones)."""
        return {"key_rotary": rotary_name(args_rotary(model_args))}
