"""SKVQ: per-token keys and values in reordered, clipped groups, sinks and a sliding window.

A configuration of the sliding-window store (``methods/skvq/sliding_store.py``). The first
``skvq_n_sink`` tokens and the newest ``skvq_window`` tokens stay in full precision; every
token in between is quantized per token, keys and values alike, at ``skvq_bits_key`` /
``skvq_bits_value`` bits in groups of ``skvq_group_size`` channels, the window sliding one
token per decode step (the token leaving it is quantized). A prompt no longer than
``n_sink + window`` is kept whole.

Fitted once, when tokens are first quantized, from every full-precision row past the sinks
(the first prompt chunk that overflows the window, or the window itself when decode steps
fill it first), per (batch row, KV head), then frozen (the card's adaptation of the
paper's offline calibration):

- ``skvq_reorder``: each head's channels sorted by their range (max - min) over those rows
  and cut into equal groups (``methods/skvq/reorder.py``; the card's MLX-friendly option: the
  paper clusters per-channel (min, max) with KMeans into groups of varying size, which
  ``mx.quantize``'s layout cannot hold). The order stays within each head (the repo
  reorders the H·d channels of all heads together) so that attention can run in the
  reordered order. Keys are post-RoPE here (mlx-lm's cache sees nothing else; the paper's
  best setting quantized pre-RoPE keys and re-rotated them at every step), so the key
  order moves rotary pairs (i, i + d/2), or (2i, 2i + 1) for a ``rope_traditional`` model,
  as one unit: a pair's two channels always share a group, as the card's pitfall asks.
- ``skvq_clip_search``: the clip ratio alpha of keys and of values, each per (batch row,
  KV head), chosen from 1.00, 0.99, ..., 0.85 for the least squared error of quantizing
  those rows (reordered); off, alpha is ``skvq_clip_alpha`` (which then has no other use).
  Clipping follows the repo: the group's min and max are both scaled by alpha (towards 0).
- ``skvq_max_ctx``: a cap on the tokens of a sequence (the card's inferred meaning): the
  packed storage never grows room past it, and an update that would take the sequence
  beyond it is refused before anything is stored. None: no cap, storage grows with what
  is kept (there is no preallocation: storage here always grows with what is kept).
- The paper's fp8 scales and 1.5-bit values are not offered (no field holds them).

Attention: a prompt chunk attends over the decoded history plus itself. A decode step runs
in the reordered channel space: the token is permuted in, the queries through the key
order, the output back through the inverse value order (three small gathers a layer); the
parts are the sinks (full-precision rows) and the packed rows with the window as their
tails. Values are per-token group-affine (the kernels' value layout), but keys are per
token as well, which the fused kernel does not read (it takes per-channel keys): the
packed keys are ``TokenRows`` and both parts go through the pure-MLX path on every device,
the GPU included, one ``quantized_matmul`` over the packed keys and one over the packed
values on the CPU. ``fused_attention`` reaches the dispatcher, which has no kernel for
these parts. A fused kernel with a per-token key loop would serve this layout as it is:
queries and outputs are already in the stored order.
"""

from __future__ import annotations

from ...quant.cache import QuantizedCache
from .clip import CLIP_GRID
from .reorder import RangeOrder
from .sliding_store import SlidingWindowStore


class SKVQCache(QuantizedCache):
    group_field = "skvq_group_size"
    batchable = "stacked"  # its rows never mix: sequences in the same state share one cache (cache/stacked.py)

    def make_store(self):
        o = self.config.options
        args = getattr(self.context, "model_args", None)
        pairs = "adjacent" if getattr(args, "rope_traditional", False) else "half"
        return SlidingWindowStore(
            key_bits=o.skvq_bits_key, value_bits=o.skvq_bits_value, group=self.group,
            window=o.skvq_window, n_sink=o.skvq_n_sink,
            key_order=RangeOrder(pairs) if o.skvq_reorder else None,
            value_order=RangeOrder() if o.skvq_reorder else None,
            clip_grid=CLIP_GRID if o.skvq_clip_search else (o.skvq_clip_alpha,),
            capacity=o.skvq_max_ctx,
        )

    def update_and_fetch(self, keys, values):
        cap = self.config.options.skvq_max_ctx
        if cap is not None and self.offset + keys.shape[2] > cap:
            raise ValueError(
                f"skvq_max_ctx={cap}: this update would take the sequence to "
                f"{self.offset + keys.shape[2]} tokens; allowed: at most {cap} tokens a "
                "sequence (None: no cap)")
        return super().update_and_fetch(keys, values)

    @property
    def n_quantized(self) -> int:
        return self.store.keys.count
