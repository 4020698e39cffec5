"""A store of product-VQ keys and values with a full-precision window, and its cache base.

``CodebookStore`` keeps a layer's tokens as packed codebook indices (``quant/vq.py``),
keys and values each in their own ``ProductVQ`` codec, and the newest ``window`` tokens
in full precision, written in place (``RecentRows``). Decode steps leave their tokens in the
window until it holds ``window + VALUE_ROOM`` (32 more); the oldest ``VALUE_ROOM`` then leave
it together, coded in one pass (``_flush``), so that the window holds ``window`` to
``window + 31`` tokens and 31 steps of 32 only write their row; a prompt chunk codes every
token past the newest ``window`` at once. Coded tokens are never re-coded. Encoding is per
token, so what is stored does not depend on how the prompt was chunked or when a token
left the window, once the codebooks exist.

The codebooks come from a calibration (given to the store) or, without one, are fitted
once (``CodebookFit.fit_rows``) on the tokens the store holds when its first tokens are to
be encoded (the prompt, or its first chunk when it comes in chunks longer than the window;
the window plus one token when the prompt fits the window), and then kept fixed. The
codecs' arrays (centroids, smoothing factors) are kept per layer and saved with the state
and counted in ``nbytes``. A fit from the prompt is each row's own, with the batch first:
centroids (B, K, s), smoothing factors (B, H, 1, D), row b's what the row alone is fitted
(a stacked batch concatenates its sequences'). A calibration's are one for every row, as
its file holds them: centroids (K, s), kept once by a stacked batch (equal for its
sequences), smoothing factors (1, H, 1, D). Either is read as a codebook per row
(``ProductVQ.codebooks``: every product one per row, of the shape it has alone). A state
saved before the batch axis (a prompt's centroids (K, s)) gets it when restored.

Attention: a prompt chunk attends over the decoded history plus itself; a decode step over
one part, keys read through lookup tables (``CodebookKeys``), values through centroids
gathered by index (``CodebookValues``), the window as the part's full-precision tail: the
pure-MLX path on every device. Once tokens are coded (the codebooks fixed), a decode step
does the same arithmetic in a graph of fewer operations (``CodebookStore.decode_attention``), a
stacked batch's reads a block of rows after another, so that the step holds about a block's
index reads, lookups and value rows rather than the batch's (``_read_blocks``). On CUDA a
steady step gathers the centroids of the coded keys (in the code space, where the lookups
read them) and values, takes the window's keys into the code space, all in the queries'
dtype, and attends with one ``scaled_dot_product_attention`` by the queries taken there
(``_decoded_attention``): a stacked batch's rows in one piece, a layer's at a time.

``CodebookCache`` is the ``QuantizedCache`` of such methods: its ``sub_dim_fields`` must
divide head_dim, and the head_dim must admit the rotation where the method rotates.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from ..cache.buffers import GrowingArray, RecentRows
from ..kernels import kivi_decode as kd
from ..kernels.codebook_rows import codebook_rows
from ..kernels.decode import DecodePart
from ..kernels.kivi_decode import token_mix
from . import vq
from .cache import QuantizedCache
from .packed import GROWTH_TOKENS, field_arrays, runs_layout, unpack_fields
from .store import VALUE_ROOM, WINDOW_STEP, PackedStore, as_dtype, joined_history
from .token_rows import ReadViews, held
from .vq import (CodebookKeys, CodebookValues, ProductVQ, index_words, kmeans, kmeans_rows,
                 rotate, rotation_problem)

SMOOTH_FLOOR = 1e-4  # smallest per-channel smoothing factor
# Bytes the steady step's reads of a block of a batch's rows hold, at most (``_read_blocks``;
# a block has a row at least): on the CPU a row a block at the defaults (the fastest block
# there too); on a GPU larger blocks, fewer graph nodes (two rows at the 8B shape and 8k
# tokens; not measured there: benchmarks/notes/serving_batches.md).
READ_BLOCK = 1 << 22
READ_BLOCK_GPU = 1 << 28


def smoothing_factors(keys: mx.array, per_row: bool = False) -> mx.array:
    """lambda_c = sqrt(max |K[., c]|) per KV head over every sequence and token, floored:
    (1, H, 1, D) float32; with ``per_row``, each row's over its tokens: (B, H, 1, D)."""
    peak = mx.abs(keys.astype(mx.float32)).max(axis=2 if per_row else (0, 2), keepdims=True)
    return mx.maximum(mx.sqrt(peak), SMOOTH_FLOOR)


