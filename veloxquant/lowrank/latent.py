"""Tokens kept as latent coordinates on a basis fitted from the prompt, quantized channel
segment by channel segment, read at decode through the basis (never a dense history).

**Basis.** Per batch row and group of g KV heads (SVDq: g = 1; Palu: g heads side by
side), ``X (T, n = g*d)``: the mean ``μ`` (n,) and the first r right singular vectors
``V_r`` (n, r) of ``X - μ``, from the eigenvectors of its Gram matrix over a bounded
sample of tokens (``factors.gram_basis``: the basis is complete whatever the number of
tokens, and r = n reconstructs exactly). A token's latent is ``l = (x - μ) V_r``, its reconstruction
``x_hat = l_hat V_rᵀ + μ``. The rank is given (clipped to n), or the smallest r whose
singular values hold ``fraction`` of their mass ``Σσ`` (linear σ, SVDq's adaptation;
``energy_rank(power=1)``), the largest over the layer's groups and batch rows, so that
one r serves the layer.

**Latents** (``LatentTokens``): per channel, min-max over token groups of ``group``
tokens (``GroupAffine`` "channel"), in contiguous channel segments of their own widths,
largest σ first (``ChannelSegment``): 0 bits keeps nothing (the channel reads as 0), 1-6 and 8
are packed, 16 or more keep the channel unquantized in the model's dtype (adjacent
segments kept alike are stored as one span, ``stored_spans``: the same numbers, one read
at decode). New latents
wait in full precision until a whole group of tokens is there, then every segment
flushes that block.

**Decode** (``FoldedKeys``, ``FoldedValues``: ``PackedScores`` of ``kernels/decode.py``).
With ``V^(h)`` the d rows of ``V_r`` that belong to KV head h of its group:

- keys: ``q K_hatᵀ = (q V^(h)) L_hatᵀ + q.μ_h``: the query is folded into the latent
  space once per step (r numbers), then scored against the packed latents segment by
  segment (``quantized_matmul`` on the CPU) and the full-precision latents;
- values: ``p V_hat = (p L_hat) V^(h)ᵀ + (Σp) μ_h``: the mix runs over the packed latents
  (r numbers per query) and is lifted back to head_dim once.

Where a run is the step's only part, ``q.μ_h`` is one constant per query row under the
softmax and ``Σp = 1``: those terms are left out and ``+ μ_h`` added (``scores_shifted``,
``mix_normalised``). Both are exact rewritings of attention over the reconstruction (float rounding apart):
O(T r) per query head instead of O(T d) plus the reconstruction. Keys are the
post-RoPE keys mlx-lm hands the cache, so no rotation stands between query and latent;
Palu's paper factors pre-RoPE keys and rotates each reconstructed key in a fused kernel,
which this fold cannot do (a per-token rotation does not commute with ``V^(h)``).

A decode step does small, fixed work (issue 30): what it reads of the packed spans (their
valid tokens, in the layout its path reads: ``_SpanRead``) and of a run's basis and mean
(per head, transposed, broadcast over the query rows: ``_BasisRead``) are views kept
between flushes (``ReadViews``), so a step slices and reshapes nothing of the history; the
folded query is cut into the spans' channels by one split and their scores summed into one
another (``addmm``); the lift adds the mean in the same product; 1-bit words are unpacked
in one fused pass on a GPU's path; a token's moments and both tensors' latents are tied by
one dependency.

On CUDA, a steady step (one run, the queries one row) is one
``scaled_dot_product_attention`` call in the latent space instead (fused by MLX up to
width 128): the folded queries against
the latents decoded in the queries' dtype, the value latents (or the exact values) as its
values, every width zero-padded to one of ``FUSED_WIDTHS``, the mixed latents
lifted with the mean in one product (``LatentStore._fused_attention``). The stored rows
are read once the queries exist, as the other CUDA reads do (``PackedStore.history_after``).

``LatentStore`` holds a layer: keys and values wait exactly (``pending``) until at least
as many tokens as a basis has rows (n = g*d) are held, when the bases are fitted on every
token held and everything is encoded (a basis fitted on fewer tokens spans only them, so
new tokens would lose every other direction); that happens in the prompt chunk that
brings the count there, so a prefilled prompt is kept compressed, and a shorter history
(prompt and decode tokens) stays exact. Later tokens are projected onto the newest bases
as they come. Values are latent (their own basis and segments) or kept exactly.

**Calibrated bases** (a config's ``calibration_file``, written by ``veloxquant
calibrate``): the papers fit offline (Palu decomposes the projection weights, SVDq the key
matrices of calibration data). The file holds each layer's means and bases, fitted on a
text's keys and values as a one-chunk prompt of them would be (``LatentCache.calibrate``);
a cache installs them before its first tokens, so it holds no token exactly, solves no
eigenproblem on the prefill path, keeps no running moments and never refits.

**Refits** (issue 37): a basis fitted on the first tokens codes later post-RoPE tokens
worse (RoPE turns them into directions the first positions never showed). Every token
taken in adds to running float32 moments (``Latent``: a (g*d)^2 Gram matrix a group), and
each time the tokens held double since the end of the prompt or the last refit (a
Python counter, checked at decode steps), a new basis of the same rank (the rank is
an array shape: choosing it again would read a value on the host) is taken from them
and the tokens after it are coded on it, as a new ``Run``. Stored tokens keep the basis
they were coded with: re-coding them would quantize them twice. A decode step reads one
part a run (``decode_parts``), or, values kept exactly, one part of every run's keys and
the values (``_RunKeys``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

from ..cache.buffers import GrowingArray, RecentRows
from ..cache.calibration import batch_rows, layer_calibration
from ..kernels import kivi_decode as kd
from ..kernels.decode import DecodePart, scaled_queries
from ..quant.affine import SUPPORTED_BITS
from ..quant.cache import QuantizedCache
from ..quant.packed import GROWTH_TOKENS, GroupAffine, PackedTokens
from ..quant.store import WINDOW_STEP, PackedStore, as_dtype
from ..quant.token_rows import ReadViews, held
from . import latent_rows_kernel as rows_kernel
from .cpu_streams import cpu_eigh
from .factors import energy_rank, gram_basis

UNQUANTIZED_BITS = 16  # widths from here on keep a channel in the model's dtype
# the widths the latent attention is padded to on CUDA (queries', keys' and values' widths
# equal). MLX 0.32's CUDA back-end fuses a one-row attention at 64, 96 and 128
# (``sdpa_vector``); at 256 it runs its own products and softmax, which still beat the
# float32 read on an H100 (benchmarks/notes/cuda_dense_reads.md)
FUSED_WIDTHS = (64, 96, 128, 256)
REFIT_GROWTH = 2  # a new basis each time the tokens held have doubled since the last fit


def width_problem(bits: int) -> str | None:
    """Why a latent channel cannot be stored at ``bits`` (None when it can)."""
    if bits == 0 or bits in SUPPORTED_BITS or bits >= UNQUANTIZED_BITS:
        return None
    return (f"width {bits} is not stored here; allowed: 0 (the channels are dropped), "
            f"{', '.join(map(str, SUPPORTED_BITS))} (packed), {UNQUANTIZED_BITS} or more (unquantized)")


@dataclass(frozen=True)
class ChannelSegment:
    start: int
    stop: int
    bits: int


def split_channels(rank: int, schedule) -> list[ChannelSegment]:
    """``rank`` channels cut into ``len(schedule)`` contiguous near-equal segments (the
    first ``rank mod len`` one channel longer), each at its width; empty ones left out."""
    n = len(schedule)
    out, start = [], 0
    for i, bits in enumerate(schedule):
        stop = start + rank // n + (1 if i < rank % n else 0)
        if stop > start:
            out.append(ChannelSegment(start, stop, int(bits)))
        start = stop
    return out


def _stored_as(bits: int):
    """How a segment's channels are kept: dropped, packed at ``bits``, or unquantized."""
    return "dropped" if bits == 0 else ("exact" if bits >= UNQUANTIZED_BITS else bits)


