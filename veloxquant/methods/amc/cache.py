"""AMC (adapted; no paper found): per-token tiers of rank and precision, by saliency.

Everything here is the card's proposal, inferred from the field names. A configuration of
the tiered-rows store (``methods/amc/token_tiers.py``), per layer and KV head:

- **Saliency** ``s_int(t) = Σ_c (k_tc - μ_c)² / σ_c²`` over pre-RoPE keys (the cache
  rotates each key back at its position when it knows the model's rotary settings,
  ``quant/prerope.py``; post-RoPE keys otherwise): RoPE turns a low-frequency channel
  pair further with every position, so post-RoPE statistics of the prompt call every
  generated key atypical (most of them went to High). μ and σ² per channel from the
  first ``FIT_TOKENS`` tokens or more (the first prompt chunk, or, after a shorter
  one, the stored tokens once that many exist); ``amc_calib_variance`` (a float
  in the options, not the card's per-channel array) replaces σ² by one variance for every
  channel, so the channels weigh equally (its value only scales saliency, which ranks and
  thresholds in the same units do not see). With ``amc_use_query_saliency``, a prompt
  chunk's ``s = (1 - α) rank(s_int) + α rank(s_q)`` (ranks over the chunk, in [0, 1];
  α = ``amc_query_alpha``), s_q the attention its last ``amc_threshold_window`` queries pay
  each token, summed over the GQA group (``quant/saliency.py``); otherwise s = s_int and α
  has no effect.
- **Tiers**: of a prompt chunk of n tokens, per head the ``round(k_high n)`` most salient
  are High, the next ``round(k_mid n)`` Mid, the rest Low (exact counts). The tokens of
  the fit set the thresholds θ_high, θ_mid: the smallest s in High, in High + Mid (+inf
  for an empty tier, -inf when the tiers above take every token). Tokens that arrive
  before the fit (a prompt shorter than ``FIT_TOKENS``) are High: no statistics or basis
  exist yet to rank or project them.
- **Decode**: the new token's s is its s_int, or, with query saliency (whose query part
  a new token does not have yet), the fraction of the last ``amc_threshold_window``
  tokens' s_int below its own (the rank scale of the blend). High if s >= θ_high, Mid if
  s >= θ_mid, else Low; then (after the tier is set) its s joins the window and, with
  ``amc_adaptive_thresholds``, ``θ <- (1 - γ) θ + γ θ'``, θ' the same thresholds over the
  window (γ = ``amc_gamma``; windows under 2 tokens leave θ alone). Tiers are final.
  A choice beyond the card (as KIVI keeps a full-precision residual): decode tokens wait
  exact in a window of ``FLUSH`` rows, attended as they are, and a full window (or a
  prompt chunk's arrival) gives its tokens their tiers in one batched step
  (``tiering.py``) with the rule above, token by token in order: the tiers, thresholds
  and saliency window after it are what steps of one token each would leave, bit for
  bit. So the newest ``T mod FLUSH`` decode tokens are exact, and a decode step
  writes one row and attends.
- **Treatments** (named constants below): High 8-bit, Mid 4-bit min-max per token in
  groups of G = ``amc_group_size`` channels; Low: the coefficients on the head's top
  ``r`` principal directions (``RANK_DIVISOR``: r = d/4, raised to a multiple of 16 so
  2-bit rows fill words; float16, counted), 2-bit in groups of gcd(G, r). The key basis
  is fitted on pre-RoPE keys where the rotary settings are known (the card's pitfall:
  a basis of the prompt's post-RoPE keys misses the directions RoPE turns a generated
  key to; with it the bench's KL at the defaults was 4.64, pre-RoPE 0.64): Low keys are
  kept as pre-RoPE coefficients with their positions and rotated again when read. The
  bases (and means) are the eigenvectors of the covariance of at most
  ``FIT_SAMPLE_TOKENS`` of the fit's tokens (bounded work: no QR/SVD over the tokens).
  A value takes its key's tier.
- **Room**: each tier grows by its share of the decode tokens (k_high, k_mid, the rest),
  from Python counters; a decode token whose tier is full for its head goes to the
  nearest tier with room (ties toward the finer one), so no decode step reads the
  counts on the host and memory follows the card's mix.

Attention: a prompt chunk over the decoded history plus itself (the window flushed
first); a decode step over the three tiers (``MaskedRows``: each head reads its own rows)
and the window's rows, one compiled pass, pure MLX on every device.
The cache always owns attention (its tiers are packed), so the attention hook is in place
whether or not query saliency is on. No setting is lossless (High is 8-bit);
``amc_k_high=1`` is uniform 8-bit quantization.
Memory per token and head (K and V each): ``d b/8 + 4 d/G`` bytes at b = 8 and 4, and
``r/4 + 4 r/g`` for Low; one uint8 tier flag; per head the bases and means (float16), the
saliency statistics, thresholds and window (float32); the int32 position of each Low
key; tiers grow 256 rows at a time; the window's ``FLUSH`` rows of keys and values in
the model's dtype while it holds any.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from ...cache.base import causal_mask
from ...cache.buffers import GrowingArray, arrays_written
from ...cache.rope import Rotary
from ...kernels.decode import DecodePart, decode_attention
from ...quant.cache import QuantizedCache
from ...quant.prerope import model_rotary, to_pre_rope
from ...quant.saliency import n_salient, probe_attention_sums
from ...quant.token_rows import TokenGroups
from . import decode_step, tiering
from .projection import pca_basis
from .tiering import thresholds
from .token_tiers import TieredRowsStore

HIGH_BITS, MID_BITS, LOW_BITS = 8, 4, 2
LOW = 2  # the tier kept as coefficients on a basis
RANK_DIVISOR = 4  # Low keeps d / 4 principal directions
VARIANCE_FLOOR = 1e-6  # of a head's largest channel variance
FIT_TOKENS = 64  # the fewest tokens whose statistics, quantiles and basis the tiers may follow
# Decode tokens held exact before one batched flush into the tiers: the eviction base and
# the quantized stores do their periodic work every 32 tokens too, so a model's layers and
# methods keep one period, and 32 rows of one head are small beside its tiers.
FLUSH = 32


def low_rank(d: int) -> int:
    return min(d, -(-max(d // RANK_DIVISOR, 16) // 16) * 16)


def ranks(s: mx.array) -> mx.array:
    """Ranks of s along the last axis scaled into [0, 1]."""
    n = s.shape[-1]
    return mx.argsort(mx.argsort(s, axis=-1), axis=-1).astype(mx.float32) / max(n - 1, 1)


@functools.lru_cache(maxsize=FLUSH + 1)
def _held(n: int) -> mx.array:
    """The window's held count as an int32 array (one per count, made once)."""
    return mx.array(n, mx.int32)


