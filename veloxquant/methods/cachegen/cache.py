"""CacheGen: anchor/delta coding, depth-scheduled bit widths, per-channel entropy coding.

Per layer, keys and values alike (``methods/cachegen/delta.py``):

- **bits**: ``cachegen_resolved_bits`` when set; otherwise the depth schedule, the layers
  split into ``cachegen_layer_groups`` contiguous groups, the first getting
  ``cachegen_bits + 1`` (capped at 8), the rest ``cachegen_bits`` (the released codec's
  32/16/16 bins ~ 5/4/4 bits; inferred). One group means no schedule: ``cachegen_bits``
  everywhere. A cache built without a model context (no layer count) uses
  ``cachegen_bits``. The width used is ``resolved_bits`` on the cache (the options are
  frozen: they are not rewritten) and is saved with it.
- **anchors and deltas** (``cachegen_use_delta``): tokens in groups of G =
  ``cachegen_group_size`` consecutive tokens (the anchor spacing, inferred equal to the
  scale group); the group's first token quantized at 8 bits, every other token as its
  delta from the reconstructed anchor, on one step per channel group for the whole anchor
  group: the anchor's range at the layer's width (widened where a delta is larger), so
  small deltas give symbols near zero and lower the entropy. Without delta coding every
  token is coded directly.
- **quantization**: symmetric per G channels, float16 scales: per token without deltas,
  per anchor group with them (the released code scales per token over all H*d channels:
  per-group scales are the card's adaptation).
- **streaming**: a prompt chunk encodes its whole groups of G tokens, the rest (and decode
  tokens) wait in full precision until a group is whole (``quant/chunk_store.py``).
- **entropy coding** (``quant/entropy.py``, rANS): the symbols of each (layer, K/V) coded
  with one frequency table per channel (head x dim; ``cachegen_per_channel``) or one
  pooled table, built from the symbols coded (the released code's per-chunk CDFs: one
  set per coded segment, ``quant/coded_cache.py``, each segment coded once); anchors with
  one pooled table (a per-channel table of 255 entries would outweigh the 1/G of tokens
  it codes). Zero counts need no smoothing: the table is the data's own.

What stays resident (``nbytes``, and ``state``: what mlx-lm evaluates after each prefill
chunk, with no coding): the fixed-length codes, packed at the layer's width (the anchor's
zero delta included), float16 scales (per token, or per anchor group), anchor codes and
scales, the full-precision tail. What ``veloxquant_mlx.save_prompt_cache`` writes (the
coded form, ``stored_nbytes``): the coded streams and their uint16 tables, the scales, the
anchors' streams, the tail (``quant/coded_cache.py``); a file of either form loads.
Attention never reads a stream: a prompt chunk attends over the reconstructed history plus
itself, a decode step over the resident codes read where they lie (``AnchoredScores``:
group-affine products over the packed deltas and anchors, no decoded copy of the history)
and the tail, merged in one softmax.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ...cache.base import CacheStateError
from ...quant import entropy
from ...quant.affine import unpack_codes
from ...quant.coded_cache import EntropyCodedCache, from_numpy, join_segments, split_segments, to_numpy
from ...quant.packed import GROWTH_TOKENS
from .delta import ANCHOR_BITS, AnchoredCodec, AnchoredStore, AnchoredTokens, qmax


def layer_bits(options, layer: int, n_layers: int | None) -> int:
    """The layer's width: the explicit override, else the depth schedule."""
    if options.cachegen_resolved_bits is not None:
        return options.cachegen_resolved_bits
    groups, bits = options.cachegen_layer_groups, options.cachegen_bits
    if n_layers is None or groups == 1:
        return bits
    return min(8, bits + 1) if layer * groups // n_layers == 0 else bits


def _lanes(x: np.ndarray) -> np.ndarray:
    """(B, H, n, D) -> (H*D, B*n): one lane per channel, its symbols along the tokens."""
    b, h, n, d = x.shape
    return x.transpose(1, 3, 0, 2).reshape(h * d, b * n)


def _from_lanes(x: np.ndarray, b: int, h: int, d: int) -> np.ndarray:
    return x.reshape(h, d, b, -1).transpose(2, 0, 3, 1)


