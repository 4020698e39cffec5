"""Palu: low-rank latents of keys and values shared by groups of heads, quantized.

A configuration of the latent store (``lowrank/latent.py``), per layer, for keys and for
values separately:

- **groups** (G-LRD): the KV heads in ``palu_n_head_groups`` contiguous groups of g (a
  count above the model's KV heads gives each head its own group; one that does not
  divide them is refused); a
  group's heads side by side, ``X_j (T, g d)``, share one basis (the faithful analog of
  the paper's grouped decomposition, not the port's per-head basis stacked over tokens);
- **basis**, from the config's ``calibration_file`` (``veloxquant calibrate --method
  palu``: fitted offline on a text's keys and values, as the paper calibrates offline,
  then fixed: no fit on the prefill path, no refits), or else first fitted on every token
  held when at least g d are (in the prompt chunk that brings the count there; the paper
  decomposes the projection weights after whitening; a cache never sees weights):
  mean ``μ_j`` and the first r right singular vectors of ``X_j - μ_j``, r = ``palu_rank``
  (clipped to g d) or the smallest r holding ``palu_energy_threshold`` of the
  singular-value mass ``Σσ``, the largest over the layer's groups;
- **latents** ``L = (X_j - μ_j) V_r`` (T, r) per group, never the heads' K/V: the first
  ``floor(palu_hi_fraction * r)`` channels (largest σ) at ``palu_hi_bit``, the rest at
  ``palu_lo_bit``, per channel min-max over ``palu_group_size`` tokens (the paper groups
  along the latent dims per token, after a Hadamard transform); 16 bits keeps a channel
  unquantized. ``palu_quantize_values=False`` keeps the value latents in the model's dtype;
- **refits**: each time the tokens held double since the end of the prompt or the last
  refit, new bases of the same rank from the running moments of every token taken in;
  later tokens are coded on them, stored ones keep theirs (``lowrank/latent.py``).

RoPE: the paper caches pre-RoPE latents and rotates each reconstructed key in a fused
kernel. Here keys are the post-RoPE keys mlx-lm gives, which lets attention stay in the
latent space: ``q K_hᵀ = (q V^(h)) L_hatᵀ + q.μ_h`` (the query folded onto head h's rows
of the basis) and ``p V_h = (p L_hat) V^(h)ᵀ + (Σp) μ_h``; post-RoPE keys need a higher
rank for the same error (the card's pitfall). Until the bases are fitted, tokens are
held exactly.

Memory per token and tensor: ``n_groups (r_hi b_hi / 8 + r_lo b_lo / 8 + r 2 s / G)``
bytes (s: the model dtype's size), plus the bases ``n_groups (g d r + g d) s`` once.
"""

from __future__ import annotations

import functools
import math

from ..lowrank.latent import ChannelSegment, LatentCache, LatentCodec, LatentStore


def hi_lo_segments(rank: int, fraction: float, hi: int, lo: int) -> list[ChannelSegment]:
    r_hi = math.floor(fraction * rank)
    return [s for s in (ChannelSegment(0, r_hi, hi), ChannelSegment(r_hi, rank, lo)) if s.stop > s.start]


class PALUCache(LatentCache):
    batchable = "stacked"  # its rows never mix once prefilled: sequences whose fitted ranks agree (always, with palu_rank set) share one cache (cache/stacked.py)
    # what a calibration file's bases depend on (not the widths: they code the latents)
    calibration_fields = ("palu_rank", "palu_energy_threshold", "palu_n_head_groups")

    def make_store(self):
        o = self.config.options
        segments = functools.partial(hi_lo_segments, fraction=o.palu_hi_fraction, hi=o.palu_hi_bit, lo=o.palu_lo_bit)
        keys = LatentCodec(o.palu_rank, o.palu_energy_threshold, segments)
        values = (LatentCodec(o.palu_rank, o.palu_energy_threshold, segments) if o.palu_quantize_values else
                  LatentCodec(o.palu_rank, o.palu_energy_threshold, functools.partial(hi_lo_segments, fraction=1.0,
                                                                                      hi=16, lo=16)))
        return LatentStore(keys, values, group=o.palu_group_size, n_groups=o.palu_n_head_groups)

    @classmethod
    def head_groups(cls, config, n_kv_heads: int) -> int:
        n, h = config.options.palu_n_head_groups, n_kv_heads
        if h % n and n < h:
            allowed = [k for k in range(1, h + 1) if h % k == 0]
            raise ValueError(f"palu_n_head_groups={n} must divide the model's {h} KV heads; allowed here: "
                             f"{allowed} (or more than {h}: a head a group)")
        return min(n, h)
