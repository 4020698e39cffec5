"""Per-head eigenbasis codes: a rotation into the basis of the vectors' second moment,
Lloyd-Max codes per coordinate, and an optional 1-bit QJL sketch of the key residual.

**Basis** (``eigenbasis``), per (batch, KV head): the eigenvectors of ``C = x~ᵀx~ / n`` over
the unit vectors ``x~ = x / ‖x‖`` of the first run encoded, by decreasing eigenvalue
``λ`` (clamped at 0); later runs take the eigenvectors of the running moment of every
row taken in (``EigenStore``: a refit each time the tokens held double). Keys may be de-rotated to their pre-RoPE form first
(``quant/prerope.py``), where the basis is sharper. ``EigenStore`` keeps tokens exactly
until it holds at least D of them (fewer span only part of the space, and every other
direction would get the tail's σ fitted on nothing), then fits on all of them
(``fitted_arrays``: the basis, its eigenvalues and the codebooks). A calibration file
holds those same arrays: a store given them (``calibrated``) installs them at its first
commit instead, holds nothing exactly, keeps no moment and never refits.

**Codes** (``EigenCodec``): ``z = Vᵀ(x / ‖x‖)``; the first ``e`` coordinates (the semantic
subspace) take a ``head_bits`` codebook, the others a ``tail_bits`` one, each in units of
its block's σ (``σ_head² = mean λ[:e]``, ``σ_tail² = mean λ[e:]``, floored at
``SIGMA_FLOOR σ_head``). The codebooks are Lloyd-Max quantizers **trained on the
coordinates the basis was fitted on** (``trained_table``: per batch row, KV head and block),
as the paper builds them ("a codebook trained on signal dimensions and a separate codebook
for noise dimensions", its §3 and appendix), not the repo engine's Lloyd-Max codebook of
``N(0, σ²)``: one σ per block cannot hold coordinates whose variances differ (on the
reference models' keys λ_1 holds 0.3-0.8 of the mass, 30-100 times the block's mean
at d_eff = head_dim), so the Gaussian codebook clipped the strongest coordinate to its
outermost level, 36-53% key error at 8 bits (a trained codebook spans the data's range).
Later runs (refits) keep the first run's codebooks (in σ units) with their own σ; a
state saved without them reads with the Gaussian ones (``gaussian_codebook``). A row
keeps its codes as one bit stream (``methods/spectral/bitfields.py``) and ‖x‖ in float16.

**QJL** (keys, ``qjl``): the residual's semantic part ``r = (‖x‖ z - ‖x‖^ ẑ)[:e]`` (in the
basis, so ``Vᵀ(x - x̂)`` restricted to it) is sketched as ``sign(S r)`` (e bits, S the
top-left e x e block of a seeded Gaussian d x d matrix, sign(0) = +1) and ``‖r‖`` (float16).
The score adds ``sqrt(π/2) / e · ‖r‖ · (S q_sem) · sign(S r)``, an unbiased estimate of
``q_sem · r`` (q_sem: the query in the same frame, its first e coordinates).

**Reading** (``EigenScores``, the ``PackedScores`` protocol): values and post-RoPE keys are
read in the rotated frame, ``q Kᵀ = (q V)(‖k‖ ẑ)ᵀ`` and ``p V = (p (‖v‖ ẑ)) Vᵀ``: the codes
are looked up (on CUDA the rows' words and the codebooks' levels by trees of selects,
``quant/packed.py``'s ``selected_along_last``, not MLX's axis gather), never rotated back row by row. Pre-RoPE keys cannot be: RoPE turns each
position by its own angle, so the keys are rotated back out of the basis (one
(D x D) product over the history) and RoPE applied again at their positions. The QJL term
rides in the same product: ``(S q_sem) · sign = q_sem · (Sᵀ sign)``, so it is the score of
``ẑ`` with ``sqrt(π/2)/e ‖r‖/‖k‖ Sᵀ sign`` added to its first e coordinates. For a decode
step's few query rows the norms scale the (R, n) scores and weights instead of the (n, D)
coordinates. The history is read a block at a time (``read_block``), each block after the
previous one's result, so a step's float32 transients are a block's at any length or batch.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

import mlx.core as mx

from ...cache.buffers import GrowingArray
from ...cache.calibration import batch_rows
from ...kernels.decode import DecodePart
from ...kernels.kivi_decode import _splits_tokens, token_mix
from ...lowrank.cpu_streams import cpu_eigh
from ...lowrank.factors import sample_rows
from ...quant import codebook as cb
from .bitfields import pack_fields, read_codes, row_words
from ...quant.packed import GROWTH_TOKENS, selected_along_last, selects_here
from ...quant.prerope import from_pre_rope_channels, rotary_angles, to_pre_rope
from ...quant.store import VALUE_ROOM, PackedStore, paced
from ...quant.token_rows import ReadViews

RANGE_SIGMAS = 6.0  # the quadrature range, in σ (the repo starts its search on ±3.5σ; wider keeps the tails)
GRID_POINTS = 16384  # quadrature points of the Gaussian density over that range
LLOYD_ITERS = 200  # (a tenth of them from 6 bits on)
SIGMA_FLOOR = 1e-4  # σ_tail >= this fraction of σ_head
QJL_SCALE = math.sqrt(math.pi / 2)
# sketches of at most this many columns (spectral_key_d_eff) are applied (to the QJL signs in a
# read, to the residuals in an encode) as a sum of broadcast products, not a matrix product
QJL_SUMMED_COLUMNS = 8
HISTORY_BLOCK_SCORES = 1 << 26  # float32 scores of a prompt chunk against one block of the history (256 MiB)
MIN_HISTORY_BLOCK = 256
# float32 coordinates a decode step's reader decodes at once (``read_block``). On the CPU
# the step's transients (about 6 copies of a block, two blocks in flight: 24 MB at 8 x 4k)
# stay within MLX's 32 MiB cache of freed buffers; on a GPU, a bound on the step's peak
# (20.2 GB at 128k on the H200 while every layer's whole history was decoded in float32;
# not yet re-measured)
READ_BLOCK_BYTES = 2 << 20
READ_BLOCK_BYTES_GPU = 256 << 20
# decode rows held exactly once the basis is fitted, coded this many at a time: a steady decode
# step only writes its row (the quantized stores flush every 32 steps too)
DECODE_FLUSH = VALUE_ROOM
REFIT_GROWTH = 2  # a new basis each time the tokens held double since the prompt or the last refit
CALIBRATED_ARRAYS = ("basis", "eigenvalues", "tables")  # ``fitted_arrays``, per tensor, in a calibration file


@functools.lru_cache(maxsize=None)
def gaussian_codebook(bits: int) -> mx.array:
    """The 2^bits Lloyd-Max centroids of N(0, 1) (sorted, in units of σ): codebook.py's
    weighted Lloyd on the density. Started at the high-resolution optimum (point density
    ~ p^(1/3): the quantiles of N(0, 3)), it has little left to do, even at 9 bits: the
    mean squared error is within 1% of Panter-Dite's 2.72 / 4^b from 6 bits on."""
    x = mx.linspace(-1.0, 1.0, GRID_POINTS)  # in units of RANGE_SIGMAS σ: codebook.py's range
    weights = mx.exp(-0.5 * mx.square(x * RANGE_SIGMAS))
    n = 1 << bits
    start = math.sqrt(6) * mx.erfinv(2 * (mx.arange(n, dtype=mx.float32) + 0.5) / n - 1) / RANGE_SIGMAS
    iters = LLOYD_ITERS if bits <= 5 else LLOYD_ITERS // 10
    centroids = cb.lloyd(x, weights, mx.clip(start, -1.0, 1.0), iters) * RANGE_SIGMAS
    mx.eval(centroids)
    return centroids