class CacheGenCache(EntropyCodedCache):
    batchable = "stacked"  # its rows never mix: sequences in the same state share one cache (cache/stacked.py)
    group_field = "cachegen_group_size"

    def make_store(self, bits: int | None = None):
        o = self.config.options
        self.resolved_bits = bits or layer_bits(o, self.layer, getattr(self.context, "n_layers", None))
        codec = AnchoredCodec(self.resolved_bits, self.group, o.cachegen_use_delta)
        step = max(GROWTH_TOKENS, self.group)
        return AnchoredStore(AnchoredTokens(codec, step), AnchoredTokens(codec, step),
                            block=self.group, group=self.group, step_tokens=step)

    def _meta(self):
        return {**super()._meta(), "bits": self.resolved_bits}

    # -- the saved form ------------------------------------------------------------------
    def stored_arrays(self):
        s = self.store
        out = {"k_buf": s.k_buf.view(), "v_buf": s.v_buf.view()}
        for prefix, run in (("k", s.keys), ("v", s.values)):
            if run.count:
                out.update(self._coded(prefix, run))
        return {k: v for k, v in out.items() if v is not None}

    def _coded(self, prefix: str, run: AnchoredTokens):
        segments = self.coded_segments(prefix).segments(run, run.count, lambda a, b: self._code(run, a, b))
        return {f"{prefix}_scales": run.scales.view(), **join_segments(prefix, segments),
                **({f"{prefix}_anchor_scales": run.anchor_scales.view()} if run.codec.use_delta else {})}

    def _code(self, run: AnchoredTokens, start: int, end: int) -> dict[str, np.ndarray]:
        """Tokens [start, end) of the run (whole anchor groups), entropy-coded."""
        c, pooled = run.codec, not self.config.options.cachegen_per_channel
        sym = to_numpy(unpack_codes(run.codes.view()[:, :, start:end], c.bits))
        if c.use_delta:  # the anchors' zero deltas are not coded
            b, h, n, d = sym.shape
            sym = sym.reshape(b, h, n // c.group, c.group, d)[:, :, :, 1:].reshape(b, h, -1, d)
        stream, table = entropy.pack(_lanes(sym), 2 * qmax(c.bits) + 1, pooled=pooled)
        out = {"stream": stream, "table": table}
        if c.use_delta:
            anchors = run.anchor_codes.view()[:, :, start // c.group : end // c.group]
            stream, table = entropy.pack(_lanes(to_numpy(unpack_codes(anchors, ANCHOR_BITS))),
                                         2 * qmax(ANCHOR_BITS) + 1, pooled=True)
            out.update({"anchor_stream": stream, "anchor_table": table})
        return out

    def restore_stored(self, meta, arrays):
        """Either saved form: the resident codes as they are, or the coded segments decoded
        into them; the store, its width and the checks are the same."""
        coded = self.saved_form(meta) == "coded"
        self.store = self.make_store(int(meta["bits"]))
        self.store.k_buf.reset(arrays.get("k_buf"))
        self.store.v_buf.reset(arrays.get("v_buf"))
        if self.kv_shape is None:
            return
        b, h, d_k, d_v = self.kv_shape
        for prefix, run, d in (("k", self.store.keys, d_k), ("v", self.store.values, d_v)):
            if f"{prefix}_scales" not in arrays:
                continue
            c, scales = run.codec, arrays[f"{prefix}_scales"]
            anchor_scales = arrays[f"{prefix}_anchor_scales"] if c.use_delta else None
            if coded:
                names = ("stream", "table") + (("anchor_stream", "anchor_table") if c.use_delta else ())
                segments = split_segments(prefix, arrays, names)
                source, n = f"{prefix}_segments", segments[-1][1] if segments else 0
            else:
                codes = arrays[f"{prefix}_codes"]
                anchors = arrays[f"{prefix}_anchor_codes"] if c.use_delta else None
                for name, x in ((f"{prefix}_codes", codes), (f"{prefix}_scales", scales),
                                (f"{prefix}_anchor_codes", anchors), (f"{prefix}_anchor_scales", anchor_scales)):
                    if x is not None and (x.ndim != 4 or tuple(x.shape[:2]) != (b, h)):
                        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected ({b}, {h}, tokens, "
                                         f"...): the batch x kv heads of kv_shape {self.kv_shape}")
                source, n = f"{prefix}_codes", codes.shape[2]
            if (n // c.group if c.use_delta else n) != scales.shape[2]:
                raise ValueError(f"{source} cover {n} tokens, which {prefix}_scales "
                                 f"({scales.shape[2]} rows) does not")
            if coded:
                parts = [self._decode_segment(c, part, b, h, d, end - start, prefix, i)
                         for i, (start, end, part) in enumerate(segments)]
                codes = mx.concatenate([s for s, _ in parts], axis=2)
                anchors = mx.concatenate([a for _, a in parts], axis=2) if c.use_delta else None
            run.put(codes, scales, anchors, anchor_scales, exact=True, packed=not coded)
            if coded:
                self.coded_segments(prefix).adopt(run, segments)

    def _decode_segment(self, c, part, b: int, h: int, d: int, n: int, prefix: str = "k", index: int = 0):
        """The (codes, anchor codes) of one coded segment of n tokens, unpacked uint32; a
        stream that does not decode (cut, or its table edited) is named with its layer."""
        pooled = not self.config.options.cachegen_per_channel
        n_coded = n // c.group * (c.group - 1) if c.use_delta else n

        def unpack(name, *args, **kwargs):
            table = name.replace("stream", "table")
            try:
                return entropy.unpack(part[name], part[table], *args, **kwargs)
            except ValueError as exc:
                raise CacheStateError(
                    f"saved cache, layer {self.layer} ({type(self).__name__}, method "
                    f"{self.config.method!r}): {prefix}_{name} segment {index} ({n} tokens, "
                    f"{part[name].shape[0]} bytes, with {prefix}_{table}) does not decode: {exc}") from None

        lanes = unpack("stream", b * n_coded, 2 * qmax(c.bits) + 1, h * d, pooled=pooled)
        sym = _from_lanes(lanes, b, h, d)
        anchors = None
        if c.use_delta:
            full = np.full((b, h, n // c.group, c.group, d), qmax(c.bits), np.int64)
            full[:, :, :, 1:] = sym.reshape(b, h, n // c.group, c.group - 1, d)
            sym = full.reshape(b, h, n, d)
            a = unpack("anchor_stream", b * (n // c.group), 2 * qmax(ANCHOR_BITS) + 1, h * d, pooled=True)
            anchors = from_numpy(_from_lanes(a, b, h, d).astype(np.uint32))
        return from_numpy(sym.astype(np.uint32)), anchors