def stored_spans(segments: list[ChannelSegment]) -> list[tuple[int, ChannelSegment]]:
    """The segments as stored: adjacent ones kept alike (the same packed width, both
    unquantized or both dropped) joined into one span, each keyed by the index of its first
    segment. Channels are quantized one by one (min-max per channel over a token group), so
    a joined span holds exactly what its segments would; a decode step reads it at once."""
    spans: list[tuple[int, ChannelSegment]] = []
    for i, s in enumerate(segments):
        if spans and _stored_as(spans[-1][1].bits) == _stored_as(s.bits) and spans[-1][1].stop == s.start:
            j, last = spans[-1]
            spans[-1] = (j, ChannelSegment(last.start, s.stop, last.bits))
        else:
            spans.append((i, s))
    return spans


def fit_basis(x: mx.array, rank: int | None, fraction: float):
    """(mean (B, G, 1, n), basis (B, G, n, r)) of ``x`` (B, G, T, n), float32."""
    return fit_bases([x], rank, fraction)[0]


def fit_bases(xs: list[mx.array], rank: int | None, fraction: float) -> list[tuple[mx.array, mx.array]]:
    """``fit_basis`` of tensors of one shape (a layer's keys and values) as one batch: one
    set of eigenproblems over the fit streams and one host read of every tensor's rank
    (each tensor's own: the largest over its groups and batch rows), where a fit each would
    wait for the device twice. Each matrix is decomposed alone: the same bases."""
    xs = [a.astype(mx.float32) for a in xs]
    x = xs[0][None] if len(xs) == 1 else mx.stack(xs)  # one tensor (svdq, calibration): a view, no copy
    mean = x.mean(axis=3, keepdims=True)
    n = x.shape[-1]
    basis, sigma = gram_basis(x - mean)
    if rank is not None:
        ranks = [min(rank, n)] * len(xs)
    else:
        ranks = energy_rank(sigma, fraction, power=1).reshape(len(xs), -1).max(axis=1).tolist()
    return [(mean[i], mx.contiguous(basis[i, ..., :r])) for i, r in enumerate(ranks)]