TABLE_BINS = 4096  # histogram bins a trained codebook is fitted on (per row, over its range)
TABLE_VALUES = 1 << 16  # values of a block a codebook is trained on, at most (evenly spaced rows)
TABLE_ITERS = 16  # Lloyd steps of a trained codebook (from the high-rate start: within 1-2% of 64 steps)


def nearest_rows(values: mx.array, centroids: mx.array, bits: int) -> mx.array:
    """uint32 index of the nearest centroid of each value, one sorted codebook per row:
    values (..., N), centroids (..., 2^bits) with the same leading dims. A binary search
    over the midpoints (``bits`` gathers; ties go to the lower centroid, as ``cb.nearest``)."""
    mids = (centroids[..., 1:] + centroids[..., :-1]) / 2
    idx = mx.zeros(values.shape, mx.uint32)
    for k in reversed(range(bits)):
        cand = idx + (1 << k)
        idx = mx.where(values > mx.take_along_axis(mids, cand - 1, axis=-1), cand, idx)
    return idx


def _table_error(points, mass, centroids, bits):
    near = mx.take_along_axis(centroids, nearest_rows(points, centroids, bits), axis=-1)
    return (mass * mx.square(points - near)).sum(axis=-1, keepdims=True)


def trained_table(z: mx.array, bits: int) -> mx.array:
    """A 2^bits Lloyd-Max codebook (sorted) trained on each row's values: z (..., N) ->
    (..., 2^bits). Lloyd runs on a histogram of ``TABLE_BINS`` bins over the row's range
    (each bin its mean, weighed by its count), started at the better of two grids: the
    quantiles of the density's cube root (the high-rate optimum's point density, which
    leaves Lloyd little to do) and uniform levels from -max|z| to max|z|. Lloyd steps never
    increase the (binned) squared error, so the codebook fits no worse than uniform levels
    over the data's range."""
    lead, n_values = z.shape[:-1], z.shape[-1]
    z = z.reshape(-1, n_values).astype(mx.float32)
    rows, n = z.shape[0], 1 << bits
    reach = mx.maximum(mx.abs(z).max(axis=-1, keepdims=True), 1e-30)
    u = z / reach
    bins = mx.clip(mx.floor((u + 1) * (TABLE_BINS / 2)), 0, TABLE_BINS - 1).astype(mx.uint32)
    flat = (bins + (mx.arange(rows, dtype=mx.uint32) * TABLE_BINS)[:, None]).reshape(-1)
    mass = mx.zeros((rows * TABLE_BINS,), mx.float32).at[flat].add(mx.ones(flat.shape, mx.float32))
    total = mx.zeros((rows * TABLE_BINS,), mx.float32).at[flat].add(u.reshape(-1))
    mass, total = mass.reshape(rows, TABLE_BINS), total.reshape(rows, TABLE_BINS)
    centres = (mx.arange(TABLE_BINS, dtype=mx.float32) + 0.5) * (2 / TABLE_BINS) - 1
    points = mx.where(mass > 0, total / mx.maximum(mass, 1.0), centres)
    density = mx.power(mass, 1 / 3)  # the high-rate optimum's point density (Panter-Dite): p^(1/3)
    cdf = mx.cumsum(density, axis=-1) / density.sum(axis=-1, keepdims=True)
    target = (mx.arange(n, dtype=mx.float32) + 0.5) / n
    at = mx.minimum((cdf[:, :, None] < target).sum(axis=1), TABLE_BINS - 1).astype(mx.uint32)
    quantile = mx.take_along_axis(points, at, axis=-1)
    uniform = mx.broadcast_to(mx.linspace(-1.0, 1.0, n), (rows, n))
    better = _table_error(points, mass, quantile, bits) <= _table_error(points, mass, uniform, bits)
    c = mx.where(better, quantile, uniform)
    offsets = (mx.arange(rows, dtype=mx.uint32) * n)[:, None]
    weighted = (mass * points).reshape(-1)
    for _ in range(TABLE_ITERS):
        slot = (nearest_rows(points, c, bits) + offsets).reshape(-1)
        m = mx.zeros((rows * n,), mx.float32).at[slot].add(mass.reshape(-1)).reshape(rows, n)
        t = mx.zeros((rows * n,), mx.float32).at[slot].add(weighted).reshape(rows, n)
        c = mx.where(m > 0, t / mx.maximum(m, 1e-30), c)
    return (mx.sort(c, axis=-1) * reach).reshape(*lead, n)


def eigenbasis(x: mx.array) -> tuple[mx.array, mx.array]:
    """(V, λ) of the unit rows of ``x`` (B, H, n, D): V (B, H, D, D) with the eigenvectors
    as columns, λ (B, H, D) decreasing, both float32; from at most ``FIT_SAMPLE_TOKENS``
    evenly spaced rows (``lowrank/factors.py``: bounded work at any prompt length)."""
    x = sample_rows(x)
    unit = x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-30)
    second = unit.swapaxes(-1, -2) @ unit / x.shape[2]
    w, v = cpu_eigh(second)
    return v[..., ::-1], mx.maximum(w[..., ::-1], 0.0)


