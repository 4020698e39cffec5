"""KVTC, adapted: a per-layer PCA fitted on the prompt, DP bit allocation, entropy coding.

Per layer, keys and values each (``methods/kvtc/transform.py``, ``methods/kvtc/window_store.py``):

- the first ``N_SINK`` = 4 tokens (the paper's s) and the newest ``residual_window``
  tokens (the config's window, 128 by default: the paper's w) stay in full precision;
- when the first token leaves the window, a basis is fitted on every token then held past
  the sinks (the prompt's, for a prompt longer than s + w): the rows are the token's heads
  concatenated (``p = H * d``, the card's scope; batch rows pooled), keys rotated back
  before RoPE when the model's rotary settings are known (post-RoPE otherwise, e.g. a
  cache built without a model context); mean, covariance and eigenpairs in float64 on
  the host. The basis is then frozen: later prompt chunks and decode tokens are coded
  with it (the paper calibrates one cross-layer basis offline: the adaptation);
- widths by exact dynamic programming over ``kvtc_bit_choices`` under
  ``kvtc_bit_budget`` bits per token per layer for each of K and V (over the p channels),
  distortion ``λ`` for a dropped component and ``Δ²/12`` for a uniform quantizer over
  ``±kvtc_beta·√λ`` (inferred): ``Σ b_i <= budget``, all of it spent whenever more bits
  still help; components at 0 bits are dropped (no basis column kept);
- codes per kept component, then (saved form) rANS with one frequency table per
  component, made from its codes (``quant/entropy.py``; the paper uses DEFLATE).

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

from ...cache.rope import Rotary
from ...quant import entropy
from ...quant.coded_cache import EntropyCodedCache, join_segments, split_segments, to_numpy
from ...quant.packed import GROWTH_TOKENS
from ...quant.prerope import model_rotary
from .transform import TransformCodec, TransformTokens
from .window_store import SinkWindowStore

N_SINK = 4
MAX_BITS = 16  # a code fits one word or straddles two


class KVTCCache(EntropyCodedCache):
    batchable = "per_sequence"  # the quantized store has no packed layout (cache/batch.py says why)
    @property
    def group(self) -> int:  # no channel groups: any head_dim
        return 1

    def make_store(self, rotary: Rotary | None = None):
        bad = [b for b in self.config.options.kvtc_bit_choices
               if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_BITS]
        if bad:
            raise ValueError(f"kvtc_bit_choices={self.config.options.kvtc_bit_choices!r} holds {bad!r}: "
                             f"allowed: integer widths from 0 to {MAX_BITS}")
        rotary = rotary or model_rotary(self.context)
        return SinkWindowStore(TransformTokens(GROWTH_TOKENS, rotary, N_SINK),
                               TransformTokens(GROWTH_TOKENS, None, N_SINK),
                               n_sink=N_SINK, window=self.config.residual_window, fit=self._fit)

    def update_and_fetch(self, keys, values):
        o = self.config.options
        most = max(o.kvtc_bit_choices) * keys.shape[1] * min(keys.shape[3], values.shape[3])
        if o.kvtc_bit_budget > most:
            raise ValueError(
                f"kvtc_bit_budget={o.kvtc_bit_budget} is more than this model's layers can spend: "
                f"allowed up to max(kvtc_bit_choices) * kv heads * head_dim = {most}")
        return super().update_and_fetch(keys, values)

    def _fit(self, run: TransformTokens, x: mx.array) -> None:
        o = self.config.options
        run.fit(x, o.kvtc_bit_budget, o.kvtc_bit_choices, o.kvtc_beta)

    def _meta(self):
        rotary = self.store.keys.rotary
        return {"coded": self.store.keys.count, "rotary": rotary.to_json() if rotary else "none"}

    # -- the saved form ------------------------------------------------------------------
    def stored_arrays(self):
        s = self.store
        out = {"sink_k": s.sink_k.view(), "sink_v": s.sink_v.view(), "k_win": s.k_win.view(),
               "v_win": s.v_win.view()}
        for prefix, run in (("k", s.keys), ("v", s.values)):
            c = run.codec
            if c is None:
                continue
            out.update({f"{prefix}_mean": c.mean, f"{prefix}_basis": c.basis, f"{prefix}_bits": c.bits,
                        f"{prefix}_step": c.step})
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
            run.codec = c = TransformCodec(*(arrays[f"{prefix}_{f}"] for f in ("mean", "basis", "bits", "step")))
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