class AMCCache(QuantizedCache):
    batchable = "stacked"  # its rows never mix: sequences in the same state share one cache (cache/stacked.py)
    group_field = "amc_group_size"

    def make_store(self):
        self.mu = self.var = self.theta = self.window = self.window_int = None
        self.seen = self.at = 0
        self.rotary = model_rotary(self.context)
        # the window's room grows with its first tokens (a short prompt pays no 32 rows), to
        # FLUSH, and is kept from window to window
        self.pending_k, self.pending_v = (GrowingArray(step=FLUSH, limit=FLUSH, geometric=True) for _ in range(2))
        return None  # built at the first tokens: the low tier's width needs head_dim

    def _build(self, d: int, rotary=None) -> None:
        g, r, o = self.group, low_rank(d), self.config.options
        codecs = [TokenGroups(HIGH_BITS, g), TokenGroups(MID_BITS, g), TokenGroups(LOW_BITS, math.gcd(g, r))]
        shares = [o.amc_k_high, o.amc_k_mid, max(0.0, 1 - o.amc_k_high - o.amc_k_mid)]
        self.store = TieredRowsStore(codecs, codecs, shares=shares, projected=(LOW,), rotary=rotary)

    # -- saliency ------------------------------------------------------------------------
    def _unrotated(self, keys: mx.array, start: int) -> mx.array:
        """What saliency reads: the keys (at positions start..) before RoPE, if known."""
        return keys if self.rotary is None else to_pre_rope(keys, start, self.rotary)

    def _fit(self, keys: mx.array, values: mx.array, start: int = 0) -> None:
        k = self._unrotated(keys, start).astype(mx.float32)
        self.mu = k.mean(axis=2)
        calib = self.config.options.amc_calib_variance
        if calib is None:
            var = k.var(axis=2)
            self.var = mx.maximum(var, VARIANCE_FLOOR * var.max(axis=-1, keepdims=True) + 1e-30)
        else:
            self.var = mx.full(self.mu.shape, float(calib))
        r = low_rank(keys.shape[-1])
        basis_keys = keys if self.store.rotary is None else k  # the Low tier keeps keys pre-RoPE where it can
        self.store.projections[LOW] = tuple(a.astype(mx.float16)
                                            for a in (*pca_basis(basis_keys, r), *pca_basis(values, r)))

    def _fit_with_history(self, keys: mx.array, values: mx.array) -> None:
        """The fit over the tokens stored before it (all High, in their decoded form) and
        the new ones; the stored tokens' saliencies fill the window and, at a decode step,
        set the thresholds (a prompt chunk sets them from its own, as a first chunk does)."""
        o = self.config.options
        old_k, old_v = self.store.history(mx.float32)
        self._fit(mx.concatenate([old_k, keys.astype(mx.float32)], axis=2),
                  mx.concatenate([old_v, values.astype(mx.float32)], axis=2))
        s_int = self._intrinsic(self._unrotated(old_k, 0))
        s = ranks(s_int) if o.amc_use_query_saliency else s_int
        if keys.shape[2] == 1:
            self.theta = thresholds(s, o.amc_k_high, o.amc_k_mid)
        self._remember(s, s_int)

    def _intrinsic(self, keys: mx.array) -> mx.array:
        dev = keys.astype(mx.float32) - self.mu[:, :, None]
        return (dev * dev / self.var[:, :, None]).sum(axis=-1)

    def _remember(self, s: mx.array, s_int: mx.array) -> None:
        """The newest saliencies (B, H, n) join the window (a ring of threshold_window)."""
        w = self.config.options.amc_threshold_window
        if self.window is None:
            self.window = mx.zeros((*s.shape[:2], w), mx.float32)
            self.window_int = mx.zeros_like(self.window) if self.config.options.amc_use_query_saliency else None
        m = min(s.shape[-1], w)
        slots = (self.at + mx.arange(m)) % w
        self.window[..., slots] = s[..., -m:]
        if self.window_int is not None:
            self.window_int[..., slots] = s_int[..., -m:]
        self.at, self.seen = (self.at + m) % w, min(self.seen + m, w)

    def _chunk_tiers(self, queries, all_keys, keys, scale):
        o, n = self.config.options, keys.shape[2]
        s_int = self._intrinsic(self._unrotated(keys, all_keys.shape[2] - n))
        s = s_int
        if o.amc_use_query_saliency:
            m, start = min(o.amc_threshold_window, n), all_keys.shape[2] - n
            probes = mx.arange(n - m, n)
            s_q = probe_attention_sums(queries[:, :, probes], all_keys, scale, probes + start)[..., start:]
            s = (1 - o.amc_query_alpha) * ranks(s_int) + o.amc_query_alpha * ranks(s_q)
        n_hi = n_salient(o.amc_k_high, n)
        n_mid = min(n - n_hi, n_salient(o.amc_k_mid, n))
        place = mx.argsort(mx.argsort(-s, axis=-1), axis=-1)  # 0: the most salient
        tiers = mx.where(place < n_hi, 0, mx.where(place < n_hi + n_mid, 1, 2)).astype(mx.uint8)
        if self.theta is None:
            self.theta = thresholds(s, o.amc_k_high, o.amc_k_mid)
        self._remember(s, s_int)
        return tiers, [n_hi, n_mid, n - n_hi - n_mid]

    @staticmethod
    def _all_high(keys):
        """The tiers of tokens that arrive before the fit."""
        return mx.zeros((*keys.shape[:2], keys.shape[2]), mx.uint8), [keys.shape[2], 0, 0]

    # -- the protocol ----------------------------------------------------------------------
    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        k, v = self._take_chunk(sinks)
        if self.store is None:
            self._build(k.shape[-1], self.rotary)
        if queries.shape[2] == 1 and k.shape[2] == 1:
            return self._step(queries, k, v, scale)
        if self.pending_k.length:  # the window's tokens come first, in order
            self._flush()
        start, n = self.store.length, k.shape[2]
        if self.mu is None and start + n >= FIT_TOKENS:
            if start:
                self._fit_with_history(k, v)
            else:
                self._fit(k, v)
        old_k, old_v = self.store.history(k.dtype)
        all_k = k if old_k is None else mx.concatenate([old_k, k], axis=2)
        all_v = v if old_v is None else mx.concatenate([old_v, v], axis=2)
        if isinstance(mask, mx.array):
            mask = causal_mask(queries.shape[2], all_k.shape[2])
        out = mx.fast.scaled_dot_product_attention(queries, all_k, all_v, scale=scale, mask=mask)
        tiers, most = self._chunk_tiers(queries, all_k, k, scale) if self.mu is not None else self._all_high(k)
        self.store.commit(k, v, tiers, most)
        return mx.depends(out, arrays_written(self._arrays()))  # stored with its layer

    def _step(self, queries, k, v, scale):
        """A decode step: the token joins the window; a full window is flushed into the tiers."""
        self.pending_k.append(k)
        self.pending_v.append(v)
        flushed = self.pending_k.length == FLUSH
        if flushed:
            self._flush()
        held = self.pending_k.length
        window = (self.pending_k.buffer, self.pending_v.buffer, _held(held)) if held else None
        out = decode_step.decode_attention(self.store, queries, scale, window)
        if out is None:
            parts = self.store.decode_parts(None)
            if held:
                parts.append(DecodePart(None, self.pending_k.view(), None, self.pending_v.view()))
            out = decode_attention(queries, parts, scale=scale, use_kernel=False, n_kv_heads=k.shape[1])
        return mx.depends(out, self._flush_writes()) if flushed else out

    def _flush(self) -> None:
        """The window's tokens into their tiers, in order, as one batched step; the window
        is emptied (its room kept)."""
        keys, values = self.pending_k.view(), self.pending_v.view()
        self.pending_k.truncate(0)
        self.pending_v.truncate(0)
        start, n = self.store.length, keys.shape[2]
        if self.mu is None:
            early = min(n, max(0, FIT_TOKENS - 1 - start))  # before the fit: High
            if early:  # with the room steps of one token would have left
                self.store.commit(keys[:, :, :early], values[:, :, :early], *self._all_high(keys[:, :, :early]),
                                  [self.store.stepwise_room(0, early), None, None])
            if early == n:
                return
            keys, values = keys[:, :, early:], values[:, :, early:]
            # the fit at its token (FIT_TOKENS - 1 High ones stored), over them and it
            self._fit_with_history(keys[:, :, :1], values[:, :, :1])
        tiering.flush(self, keys, values)

    def _flush_writes(self) -> list[mx.array]:
        """What a flush writes that the step's attention does not read (the thresholds,
        the saliency window, the flags): generate_step evaluates only the logits, so
        attention's output depends on them (one node a layer), or their lazy graphs would
        chain from flush to flush."""
        written = [self.theta, self.window, self.window_int, self.store.flags.buffer]
        return [a for a in written if a is not None]

    # -- what is kept ------------------------------------------------------------------------
    @property
    def stored_length(self) -> int:
        return self.pending_k.length + (0 if self.store is None else self.store.length)

    def dequantized(self, dtype):
        """The tiers' tokens decoded, then the window's, in order."""
        k, v = (None, None) if self.store is None else self.store.history(dtype)
        if not self.pending_k.length:
            return k, v
        held_k, held_v = self.pending_k.view().astype(dtype), self.pending_v.view().astype(dtype)
        if k is None:
            return held_k, held_v
        return mx.concatenate([k, held_k], axis=2), mx.concatenate([v, held_v], axis=2)

    def _arrays(self):
        own = {"mu": self.mu, "var": self.var, "theta": self.theta, "window": self.window,
               "window_int": self.window_int, "pending_k": self.pending_k, "pending_v": self.pending_v}
        if self.store is None:
            return own
        return {**self.store.arrays(), **own}

    def _meta(self):
        return {"window_seen": self.seen, "window_at": self.at,
                "rotary": "none" if self.rotary is None else self.rotary.to_json(),
                **({} if self.store is None else self.store.meta())}

    def _restore_meta(self, meta) -> None:
        arrays = self.__dict__.pop("_saved_arrays", {})
        for name in ("mu", "var", "theta", "window", "window_int"):
            setattr(self, name, arrays.pop(name, None))
        for window in ("pending_k", "pending_v"):
            rows = arrays.pop(window, None)
            getattr(self, window).reset(rows)  # an emptied window gets its room back (restore_room)
        self.seen, self.at = int(meta.get("window_seen", 0)), int(meta.get("window_at", 0))
        rotary = meta.get("rotary", "none")  # as saved, whatever this process's context says
        self.rotary = None if rotary == "none" else Rotary.from_json(rotary)
        if arrays:
            # Low keys saved before RoPE carry their positions (a state without them kept them after)
            self._build(self.kv_shape[2] if self.kv_shape else arrays["tier2_k_basis"].shape[2],
                        self.rotary if "k2_positions" in arrays else None)
            self.store.restore(meta, arrays)

    def _layout_problems(self):
        if self.kv_shape is not None and self.store is not None:
            yield from self.store.layout_problems(self.kv_shape[2:])

    def _state_problems(self):
        held = self.pending_k.length
        if held != self.pending_v.length or held >= FLUSH:
            yield "window rows (keys, values)", (held, self.pending_v.length), f"equal, fewer than {FLUSH}"
            return
        for name, rows in (("key", self.pending_k.buffer), ("value", self.pending_v.buffer)):
            if rows is not None and self.kv_shape is not None and (
                    rows.ndim != 4 or rows.shape[1] != self.kv_shape[1]
                    or rows.shape[3] != self.kv_shape[2 if name == "key" else 3]):
                yield f"window {name} rows", rows.shape, f"(batch, {self.kv_shape[1]}, rows, head_dim)"
                return
        if self.store is None:
            if self.offset:
                yield "tokens stored", 0, f"the offset {self.offset}"
            return
        yield from self.store.problems(self.offset - held)