def coded_rows(x: mx.array, start: int, rotary) -> mx.array:
    """float32 rows (B, H, n, D) in the frame a run fits and codes them: keys de-rotated to
    their pre-RoPE form at positions ``start``.. when a ``rotary`` is given, else as they are."""
    return to_pre_rope(x, start, rotary) if rotary is not None else x.astype(mx.float32)


def fitted_arrays(codec: "EigenCodec", x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """What a run's fit takes from rows ``x`` (B, H, n, D) in its frame: the basis (B, H, D, D),
    its eigenvalues (B, H, D), and the two codebooks (B, H, 2^head + 2^tail) trained on the
    unit rows' coordinates in it, all float32 and from at most ``FIT_SAMPLE_TOKENS`` evenly
    spaced rows. A calibration file holds exactly these (``SpectralQuantCache.calibrate``)."""
    x = sample_rows(x)
    basis, eigenvalues = eigenbasis(x)
    unit = x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-30)
    return basis, eigenvalues, codec.train(unit @ basis, codec.sigmas(eigenvalues, x.shape[-1]))


@dataclass(frozen=True)
class EigenCodec:
    """Eigen-coordinates at ``bits`` (the average budget b): ``e = min(d_eff, d - 1)``
    semantic coordinates, ``b_low = max(1, round(b - e/d))`` bits for the tail and
    ``b_low + 1`` for the semantic ones, one of which is the QJL sign for keys
    (``key``): keys carry ``b_low`` bits there, with or without the sketch."""

    bits: int
    d_eff: int
    key: bool
    qjl: bool

    def widths(self, d: int) -> tuple[int, int, int]:
        """(e, semantic bits, tail bits) at head_dim d."""
        e = min(self.d_eff, d - 1)
        low = max(1, math.floor(self.bits - e / d + 0.5))
        return e, low if self.key else low + 1, low

    def layout(self, d: int) -> tuple[tuple[int, int], ...]:
        e, head, tail = self.widths(d)
        return ((e, head), (d - e, tail)) + (((e, 1),) if self.qjl else ())

    @property
    def n_norms(self) -> int:
        return 2 if self.qjl else 1

    def table_sizes(self, d: int) -> tuple[int, int]:
        """Centroids of the semantic and of the tail codebook."""
        _, head, tail = self.widths(d)
        return 1 << head, 1 << tail

    def train(self, z: mx.array, sigma: mx.array) -> mx.array:
        """(B, H, 2^head + 2^tail) float32: the two codebooks, in units of their block's σ,
        trained on the unit rows' coordinates ``z`` (B, H, n, D) in the basis (on evenly
        spaced rows holding at most ``TABLE_VALUES`` of a block's values)."""
        b, h, n, d = z.shape
        e, head_bits, tail_bits = self.widths(d)
        tables = []
        for block, bits, scale in ((slice(0, e), head_bits, sigma[:, :, None, :1]),
                                   (slice(e, d), tail_bits, sigma[:, :, None, 1:])):
            width = block.stop - block.start
            step = -(-n * width // TABLE_VALUES)
            values = z[:, :, ::step, block] / scale
            tables.append(trained_table(values.reshape(b, h, -1), bits))
        return mx.concatenate(tables, axis=-1)

    def tables(self, stored: mx.array | None, d: int, lead: tuple[int, int]):
        """(semantic, tail) codebooks (B, H, size) in σ units: the stored ones, or for a state
        saved without them the Lloyd-Max codebooks of a unit Gaussian."""
        sizes = self.table_sizes(d)
        if stored is None:
            _, head_bits, tail_bits = self.widths(d)
            return (mx.broadcast_to(gaussian_codebook(head_bits), (*lead, sizes[0])),
                    mx.broadcast_to(gaussian_codebook(tail_bits), (*lead, sizes[1])))
        return stored[..., : sizes[0]], stored[..., sizes[0]:]

    def sigmas(self, eigenvalues: mx.array, d: int) -> mx.array:
        e = self.widths(d)[0]
        head = mx.maximum(mx.sqrt(eigenvalues[..., :e].mean(axis=-1)), 1e-12)
        tail = mx.maximum(mx.sqrt(eigenvalues[..., e:].mean(axis=-1)), SIGMA_FLOOR * head)
        return mx.stack([head, tail], axis=-1)  # (B, H, 2)

    def encode(self, x, basis, sigma, sketch, tables=None):
        """float32 rows (B, H, n, D) -> (words (B, H, n, W) uint32, norms (B, H, n, 1|2) float16)."""
        b, h, n, d = x.shape
        e, head_bits, tail_bits = self.widths(d)
        norm = mx.linalg.norm(x, axis=-1, keepdims=True)
        norm16 = norm.astype(mx.float16)
        z = (x / mx.maximum(norm, 1e-30)) @ basis
        s = sigma[:, :, None, :]
        book_head, book_tail = self.tables(tables, d, (b, h))
        head = nearest_rows((z[..., :e] / s[..., :1]).reshape(b, h, n * e), book_head, head_bits)
        tail = nearest_rows((z[..., e:] / s[..., 1:]).reshape(b, h, n * (d - e)), book_tail, tail_bits)
        fields, norms = [(head.reshape(b, h, n, e), head_bits), (tail.reshape(b, h, n, d - e), tail_bits)], [norm16]
        if self.qjl:
            z_head = mx.take_along_axis(book_head, head, axis=-1).reshape(b, h, n, e) * s[..., :1]
            residual = norm * z[..., :e] - norm16.astype(mx.float32) * z_head
            fields.append((_sketched(residual, sketch.T) >= 0, 1))
            norms.append(mx.linalg.norm(residual, axis=-1, keepdims=True).astype(mx.float16))
        return pack_fields(fields), mx.concatenate(norms, axis=-1) if self.qjl else norm16


class EigenTokens:
    """A growing run of rows in one ``EigenCodec``, with its frozen basis (fitted on the
    first rows it encodes) and, for pre-RoPE keys, the model's rotary settings."""

    def __init__(self, codec: EigenCodec, *, rotary=None, seed: int = 0, step_tokens: int = GROWTH_TOKENS,
                 start: int = 0):
        self.codec, self.rotary, self.seed, self.step = codec, rotary, seed, step_tokens
        self.start = start  # the position of the run's first row (pre-RoPE keys turn by it)
        self.moment: mx.array | None = None  # (B, H, D, D) float32: Σ x~ᵀx~ of every row taken in, all runs
        self.seen = 0  # rows in the moment
        self.words = GrowingArray(axis=2, step=step_tokens)
        self.norms = GrowingArray(axis=2, step=step_tokens)
        self.basis: mx.array | None = None  # (B, H, D, D) float32
        self.sigma: mx.array | None = None  # (B, H, 2) float32
        self.sketch: mx.array | None = None  # (e, e) float32 (QJL only)
        self.tables: mx.array | None = None  # (B, H, 2^head + 2^tail) float32, σ units (trained at the fit)
        self._views = ReadViews()  # what a decode step reads, kept until a write or a new basis (``read_views``)

    @property
    def count(self) -> int:
        return self.words.length

    @property
    def dim(self) -> int:
        return self.basis.shape[-1]

    def fit(self, x: mx.array) -> None:
        """The basis and the codebooks, both from (at most ``FIT_SAMPLE_TOKENS`` of) ``x``;
        the running moment starts empty (``append`` adds)."""
        d = x.shape[-1]
        self.install(*fitted_arrays(self.codec, x))
        self.moment = mx.zeros((*x.shape[:2], d, d), mx.float32)

    def install(self, basis: mx.array, eigenvalues: mx.array, tables: mx.array | None = None) -> None:
        """Code on ``basis`` from now: σ from its ``eigenvalues``, the codebooks ``tables``
        (σ units), the sketch from the seed. Keeps no moment: that is ``fit``'s to start."""
        d = basis.shape[-1]
        self.basis, self.sigma, self.tables = basis, self.codec.sigmas(eigenvalues, d), tables
        if self.codec.qjl:
            e = self.codec.widths(d)[0]
            # a copy: the (e, e) corner as a view would keep the whole (d, d) draw alive
            self.sketch = mx.contiguous(mx.random.normal((d, d), key=mx.random.key(self.seed))[:e, :e])

    def refitted(self) -> "EigenTokens":
        """A new run after this one, on the eigenbasis of the moment of every row taken in
        (a D x D eigh; nothing read on the host), which it carries on."""
        second = self.moment / max(self.seen, 1)
        w, v = cpu_eigh(mx.where(mx.isfinite(second), second, 0.0))
        run = EigenTokens(self.codec, rotary=self.rotary, seed=self.seed, step_tokens=self.step,
                          start=self.start + self.count)
        # the codebooks are in σ units: they carry over to the new basis's σ
        run.install(v[..., ::-1], mx.maximum(w[..., ::-1], 0.0), self.tables)
        run.moment, run.seen = self.moment, self.seen
        return run

    def append(self, x: mx.array, decoding: bool = False) -> None:
        """Encode rows (B, H, n, D) after those kept (the first call fits the basis); their
        unit rows join the moment (evaluated with the codes, which attention reads: a
        lazy sum left alone would lengthen at every step)."""
        x = coded_rows(x, self.start + self.count, self.rotary)
        if self.basis is None:
            self.fit(x)
        words, norms = _encode_fn(self.codec)(x, self.basis, self.sigma, self.sketch, self.tables)
        if self.moment is not None:
            unit = x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-30)
            self.moment = self.moment + unit.swapaxes(-1, -2) @ unit
            self.seen += x.shape[2]
            words = mx.depends(words, self.moment)
        self._views.clear()  # before the write in place into the buffers they view
        self.words.append(words)
        self.norms.append(norms)

    def coordinates(self) -> mx.array:
        """``‖x‖ ẑ`` (B, H, capacity, D) float32 of every buffered row (spare room included:
        zero norms, zero rows)."""
        return _coordinates_fn(self.codec, self.dim, True, False)(
            self.words.buffer, self.norms.buffer, self.sigma, self.tables, None)[0]

    def read_views(self):
        """(spans, their (words, norms) slices) as a decode step reads the whole buffer, a
        ``read_block`` at a time: views of the buffers, kept until the buffers or the block
        change (``_views``, cleared before each write)."""
        words, norms = self.words.buffer, self.norms.buffer
        b, h, capacity, _ = words.shape
        block = read_block(b * h * self.dim * 4)

        def build():
            spans = tuple((first, min(first + block, capacity)) for first in range(0, capacity, block))
            cuts = tuple((words, norms) if (first, end) == (0, capacity)
                         else (words[:, :, first:end], norms[:, :, first:end]) for first, end in spans)
            return spans, cuts

        return self._views.get(self, (words, norms, block), build)

    def decode(self, dtype) -> mx.array | None:
        """The valid rows (B, H, count, D) in ``dtype``, post-RoPE again for keys (transient)."""
        if not self.count:
            return None
        scaled = self.coordinates()[:, :, : self.count]
        if self.rotary is None:
            return (scaled @ self.basis.swapaxes(-1, -2)).astype(dtype)
        rows_t = from_pre_rope_channels(self.basis @ scaled.swapaxes(-1, -2), self.start, self.rotary)
        return rows_t.swapaxes(-1, -2).astype(dtype)

    def reader(self) -> "EigenScores":
        return EigenScores(self, self.count)

    def arrays(self, prefix: str):
        out = {f"{prefix}_words": self.words, f"{prefix}_norms": self.norms,
               f"{prefix}_basis": self.basis, f"{prefix}_sigma": self.sigma, f"{prefix}_tables": self.tables}
        if self.codec.qjl:
            out[f"{prefix}_sketch"] = self.sketch
        return out

    def problems(self, name: str, head_dim: int):
        """(field, found, expected) where the kept arrays contradict the codec or each other."""
        if self.words.buffer is None and self.basis is None:
            return
        if self.basis is None or self.sigma is None:
            yield f"{name} eigenbasis", "missing", "saved with the coded rows"
            return
        e = self.codec.widths(head_dim)[0]
        found = (tuple(self.basis.shape[2:]), tuple(self.sigma.shape[2:]))
        if found != ((head_dim, head_dim), (2,)):
            yield f"{name} basis and sigmas (trailing dims)", found, ((head_dim, head_dim), (2,))
        if self.words.buffer is not None:
            want = (row_words(self.codec.layout(head_dim)), self.codec.n_norms)
            got = (self.words.buffer.shape[-1], self.norms.buffer.shape[-1] if self.norms.buffer is not None else None)
            if got != want:
                yield f"{name} words and norms per row", got, f"{want} ({self.codec.layout(head_dim)} bit fields)"
        if self.tables is not None and self.tables.shape[-1] != sum(self.codec.table_sizes(head_dim)):
            yield f"{name} codebooks (centroids a head)", self.tables.shape[-1], f"{self.codec.table_sizes(head_dim)}"
        if self.codec.qjl and (self.sketch is None or tuple(self.sketch.shape) != (e, e)):
            yield f"{name} QJL sketch", None if self.sketch is None else tuple(self.sketch.shape), (e, e)


