"""SKVQ: per-token keys and values in reordered, clipped groups, sinks and a sliding window.

A configuration of the sliding-window store (``methods/skvq/sliding_store.py``). The first
``skvq_n_sink`` tokens and the newest ``skvq_window`` tokens stay in full precision; every
token in between is quantized per token, keys and values alike, at ``skvq_bits_key`` /
``skvq_bits_value`` bits in groups of ``skvq_group_size`` channels, the window sliding one
token per decode step (the token leaving it is quantized). A prompt no longer than
``n_sink + window`` is kept whole.

A channel order and a clip ratio of keys and of values, per (batch row, KV head), frozen
once in place (the paper calibrates them offline):

- ``skvq_reorder``: each head's channels sorted by their range (max - min) over the
  fitting rows and cut into equal groups (``methods/skvq/reorder.py``; the card's
  MLX-friendly option: the paper clusters per-channel (min, max) with KMeans into groups
  of varying size, which ``mx.quantize``'s layout cannot hold). The order stays within each head (the repo
  reorders the H·d channels of all heads together) so that attention can run in the
  reordered order. Keys are post-RoPE here (mlx-lm's cache sees nothing else; the paper's
  best setting quantized pre-RoPE keys and re-rotated them at every step), so the key
  order moves rotary pairs (i, i + d/2), or (2i, 2i + 1) for a ``rope_traditional`` model,
  as one unit: a pair's two channels always share a group, as the card's pitfall asks.
- ``skvq_clip_search``: the clip ratio alpha of keys and of values, each per (batch row,
  KV head), chosen from 1.00, 0.99, ..., 0.85 for the least squared error of quantizing
  the fitting rows (reordered); off, alpha is ``skvq_clip_alpha`` (which then has no
  other use). Clipping follows the repo: the group's min and max are both scaled by
  alpha (towards 0).

They come from one of two places:

- with the config's ``calibration_file`` (the paper's procedure): a file written by
  ``veloxquant calibrate --method skvq`` for this model, these settings
  (``calibration_fields``) and, with the reorder, these rotary pairs (``key_pairs``;
  refused otherwise, naming the file, the field and both values). It holds per layer what
  the fit gives on the calibration text's rows past the sinks, as a one-chunk prompt of
  that text is fitted (``SKVQCache.calibrate``): ``perm_k``, ``perm_v`` (1, H, 1, D)
  uint32 with ``skvq_reorder``, ``alpha_k``, ``alpha_v`` (1, H) float32 with
  ``skvq_clip_search`` (a fixed ratio is the config's ``skvq_clip_alpha``). The cache
  installs them at its first update, before any token is stored, every batch row taking
  the same ones: no order is sorted and no ratio searched on the prefill path, the sinks
  are kept reordered like the rest, and from then on it is a cache whose fit gave those
  arrays;
- without it (the card's adaptation): fitted when tokens are first quantized, from every
  full-precision row past the sinks (the first prompt chunk that overflows the window, or
  the window itself when decode steps fill it first).

Also:

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

from ...cache.calibration import layer_calibration
from ...quant.cache import QuantizedCache
from .clip import CLIP_GRID
from .reorder import RangeOrder
from .sliding_store import SlidingWindowStore


def key_pairing(model_args) -> str:
    """The rotary pairs of a model's post-RoPE keys: (2i, 2i + 1) for ``rope_traditional``,
    else (i, i + d/2), ``mx.fast.rope``'s default (also with no model known)."""
    return "adjacent" if getattr(model_args, "rope_traditional", False) else "half"


def calibrated_names(options) -> tuple[str, ...]:
    """The arrays a calibration file holds a layer under these options: the orders with
    the reorder, the clip ratios with the search (a fixed ratio is the config's)."""
    return (("perm_k", "perm_v") if options.skvq_reorder else ()) + \
        (("alpha_k", "alpha_v") if options.skvq_clip_search else ())