@dataclass(frozen=True)
class CodebookFit:
    """How a layer's codebooks are fitted: keys smoothed per channel and rotated, then
    k-means over their sub-vectors; values' raw sub-vectors likewise.

    ``sample``: points per centroid looked at, at most (a seeded sample beyond);
    ``iters``: Lloyd iterations at most; ``seed``: the k-means keys (split per codebook)."""

    key_sub_dim: int
    key_bits: int
    value_sub_dim: int
    value_bits: int
    iters: int
    sample: int
    seed: int = 0
    smooth: bool = True
    rotated: bool = True

    def fit(self, keys: mx.array, values: mx.array, progress=None) -> tuple[ProductVQ, ProductVQ]:
        """The (key, value) codecs for keys and values (B, H, T, D), one for every row (a
        calibration): centroids (K, s), smoothing factors (1, H, 1, D); ``progress(name,
        done, total)`` after each k-means iteration, name "keys" or "values"."""
        return self._fit(keys, values, progress, per_row=False)

    def fit_rows(self, keys: mx.array, values: mx.array, progress=None) -> tuple[ProductVQ, ProductVQ]:
        """Each row's own codecs (a fit from the prompt), row b's what ``fit`` gives that row
        alone: centroids (B, K, s), smoothing factors (B, H, 1, D)."""
        return self._fit(keys, values, progress, per_row=True)

    def _fit(self, keys, values, progress, per_row: bool) -> tuple[ProductVQ, ProductVQ]:
        keys_rng, values_rng = mx.random.split(mx.random.key(self.seed))
        scale = smoothing_factors(keys, per_row) if self.smooth else None
        frame = ProductVQ(mx.zeros((1, self.key_sub_dim)), self.key_bits, scale, self.rotated)
        codecs = []
        for name, x, s, bits, rng, base in (
            ("keys", frame.to_code_space(keys), self.key_sub_dim, self.key_bits, keys_rng, frame),
            ("values", values, self.value_sub_dim, self.value_bits, values_rng, ProductVQ(None, self.value_bits)),
        ):
            k = 1 << bits
            report = (lambda d, t, name=name: progress(name, d, t)) if progress else None
            points = x.reshape(x.shape[0], -1, s) if per_row else x.reshape(-1, s)
            if per_row:  # a prompt's fit: on a GPU no host read a Lloyd iteration (the same centroids)
                c = kmeans_rows(points, k, iters=self.iters, key=rng, sample=self.sample * k, progress=report,
                                read_host=report is not None or mx.default_device() == mx.cpu)
            else:
                c = kmeans(points, k, iters=self.iters, key=rng, sample=self.sample * k, progress=report)
            codecs.append(ProductVQ(c.astype(mx.float16), bits, base.scale, base.rotated))
        return codecs[0], codecs[1]


def codec_arrays(key: ProductVQ | None, value: ProductVQ | None) -> dict[str, mx.array | None]:
    """What a layer's codecs keep, by name (the calibration file's names too)."""
    return {"key_centroids": None if key is None else key.centroids,
            "key_scale": None if key is None else key.scale,
            "value_centroids": None if value is None else value.centroids}


@functools.lru_cache(maxsize=1)
def _no_scale() -> mx.array:
    return mx.zeros((0,), mx.float32)


def _scale_arg(codec: ProductVQ) -> mx.array:
    return codec.scale if codec.scale is not None else _no_scale()