@functools.lru_cache(maxsize=None)
def _encode_fn(codec: EigenCodec):
    """``codec.encode`` as one compiled pass (its elementwise chains fused)."""
    return mx.compile(codec.encode)


@functools.lru_cache(maxsize=None)
def _coordinates_fn(codec: EigenCodec, d: int, on_rows: bool, qjl: bool):
    """``_coordinates`` as one compiled pass."""
    return mx.compile(functools.partial(_coordinates, codec, d, on_rows, qjl))


def _coordinates(codec: EigenCodec, d: int, on_rows: bool, qjl: bool, words, norms, sigma, tables, sketch):
    """Packed rows (B, H, n, W) -> (float32 coordinates (B, H, n, D), float32 norms (B, H, 1, n)).
    The coordinates are ``‖x‖ ẑ`` with ``on_rows``, ``ẑ`` otherwise (the caller scales its
    (R, n) scores or weights by the norms instead: fewer products than (n, D) coordinates for
    a decode step's few query rows). With ``qjl`` the key's QJL correction is folded into its
    first e coordinates: ``(S q_sem) . sign`` is ``q_sem . (Sᵀ sign)``, so the corrected
    score is the score of ``ẑ + sqrt(π/2)/e ‖r‖/‖x‖ [Sᵀ sign, 0]``, and one rebuild of the keys
    (and for pre-RoPE keys one rotation) serves both terms. The codebooks are scaled here, in
    each block's pass, and the QJL signs read apart from the codes: a table made once for
    every block, or one read of both, raised a stacked CPU step's peak by 4-6 MB (past the
    32 MiB of freed buffers MLX's CPU allocator keeps, tests/test_spectral.py)."""
    e = codec.widths(d)[0]
    b, h = words.shape[:2]
    table = _scaled_table(codec, d, sigma, tables, (b, h))
    codes = read_codes(words, codec.layout(d), 0, d, (0,) * e + (codec.table_sizes(d)[0],) * (d - e))
    if selects_here(table.shape[-1]):  # CUDA: a tree of selects (``quant/packed.py``)
        z = selected_along_last(table[:, :, None, :], codes)
    else:
        z = mx.take_along_axis(table, codes.reshape(b, h, -1), axis=-1).reshape(codes.shape)
    norm = norms[..., :1].astype(mx.float32)
    if on_rows:
        z = z * norm
    if qjl:
        signs = 2 * read_codes(words, codec.layout(d), d, d + e).astype(mx.float32) - 1
        rho = norms[..., 1:2].astype(mx.float32)
        if not on_rows:  # zero norms (spare rows, a zero key) have a zero residual
            rho = mx.where(norm > 0, rho / mx.maximum(norm, 1e-30), 0.0)
        z[..., :e] = z[..., :e] + (QJL_SCALE / e) * rho * _sketched(signs, sketch)
    return z, norm.swapaxes(-1, -2)


