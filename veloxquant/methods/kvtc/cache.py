"""KVTC: a per-layer PCA basis, DP bit allocation, entropy coding; calibrated offline or fitted on the prompt.

Per layer, keys and values each (``methods/kvtc/transform.py``, ``methods/kvtc/window_store.py``):

- the first ``N_SINK`` = 4 tokens (the paper's s) and the newest ``residual_window``
  tokens (the config's window, 128 by default: the paper's w) stay in full precision;
- the codec (mean, basis, widths, steps) of the rows: a token's heads concatenated
  (``p = H * d``, the card's scope; batch rows pooled), keys rotated back before RoPE when
  the model's rotary settings are known (post-RoPE otherwise, e.g. a cache built without
  a model context). It comes from one of two places, and is frozen once there:

  - with the config's ``calibration_file`` (the paper's procedure): a file written by
    ``veloxquant calibrate --method kvtc`` for this model, these settings and this key
    rotary (refused otherwise, naming the file, the field and both values), read when
    the first token leaves the window: no fit at all on the prefill path. The paper
    calibrates one basis across layers; the file holds one per layer, fitted as below on
    the calibration text's tokens past the sinks and before the window, as a one-chunk
    prompt of that text is fitted (``KVTCCache.calibrate``; a file is made for one
    ``residual_window``);
  - without it (adapted, "local PCA"): fitted when the first token leaves the window, on
    the rows then leaving it (a prompt chunk's tokens past the sinks and before the window;
    at a decode step, the leaving rows and the window): mean and covariance (of at most
    4,096 evenly spaced rows) in float32 on the default device, the p x p eigenproblem on
    the CPU;

  later prompt chunks and decode tokens are coded with it;
- widths by exact dynamic programming over ``kvtc_bit_choices`` under
  ``kvtc_bit_budget`` bits per token per layer for each of K and V (over the p channels),
  distortion ``λ`` for a dropped component and ``Δ²/12`` for a uniform quantizer over
  ``±kvtc_beta·√λ`` (inferred): ``Σ b_i <= budget``, all of it spent whenever more bits
  still help; components at 0 bits are dropped (no basis column kept);
- codes per kept component, then (saved form) rANS with one frequency table per
  component, made from its codes (``quant/entropy.py``; the paper uses DEFLATE).

Batches (``cache/stacked.py``): a sequence's codec is its own, so sequences whose codecs are
equal (every one from the same ``calibration_file``) share one stacked cache once their
codecs are in place; codecs fitted on distinct prompts differ, and each such sequence
decodes as a group of its own. A fit is never made over several sequences' rows.

What stays resident (``nbytes``, and ``state``: what mlx-lm evaluates after each prefill
chunk, with no coding): sinks and window rows, the float16 mean and kept basis columns,
widths and steps, per middle token the codes packed at their widths (the bit budget,
rounded up to 32-bit words). What ``veloxquant_mlx.save_prompt_cache`` writes (the coded
form, ``stored_nbytes``): the same with the codes entropy-coded (``quant/coded_cache.py``);
a file of either form loads. A prompt chunk
attends over the reconstructed history plus itself; a decode step over the sinks and
the coded middle plus window (``TransformScores``: keys rebuilt and rotated, values mixed
in the PCA domain), merged by log-sum-exp, on the pure-MLX path.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ...cache.calibration import layer_calibration
from ...cache.rope import Rotary
from ...quant import entropy
from ...quant.coded_cache import EntropyCodedCache, join_segments, split_segments, to_numpy
from ...quant.packed import GROWTH_TOKENS
from ...quant.prerope import args_rotary, model_rotary, rotary_name
from .allocation import leading_count, useful_widths
from .transform import TransformCodec, TransformTokens, start_fits
from .window_store import SinkWindowStore

N_SINK = 4
MAX_BITS = 16  # a code fits one word or straddles two
CODEC = ("mean", "basis", "bits", "step")  # a TransformCodec's arrays, as saved and calibrated
CALIBRATED = tuple(f"{prefix}_{name}" for prefix in "kv" for name in CODEC)


class KVTCCache(EntropyCodedCache):
    batchable = "stacked"  # its rows never mix once fitted: sequences whose codecs are equal (one calibration file) share one cache (cache/stacked.py)
    # the fields a calibration file's codecs depend on: the window's too, as it decides
    # which of the text's rows are fitted (the sinks are a constant)
    calibration_fields = ("kvtc_bit_budget", "kvtc_bit_choices", "kvtc_beta", "residual_window")

    @property
    def group(self) -> int:  # no channel groups: any head_dim
        return 1

    @property
    def stack_ready(self) -> bool:
        """Codecs in place (cache/stacked.py): a fit pools the rows it is given."""
        store = self.__dict__.get("store")
        return store is None or store.keys.codec is not None

    def make_store(self, rotary: Rotary | None = None):
        _check_choices(self.config.options)
        rotary = rotary or model_rotary(self.context)
        return SinkWindowStore(TransformTokens(GROWTH_TOKENS, rotary, N_SINK),
                               TransformTokens(GROWTH_TOKENS, None, N_SINK),
                               n_sink=N_SINK, window=self.config.residual_window, fit=self._fit)

    def _init_storage(self) -> None:
        super()._init_storage()
        if self.config.calibration_file and self.context is not None:  # a wrong file fails at once
            self._calibration(None)

    _budget_checked = None  # the (kv heads, key and value head_dims) the budget was checked for

    def update_and_fetch(self, keys, values):
        dims = (keys.shape[1], keys.shape[3], values.shape[3])
        if dims != self._budget_checked:  # once: the check's allocation is numpy work a decode step need not do
            _check_budget(self.config, keys, values)  # the flat fields: ``options`` builds an object a read
            self._budget_checked = dims
        if self.config.calibration_file and self.kv_shape is None:  # the file meets the keys
            self._calibration((keys.shape[1], keys.shape[-1]))
        return super().update_and_fetch(keys, values)

    def _calibration(self, kv_shape) -> dict[str, mx.array]:
        """This layer's codec arrays in ``calibration_file``, checked against the config,
        the model, the keys' shape (when known) and the keys' rotary."""
        return layer_calibration(self.config, self.calibration_fields, CALIBRATED, self.layer,
                                 model_args=getattr(self.context, "model_args", None), kv_shape=kv_shape,
                                 cache_metadata={"key_rotary": rotary_name(self.store.keys.rotary)})

    def _fit(self, runs: list[tuple[TransformTokens, mx.array]]) -> None:
        """Fit each (run, rows): every fit's array work is started, then evaluated at once (the
        decompositions side by side, on the GPU or the CPU streams: ``factors.gram_leading``;
        one wait for the device), then each fit's allocation runs on the host."""
        if self.config.calibration_file:  # calibrated offline: prefill only projects and codes
            arrays = self._calibration(self.kv_shape[1:3])
            for run, _ in runs:
                prefix = "k" if run is self.store.keys else "v"
                run.codec = TransformCodec(*(arrays[f"{prefix}_{name}"] for name in CODEC))
            return
        o = self.config.options
        fit = (o.kvtc_bit_budget, o.kvtc_bit_choices, o.kvtc_beta)
        started = start_fits([run.fit_rows(x) for run, x in runs], *fit)  # keys' and values' as one batch
        mx.eval([a for s in started for a in s[:3]])
        for (run, _), s in zip(runs, started):
            run.finish_fit(s, *fit)

    # -- offline calibration (``veloxquant calibrate --method kvtc``) -----------------------
    @classmethod
    def calibrate(cls, keys, values, config, *, iters: int, seed: int, progress=None, model_args=None):
        """A layer's codec arrays from its post-RoPE keys and values (B, H, T, D) of a text:
        the fit a one-chunk prompt of those tokens gets, on its tokens past the sinks and
        before the window (keys rotated back with ``model_args``' rotary, as the cache
        does), but exact where a prompt's fit may take its leading components by subspace
        iteration (``transform.fit_codec``). ``iters`` and ``seed`` change nothing: the fit is
        exact and unseeded."""
        o = config.options
        _check_choices(o)
        _check_budget(o, keys, values)
        end = keys.shape[2] - config.residual_window
        if end <= N_SINK:
            raise ValueError(f"{keys.shape[2]} calibration tokens leave none to fit: kvtc fits the tokens "
                             f"past its {N_SINK} sinks and before residual_window={config.residual_window}")
        arrays = {}
        for done, (prefix, x, rotary) in enumerate((("k", keys, args_rotary(model_args)), ("v", values, None))):
            run = TransformTokens(GROWTH_TOKENS, rotary, N_SINK)
            run.fit(x[:, :, N_SINK:end], o.kvtc_bit_budget, o.kvtc_bit_choices, o.kvtc_beta, exact=True)
            arrays.update({f"{prefix}_{name}": getattr(run.codec, name) for name in CODEC})
            if progress:
                progress("keys and values", done + 1, 2)
        return arrays

    @classmethod
    def calibration_metadata(cls, model_args) -> dict[str, str]:
        """What the file's codecs depend on besides the fields: the rotary the keys were
        fitted under (a cache whose keys are rotated otherwise refuses the file)."""
        return {"key_rotary": rotary_name(args_rotary(model_args))}

    def _meta(self):
        rotary = self.store.keys.rotary
        return {"coded": self.store.keys.count, "rotary": rotary_name(rotary)}

    # -- the saved form ------------------------------------------------------------------
    def stored_arrays(self):
        s = self.store
        out = {"sink_k": s.sink_k.view(), "sink_v": s.sink_v.view(), "k_win": s.k_win.view(),
               "v_win": s.v_win.view()}
        for prefix, run in (("k", s.keys), ("v", s.values)):
            c = run.codec
            if c is None:
                continue
            out.update({f"{prefix}_{f}": getattr(c, f) for f in CODEC})
            if run.count and c.bits.size:
                segments = self.coded_segments(prefix).segments(run, run.count,
                                                                lambda a, b, run=run: self._code(run, a, b))
                out.update(join_segments(prefix, segments))
        return {k: v for k, v in out.items() if v is not None}

    @staticmethod
    def _code(run: TransformTokens, start: int, end: int) -> dict[str, np.ndarray]:
        """Tokens [start, end) of the run, entropy-coded: one lane a kept component."""
        codes = to_numpy(run.unpacked(start, end))  # (B, n, k)
        stream, table = entropy.pack(codes.transpose(2, 0, 1).reshape(codes.shape[2], -1),
                                     1 << to_numpy(run.codec.bits).astype(np.int64))
        return {"stream": stream, "table": table}

    def restore_stored(self, meta, arrays):
        """Either saved form: the resident packed codes as they are, or the coded segments
        decoded and packed; the store, its rotary and codecs and the checks are the same."""
        coded = self.saved_form(meta) == "coded"
        rotary = None if meta.get("rotary", "none") == "none" else Rotary.from_json(meta["rotary"])
        self.store = s = self.make_store(rotary)
        s.keys.rotary = rotary  # as saved, whatever this process's context says
        for name in ("sink_k", "sink_v", "k_win", "v_win"):
            getattr(s, name).reset(arrays.get(name))
        n = int(meta.get("coded", 0))
        for prefix, run, dim in (("k", s.keys, 2), ("v", s.values, 3)):
            if f"{prefix}_basis" not in arrays:
                continue
            run.codec = c = TransformCodec(*(arrays[f"{prefix}_{f}"] for f in CODEC))
            run.heads = (self.kv_shape[1], self.kv_shape[dim])
            k, b = c.bits.size, self.kv_shape[0]
            if coded:
                if not (n and k):
                    continue
                segments = split_segments(prefix, arrays, ("stream", "table"))
                if (segments[-1][1] if segments else 0) != n:
                    raise ValueError(f"{prefix}_segments cover {segments[-1][1] if segments else 0} "
                                     f"tokens, expected the {n} coded tokens")
                parts = []
                for start, end, part in segments:
                    lanes = entropy.unpack(part["stream"], part["table"], b * (end - start),
                                           1 << to_numpy(c.bits).astype(np.int64), k)
                    parts.append(lanes.reshape(k, b, end - start).transpose(1, 2, 0))
                codes = c.fields.pack(mx.array(np.concatenate(parts, axis=1).astype(np.uint32)))
            else:
                if not n:
                    continue
                codes = arrays[f"{prefix}_codes"]
                if tuple(codes.shape) != (b, n, c.fields.n_words):
                    raise ValueError(f"{prefix}_codes has shape {tuple(codes.shape)}, expected ({b}, {n}, "
                                     f"{c.fields.n_words}): batch, the {n} coded tokens, the words of "
                                     f"{prefix}_bits' {int(c.bits.astype(mx.int32).sum())} bits")
            run.codes.reset(codes)
            if coded:
                self.coded_segments(prefix).adopt(run, segments)