# -- the steady state's decode step, in few graph nodes ----------------------------------------
# A decode step once tokens are coded (the codebooks fixed) stores its token (``commit``) and
# attends with the arithmetic that ``decode_parts`` and the joint softmax of
# ``kernels/decode.py`` perform there, the same operations (matrix products of the same
# shapes included) on the same values, so that every code, score, probability and output is
# bit for bit theirs; what changes is the number of operations in the step's graph (issue 30's
# CPU guard):
# - indices are read from the whole code buffers (their shapes change only when they grow,
#   so each compiled pass is traced once per growth) and cut to the coded tokens after the
#   gather; an index is read from the two words it spans at most (``unpack_fields``), fused
#   with the gather's offsets in one compiled pass, with no per-index slice
#   (``unpack_indices``' way) and nothing W times the indices' size over the buffer;
# - the keys' lookup (``lookup_scores``) gathers from the flat tables with each query row's
#   offsets in the index; the values' centroids (``gather_centroids``) are gathered a row of
#   a centroid's channels at a time;
# - tokens are coded only when the window flushes (``_flush``: -2c and c.c formed in one
#   fused pass, the tokens' distances as ``vq.nearest`` forms them, the indices packed through
#   one-hot word tables, ``_column_tables``); a steady step writes its row and reads;
# - a codebook per row (``ProductVQ.codebooks``) is read with one product a row, as
#   ``vq.lookup_scores`` forms them; the queries' scaling and smoothing are one fused pass;
# - the window's held rows are one slice of its buffer (none when it is full), and the
#   probabilities' coded and window parts come from one split;
# - a stacked batch's reads go a block of rows at a time (``_read_blocks``), one block after the
#   other: a batch that fits one block, and one row, takes the graph above, node for node.


def _fields(n: int, bits: int) -> tuple[mx.array, ...]:
    """The field layout of a token's ``n`` packed indices of ``bits``: ``unpack_fields``'
    arrays, (n,) each (one list of words for every token)."""
    return runs_layout(((n, bits),), 1).arrays()


@functools.lru_cache(maxsize=None)
def _key_offsets(b: int, h: int, r: int, n: int, k: int) -> mx.array:
    """(B, H, R, 1, n) uint32: where query row r's table of sub-space j starts in the flat
    (B, H, R, n, K) tables."""
    rows = np.arange(b * h * r).reshape(b, h, r, 1, 1) * n
    return mx.array(((rows + np.arange(n)) * k).astype(np.uint32))


@functools.lru_cache(maxsize=None)
def _value_offsets(rows: int, k: int) -> mx.array:
    """Where each row's codebook starts in the ``rows`` codebooks of ``k`` centroids laid end
    to end: (rows, 1, 1, 1) uint32 (0 for one codebook)."""
    return mx.array((np.arange(rows) * k).astype(np.uint32).reshape(rows, 1, 1, 1))


@functools.lru_cache(maxsize=None)
def _column_tables(n: int, bits: int) -> tuple[mx.array, ...]:
    """``vq.pack_indices``' field layout for ``n`` indices of ``bits``: the per-index shifts as
    (n, 1) columns and one-hot (n, W) tables of each field's word and next word, built from
    numpy (arrays with no graph behind them: a flush that first reads them builds nothing)."""
    (word, next_word, shift, high_shift, crosses, _), n_words = field_arrays(np.full(n, bits))
    slots = np.arange(n_words)
    return (mx.array(shift[:, None]), mx.array(crosses[:, None]), mx.array(high_shift[:, None]),
            mx.array((word[:, None] == slots).astype(np.uint32)),
            mx.array((next_word[:, None] == slots).astype(np.uint32)))


def _lead(codebook, b: int) -> tuple[int, ...]:
    """The leading axis a product against ``codebook`` takes: ``(b,)`` for a codebook per row
    (one product a row), none for one codebook (K, s) (read by a single row)."""
    return (b,) if codebook.ndim == 3 else ()


def _codebook(centroids):
    """A codebook (K, s), or one per row (1 or B, K, s), in float32 (as ``nearest`` and the
    readers cast it), -2c and c.c; c.c as (-2c)^2 / 4, exact (powers of two; the centroids
    are float16), so that the three come from one fused pass."""
    c = centroids.astype(mx.float32)
    m2c = -2.0 * c
    return c, m2c, m2c * m2c * 0.25


def _queries(queries, lam, scale: float, scaled: bool):
    """The step's scaled float32 queries (B, H, R, D), as the joint softmax scales them, and
    q * lambda, ``ProductVQ.query_to_code_space`` before its rotation."""
    q = queries.astype(mx.float32) * scale
    return q, (q * lam if scaled else q)