def _sketched(x: mx.array, sketch: mx.array) -> mx.array:
    """``x @ sketch`` (..., n, e) for an (e, e) sketch (or its transpose): the QJL signs'
    correction, or the encoder's projection of the residuals. For a few columns, a sum of e
    broadcast products that a compiled pass fuses. As a product (n rows by e), cuBLAS ran it
    on an H100 with a thread-block cluster of 3 in y, and MLX instantiates a CUDA graph that
    holds such a kernel anew at every commit (benchmarks/notes/cuda_graphs.md)."""
    e = sketch.shape[-1]
    if e > QJL_SUMMED_COLUMNS:
        return x @ sketch
    columns, rows = mx.split(x, e, axis=-1), mx.split(sketch, e, axis=0)
    out = columns[0] * rows[0]
    for column, row in zip(columns[1:], rows[1:]):
        out = out + column * row
    return out


@functools.lru_cache(maxsize=256)  # a span per read block and capacity: bounded
def _key_span_fn(codec: EigenCodec, d: int, qjl: bool, traditional: bool | None, lo: int, hi: int, reach: int):
    """A decode step's (R <= D query rows) scores over one span of a run, one compiled pass:
    ``_coordinates`` (the norms left out), the scores (post-RoPE keys: of the queries in the
    basis; pre-RoPE (``traditional`` not None): of the keys rotated back and turned by the
    span's columns [lo, hi) of the (D/2, reach) angle tables), times the norms: what
    ``EigenScores.scores`` computes a span at a time for more query rows."""

    def run(q, words, norms, sigma, tables, sketch, basis=None, cos=None, sin=None):
        z, norm = _coordinates(codec, d, False, qjl, words, norms, sigma, tables, sketch)
        if traditional is None:
            s = q @ z.swapaxes(-1, -2)
        else:
            s = _turned_scores(q, basis @ z.swapaxes(-1, -2), _part(cos, lo, hi, reach), _part(sin, lo, hi, reach),
                               traditional)
        return s * norm

    return mx.compile(run)


@functools.lru_cache(maxsize=256)  # as _key_span_fn
def _value_span_fn(codec: EigenCodec, d: int, lo: int, hi: int, reach: int, splits: bool):
    """A decode step's ``p Z`` over one span of a run (in the basis), one compiled pass: the
    span's columns [lo, hi) of the weights (padded to the run's whole buffer), times the
    norms, over ``_coordinates``. ``splits``: ``token_mix`` cuts the token axis (CUDA)."""

    def run(p, words, norms, sigma, tables):
        z, norm = _coordinates(codec, d, False, False, words, norms, sigma, tables, None)
        return token_mix(_part(p, lo, hi, reach) * norm, z)

    return mx.compile(run)


def _scaled_table(codec: EigenCodec, d: int, sigma, tables, lead) -> mx.array:
    """The codebooks in the basis' units (B, H, 2^head + 2^tail) float32: each block's σ times
    its codebook, the tail's after the semantic one's (a tail code indexes past the semantic
    codebook: ``_coordinates``' one gather)."""
    book_head, book_tail = codec.tables(tables, d, lead)
    return mx.concatenate([book_head * sigma[..., None, 0], book_tail * sigma[..., None, 1]], axis=-1)


def _turn_pairs(x1, x2, cos, sin):
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


_turn = mx.compile(_turn_pairs, shapeless=True)