class LatentTokens:
    """A growing run of latents (B, G, T, r) in channel segments."""

    def __init__(self, segments: list[ChannelSegment], group: int, step_tokens: int, lead: tuple[int, int]):
        self.segments, self.lead = segments, lead  # lead: (B, G)
        self.group = group
        self.rank = segments[-1].stop if segments else 0
        self.spans = stored_spans(segments)  # what is stored: adjacent alike segments joined
        self.packed = {i: PackedTokens(GroupAffine(s.bits, group, "channel"), step_tokens)
                       for i, s in self.spans if 0 < s.bits < UNQUANTIZED_BITS}
        # unquantized segments and the buffer are read through ``view``, never by whole steps
        self.exact = {i: GrowingArray(axis=2, step=step_tokens, geometric=True)
                      for i, s in self.spans if s.bits >= UNQUANTIZED_BITS}
        # a group's room, kept across flushes: every decode step writes one row in place, so
        # steps launch the same kernels whatever the count (MLX's CUDA graphs recur)
        self.buf = RecentRows(axis=2, step=WINDOW_STEP, limit=group, geometric=True)
        self.flushed = 0  # tokens in the segments (a multiple of the group)
        # the decode read's views: each span's valid tokens (``_span_views``, kept until the
        # next flush) and its run's basis and mean in the read's layouts (``basis_views``)
        self._views = ReadViews()
        self._basis_views = ReadViews()
        self._stored = [g for p in self.packed.values() for g in (p.codes, p.scales, p.biases)] + list(self.exact.values())
        self.rows_layout = rows_kernel.RowsLayout(tuple(rows_kernel.Span(s.start, s.stop, s.bits) for _, s in self.spans),
                                                  self.rank, group)

    @property
    def count(self) -> int:
        return self.flushed + self.buf.length

    def append(self, latents: mx.array) -> None:
        """Latents (B, G, n, r), in the dtype to keep; whole groups flush at once."""
        if latents.shape[2] == 1:  # a decode step: in place, a block once a group is there
            self.buf.append(latents)
            if self.buf.length == self.group:
                self._flush(self.buf.view(), decoding=True)
                self.buf.truncate(0)
            return
        old = self.buf.view()
        x = latents if old is None else mx.concatenate([old, latents], axis=2)
        n = x.shape[2] // self.group * self.group
        if n:
            self._flush(x[:, :, :n])
        self.buf.reset(mx.contiguous(x[:, :, n:]) if x.shape[2] > n else None)

    def _flush(self, block: mx.array, decoding: bool = False) -> None:
        """``decoding``: a decode step's block (a shape that recurs: the compiled encoder)."""
        self._views.clear()  # no view pins a buffer the appends below write in place
        for i, s in self.spans:
            part = block[..., s.start:s.stop]
            if i in self.packed:
                self.packed[i].append(part, decoding)
            elif i in self.exact:
                self.exact[i].append(part)
        self.flushed += block.shape[2]

    # -- reading ---------------------------------------------------------------------------
    def dense(self) -> mx.array:
        """Every latent (B, G, count, r), float32, 0 in dropped channels (transient)."""
        parts = []
        if self.flushed:  # (an unquantized span has no rows before its first flush)
            cols = []
            for i, s in self.spans:
                if i in self.packed:
                    cols.append(self.packed[i].decode(mx.float32))
                elif i in self.exact:
                    cols.append(self.exact[i].view().astype(mx.float32))
                else:
                    cols.append(None)
            parts.append(mx.concatenate([c if c is not None else mx.zeros((*self.lead, self.flushed, s.stop - s.start))
                                         for c, (_, s) in zip(cols, self.spans)], axis=-1))
        if self.buf.length:
            parts.append(self.buf.view().astype(mx.float32))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    def _span_views(self) -> list["_SpanRead"]:
        """What a decode step reads of each stored span: its valid tokens (views of the
        buffers, in the layout the step's path reads), built when the segments change (a
        flush, a restore) and kept until then: a step slices nothing of the history."""
        return self._span_reads()[0]

    def _span_reads(self) -> tuple[list["_SpanRead"], list[int]]:
        """``_span_views`` and where the folded query is cut into their channels."""
        path = kd._pure_path()
        key = (self.flushed, path, *[g.buffer for g in self._stored])
        return self._views.get(self, key, lambda: _span_reads(self, path))

    def basis_views(self, basis: mx.array, mean: mx.array, g: int, rows: int) -> "_BasisRead":
        """The run's basis and mean in the layouts a decode step reads (views, kept while the
        run and the query rows a KV head stay as they are)."""
        key = (basis, mean, g, rows)
        return self._basis_views.get(self, key, lambda: _BasisRead.of(basis, mean, g, rows))

    def scores(self, qf: mx.array) -> mx.array:
        """(B, G, R, count) float32 ``qf Lᵀ`` for folded float32 queries (B, G, R, r)."""
        out = []
        if self.flushed:
            spans, cuts = self._span_reads()
            qs = mx.split(qf, cuts, axis=-1) if cuts else [qf]
            s = None
            for q, sp in zip(qs, spans):  # one split of the query, its pieces summed in place
                s = sp.scores(s, q, self.group)
            out.append(s if s is not None else mx.zeros((*qf.shape[:3], self.flushed)))
        if self.buf.length:
            out.append(qf @ self.buf.view().astype(mx.float32).swapaxes(-1, -2))
        return out[0] if len(out) == 1 else mx.concatenate(out, axis=-1)

    def mix(self, p: mx.array) -> mx.array:
        """(B, G, R, r) float32 ``p L`` for float32 weights (B, G, R, count)."""
        out = None
        pb = p
        if self.flushed:
            pq, pb = mx.split(p, [self.flushed], axis=-1) if self.buf.length else (p, None)
            cols = [sp.mix(pq, self.group) for sp in self._span_views()]
            out = cols[0] if len(cols) == 1 else mx.concatenate(cols, axis=-1)
        if self.buf.length:
            latents = self.buf.view().astype(mx.float32)
            out = pb @ latents if out is None else mx.addmm(out, pb, latents)
        return out

    def read_inputs(self, dtype=None) -> list[mx.array]:
        """What ``rows`` in ``dtype`` reads of the stored spans first (their codes, or their
        unquantized rows; every buffer and the window's where the latent-rows kernel writes
        the rows): what a decode step holds back until its queries exist."""
        if not self.flushed:
            return []
        if dtype is not None and rows_kernel.runs_for(self.rows_layout, dtype):
            _, window, _, arrays = self.kernel_inputs()
            return ([] if window is None else [window]) + [a for span in arrays for a in span]
        return [sp.inputs[0] for sp in self._span_views() if sp.arrays]

    def kernel_inputs(self) -> tuple:
        """(layout, the window's buffer or None, its first row, each span's buffers) as the
        latent-rows kernel reads them: whole buffers, spare room included (no copy)."""
        arrays = []
        for i, _ in self.spans:
            if i in self.packed:
                p = self.packed[i]
                arrays.append((p.codes.buffer, p.scales.buffer, p.biases.buffer))
            else:
                arrays.append((self.exact[i].buffer,) if i in self.exact else ())
        return self.rows_layout, self.buf.buffer if self.buf.length else None, self.buf.start, arrays

    def rows(self, dtype, width: int, inputs) -> mx.array:
        """Every latent (B, G, count, width) in ``dtype``, 0 in dropped channels and past the
        rank: the keys or values of one fused attention in the latent space (a CUDA decode
        step); ``inputs``: ``read_inputs(dtype)`` as the caller holds them (an iterator). On
        a GPU with ``VQ_LATENT_ROWS_KERNEL=1`` one launch writes them (``latent_rows_kernel``,
        untimed on a device so far), else MLX's ops join them."""
        if self.flushed and rows_kernel.runs_for(self.rows_layout, dtype):
            layout, window, start, arrays = self.kernel_inputs()
            window = None if window is None else next(inputs)
            arrays = [tuple(next(inputs) for _ in span) for span in arrays]
            return rows_kernel.latent_rows(layout, window, start, arrays, self.flushed, self.count, width, dtype,
                                           self.lead)
        parts, pad = [], width - self.rank
        if self.flushed:
            spans = self._span_views()
            # dropped channels and the padding as zeros broadcast (no bytes): the join writes
            # them, so the rows are written once, not padded in a pass of their own
            zeros = held(self, "_zero_views", ReadViews).get(self, (self.flushed, str(dtype), width), lambda: {
                at: mx.broadcast_to(_zero(str(dtype)), (*self.lead, self.flushed, n))
                for at, n in [(sp.start, sp.stop - sp.start) for sp in spans if not sp.arrays] + [(self.rank, pad)] if n})
            cols = [sp.rows(dtype, self.group, next(inputs)) if sp.arrays else zeros[sp.start] for sp in spans]
            cols += [zeros[self.rank]] if pad else []
            parts.append(cols[0] if len(cols) == 1 else mx.concatenate(cols, axis=-1))
        if self.buf.length:
            rows = as_dtype(self.buf.view(), dtype)
            parts.append(mx.pad(rows, [(0, 0)] * 3 + [(0, pad)]) if pad else rows)
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    def fused_views(self, basis: mx.array, mean: mx.array, g: int, rows: int, width: int, dtype) -> "_BasisRead":
        """``basis_views`` in ``dtype`` with the basis zero-padded to ``width`` columns (the
        fused read's fold and lift, the padded channels multiplied by zeros), kept likewise."""
        key = (basis, mean, g, rows, width, str(dtype))
        return held(self, "_fused_basis_views", ReadViews).get(self, key, lambda: _BasisRead.of(
            mx.pad(basis, [(0, 0)] * 3 + [(0, width - basis.shape[-1])]).astype(dtype), mean.astype(dtype), g, rows))

    # -- what is kept --------------------------------------------------------------------------
    def arrays(self, prefix: str) -> dict[str, GrowingArray]:
        out = {f"{prefix}_buf": self.buf}
        for i, p in self.packed.items():
            out.update(p.arrays(f"{prefix}{i}"))
        for i, g in self.exact.items():
            out[f"{prefix}{i}_exact"] = g
        return out

    def restore(self, prefix: str, arrays: dict[str, Any], flushed: int) -> None:
        arrays = self._spans_joined(prefix, arrays)
        self._views.clear()
        for name, kept in self.arrays(prefix).items():
            kept.reset(arrays.get(name))
        self.flushed = flushed

    def _spans_joined(self, prefix: str, arrays: dict[str, Any]) -> dict[str, Any]:
        """A file saved before adjacent alike segments were stored as one span holds each
        segment's arrays under its own index: they are joined along the channels, which
        is what the span stores (channels are quantized one by one)."""
        out = dict(arrays)
        firsts = [i for i, _ in self.spans] + [len(self.segments)]
        for i, end in zip(firsts, firsts[1:]):
            if end - i < 2:
                continue
            for suffix, axis in (("_codes", 2), ("_scales", 2), ("_biases", 2), ("_exact", 3)):
                parts = [arrays.get(f"{prefix}{j}{suffix}") for j in range(i, end)]
                if all(p is not None for p in parts):
                    out[f"{prefix}{i}{suffix}"] = mx.concatenate(parts, axis=axis)
        return out

    def problems(self, name: str):
        """(field, found, expected) where the segments contradict the token count."""
        if self.flushed % self.group:
            yield f"{name} latents in groups", self.flushed, f"a multiple of the group {self.group}"
        if self.buf.length >= self.group:
            yield f"{name} buffered latents", self.buf.length, f"fewer than the group {self.group}"
        for i, seg in self.spans:
            if i in self.packed:
                found = self.packed[i].count if self.packed[i].scales.buffer is not None else 0
                width = self.packed[i].codes.view()
                channels = None if width is None else width.shape[2]
            elif i in self.exact:
                found = self.exact[i].length
                channels = None if self.exact[i].buffer is None else self.exact[i].buffer.shape[3]
            else:
                continue
            if found != self.flushed:
                yield f"{name} latent segment {i} tokens", found, self.flushed
            elif channels is not None and channels != seg.stop - seg.start:
                yield f"{name} latent segment {i} channels", channels, seg.stop - seg.start


