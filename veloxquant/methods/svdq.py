"""SVDq: keys as latent channels on a per-head SVD basis, quantized by a bit schedule.

A configuration of the latent store (``lowrank/latent.py``), per layer and KV head:

- **basis**, from the config's ``calibration_file`` (``veloxquant calibrate --method
  svdq``: fitted offline on a text's keys, as the paper fits offline, then fixed: no fit on
  the prefill path, no refits), or else first fitted on every token held when at least
  head_dim are (the card's "per-sequence prefill SVD", in the prompt chunk that brings the
  count there): the mean ``μ`` and the first r right
  singular vectors ``V_r`` of ``K - μ``. r = ``svdq_rank`` (clipped to head_dim), or the
  smallest r holding ``svdq_energy_threshold`` of the singular-value mass ``Σσ`` (linear
  σ, the adaptation's rule), the largest over the layer's heads;
- **latents** ``L = (K - μ) V_r``: the r channels cut into ``len(svdq_bit_schedule)``
  contiguous near-equal groups, largest σ first, group i quantized per channel at
  ``svdq_bit_schedule[i]`` bits, min-max over ``svdq_group_size`` tokens; 0 bits stores
  nothing (the channels read as 0), 16 or more keeps them unquantized. The newest latents
  (fewer than a group) wait in full precision;
- **values**: exact, in the model's dtype;
- **refits**: each time the tokens held double since the end of the prompt or the last
  refit, a new basis of the same rank from the running moments of every key taken in;
  later keys are coded on it, stored ones keep theirs (``lowrank/latent.py``).

Keys are the post-RoPE keys mlx-lm gives (SVDqOptions has no rotary field; the card
notes pre-RoPE keys are more low-rank). Until the basis is fitted, tokens are held
exactly and attend exactly. A decode step attends over the latents with the query
folded onto the basis, ``q Kᵀ = (q V_r) L_hatᵀ + q.μ``, never a rebuilt key history.

Key memory per token and head: ``Σ_g n_g b_g / 8 + Σ_{b_g > 0} n_g * 2 s / G`` bytes
(scale and minimum per channel and token group, s bytes each in the model's dtype), plus
the basis ``(d r + d) s`` per head once; values ``d s``.
"""

from __future__ import annotations

import functools

from ..lowrank.latent import LatentCache, LatentCodec, LatentStore, split_channels, width_problem


class SVDqCache(LatentCache):
    batchable = "stacked"  # its rows never mix: sequences in the same state share one cache (cache/stacked.py)
    calibration_fields = ("svdq_rank", "svdq_energy_threshold")  # what a calibration file's bases depend on

    def make_store(self):
        o = self.config.options
        schedule = tuple(int(b) for b in o.svdq_bit_schedule)
        problems = [width_problem(b) for b in schedule if width_problem(b)]
        if not schedule or problems:
            raise ValueError(f"svdq_bit_schedule={tuple(o.svdq_bit_schedule)!r}: "
                             + (problems[0] if problems else "needs at least one group"))
        keys = LatentCodec(o.svdq_rank, o.svdq_energy_threshold,
                           functools.partial(split_channels, schedule=schedule))
        return LatentStore(keys, None, group=o.svdq_group_size)