def _turned_scores(q, keys_t, cos, sin, traditional: bool) -> mx.array:
    """``q . R_t k_t`` (B, H, R, n) for pre-RoPE keys in the per-channel layout (B, H, D, n)
    at the positions of the angle tables (D/2, n). For a decode step's few query rows each
    rotated half of the keys meets its half of the queries (no rotated copy of the keys is
    assembled); for a prompt chunk's many, one product with the reassembled keys (two (R, n)
    products would be the larger transient)."""
    d = keys_t.shape[-2]
    if traditional:  # pairs (2i, 2i + 1)
        x1, x2 = keys_t[..., 0::2, :], keys_t[..., 1::2, :]
    else:
        x1, x2 = keys_t[..., : d // 2, :], keys_t[..., d // 2 :, :]
    y1, y2 = _turn(x1, x2, cos, sin)
    if q.shape[-2] > d // 2:
        y = mx.stack([y1, y2], axis=-2).reshape(keys_t.shape) if traditional else mx.concatenate([y1, y2], axis=-2)
        return q @ y
    if traditional:
        return mx.addmm(q[..., 0::2] @ y1, q[..., 1::2], y2)
    return mx.addmm(q[..., : d // 2] @ y1, q[..., d // 2 :], y2)


def read_block(token_bytes: int) -> int:
    """Tokens of a run the decode reader takes at once, ``token_bytes`` the float32 coordinates
    of one token over the batch and heads: ``READ_BLOCK_BYTES`` of them (``_GPU`` on a GPU),
    a multiple of ``GROWTH_TOKENS`` (a growing buffer's blocks keep their shapes)."""
    budget = READ_BLOCK_BYTES if mx.default_device() == mx.cpu else READ_BLOCK_BYTES_GPU
    return max(1, budget // (token_bytes * GROWTH_TOKENS)) * GROWTH_TOKENS


def _part(x: mx.array, first: int, end: int, whole: int) -> mx.array:
    """``x[..., first:end]``, or ``x`` itself when that is all of its ``whole`` (no operation)."""
    return x if (first, end) == (0, whole) else x[..., first:end]


@dataclass(frozen=True)
class EigenScores:
    """An ``EigenTokens`` run as the pure-MLX decode path reads it (``PackedScores``).

    The whole buffer is read (spare rows included: the shapes change only as it grows), in
    blocks of ``read_block`` tokens, each block's reading made to wait for the previous
    block's result: the float32 transients stay a block's, at any batch or length (on the
    CPU within the 32 MiB of freed buffers MLX keeps for reuse; benchmarks/notes/serving_batches.md)."""

    tokens: EigenTokens
    count: int
    rows: tuple[int, int] | None = None  # only the rows [first, end): a block of the run

    @property
    def n_heads(self) -> int:
        return self.tokens.words.buffer.shape[1]

    def _spans(self):
        """The spans read and, per span, its (words, norms): the whole buffer's
        (``EigenTokens.read_views``, kept between writes), or the rows asked for."""
        t = self.tokens
        if not self.rows:
            return t.read_views()
        first, end = self.rows
        words, norms = t.words.buffer, t.norms.buffer
        if (first, end) != (0, words.shape[2]):
            words, norms = words[:, :, first:end], norms[:, :, first:end]
        return (self.rows,), ((words, norms),)

    def _read(self, cut, on_rows: bool, qjl: bool, after: mx.array | None):
        """``_coordinates`` of a span's (words, norms) ``cut``, read once ``after`` (the previous
        block's result) is made: left free, MLX's scheduler decodes every block before it
        reduces any (benchmarks/notes/prefill.md)."""
        t = self.tokens
        words, norms = cut
        if after is not None:
            words = mx.depends(words, after)
        return _coordinates_fn(t.codec, t.dim, on_rows, qjl)(words, norms, t.sigma, t.tables,
                                                             t.sketch if qjl else None)

    def scores(self, q: mx.array, qjl: bool = True) -> mx.array:
        """float32 ``q Kᵀ`` (B, H, R, count) for scaled float32 queries (B, H, R, D), with
        the QJL correction when the codec keeps one (``qjl=False``: without it)."""
        t = self.tokens
        qjl, on_rows = qjl and t.codec.qjl, q.shape[-2] > t.dim  # the norms scale whichever is smaller
        spans, cuts = self._spans()
        origin, reach = spans[0][0], spans[-1][1] - spans[0][0]
        if t.rotary is None:
            q = q @ t.basis
        else:
            cos, sin = rotary_angles(t.rotary, t.dim, t.start + origin, reach)
        if not on_rows:  # a decode step: each span one compiled pass (``_key_span_fn``)
            out, sketch = [], t.sketch if qjl else None
            traditional = None if t.rotary is None else t.rotary.traditional
            for (first, end), (words, norms) in zip(spans, cuts):
                if out:
                    words = mx.depends(words, out[-1])
                fn = _key_span_fn(t.codec, t.dim, qjl, traditional, first - origin, end - origin, reach)
                out.append(fn(q, words, norms, t.sigma, t.tables, sketch) if traditional is None
                           else fn(q, words, norms, t.sigma, t.tables, sketch, t.basis, cos, sin))
            s = mx.concatenate(out, axis=-1) if len(out) > 1 else out[0]
            return s if self.rows else s[..., : self.count]
        out = []
        for (first, end), cut in zip(spans, cuts):
            z, norm = self._read(cut, on_rows, qjl, out[-1] if out else None)
            if t.rotary is None:
                s = q @ z.swapaxes(-1, -2)
            else:
                lo, hi = first - origin, end - origin
                s = _turned_scores(q, t.basis @ z.swapaxes(-1, -2), _part(cos, lo, hi, reach),
                                   _part(sin, lo, hi, reach), t.rotary.traditional)
            out.append(s if on_rows else s * norm)
        s = mx.concatenate(out, axis=-1) if len(out) > 1 else out[0]
        return s if self.rows else s[..., : self.count]

    def mix(self, p: mx.array) -> mx.array:
        """float32 ``p V`` (B, H, R, D) for probabilities (B, H, R, count), or over ``rows``."""
        t = self.tokens
        room = 0 if self.rows else t.words.capacity - self.count
        if room:
            p = mx.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, room)])
        on_rows = p.shape[-2] > t.dim
        spans, cuts = self._spans()
        origin, reach = spans[0][0], spans[-1][1] - spans[0][0]
        out = None
        if not on_rows:  # a decode step: each span one compiled pass (``_value_span_fn``)
            for (first, end), (words, norms) in zip(spans, cuts):
                if out is not None:
                    words = mx.depends(words, out)
                part = _value_span_fn(t.codec, t.dim, first - origin, end - origin, reach, _splits_tokens())(
                    p, words, norms, t.sigma, t.tables)
                out = part if out is None else out + part
            return out @ t.basis.swapaxes(-1, -2)
        for (first, end), cut in zip(spans, cuts):
            z, norm = self._read(cut, on_rows, False, out)
            w = _part(p, first - origin, end - origin, reach)
            part = token_mix(w if on_rows else w * norm, z)
            out = part if out is None else out + part
        return out @ t.basis.swapaxes(-1, -2)


def history_block(query_rows: int) -> int:
    """Tokens of the history a prompt chunk scores at once: ``HISTORY_BLOCK_SCORES`` float32
    scores over its ``query_rows`` (batch x KV heads x queries), at least ``MIN_HISTORY_BLOCK``."""
    return max(MIN_HISTORY_BLOCK, HISTORY_BLOCK_SCORES // max(query_rows, 1))


class EigenStore(PackedStore):
    """Keys and values, each a list of ``EigenTokens`` runs, and rows held exactly
    (``k_pend``, ``v_pend``): every row until the basis is fitted, then the decode steps'
    newest, ``DECODE_FLUSH`` of them coded in one batch once they are there (a prompt chunk
    codes the ones held first). A prompt chunk's rows are coded as they come. With a key
    sketch a prompt chunk after the first attends over the history with the QJL-corrected
    scores too (the store owns that softmax, online over blocks of the history); otherwise
    over the decoded history, as every quantized store does.

    Refits (issue 37): each time the tokens coded double since the end of the prompt or the
    last refit (a Python counter, checked when decode rows are coded), a new run of keys and
    of values starts on the eigenbasis of the moment of every row taken in; stored rows keep
    the basis they were coded with (re-coding them would quantize them twice). ``keys`` and
    ``values`` are the newest runs."""

    def __init__(self, keys: EigenTokens, values: EigenTokens):
        self.key_runs, self.value_runs = [keys], [values]
        # exact until the basis is fitted, growing with what they hold (geometric): a short
        # prompt pays no 256-row step; then the decode window (``_hold``)
        self.k_pend = GrowingArray(axis=2, step=GROWTH_TOKENS, geometric=True)
        self.v_pend = GrowingArray(axis=2, step=GROWTH_TOKENS, geometric=True)
        self.fitted_at = 0  # tokens held at the end of the prompt or the last refit
        # a calibration file's arrays (``CALIBRATED``, batch 1), installed at the first commit
        self.calibrated: dict[str, mx.array] | None = None

    @property
    def keys(self) -> EigenTokens:
        return self.key_runs[-1]

    @property
    def values(self) -> EigenTokens:
        return self.value_runs[-1]

    @property
    def coded(self) -> int:
        return sum(r.count for r in self.key_runs)

    @property
    def length(self) -> int:
        return self.coded + self.k_pend.length

    def commit(self, keys: mx.array, values: mx.array) -> None:
        if self.keys.basis is None and self.calibrated is not None:
            self._install_calibrated(keys.shape[0])
        if self.keys.basis is not None and keys.shape[2] == 1:  # a decode step: one row written
            self._hold(keys, values)
            return
        if self.keys.basis is None:
            self.k_pend.append(keys)
            self.v_pend.append(values)
            if self.k_pend.length < keys.shape[-1]:
                return
            keys, values = self.k_pend.view(), self.v_pend.view()
            self.k_pend.reset(None)
            self.v_pend.reset(None)
        else:
            self.code_held()
        self.keys.append(keys)
        self.values.append(values)
        self.fitted_at = self.length  # a prompt is one run: the schedule counts from its end

    def _hold(self, keys: mx.array, values: mx.array) -> None:
        """A decode row, held exactly; ``DECODE_FLUSH`` of them are coded together."""
        if not self.k_pend.capacity:  # the window: its room grows with its first rows, then is kept
            self.k_pend = GrowingArray(axis=2, step=DECODE_FLUSH, limit=DECODE_FLUSH, geometric=True)
            self.v_pend = GrowingArray(axis=2, step=DECODE_FLUSH, limit=DECODE_FLUSH, geometric=True)
        self.k_pend.append(keys)
        self.v_pend.append(values)
        if self.k_pend.length == DECODE_FLUSH:
            self.code_held()

    def code_held(self) -> None:
        """Code the decode rows held exactly (after the fit) in one batch. A refit comes when
        the tokens coded double since the last fit, at that very token (the rows before it
        on the old basis, those after it on the new one)."""
        n = self.k_pend.length
        if not n:
            return
        keys, values = self.k_pend.view(), self.v_pend.view()
        self.k_pend.truncate(0)
        self.v_pend.truncate(0)
        refit_in = REFIT_GROWTH * self.fitted_at - self.coded if self.keys.moment is not None else n
        if 0 < refit_in < n:
            self._code(keys[:, :, :refit_in], values[:, :, :refit_in])
            keys, values = keys[:, :, refit_in:], values[:, :, refit_in:]
        self._code(keys, values)

    def _code(self, keys: mx.array, values: mx.array) -> None:
        self.keys.append(keys)
        self.values.append(values)
        if self.keys.moment is not None and self.coded >= REFIT_GROWTH * self.fitted_at:
            old_k, old_v = self.keys, self.values
            self.key_runs.append(old_k.refitted())
            self.value_runs.append(old_v.refitted())
            old_k.moment = old_v.moment = None  # the newest run carries it on
            self.fitted_at = self.coded

    def _install_calibrated(self, batch: int) -> None:
        """Every row's first runs start on the file's bases, σ and codebooks (broadcast over
        the batch). No moment is kept: nothing is ever refitted."""
        for run, prefix in ((self.keys, "k"), (self.values, "v")):
            basis, eigenvalues, tables = (batch_rows(self.calibrated[f"{prefix}_{name}"], batch)
                                          for name in CALIBRATED_ARRAYS)
            run.install(basis, eigenvalues, tables)
        self.calibrated = None

    def history(self, dtype):
        parts = [(k.decode(dtype), v.decode(dtype)) for k, v in zip(self.key_runs, self.value_runs) if k.count]
        if self.k_pend.length:
            parts.append((self.k_pend.view().astype(dtype), self.v_pend.view().astype(dtype)))
        if not parts:
            return None, None
        if len(parts) == 1:
            return parts[0]
        return mx.concatenate([k for k, _ in parts], axis=2), mx.concatenate([v for _, v in parts], axis=2)

    def decode_parts(self, empty) -> list[DecodePart]:
        parts = [DecodePart(k.reader(), None, v.reader(), None)
                 for k, v in zip(self.key_runs, self.value_runs) if k.count]
        if self.k_pend.length:
            parts.append(DecodePart(None, self.k_pend.view(), None, self.v_pend.view()))
        return parts

    def prefill_attention(self, queries, keys, values, *, scale, mask) -> mx.array:
        if self.keys.basis is not None:
            self.code_held()  # the chunk reads the history as it will be kept
        if not self.coded or not self.keys.codec.qjl:
            return super().prefill_attention(queries, keys, values, scale=scale, mask=mask)
        b, hq, n, d = queries.shape
        h = keys.shape[1]
        q = queries.astype(mx.float32).reshape(b, h, hq // h * n, d) * scale
        own = q @ keys.astype(mx.float32).swapaxes(-1, -2)
        if mask is not None:  # causal within the chunk (array masks arrive rebuilt as causal)
            causal = mx.tile(mx.arange(n)[:, None] >= mx.arange(n)[None], (hq // h, 1))
            own = mx.where(causal, own, -mx.inf)
        # an online softmax over the chunk, then the history a block at a time: the (R, n)
        # scores of the whole history for every query row held gigabytes a layer
        top = own.max(axis=-1, keepdims=True)  # finite: every row sees its own token
        p = mx.exp(own - top)
        total, out = p.sum(axis=-1, keepdims=True), p @ values.astype(mx.float32)
        block = history_block(q.shape[0] * q.shape[1] * q.shape[2])
        blocks = [(k, v, (first, min(first + block, k.count)))
                  for k, v in zip(self.key_runs, self.value_runs) for first in range(0, k.count, block)]
        for i, (k, v, rows) in enumerate(blocks):
            # a prompt chunk, not a decode step: each part reduced before the next is scored
            # (left lazy, the scheduler computes many parts' scores before it reduces any:
            # all of them, measured on the CPU, the chunk's own with the history's)
            mx.eval(out, total, top)
            s = EigenScores(k, k.count, rows).scores(q)
            new_top = mx.maximum(top, s.max(axis=-1, keepdims=True))
            p, fade = mx.exp(s - new_top), mx.exp(top - new_top)
            total = total * fade + p.sum(axis=-1, keepdims=True)
            out = out * fade + EigenScores(v, v.count, rows).mix(p)
            top = new_top
        self.commit(keys, values)
        out = (out / total).reshape(b, hq, n, values.shape[-1]).astype(queries.dtype)
        return paced(mx.depends(out, self.written()))

    # -- what is kept ---------------------------------------------------------------------
    def arrays(self):
        out = {"k_pend": self.k_pend, "v_pend": self.v_pend,
               "k_moment": self.keys.moment, "v_moment": self.values.moment}
        for i, (k, v) in enumerate(zip(self.key_runs, self.value_runs)):
            out.update({**k.arrays(_run_prefix("k", i)), **v.arrays(_run_prefix("v", i))})
        return out

    def meta(self):
        return {"rotary": self.keys.rotary.to_json() if self.keys.rotary is not None else "none",
                "runs": json.dumps({"starts": [r.start for r in self.key_runs], "fitted_at": self.fitted_at,
                                    "seen": [self.keys.seen, self.values.seen]})}

    def restore(self, meta, arrays) -> None:
        from ...cache.rope import Rotary

        if meta.get("rotary", "none") != "none":
            self.keys.rotary = Rotary.from_json(meta["rotary"])
        saved = json.loads(meta.get("runs") or "{}")
        self.fitted_at = int(saved.get("fitted_at", 0))
        self.k_pend.reset(arrays.get("k_pend"))
        self.v_pend.reset(arrays.get("v_pend"))
        first_k, first_v = self.key_runs[0], self.value_runs[0]
        self.key_runs, self.value_runs = [], []
        for i, start in enumerate(saved.get("starts", [0])):
            for prefix, first, runs in (("k", first_k, self.key_runs), ("v", first_v, self.value_runs)):
                run = EigenTokens(first.codec, rotary=first.rotary, seed=first.seed, step_tokens=first.step,
                                  start=int(start))
                name = _run_prefix(prefix, i)
                for field in ("words", "norms"):
                    if f"{name}_{field}" in arrays:
                        getattr(run, field).reset(arrays[f"{name}_{field}"])
                for field in ("basis", "sigma", "sketch", "tables"):
                    if f"{name}_{field}" in arrays:
                        setattr(run, field, arrays[f"{name}_{field}"])
                runs.append(run)
        for prefix, runs, seen in (("k", self.key_runs, saved.get("seen", [0, 0])[0]),
                                   ("v", self.value_runs, saved.get("seen", [0, 0])[1])):
            # a file without the moment (saved before refits existed) keeps its basis
            runs[-1].moment, runs[-1].seen = arrays.get(f"{prefix}_moment"), int(seen)

    def layout_problems(self, head_dims):
        for i, (k, v) in enumerate(zip(self.key_runs, self.value_runs)):
            label = "" if i == 0 else f" run {i}"
            yield from k.problems("key" + label, head_dims[0])
            yield from v.problems("value" + label, head_dims[1])

    def problems(self, offset: int):
        n_k = self.coded + self.k_pend.length
        n_v = sum(r.count for r in self.value_runs) + self.v_pend.length
        if n_k != offset or n_v != offset:
            yield "tokens stored", f"{n_k} keys / {n_v} values", f"the offset {offset}"
        if self.coded and self.k_pend.length >= DECODE_FLUSH:
            yield "tokens held exactly", self.k_pend.length, f"fewer than {DECODE_FLUSH} once the basis is fitted"
        starts = [r.start for r in self.key_runs]
        want = [sum(r.count for r in self.key_runs[:i]) for i in range(len(self.key_runs))]
        if starts != want or [r.count for r in self.value_runs] != [r.count for r in self.key_runs]:
            yield "run starts and rows", (starts, [r.count for r in self.value_runs]), (want, [r.count for r in self.key_runs])


def _run_prefix(prefix: str, i: int) -> str:
    """Names of run i's arrays: the first run's are the names a single basis had."""
    return prefix if i == 0 else f"{prefix}run{i}"