def _span_reads(tokens: LatentTokens, path: str) -> tuple[list["_SpanRead"], list[int]]:
    spans = [_SpanRead.of(tokens, i, seg, path) for i, seg in tokens.spans]
    return spans, [sp.start for sp in spans[1:]]


@functools.lru_cache(maxsize=None)
def _zero(dtype: str) -> mx.array:
    """A zero of ``dtype`` (by name), made once: a leaf of the steps that broadcast it."""
    return mx.zeros((1, 1, 1, 1), getattr(mx, dtype.split(".")[-1]))


@functools.lru_cache(maxsize=None)
def _word_bits() -> mx.array:
    """The 32 bit positions of a word (uint32), made once: a leaf of the steps that read it."""
    return mx.arange(32, dtype=mx.uint32)


# 1-bit codes, ``code * scale + bias`` in the scales' dtype, from words (..., groups, k, 1)
# and their group's scales and minima (..., groups, 1, 1): one fused pass, the values
# ``kivi_decode.unpacked_affine`` gives (its graph is a dozen nodes; MLX's own 1-bit
# reading is wrong on CUDA, so 1-bit words are never handed to ``mx.dequantize``)
_one_bit_affine = mx.compile(lambda words, bits, scales, biases:
                             ((words >> bits) & 1).astype(scales.dtype) * scales + biases, shapeless=True)