def _check_choices(options) -> None:
    bad = [b for b in options.kvtc_bit_choices if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_BITS]
    if bad:
        raise ValueError(f"kvtc_bit_choices={options.kvtc_bit_choices!r} holds {bad!r}: "
                         f"allowed: integer widths from 0 to {MAX_BITS}")


def _check_budget(options, keys: mx.array, values: mx.array) -> None:
    most = max(options.kvtc_bit_choices) * keys.shape[1] * min(keys.shape[3], values.shape[3])
    if options.kvtc_bit_budget > most:
        raise ValueError(
            f"kvtc_bit_budget={options.kvtc_bit_budget} is more than this model's layers can spend: "
            f"allowed up to max(kvtc_bit_choices) * kv heads * head_dim = {most}")
    # no component able to take a width would leave every token its mean and zero-width
    # codes, which MLX's CUDA back-end does not survive (a floating point exception)
    p = keys.shape[1] * min(keys.shape[3], values.shape[3])
    if not leading_count(p, options.kvtc_bit_choices, options.kvtc_bit_budget, options.kvtc_beta):
        widths = [w for w in useful_widths(options.kvtc_bit_choices, options.kvtc_beta) if w]
        if not widths:
            raise ValueError(
                f"kvtc_bit_choices={options.kvtc_bit_choices!r}: no width beats dropping a component at "
                f"kvtc_beta={options.kvtc_beta:g}, so none gets bits; allowed: choices with a wider width")
        raise ValueError(
            f"kvtc_bit_budget={options.kvtc_bit_budget} gives no component bits: the narrowest width of "
            f"kvtc_bit_choices that beats dropping a component at kvtc_beta={options.kvtc_beta:g} is "
            f"{widths[0]}; allowed: a budget of at least {widths[0]}")