def _encode(x, m2c, sq, lam, shift, spill, back, at_word, at_next, scaled: bool, rotated: bool):
    """``ProductVQ.encode`` of tokens (B, H, T, D) from their codebook's -2c and c.c:
    ``to_code_space``, ``nearest``'s [y, 1] [-2c | c.c]^T and argmin, then the fields put in their words by the
    one-hot tables and summed (fields never overlap: a sum is an or)."""
    y = x.astype(mx.float32)
    if scaled:
        y = y / lam
    if rotated:
        y = rotate(y)
    b, h, t, d = y.shape
    s = m2c.shape[-1]
    ext = mx.concatenate([m2c, sq.sum(axis=-1, keepdims=True)], axis=-1).swapaxes(-1, -2)  # (.., s+1, K)
    y = y.reshape(*_lead(m2c, b), -1, s)
    flat = mx.pad(y, [(0, 0)] * (y.ndim - 1) + [(0, 1)], constant_values=1.0)
    idx = mx.argmin(flat @ ext, axis=-1).astype(mx.uint32).reshape(b, h, t, d // s, 1)
    low = idx << shift
    high = mx.where(spill, idx >> back, 0).astype(mx.uint32)
    return (low * at_word + high * at_next).sum(axis=-2).astype(mx.uint32)


def _key_index(words, word, next_word, shift, high_shift, crosses, mask, off):
    """Flat indices (B, H, R, rows, n) into the step's lookup tables of the whole key code
    buffer (B, H, rows, W): each token's indices (two words at most an index: no (..., n, W)
    intermediate, W times the indices over the whole buffer) plus their query row's table
    offsets."""
    return unpack_fields(words, word, next_word, shift, high_shift, crosses, mask)[:, :, None] + off


def _value_index(words, word, next_word, shift, high_shift, crosses, mask, off):
    """Flat centroid rows (B, H, rows, n) of the whole value code buffer: each token's indices
    past its row's codebooks before it."""
    return unpack_fields(words, word, next_word, shift, high_shift, crosses, mask) + off


_codebook_fn = mx.compile(_codebook)
_key_index_fn = mx.compile(_key_index)
_value_index_fn = mx.compile(_value_index)


@functools.lru_cache(maxsize=None)
def _queries_fn(scale: float, scaled: bool):
    return mx.compile(functools.partial(_queries, scale=scale, scaled=scaled))


@functools.lru_cache(maxsize=None)
def _encode_step_fn(scaled: bool, rotated: bool):
    return mx.compile(functools.partial(_encode, scaled=scaled, rotated=rotated))


def _read_rows(q, qt, k_words, v_words, k_tail, v_tail, k_c32, v_c32, count, kc, vc, n_k, n_v):
    """The steady step's attention output (B, H, R, D) float32 over the coded tokens and the
    window, for the batch rows given (each row's arrays, its codebooks where one a row)."""
    b, h, r, _ = q.shape
    s_k, s_v = kc.sub_dim, vc.sub_dim
    # scores: the coded keys through lookup tables (q~ . C per sub-space), then the window's
    tables = (qt.reshape(*_lead(k_c32, b), -1, s_k) @ k_c32.swapaxes(-1, -2)).reshape(-1)  # (B*H*R*n*K,)
    at = _key_index_fn(k_words, *_fields(n_k, kc.bits), _key_offsets(b, h, r, n_k, k_c32.shape[-2]))
    coded = mx.take(tables, at).sum(axis=-1)[..., :count]
    window = q @ k_tail.astype(mx.float32).swapaxes(-1, -2)
    p_coded, p_window = mx.split(mx.softmax(mx.concatenate([coded, window], axis=-1), axis=-1),
                                 [count], axis=-1)
    # values: centroids gathered by index, then the window's rows
    books = v_c32.shape[0] if v_c32.ndim == 3 else 1
    at = _value_index_fn(v_words, *_fields(n_v, vc.bits), _value_offsets(books, v_c32.shape[-2]))
    v_rows = mx.take(v_c32.reshape(-1, s_v), at, axis=0)  # (B, H, rows, n, s)
    v_rows = v_rows.reshape(*v_rows.shape[:3], -1)[:, :, :count]
    return token_mix(p_coded, v_rows) + token_mix(p_window, v_tail.astype(mx.float32))


def _read_blocks(arrays, count, kc, vc, n_k, n_v):
    """``_read_rows`` of ``arrays`` (its first eight arguments) in blocks of rows, each block's
    reads holding ``READ_BLOCK`` bytes at most, and waiting for the block before (a ``Depends``
    on its output: side by side, MLX would form every block's at once). A row's reads are 4
    bytes a KV head for each of: R x rows x n key indices and as many lookups, R x n x K
    table entries, rows x n value indices and rows x D value channels, over the whole code
    buffer; formed for the whole batch at once, B times a sequence's (2.6x the peak of the
    sequences decoded apart on the H200: benchmarks/notes/serving_batches.md). Rows never mix, so a block's
    outputs are the whole batch's for its rows, bit for bit; a batch that fits one block (one
    row always) is read as before, in the same graph."""
    q, k_words = arrays[0], arrays[2]
    b, h, r, _ = q.shape
    rows, d_v = k_words.shape[2], arrays[5].shape[-1]
    per_row = 4 * h * (2 * r * rows * n_k + r * n_k * (1 << kc.bits) + rows * (n_v + d_v))
    g = max(1, (READ_BLOCK if mx.default_device() == mx.cpu else READ_BLOCK_GPU) // per_row)
    if g >= b:
        return _read_rows(*arrays, count, kc, vc, n_k, n_v)
    cuts = list(range(g, b, g))
    # every row's arrays are batch first (a codebook per row too); one codebook serves each block
    parts = [mx.split(x, cuts) if x.ndim == 4 or (x.ndim == 3 and x.shape[0] == b) else [x] * (len(cuts) + 1)
             for x in arrays]
    out = []
    for block in zip(*parts):
        if out:  # the block's index reads and tables wait for the block before
            block = (block[0], *mx.depends(list(block[1:4]), [out[-1]]), *block[4:])
        out.append(_read_rows(*block, count, kc, vc, n_k, n_v))
    return mx.concatenate(out)


def _code_space(x, lam, dtype, scaled: bool, rotated: bool, query: bool):
    """``ProductVQ.to_code_space`` of rows (a step's window keys), or with ``query``
    ``query_to_code_space`` (the smoothing multiplied, not divided), in ``dtype``."""
    y = x.astype(mx.float32)
    if scaled:
        y = y * lam if query else y / lam
    return (rotate(y) if rotated else y).astype(dtype)


@functools.lru_cache(maxsize=None)
def _code_space_fn(dtype, scaled: bool, rotated: bool, query: bool):
    return mx.compile(functools.partial(_code_space, dtype=dtype, scaled=scaled, rotated=rotated, query=query))


def _gathered(words, flat, n: int, bits: int, books: int, count: int) -> mx.array:
    """The coded tokens' rows (B, H, count, n s) of the whole code buffer ``words``: each
    token's centroids gathered from the codebooks laid end to end (``flat`` (books K, s)); on
    a GPU in one launch (``kernels/codebook_rows.py``), the same values."""
    rows = codebook_rows(words, flat, n, bits, books, count)
    if rows is not None:
        return rows
    at = _value_index_fn(words, *_fields(n, bits), _value_offsets(books, flat.shape[0] // books))
    rows = mx.take(flat, at, axis=0)  # (B, H, rows, n, s)
    return rows.reshape(*rows.shape[:3], -1)[:, :, :count]


class CodebookStore(PackedStore):
    def __init__(self, window: int, fit: CodebookFit, codecs: tuple[ProductVQ, ProductVQ] | None = None):
        self.window, self.fitter = window, fit
        self.key_codec, self.value_codec = codecs if codecs is not None else (None, None)
        self.fitted_from = "calibration" if codecs is not None else None
        self.k_win = RecentRows(step=WINDOW_STEP, limit=window + VALUE_ROOM, geometric=True)
        self.v_win = RecentRows(step=WINDOW_STEP, limit=window + VALUE_ROOM, geometric=True)
        self.k_codes = GrowingArray(axis=2, step=GROWTH_TOKENS)
        self.v_codes = GrowingArray(axis=2, step=GROWTH_TOKENS)
        self.dims: tuple[int, int] | None = None  # key and value head_dim (the first tokens')

    def install(self, key: ProductVQ, value: ProductVQ, source: str) -> None:
        self.key_codec, self.value_codec, self.fitted_from = key, value, source

    @property
    def count(self) -> int:
        """Tokens held as codes."""
        return self.k_codes.length

    @property
    def length(self) -> int:
        return self.count + self.k_win.held

    # -- writing -------------------------------------------------------------------------
    def _encode(self, keys: mx.array, values: mx.array, held_k, held_v) -> None:
        """Append ``keys``/``values`` as codes, fitting the codebooks first (on ``held``,
        every token held now) when there are none yet."""
        if self.key_codec is None:
            self.install(*self.fitter.fit_rows(held_k, held_v), "prompt")
        self.k_codes.append(self.key_codec.encode(keys))
        self.v_codes.append(self.value_codec.encode(values))

    def commit(self, keys: mx.array, values: mx.array) -> None:
        """Take new tokens in; encode those that leave the window."""
        self.dims = self.dims or (keys.shape[-1], values.shape[-1])
        if keys.shape[2] == 1 and self.window:  # a decode step: rows written in place
            self.k_win.append(keys)
            self.v_win.append(values)
            held = self.k_win.held
            if self.key_codec is None:
                if held > self.window:  # the first token to leave: codebooks fitted on those held
                    held_k, held_v = self.k_win.view(), self.v_win.view()
                    self._encode(self.k_win.pop_front(1), self.v_win.pop_front(1), held_k, held_v)
            elif held >= self.window + VALUE_ROOM:
                self._flush(held - self.window)
            return
        k_all = keys if self.k_win.view() is None else mx.concatenate([self.k_win.view(), keys], axis=2)
        v_all = values if self.v_win.view() is None else mx.concatenate([self.v_win.view(), values], axis=2)
        n_old = k_all.shape[2] - self.window
        if n_old > 0:
            self._encode(k_all[:, :, :n_old], v_all[:, :, :n_old], k_all, v_all)
            k_all, v_all = mx.contiguous(k_all[:, :, n_old:]), mx.contiguous(v_all[:, :, n_old:])
        self.k_win.reset(k_all if k_all.shape[2] else None)
        self.v_win.reset(v_all if v_all.shape[2] else None)

    def _flush(self, n: int) -> None:
        """The window's ``n`` oldest tokens coded, one pass for keys and one for values (per
        token: the codes ``ProductVQ.encode`` gives each alone), and the rows left moved to
        the front of its buffer, so that the steps until the next flush only write theirs.
        A pass forms ``vq.nearest``'s block of distances at most (a stacked batch's tokens at
        4,096 centroids are more): past it, blocks of tokens each waiting for the one before
        (a ``Depends``, as ``_read_blocks``), so that one block's distances exist at a time."""
        budget = vq.NEAREST_CHUNK if mx.default_device() == mx.cpu else vq.NEAREST_CHUNK_GPU
        for codec, win, codes in ((self.key_codec, self.k_win, self.k_codes),
                                  (self.value_codec, self.v_win, self.v_codes)):
            rows = win.pop_front(n)
            b, h, _, d = rows.shape
            _, m2c, sq = _codebook_fn(codec.codebooks(b))
            encode = _encode_step_fn(codec.scale is not None, codec.rotated)
            args = (_scale_arg(codec), *_column_tables(d // codec.sub_dim, codec.bits))
            block = max(1, budget // (b * h * d // codec.sub_dim * m2c.shape[-2]))
            out = []
            for i in range(0, n, block):
                x = rows if block >= n else rows[:, :, i : i + block]
                if out:
                    x = mx.depends([x], [out[-1]])[0]
                out.append(encode(x, m2c, sq, *args))
            codes.append(out[0] if len(out) == 1 else mx.concatenate(out, axis=2))
            win.compact()

    def decode_attention(self, queries, keys, values, *, scale, use_kernel) -> mx.array:
        """A decode step: ``commit``, then, once tokens are coded, the attention in few graph
        nodes (see above), bit for bit the joint softmax over ``decode_parts``; before, through
        it."""
        if not (keys.shape[2] == 1 and self.window):
            return super().decode_attention(queries, keys, values, scale=scale, use_kernel=use_kernel)
        self.commit(keys, values)
        if not self.count:
            return self.attend_parts(queries, scale=scale, use_kernel=use_kernel, n_kv_heads=keys.shape[1])
        if use_kernel and kd.gpu_backend() == "cuda":
            return self._decoded_attention(queries, scale)
        kc, vc = self.key_codec, self.value_codec
        (d_k, d_v), (b, hq) = self.dims, queries.shape[:2]
        h = keys.shape[1]
        r, n_k, n_v = hq // h, d_k // kc.sub_dim, d_v // vc.sub_dim
        k_c32, v_c32 = kc.codebooks(b).astype(mx.float32), vc.codebooks(b).astype(mx.float32)
        # the reads, a block of rows at a time (see ``_read_rows``)
        lam = _scale_arg(kc)
        q, qt = _queries_fn(scale, kc.scale is not None)(queries.reshape(b, h, r, d_k), lam)
        if kc.rotated:
            qt = rotate(qt)
        arrays = (q, qt, self.k_codes.buffer, self.v_codes.buffer, self.k_win.view(), self.v_win.view(), k_c32, v_c32)
        o = _read_blocks(arrays, self.count, kc, vc, n_k, n_v)
        return o.reshape(queries.shape).astype(queries.dtype)

    def _decoded_attention(self, queries, scale) -> mx.array:
        """A steady decode step on CUDA: the coded keys in the code space (their centroids
        gathered by index, as the table lookup reads them) and the window's keys taken there,
        the values' centroids and the window's rows, all in the queries' dtype, read with one
        ``scaled_dot_product_attention`` by the queries taken into the code space
        (``q~ . y = q . x``). The float32 read's lookups and mix are what cuBLAS and the
        gathers serve slowly at decode shapes (``benchmarks/notes/cuda_dense_reads.md``). The
        codes are read once the queries exist, so that MLX does not decode later layers'
        rows ahead of their attention and hold them all (``PackedStore.history_after``)."""
        kc, vc, dtype = self.key_codec, self.value_codec, queries.dtype
        d_k, d_v = self.dims
        lam, scaled = _scale_arg(kc), kc.scale is not None
        k_flat, v_flat, books_k, books_v = self._flat_codebooks(queries.shape[0], dtype)
        k_words, v_words = mx.depends([self.k_codes.buffer, self.v_codes.buffer], [queries])
        k, v = joined_history(
            [_gathered(k_words, k_flat, d_k // kc.sub_dim, kc.bits, books_k, self.count)],
            [_gathered(v_words, v_flat, d_v // vc.sub_dim, vc.bits, books_v, self.count)],
            _code_space_fn(dtype, scaled, kc.rotated, False)(self.k_win.view(), lam), self.v_win.view(), dtype)
        b, hq, _, _ = queries.shape
        h = self.k_codes.buffer.shape[1]
        q = _code_space_fn(dtype, scaled, kc.rotated, True)(queries.reshape(b, h, hq // h, d_k), lam)
        return mx.fast.scaled_dot_product_attention(q.reshape(queries.shape), k, v, scale=scale)

    def _flat_codebooks(self, b: int, dtype):
        """Both codecs' codebooks laid end to end (books K, s) in ``dtype`` and how many books
        each holds (one, or one a row), kept while the codebooks stay."""
        kc, vc = self.key_codec, self.value_codec

        def build():
            out = [c.codebooks(b) for c in (kc, vc)]
            books = [c.shape[0] if c.ndim == 3 else 1 for c in out]
            return (*(as_dtype(c.reshape(-1, c.shape[-1]), dtype) for c in out), *books)

        return held(self, "_codebook_views", ReadViews).get(self, (kc.centroids, vc.centroids, b, str(dtype)), build)

    # -- reading --------------------------------------------------------------------------
    def history(self, dtype) -> tuple[mx.array | None, mx.array | None]:
        """Every stored token in ``dtype``, in order (transient: prefill chunks and tests)."""
        parts_k, parts_v = [], []
        if self.count:
            d_k, d_v = self.dims
            parts_k.append(self.key_codec.decode(self.k_codes.view(), d_k, dtype))
            parts_v.append(self.value_codec.decode(self.v_codes.view(), d_v, dtype))
        return joined_history(parts_k, parts_v, self.k_win.view(), self.v_win.view(), dtype)

    def decode_parts(self, empty: mx.array) -> list[DecodePart]:
        keys = values = None
        if self.count:
            d_k, d_v = self.dims
            keys = CodebookKeys(self.k_codes.buffer, self.count, self.key_codec, d_k)
            values = CodebookValues(self.v_codes.buffer, self.count, self.value_codec, d_v)
        return [DecodePart(keys, self.k_win.view(), values, self.v_win.view())]

    # -- checks of a restored state ---------------------------------------------------------
    def layout_problems(self, head_dims: tuple[int, int]):
        f = self.fitter
        for name, sub, bits, d in (("key", f.key_sub_dim, f.key_bits, head_dims[0]),
                                   ("value", f.value_sub_dim, f.value_bits, head_dims[1])):
            centroids = getattr(self, f"{name}_codec")
            want = (1 << bits, sub)
            if centroids is not None and tuple(centroids.centroids.shape[-2:]) != want:
                yield f"{name} codebook (centroids, sub_dim)", tuple(centroids.centroids.shape), want
            codes = getattr(self, f"{name[0]}_codes").view()
            words = index_words(d // sub, bits)
            if codes is not None and codes.shape[3] != words:
                yield f"{name} code words per token", codes.shape[3], f"{words} ({d // sub} indices of {bits} bits)"
        scale = self.key_codec.scale if self.key_codec is not None else None
        if scale is not None and scale.shape[-1] != head_dims[0]:
            yield "key smoothing factors' head_dim", scale.shape[-1], head_dims[0]

    def problems(self, offset: int):
        n_k, n_v = self.k_codes.length, self.v_codes.length
        held = self.k_win.held
        if n_k != n_v or held != self.v_win.held:
            yield "stored tokens", f"{n_k}+{held} keys / {n_v}+{self.v_win.held} values", "as many values as keys"
        low = min(offset, self.window)
        if not low <= held < self.window + VALUE_ROOM:
            yield "full-precision tokens", held, (f"from min(offset {offset}, window {self.window}) "
                                                  f"to window + {VALUE_ROOM - 1}")
        if n_k + held != offset:
            yield "tokens stored", n_k + held, f"the offset {offset}"
        if n_k and self.key_codec is None:
            yield "codebooks", None, f"codebooks for the {n_k} coded tokens"

    # -- what is kept ------------------------------------------------------------------------
    def arrays(self) -> dict[str, Any]:
        return {"k_codes": self.k_codes, "v_codes": self.v_codes, "k_res": self.k_win,
                "v_res": self.v_win, **codec_arrays(self.key_codec, self.value_codec)}

    def meta(self) -> dict[str, Any]:
        return {"codebooks_from": self.fitted_from or "", "head_dims": json.dumps(self.dims)}

    def restore(self, meta: dict[str, Any], arrays: dict[str, Any]) -> None:
        dims = json.loads(meta.get("head_dims") or "null")
        self.dims = None if dims is None else tuple(dims)
        for name in ("k_codes", "v_codes", "k_res", "v_res"):
            getattr(self, {"k_res": "k_win", "v_res": "v_win"}.get(name, name)).reset(arrays.get(name))
        f = self.fitter
        if arrays.get("key_centroids") is not None:
            source = meta.get("codebooks_from") or "prompt"
            keys, values = arrays["key_centroids"], arrays["value_centroids"]
            if source == "prompt" and keys.ndim == 2:  # saved before the batch axis: one sequence's
                keys, values = keys[None], values[None]
            self.install(ProductVQ(keys, f.key_bits, arrays.get("key_scale"), f.rotated),
                         ProductVQ(values, f.value_bits), source)


class CodebookCache(QuantizedCache):
    """A ``QuantizedCache`` whose codecs cut heads into sub-vectors: each field of
    ``sub_dim_fields`` must divide head_dim (keys, then values), and with ``rotates`` the
    head_dim must admit the Hadamard rotation."""

    sub_dim_fields: tuple[str, str]
    rotates = True
    group_field = ""

    @property
    def group(self) -> int:  # no group-affine codec: any head_dim passes QuantizedCache's check
        return 1

    @classmethod
    def sub_dim_problem(cls, config, d_k: int, d_v: int) -> str | None:
        """Why the sub-vector fields do not fit these key and value head_dims, or None."""
        for name, d in zip(cls.sub_dim_fields, (d_k, d_v)):
            sub = getattr(config, name)  # the flat field (a decode step asks: no options object)
            if d % sub:
                allowed = ", ".join(str(s) for s in range(1, d + 1) if d % s == 0)
                return f"{name}={sub} must divide head_dim={d}; allowed here: {allowed}"
        return None

    def update_and_fetch(self, keys, values):
        d_k, d_v = keys.shape[-1], values.shape[-1]
        problem = self.sub_dim_problem(self.config, d_k, d_v)
        if problem:
            raise ValueError(problem)
        problem = rotation_problem(d_k) if self.rotates else None
        if problem:
            raise ValueError(f"method {self.config.method!r}: {problem}")
        return super().update_and_fetch(keys, values)