@dataclass(frozen=True)
class _SpanRead:
    """What a decode step reads of one stored span of ``LatentTokens``: its valid tokens, as
    views of its buffers in the layout the step's path reads (``_span_views``)."""

    start: int
    stop: int
    bits: int  # 0: dropped; UNQUANTIZED_BITS or more: kept unquantized
    path: str  # kivi_decode._pure_path(): "qmm" (quantized_matmul) or a dequantization
    arrays: tuple  # packed: (codes, scales, minima); unquantized: (rows, rows transposed); dropped: ()
    unpacked: bool = False  # 1 bit (groups of 32k tokens): arrays (words (..., groups, k, 1), scales and minima (..., groups, 1, 1))
    # packed at 2 bits or more: the whole buffers (codes, scales, minima) over the same room of
    # tokens, which ``rows`` decodes before it cuts the valid tokens (a step's fused read):
    # slices of the buffers are not contiguous, and the dequantization would copy each first
    room: tuple = ()

    @classmethod
    def of(cls, tokens: "LatentTokens", i: int, seg: ChannelSegment, path: str) -> "_SpanRead":
        n = tokens.flushed
        if i in tokens.packed:
            p = tokens.packed[i]
            groups, words = n // tokens.group, n * seg.bits // 32
            codes = p.codes.buffer
            arrays = (codes[..., :words], p.scales.buffer[..., :groups], p.biases.buffer[..., :groups])
            k = tokens.group // 32  # words a group at 1 bit
            if path != "qmm" and seg.bits == 1 and k and codes.shape[-1] % k == 0:
                # (..., groups, words a group, 1) words against their group's (..., groups, 1, 1)
                # scales and minima: the buffer's words (contiguous) grouped, then cut
                words = codes[..., :words, None, None] if k == 1 else \
                    codes.reshape(*codes.shape[:-1], -1, k)[..., :groups, :, None]
                arrays = (words, *(a[..., None, None] for a in arrays[1:]))
                return cls(seg.start, seg.stop, seg.bits, path, arrays, True)
            room = (codes, p.scales.buffer, p.biases.buffer)
            coded, scaled = codes.shape[-1] * 32 // seg.bits, room[1].shape[-1] * tokens.group
            if coded != scaled:  # rooms of unequal size (a restored state): their common room
                n_room = min(coded, scaled)
                room = (codes[..., : n_room * seg.bits // 32], *(a[..., : n_room // tokens.group] for a in room[1:]))
            return cls(seg.start, seg.stop, seg.bits, path, arrays, room=room)
        if i in tokens.exact:
            rows = tokens.exact[i].view()
            return cls(seg.start, seg.stop, seg.bits, path, (rows, rows.swapaxes(-1, -2)))
        return cls(seg.start, seg.stop, 0, path, ())

    def _dequantized(self, dtype, group: int, codes: mx.array | None = None) -> mx.array:
        """The span's latents (B, G, channels, tokens) in ``dtype`` (None: the scales');
        ``codes``: the span's codes as the caller holds them (None: its own view)."""
        own, scales, biases = self.arrays
        codes = own if codes is None else codes
        if dtype is not None:
            scales, biases = scales.astype(dtype), biases.astype(dtype)
        if self.unpacked:
            out = _one_bit_affine(codes, _word_bits(), scales, biases)
            return out.reshape(*out.shape[:-3], -1)
        return kd.dequantize(codes, scales, biases, group, self.bits)

    def rows(self, dtype, group: int, first: mx.array) -> mx.array:
        """The span's latents (B, G, tokens, channels) in ``dtype``, its first input
        (``inputs[0]``: codes, or the unquantized rows) as ``first``."""
        if self.bits >= UNQUANTIZED_BITS:
            return as_dtype(first, dtype)
        if self.room:
            scales, biases = (a.astype(dtype) for a in self.room[1:])
            tokens = self.arrays[1].shape[-1] * group
            return kd.dequantize(first, scales, biases, group, self.bits)[..., :tokens].swapaxes(-1, -2)
        return self._dequantized(dtype, group, first).swapaxes(-1, -2)

    @property
    def inputs(self) -> tuple:
        """What ``rows`` reads: the whole buffers where it decodes their room, else ``arrays``."""
        return self.room or self.arrays

    def scores(self, acc: mx.array | None, q: mx.array, group: int) -> mx.array | None:
        """``acc +`` float32 ``q Lᵀ`` over the span's channels (``q``: the query's)."""
        if not self.arrays:
            return acc
        if self.bits >= UNQUANTIZED_BITS:
            keys_t = self.arrays[1].astype(mx.float32)
        elif self.path == "qmm":
            t = mx.quantized_matmul(q, *self.arrays, transpose=False, group_size=group, bits=self.bits)
            return t if acc is None else acc + t
        else:  # float32 scales: the dequantization writes float32 rows, no second pass to cast them
            keys_t = self._dequantized(mx.float32, group)
        return q @ keys_t if acc is None else mx.addmm(acc, q, keys_t)

    def mix(self, p: mx.array, group: int) -> mx.array:
        """float32 ``p L`` (B, G, R, channels) over the span's tokens."""
        if not self.arrays:
            return mx.zeros((*p.shape[:3], self.stop - self.start))
        if self.bits >= UNQUANTIZED_BITS:
            return p @ self.arrays[0].astype(mx.float32)
        if self.path == "qmm":
            return mx.quantized_matmul(p, *self.arrays, transpose=True, group_size=group, bits=self.bits)
        return kd.token_mix(p, self._dequantized(None, group).astype(mx.float32).swapaxes(-1, -2))


@dataclass(frozen=True)
class _BasisRead:
    """A run's basis and mean in the layouts a decode step reads (views): per KV head h,
    ``V^(h)`` (B, H, d, r) and its transpose, ``μ_h`` (B, H, 1, d), its transpose, and
    ``μ_h`` broadcast over the R query rows a KV head (B, H, R, d)."""

    basis: mx.array
    basis_t: mx.array
    mean: mx.array
    mean_t: mx.array
    mean_rows: mx.array

    @classmethod
    def of(cls, basis: mx.array, mean: mx.array, g: int, rows: int) -> "_BasisRead":
        b, groups, n, r = basis.shape
        h, d = groups * g, n // g
        if g > 1:  # a group's heads side by side: head k's rows are k*d .. (k+1)*d - 1
            basis, mean = basis.reshape(b, h, d, r), mean.reshape(b, h, 1, d)
        return cls(basis, basis.swapaxes(-1, -2), mean, mean.swapaxes(-1, -2), mx.broadcast_to(mean, (b, h, rows, d)))


@dataclass(frozen=True)
class _Folded:
    """Tokens ``L_hat V^(h)ᵀ + μ_h`` of one tensor, read in the latent space (``PackedScores``)."""

    latents: LatentTokens
    basis: mx.array  # (B, G, g*d, r)
    mean: mx.array  # (B, G, 1, g*d)
    heads_per_group: int

    @property
    def count(self) -> int:
        return self.latents.count

    @property
    def n_heads(self) -> int:
        return self.basis.shape[1] * self.heads_per_group

    def _views(self, rows: int) -> _BasisRead:
        return self.latents.basis_views(self.basis, self.mean, self.heads_per_group, rows)


class FoldedKeys(_Folded):
    """Keys scored through the query folded onto the basis."""

    def scores(self, q: mx.array) -> mx.array:
        views = self._views(q.shape[2])
        return self._latent_scores(q, views) + q @ views.mean_t

    def scores_shifted(self, q: mx.array) -> mx.array:
        """``scores`` less ``q.μ_h``, one constant a query row: what a softmax over these
        scores alone reads (``kernels/decode.py`` asks for it where this part is all)."""
        return self._latent_scores(q, self._views(q.shape[2]))

    def _latent_scores(self, q, views: _BasisRead):
        b, h, rq, _ = q.shape
        g = self.heads_per_group
        qf = q @ views.basis
        if g > 1:
            qf = qf.reshape(b, h // g, g * rq, -1)  # (B, G, g*R, r)
        s = self.latents.scores(qf)
        return s if g == 1 else s.reshape(b, h, rq, -1)


class FoldedValues(_Folded):
    """Values mixed in the latent space, lifted once (the mean added by the same product)."""

    def mix(self, p: mx.array) -> mx.array:
        views = self._views(p.shape[2])
        return mx.addmm(p.sum(axis=-1, keepdims=True) * views.mean, self._latent_mix(p), views.basis_t)

    def mix_normalised(self, p: mx.array) -> mx.array:
        """``mix`` for weights that sum to 1 over these tokens (a softmax over this part
        alone: ``kernels/decode.py`` asks for it then): ``Σp = 1`` leaves ``+ μ_h``."""
        views = self._views(p.shape[2])
        return mx.addmm(views.mean_rows, self._latent_mix(p), views.basis_t)

    def _latent_mix(self, p):
        b, h, rq, t = p.shape
        g = self.heads_per_group
        pl = self.latents.mix(p if g == 1 else p.reshape(b, h // g, g * rq, t))
        return pl if g == 1 else pl.reshape(b, h, rq, -1)


@dataclass(frozen=True)
class _RunKeys:
    """The keys of several runs (each on its own basis) as one ``PackedScores``: their
    scores side by side, in token order, each with its mean term."""

    runs: tuple[FoldedKeys, ...]

    @property
    def count(self) -> int:
        return sum(k.count for k in self.runs)

    @property
    def n_heads(self) -> int:
        return self.runs[0].n_heads

    def scores(self, q: mx.array) -> mx.array:
        return mx.concatenate([k.scores(q) for k in self.runs], axis=-1)


@dataclass(frozen=True)
class LatentCodec:
    """How one tensor (keys or values) is kept: the rank rule and the segments' widths."""

    rank: int | None
    fraction: float
    segments: Callable[[int], list[ChannelSegment]]  # rank -> segments


@dataclass
class Run:
    """Tokens coded on one basis: its mean (B, G, 1, n), basis (B, G, n, r) and latents."""

    mean: mx.array
    basis: mx.array
    tokens: LatentTokens


@mx.compile
def _decode_token(x, x_col, mean, basis, shift, shift_col, gram, total):
    """A decode token's latents and the running moments with it taken in, each moment one
    elementwise pass: the outer product as a broadcast product of the token centred as a
    column and as a row, not a product of its own (its factors negated, bit for bit the same
    product: the sum's ``x - shift`` is then no common term, which compile would make a
    pass of its own)."""
    f32 = mx.float32
    latents = ((x.astype(f32) - mean.astype(f32)) @ basis.astype(f32)).astype(x.dtype)
    gram = gram + (shift_col - x_col.astype(f32)) * (shift - x.astype(f32))
    return latents, gram, total + (x.astype(f32) - shift)


class Latent:
    """One tensor of a layer in latent form: runs of tokens, each kept on the basis it was
    coded with (``Run``; a refit starts a new run and leaves the earlier ones as they are),
    and the running moments of every token taken in exactly (``shift``, the mean at the
    first fit; ``total = Σ (x - shift)``; ``gram = Σ (x - shift)ᵀ(x - shift)``, float32),
    from which ``refit`` takes a new basis without reading the history again.
    ``basis``, ``mean`` and ``tokens`` are the newest run's: where new tokens go."""

    def __init__(self, codec: LatentCodec, group: int, step_tokens: int):
        self.codec, self.group, self.step = codec, group, step_tokens
        self.runs: list[Run] = []
        self.shift = self.total = self.gram = None

    @property
    def basis(self):
        return self.runs[-1].basis if self.runs else None

    @property
    def mean(self):
        return self.runs[-1].mean if self.runs else None

    @property
    def tokens(self) -> LatentTokens | None:
        return self.runs[-1].tokens if self.runs else None

    @property
    def count(self) -> int:
        return sum(run.tokens.count for run in self.runs)

    def fit(self, x: mx.array) -> None:
        """Fit the basis on ``x`` (B, G, T, n); the moments start empty (``append`` adds)."""
        self.start(*fit_basis(x, self.codec.rank, self.codec.fraction), x.dtype)

    def start(self, mean: mx.array, basis: mx.array, dtype) -> None:
        """The first run on a fitted ``mean`` and ``basis`` (float32), kept in ``dtype``;
        the moments start empty."""
        self.install(mean.astype(dtype), basis.astype(dtype))
        n = mean.shape[-1]
        self.shift = mx.array(mean)  # its own buffer: the run's mean is this one in float32
        self.total = mx.zeros(mean.shape, mx.float32)
        self.gram = mx.zeros((*mean.shape[:2], n, n), mx.float32)

    def install(self, mean, basis) -> None:
        """Start a run on ``basis``."""
        tokens = LatentTokens(self.codec.segments(basis.shape[-1]), self.group, self.step, tuple(basis.shape[:2]))
        self.runs.append(Run(mean, basis, tokens))

    def append(self, x: mx.array, decoding: bool = False) -> None:
        """Project ``x`` (B, G, n, g*d) onto the newest basis and keep its latents; its
        moments join the running ones (evaluated with the latents, which attention reads:
        a lazy sum left alone would lengthen at every step)."""
        latents, moments = self.project(x)
        self.tokens.append(mx.depends(latents, moments) if moments else latents)

    def project(self, x: mx.array) -> tuple[mx.array, list[mx.array]]:
        """The latents of ``x`` (B, G, n, g*d) on the newest basis, in its dtype, and the
        running moments with ``x`` taken in ([] where none are kept): the caller has them
        evaluated with the latents (``append``; ``LatentStore._encode``, for keys and values
        at once)."""
        run, f32 = self.runs[-1], mx.float32
        gram = self.gram
        if gram is not None and x.shape[2] == 1:  # a decode token: one compiled pass
            latents, self.gram, self.total = _decode_token(x, x.swapaxes(-1, -2), run.mean, run.basis, self.shift,
                                                           self._shift_column(), gram, self.total)
            return latents, [self.gram, self.total]
        xf = x.astype(f32)  # (a cast to the dtype an array has is the array: no node)
        latents = ((xf - run.mean.astype(f32)) @ run.basis.astype(f32)).astype(x.dtype)
        if gram is None:
            return latents, []
        centred = xf - self.shift
        self.gram = gram = mx.addmm(gram, centred.swapaxes(-1, -2), centred)
        self.total = total = self.total + centred.sum(axis=2, keepdims=True)
        return latents, [gram, total]

    def _shift_column(self) -> mx.array:
        """``shift`` as a column (B, G, n, 1): a view kept while ``shift`` is the same array."""
        return held(self, "_shift_views", ReadViews).get(self, (self.shift,), lambda: self.shift.swapaxes(-1, -2))

    def refit(self) -> None:
        """A new run on a basis of the same rank from the running moments of every token
        taken in (the eigenvectors of their scatter matrix: a (g*d x g*d) eigh). Stored
        tokens keep the basis they were coded with: re-coding them on the new one would
        quantize them twice (at 1 or 2 bits the second error exceeds the first: measured,
        svdq's prompt keys went from 0.36 to 1.5 relative error after three refits). Nothing
        is read on the host: a refit may fall in a decode step."""
        count = self.count
        mean_c = self.total / count
        scatter = self.gram - count * (mean_c.swapaxes(-1, -2) @ mean_c)
        scatter = mx.where(mx.isfinite(scatter), scatter, 0.0)  # an overflowed token must not stop the refit
        _, vectors = cpu_eigh(scatter)  # ascending
        basis = vectors[..., ::-1][..., : self.basis.shape[-1]]
        dtype = self.basis.dtype
        self.install((self.shift + mean_c).astype(dtype), mx.contiguous(basis.astype(dtype)))

    def dense(self) -> mx.array:
        """The reconstruction (B, G, count, n), float32 (transient)."""
        parts = [run.tokens.dense() @ run.basis.astype(mx.float32).swapaxes(-1, -2) + run.mean.astype(mx.float32)
                 for run in self.runs if run.tokens.count]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    def arrays(self, prefix: str) -> dict[str, Any]:
        out = {f"{prefix}_shift": self.shift, f"{prefix}_total": self.total, f"{prefix}_gram": self.gram}
        if not self.runs:
            out.update({f"{prefix}_basis": None, f"{prefix}_mean": None})
        for i, run in enumerate(self.runs):
            name = run_prefix(prefix, i)
            out.update({f"{name}_basis": run.basis, f"{name}_mean": run.mean, **run.tokens.arrays(name)})
        return out


def run_prefix(prefix: str, i: int) -> str:
    """Names of run i's arrays: the first run's are the names a single basis had."""
    return prefix if i == 0 else f"{prefix}run{i}_"


def _group(x: mx.array, g: int) -> mx.array:
    """(B, H, T, d) -> (B, H/g, T, g*d): a group's heads side by side."""
    if g == 1:
        return x
    b, h, t, d = x.shape
    if t == 1:  # a decode token: its heads are already side by side
        return x.reshape(b, h // g, 1, g * d)
    return x.reshape(b, h // g, g, t, d).swapaxes(2, 3).reshape(b, h // g, t, g * d)


def _ungroup(x: mx.array, g: int) -> mx.array:
    if g == 1:
        return x
    b, groups, t, n = x.shape
    return x.reshape(b, groups, t, g, n // g).swapaxes(2, 3).reshape(b, groups * g, t, n // g)


class LatentStore(PackedStore):
    """A layer's keys (always) and values (``value_codec``, or kept exactly) in latent form.

    ``n_groups``: head groups sharing a basis (None: one per KV head)."""

    def __init__(self, key_codec: LatentCodec, value_codec: LatentCodec | None, *, group: int,
                 n_groups: int | None = None):
        self.n_groups = n_groups
        self.heads_per_group: int | None = None
        step = max(GROWTH_TOKENS, group)
        self.keys = Latent(key_codec, group, step)
        self.values = Latent(value_codec, group, step) if value_codec is not None else None
        # exact rows grow with what they hold (geometric): a short prompt, held exactly until
        # the fit, pays no 256-row step
        self.v_exact = GrowingArray(axis=2, step=GROWTH_TOKENS, geometric=True) if value_codec is None else None
        self.k_pend = GrowingArray(axis=2, step=GROWTH_TOKENS, geometric=True)
        self.v_pend = GrowingArray(axis=2, step=GROWTH_TOKENS, geometric=True)
        self.fitted_at = 0  # tokens held at the last fit (a Python counter: the refit schedule)
        # a calibration file's arrays (``{k,v}_{mean,basis}``, batch 1), installed at the first commit
        self.calibrated: dict[str, mx.array] | None = None

    @property
    def fitted(self) -> bool:
        return self.keys.basis is not None

    @property
    def length(self) -> int:
        return self.keys.count if self.fitted else self.k_pend.length

    # -- writing ---------------------------------------------------------------------------
    def commit(self, keys: mx.array, values: mx.array) -> None:
        if self.keys.runs and keys.shape[2] == 1 and self.heads_per_group is not None:
            # a decode step, fitted (its groups known): the steady state
            self._encode(keys, values)
            if self.keys.gram is not None and self.length >= REFIT_GROWTH * self.fitted_at:
                self._refit()
            return
        if self.heads_per_group is None:
            self.heads_per_group = 1 if self.n_groups is None else keys.shape[1] // self.n_groups
        if not self.fitted and self.calibrated is not None:
            self._install_calibrated(keys.shape[0], keys.dtype)
        if not self.fitted:
            self.k_pend.append(keys)
            self.v_pend.append(values)
            if self.k_pend.length >= self.fit_tokens(keys.shape[-1]):
                self._fit()
            return
        self._encode(keys, values)
        if keys.shape[2] > 1:
            # a prompt is one run: the schedule counts from its end (a run more would cost
            # every decode step a read of it), and the moments already hold all of it
            self.fitted_at = self.length
        elif self._refit_due():
            self._refit()

    def fit_tokens(self, head_dim: int) -> int:
        """Tokens held exactly before the bases are fitted: the rows of a basis."""
        return self.heads_per_group * head_dim

    def _fit(self) -> None:
        keys, values = self.k_pend.view(), self.v_pend.view()
        g = self.heads_per_group
        k_codec = self.keys.codec
        if self.values is not None and (self.values.codec.rank, self.values.codec.fraction) == (
                k_codec.rank, k_codec.fraction) and keys.shape == values.shape:
            fits = fit_bases([_group(keys, g), _group(values, g)], k_codec.rank, k_codec.fraction)
            for latent, fit in zip((self.keys, self.values), fits):
                latent.start(*fit, keys.dtype)
        else:
            self.keys.fit(_group(keys, g))
            if self.values is not None:
                self.values.fit(_group(values, g))
        self.k_pend.reset(None)
        self.v_pend.reset(None)
        self.fitted_at = keys.shape[2]
        self._encode(keys, values)

    def _install_calibrated(self, batch: int, dtype) -> None:
        """Every row's runs start on the file's bases; no moments are kept: no refits."""
        for latent, prefix in ((self.keys, "k"), (self.values, "v")):
            if latent is None:
                continue
            mean, basis = (batch_rows(self.calibrated[f"{prefix}_{name}"], batch) for name in ("mean", "basis"))
            latent.install(mean.astype(dtype), basis.astype(dtype))
        self.calibrated = None

    def _refit_due(self) -> bool:
        return self.fitted and self.keys.gram is not None and self.length >= REFIT_GROWTH * self.fitted_at

    def _refit(self) -> None:
        for latent in (self.keys, self.values):
            if latent is not None:
                latent.refit()
        self.fitted_at = self.length

    def _encode(self, keys, values) -> None:
        g, k_latent, v_latent = self.heads_per_group, self.keys, self.values
        latents, moments = k_latent.project(_group(keys, g))
        if v_latent is None:
            k_latent.runs[-1].tokens.append(mx.depends(latents, moments) if moments else latents)
            self.v_exact.append(values)
            return
        v_latents, v_moments = v_latent.project(_group(values, g))
        moments = moments + v_moments
        if moments:  # one dependency for both tensors' moments
            latents, v_latents = mx.depends([latents, v_latents], moments)
        k_latent.runs[-1].tokens.append(latents)
        v_latent.runs[-1].tokens.append(v_latents)

    # -- reading ---------------------------------------------------------------------------
    def history(self, dtype):
        if not self.length:
            return None, None
        if not self.fitted:
            return self.k_pend.view().astype(dtype), self.v_pend.view().astype(dtype)
        g = self.heads_per_group
        k = _ungroup(self.keys.dense(), g).astype(dtype)
        v = (_ungroup(self.values.dense(), g) if self.values is not None else self.v_exact.view()).astype(dtype)
        return k, v

    def attend_parts(self, queries, *, scale, use_kernel, n_kv_heads: int) -> mx.array:
        """A decode step's attention. One run (no refit yet, the steady state) is one part
        that no kernel reads: what ``kernels/decode.py``'s joint softmax does with it (the same
        operations in the same order), without building the parts and dispatching on them
        each step; otherwise the general reading."""
        runs = self.keys.runs
        if len(runs) != 1 or not runs[0].tokens.count:
            return super().attend_parts(queries, scale=scale, use_kernel=use_kernel, n_kv_heads=n_kv_heads)
        run, g = runs[0], self.heads_per_group
        width = self._fused_width(queries) if use_kernel and kd.gpu_backend() == "cuda" else None
        if width is not None:
            return self._fused_attention(queries, scale, n_kv_heads, width)
        q = scaled_queries(queries, n_kv_heads, scale)
        b, h, rq, _ = q.shape
        views = run.tokens.basis_views(run.basis, run.mean, g, rq)
        qf = q @ views.basis
        if g > 1:
            qf = qf.reshape(b, h // g, g * rq, -1)  # (B, G, g*R, r)
        # the softmax is row by row: taken in the groups' layout, where the value latents
        # are mixed, it spares the scores' and the weights' reshapes
        p = mx.softmax(run.tokens.scores(qf), axis=-1)
        if self.values is None:
            o = kd.token_mix(p if g == 1 else p.reshape(b, h, rq, -1), self.v_exact.view().astype(mx.float32))
        else:
            r = self.values.runs[0]
            pl = r.tokens.mix(p)
            views = r.tokens.basis_views(r.basis, r.mean, g, rq)
            o = mx.addmm(views.mean_rows, pl if g == 1 else pl.reshape(b, h, rq, -1), views.basis_t)
        return o.reshape(queries.shape).astype(queries.dtype)

    def _fused_width(self, queries) -> int | None:
        """The width one fused attention in the latent space reads the run at (the ranks,
        or the head dim of values kept exactly, rounded up to one of ``FUSED_WIDTHS``), or None
        where it cannot: a width past them all; values kept exactly per head while a
        group holds several heads (keys and values would have different head counts)."""
        if queries.shape[2] != 1:
            return None
        r = self.keys.runs[0].tokens.rank
        if self.values is None:
            d = queries.shape[-1]
            return d if self.heads_per_group == 1 and r <= d and d in FUSED_WIDTHS else None
        r = max(r, self.values.runs[0].tokens.rank)
        return next((w for w in FUSED_WIDTHS if w >= r), None)

    def _fused_attention(self, queries, scale, n_kv_heads: int, width: int) -> mx.array:
        """A decode step on CUDA: attention in the latent space as one fused
        ``scaled_dot_product_attention``. The queries folded onto their heads' rows of the
        key basis are its queries (a group's heads' query rows as its query heads), the
        latents decoded in the queries' dtype its keys and values, all zero-padded to
        ``width`` (the bases too: the padded channels meet zeros); the mixed value latents
        are lifted with the mean in one product, in the queries' dtype. The
        float32 read's small products are what cuBLAS serves badly at decode shapes
        (``benchmarks/notes/cuda_dense_reads.md``). ``q.μ_h`` is left out as in
        ``FoldedKeys.scores_shifted`` (the run is the step's only part)."""
        run, g = self.keys.runs[0], self.heads_per_group
        b, hq, _, d = queries.shape
        h, dtype = n_kv_heads, queries.dtype
        rq = hq // h
        vr = None if self.values is None else self.values.runs[0]
        inputs = run.tokens.read_inputs(dtype) + ([] if vr is None else vr.tokens.read_inputs(dtype))
        inputs = iter(mx.depends(inputs, [queries]) if inputs else [])
        qf = queries.reshape(b, h, rq, d) @ run.tokens.fused_views(run.basis, run.mean, g, rq, width, dtype).basis
        keys = run.tokens.rows(dtype, width, inputs)
        values = as_dtype(self.v_exact.view(), dtype) if vr is None else vr.tokens.rows(dtype, width, inputs)
        out = mx.fast.scaled_dot_product_attention(qf.reshape(b, h * rq, 1, width), keys, values, scale=scale)
        if vr is None:
            return out.reshape(queries.shape)
        views = vr.tokens.fused_views(vr.basis, vr.mean, g, rq, width, dtype)
        return mx.addmm(views.mean_rows, out.reshape(b, h, rq, width), views.basis_t).reshape(queries.shape)

    def decode_parts(self, empty: mx.array) -> list[DecodePart]:
        """One part per run (a run's keys and values were coded at the same steps); values
        kept exactly are one part with every run's keys (``_RunKeys``): one product reads them."""
        if not self.fitted:
            return [DecodePart(None, self.k_pend.view(), None, self.v_pend.view())]
        g = self.heads_per_group
        if self.values is None:
            keys = [FoldedKeys(run.tokens, run.basis, run.mean, g) for run in self.keys.runs if run.tokens.count]
            return [DecodePart(keys[0] if len(keys) == 1 else _RunKeys(tuple(keys)), None, None, self.v_exact.view())]
        return [DecodePart(FoldedKeys(run.tokens, run.basis, run.mean, g), None,
                           FoldedValues(r.tokens, r.basis, r.mean, g), None)
                for run, r in zip(self.keys.runs, self.values.runs) if run.tokens.count]

    # -- what is kept, and checks of a restored state ------------------------------------------
    def arrays(self) -> dict[str, Any]:
        out = {"k_pend": self.k_pend, "v_pend": self.v_pend, **self.keys.arrays("k")}
        if self.values is not None:
            out.update(self.values.arrays("v"))
        else:
            out["v_exact"] = self.v_exact
        return out

    def meta(self) -> dict[str, Any]:
        return {"latent": json.dumps({
            "heads_per_group": self.heads_per_group,
            "fitted_at": self.fitted_at,
            "flushed": [x.tokens.flushed if x is not None and x.tokens is not None else 0
                        for x in (self.keys, self.values)],
            # (keys, values) tokens flushed in each run; the last entry is ``flushed``'s
            "runs": [[r.tokens.flushed for r in x.runs] if x is not None else []
                     for x in (self.keys, self.values)]})}

    def restore(self, meta: dict[str, Any], arrays: dict[str, Any]) -> None:
        saved = json.loads(meta.get("latent") or "{}")
        self.heads_per_group = saved.get("heads_per_group")
        self.fitted_at = int(saved.get("fitted_at", 0))
        self.k_pend.reset(arrays.get("k_pend"))
        self.v_pend.reset(arrays.get("v_pend"))
        if self.v_exact is not None:
            self.v_exact.reset(arrays.get("v_exact"))
        runs = saved.get("runs") or [[f] for f in saved.get("flushed", [0, 0])]
        for latent, prefix, flushed in zip((self.keys, self.values), "kv", runs):
            if latent is None:
                continue
            latent.runs = []
            for i, n in enumerate(flushed):
                name = run_prefix(prefix, i)
                if arrays.get(f"{name}_basis") is None:
                    break
                latent.install(arrays[f"{name}_mean"], arrays[f"{name}_basis"])
                latent.tokens.restore(name, arrays, int(n))
            # a file without the moments (saved before refits existed) keeps its basis
            latent.shift, latent.total, latent.gram = (arrays.get(f"{prefix}_{k}") for k in ("shift", "total", "gram"))

    def layout_problems(self, head_dims: tuple[int, int]):
        g = self.heads_per_group or 1
        for latent, name, d in ((self.keys, "key", head_dims[0]), (self.values, "value", head_dims[1])):
            if latent is None:
                continue
            for i, run in enumerate(latent.runs):
                n, r = run.basis.shape[2:]
                label = name if i == 0 else f"{name} run {i}"
                if n != g * d or run.mean.shape[-1] != n:
                    yield f"{label} basis rows (heads per group x head_dim)", n, f"{g} x {d}"
                    return
                if run.tokens.rank != r:
                    yield f"{label} latent channels", run.tokens.rank, f"the basis rank {r}"
                    return
            if latent.runs and latent.gram is not None:
                n = latent.basis.shape[2]
                if (tuple(latent.gram.shape[2:]) != (n, n) or latent.total is None or latent.shift is None
                        or latent.total.shape[-1] != n or latent.shift.shape[-1] != n):
                    yield f"{name} running moments (gram rows x columns)", tuple(latent.gram.shape[2:]), (n, n)

    def problems(self, offset: int):
        if self.fitted and (self.k_pend.length or self.v_pend.length):
            yield "pending tokens", self.k_pend.length, "none once the bases are fitted"
        if self.length != offset:
            yield "tokens stored", self.length, f"the offset {offset}"
        if not self.fitted:
            if self.v_pend.length != self.k_pend.length:
                yield "pending values", self.v_pend.length, f"{self.k_pend.length}, as many as keys"
            return
        for run in self.keys.runs:
            yield from run.tokens.problems("key")
        n_values = self.values.count if self.values is not None else self.v_exact.length
        if n_values != self.length:
            yield "values stored", n_values, f"{self.length}, as many as keys"
        if self.values is not None:
            for run in self.values.runs:
                yield from run.tokens.problems("value")
            if [r.tokens.count for r in self.values.runs] != [r.tokens.count for r in self.keys.runs]:
                yield ("value runs (tokens each)", [r.tokens.count for r in self.values.runs],
                       [r.tokens.count for r in self.keys.runs])


class LatentCache(QuantizedCache):
    """The ``QuantizedCache`` of a latent method: its group is a run of tokens, so head_dim
    is not checked against it (``QuantizedCache`` would). With ``calibration_file``, its
    bases come from the file (``calibrate`` writes them) instead of the prompt."""

    group_field = ""
    calibration_fields: tuple[str, ...] = ()  # the fields a calibration file's bases depend on

    @classmethod
    def head_groups(cls, config, n_kv_heads: int) -> int | None:
        """Groups of KV heads sharing a basis (None: a basis a head)."""
        return None

    def _init_storage(self) -> None:
        super()._init_storage()
        if self.config.calibration_file and self.context is not None:  # a wrong file fails at once
            self._calibration(None)

    def _calibration(self, kv_shape) -> dict[str, mx.array]:
        """This layer's bases in ``calibration_file``, checked against the config, the
        model and the keys' (heads, head_dim) when known."""
        names = tuple(f"{p}_{n}" for p in ("kv" if self.store.values is not None else "k") for n in ("mean", "basis"))
        return layer_calibration(self.config, self.calibration_fields, names, self.layer,
                                 model_args=getattr(self.context, "model_args", None), kv_shape=kv_shape)

    def update_and_fetch(self, keys, values):
        store = self.store
        if store.heads_per_group is None:  # read once: the first commit fixes the groups
            store.n_groups = self.head_groups(self.config, keys.shape[1])
        if self.config.calibration_file and not store.fitted and store.calibrated is None:
            store.calibrated = self._calibration((keys.shape[1], keys.shape[-1]))
        return super().update_and_fetch(keys, values)

    @classmethod
    def calibrate(cls, keys, values, config, *, iters: int, seed: int, progress=None, model_args=None):
        """A layer's bases from its post-RoPE keys and values (1, H, T, D) of a text, as a
        one-chunk prompt of those tokens fits them (each group's mean and leading right
        singular vectors, float32, the rank by the config's rule). ``iters``, ``seed`` and
        ``model_args`` change nothing: the fit is exact and post-RoPE, as the cache codes."""
        store = cls(config).make_store()
        h, t, d = keys.shape[1:]
        groups = cls.head_groups(config, h)
        g = 1 if groups is None else h // groups
        if t < g * d:
            raise ValueError(f"{t} calibration tokens: a basis of {g} head(s) x head_dim {d} needs at least "
                             f"{g * d} (use more --tokens)")
        arrays = {}
        tensors = [(p, latent, x) for p, latent, x in (("k", store.keys, keys), ("v", store.values, values))
                   if latent is not None]
        for done, (prefix, latent, x) in enumerate(tensors):
            arrays[f"{prefix}_mean"], arrays[f"{prefix}_basis"] = fit_basis(
                _group(x, g), latent.codec.rank, latent.codec.fraction)
            if progress:
                progress("keys and values" if len(tensors) > 1 else "keys", done + 1, len(tensors))
        return arrays

    @property
    def group(self) -> int:
        return 1

    @property
    def stack_ready(self) -> bool:
        """Fitted (cache/stacked.py): a fit over a group's rows would give all of them the
        largest of their ranks."""
        store = self.__dict__.get("store")
        return store is None or store.fitted