class SKVQCache(QuantizedCache):
    group_field = "skvq_group_size"
    batchable = "stacked"  # its rows never mix: sequences in the same state share one cache (cache/stacked.py)
    # What a calibration file's arrays depend on: the sinks decide which of the text's rows
    # are fitted, the reorder and the search which arrays there are and what the ratios are
    # searched on; group and widths only the searched ratios (checked only with the search
    # on: the orders alone serve any). Not the window: the fit reads every row past the sinks.
    order_fields = ("skvq_n_sink", "skvq_reorder", "skvq_clip_search")
    calibration_fields = (*order_fields, "skvq_group_size", "skvq_bits_key", "skvq_bits_value")

    @staticmethod
    def _new_store(options, group: int, pairs: str) -> SlidingWindowStore:
        o = options
        return SlidingWindowStore(
            key_bits=o.skvq_bits_key, value_bits=o.skvq_bits_value, group=group,
            window=o.skvq_window, n_sink=o.skvq_n_sink,
            key_order=RangeOrder(pairs) if o.skvq_reorder else None,
            value_order=RangeOrder() if o.skvq_reorder else None,
            clip_grid=CLIP_GRID if o.skvq_clip_search else (o.skvq_clip_alpha,),
            capacity=o.skvq_max_ctx,
        )

    def make_store(self):
        return self._new_store(self.config.options, self.group, key_pairing(getattr(self.context, "model_args", None)))

    def _init_storage(self) -> None:
        super()._init_storage()
        if self.config.calibration_file and self.context is not None:  # a wrong file fails at once
            self._calibration(None)

    def _calibration(self, kv_shape):
        """This layer's orders and clip ratios in ``calibration_file``, checked against the
        config, the model, the keys' (heads, head_dim) when known and, with a key order,
        the rotary pairs the keys were ordered by."""
        o, order = self.config.options, self.store.key_order
        fields = self.calibration_fields if o.skvq_clip_search else self.order_fields
        return layer_calibration(self.config, fields, calibrated_names(o), self.layer,
                                 model_args=getattr(self.context, "model_args", None), kv_shape=kv_shape,
                                 cache_metadata=None if order is None else {"key_pairs": order.pairs})

    def update_and_fetch(self, keys, values):
        cap = self.config.skvq_max_ctx  # the flat field: ``options`` builds an object a read
        if cap is not None and self.offset + keys.shape[2] > cap:
            raise ValueError(
                f"skvq_max_ctx={cap}: this update would take the sequence to "
                f"{self.offset + keys.shape[2]} tokens; allowed: at most {cap} tokens a "
                "sequence (None: no cap)")
        # calibrated: the file meets the keys at the first update, its arrays are in place
        # before the first token is stored (attend), and nothing is fitted
        arrays = self._calibration((keys.shape[1], keys.shape[-1])) \
            if self.config.calibration_file and self.kv_shape is None else None
        out = super().update_and_fetch(keys, values)
        if arrays is not None:
            self.store.install(arrays, keys.shape[:2])
        return out

    # -- offline calibration (``veloxquant calibrate --method skvq``) --------------------------
    @classmethod
    def calibrate(cls, keys, values, config, *, iters: int, seed: int, progress=None, model_args=None):
        """A layer's orders and clip ratios (``calibrated_names``) from its post-RoPE keys
        and values (1, H, T, D) of a text: the store's own fit on the text's rows past the
        sinks, as a one-chunk prompt of those tokens is fitted (key pairs by ``model_args``'
        rotary). ``iters`` and ``seed`` change nothing: the fit is exact and unseeded."""
        o = config.options
        names = calibrated_names(o)
        if not names:
            raise ValueError("skvq_reorder=False and skvq_clip_search=False: nothing is fitted, so nothing "
                             "to calibrate")
        group, n_sink = getattr(o, cls.group_field), o.skvq_n_sink
        if keys.shape[-1] % group or values.shape[-1] % group:
            raise ValueError(f"skvq_group_size={group} must divide head_dim={keys.shape[-1]} "
                             f"(values: {values.shape[-1]})")
        if keys.shape[2] <= n_sink:
            raise ValueError(f"{keys.shape[2]} calibration tokens leave none to fit: skvq fits the rows "
                             f"past its skvq_n_sink={n_sink} sinks (use more --tokens)")
        store = cls._new_store(o, group, key_pairing(model_args))
        store.fit(keys[:, :, n_sink:], values[:, :, n_sink:])
        if progress:
            progress("keys and values", 1, 1)
        return {name: getattr(store, name) for name in names}

    @classmethod
    def calibration_metadata(cls, model_args) -> dict[str, str]:
        """What the file's key order depends on besides the fields: the rotary pairs kept
        together (a model rotating the other pairs refuses the file)."""
        return {"key_pairs": key_pairing(model_args)}

    @property
    def n_quantized(self) -> int:
        return self.store.keys.count
