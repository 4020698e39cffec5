"""Vector codebooks: product quantization with k-means codebooks, packed indices, lookup tables.

A product-VQ codec cuts each head's vector (D channels) into ``D / s`` sub-vectors of
``s`` channels and stores, for each, the index of its nearest centroid in one codebook of
``2**bits`` centroids shared by every sub-vector position (and every head of a layer).

- **k-means** (``kmeans``): seeded (explicit MLX PRNG keys, no global state), initialised
  with ``k`` distinct data points drawn at random, Lloyd iterations (assign, move each
  centroid to its members' mean; an empty cluster keeps its centroid) until the
  assignment stops changing or ``iters`` runs out; at most ``sample`` points are looked
  at (a seeded sample beyond). With no more points than centroids every point is a
  centroid. ``progress(done, total)`` is called after each iteration. ``kmeans_rows``
  fits each row of a batch on its own (a codebook per row), the same arithmetic batched.
- **A codebook per row**: ``nearest``, ``lookup_scores`` and ``gather_centroids`` take
  centroids (K, s), one codebook for every row, or (B, K, s), one per row of the batch
  (x's first axis; (1, K, s) serves every row, each row's products apart). Against a
  codebook per row every matrix product is one per row, of the shape the row's product
  has alone (a block holds the same rows of each row): MLX folds a product against a 2-D
  table into one over all the rows, which OpenBLAS sums in another order for some shapes
  (an inner size of 9: value sub-vectors of 8), so a row's codes would depend on the rows
  beside it. With one row, ``nearest`` takes the (K, s) path's products.
- **Nearest centroid** (``nearest``): exact, ``argmin_c ||c||^2 - 2 x.c`` over blocks of
  rows, so that no more than ``NEAREST_CHUNK`` distances exist at a time on the CPU (4,096
  centroids: 128 rows a block, the fastest there) and ``NEAREST_CHUNK_GPU`` on a GPU, where
  each block's three launches cost more than its arithmetic (vecinfer's 4k prompt is a
  million key sub-vectors a layer: 8,192 blocks at the CPU's size); with a codebook per
  row a block holds those rows of each row of the batch (B times the distances). On a
  GPU, blocks
  past the first are paced: each is scheduled, then the host waits for the one before,
  so two blocks' distances exist at a time; left lazy, the device formed every block's
  before reducing any (14 GB for those keys). A decode step's rows are one block at every
  method's defaults (vecinfer codes a token a step, a2ats a 128-token window against 256
  centroids): nothing waits there; only a call past 64 MiB of distances waits, where
  lazy blocks would hold them all. ``benchmarks/notes/kernel_constants.md``. On a GPU with
  sub-vectors of up to 32 channels none of this runs: one kernel keeps each row's running
  minimum and writes no distance (``kernels/nearest_centroid.py``; exact float32 sums, no
  waits).
- **Packed indices** (``pack_indices``/``unpack_indices``): every width from 1 to 16
  bits, one little-endian bit stream per token (``affine.pack_codes``' order), padded to
  whole uint32 words per token: ``index_words(n, bits) = ceil(n * bits / 32)``. Unpacking
  is elementwise at every width (a width that does not divide 32 repeats its layout every
  ``lcm(bits, 32)`` bits, read by static slices: a gather there cost 20x more at 12 bits).
- **Rotation** (``rotate``): the orthonormal Walsh-Hadamard transform
  (``mx.hadamard_transform`` scaled by 1/sqrt(D)); at D = 2^k or 12 * 2^k it is
  symmetric, hence its own inverse, so nothing is stored for it. Other head dims are
  refused (``check_rotation``): MLX's other sizes (20 * 2^k, 28 * 2^k) are not symmetric
  and any other size crashes it.
- **Lookup-table scores** (``lookup_scores``): ``q . k_hat`` for every stored token
  without forming k_hat: one table ``q_j . C`` per sub-space (R x D x 2^bits products,
  once per step), then a gather by index and a sum over the sub-spaces (T x D / s reads).
  ``CodebookKeys`` (``scores``) and ``CodebookValues`` (``mix``: centroids gathered by
  index) are the ``PackedScores`` parts of ``kernels/decode.py``: the pure-MLX path
  reads them on every device (no fused kernel reads codebooks).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from ..kernels.compiled import PerShape, code_shifts
from ..kernels.kivi_decode import token_mix
from ..kernels.nearest_centroid import nearest_rows

MAX_BITS = 16
NEAREST_CHUNK = 1 << 19  # distances formed at a time by ``nearest`` with the CPU as the device
NEAREST_CHUNK_GPU = 1 << 24  # the same on a GPU (64 MiB of float32 distances a block)
Progress = Callable[[int, int], None]


# -- packed indices ---------------------------------------------------------------------
def index_words(n: int, bits: int) -> int:
    """uint32 words that ``n`` indices of ``bits`` bits take (per token, padded)."""
    return (n * bits + 31) // 32


@functools.lru_cache(maxsize=None)
def _fields(n: int, bits: int):
    """Where each of ``n`` indices lies: word, shift, whether it spills into the next word,
    the next word (clamped) and the right shift of its spilled part (clamped to 31)."""
    start = mx.arange(n, dtype=mx.uint32) * bits
    word, shift = start // 32, start % 32
    spill = (shift + bits) > 32
    last = index_words(n, bits) - 1
    nxt = mx.minimum(word + 1, last)
    back = mx.where(spill, 32 - shift, 31).astype(mx.uint32)
    return word, shift, spill, nxt, back


def pack_indices(codes: mx.array, bits: int) -> mx.array:
    """(..., n) integers below ``2**bits`` -> (..., index_words(n, bits)) uint32."""
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits={bits}: indices of 1 to {MAX_BITS} bits are packed")
    codes = codes.astype(mx.uint32)
    *lead, n = codes.shape
    w = index_words(n, bits)
    if 32 % bits == 0:  # whole indices per word
        per = 32 // bits
        codes = mx.pad(codes, [(0, 0)] * len(lead) + [(0, w * per - n)])
        return (codes.reshape(*lead, w, per) << code_shifts(bits)).sum(axis=-1).astype(mx.uint32)
    word, shift, spill, nxt, back = _fields(n, bits)
    low = codes << shift  # high bits that do not fit drop off
    high = mx.where(spill, codes >> back, 0).astype(mx.uint32)
    words = mx.zeros((*lead, w), mx.uint32)
    return words.at[..., word].add(low).at[..., nxt].add(high)  # disjoint bit fields


def unpack_indices(words: mx.array, bits: int, n: int) -> mx.array:
    """Inverse of ``pack_indices``: (..., W) uint32 -> (..., n) uint32."""
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        per = 32 // bits
        codes = (words[..., None] >> code_shifts(bits)) & mask
        return codes.reshape(*words.shape[:-1], -1)[..., :n]
    # The layout repeats every lcm(bits, 32) bits: static slices of each period's words
    # (elementwise, no gather; 12 bits: 8 indices in 3 words).
    g = math.gcd(bits, 32)
    per_index, per_word = 32 // g, bits // g
    *lead, w = words.shape
    periods = -(-w // per_word)
    if periods * per_word != w:
        words = mx.pad(words, [(0, 0)] * len(lead) + [(0, periods * per_word - w)])
    grid = words.reshape(*lead, periods, per_word)
    out = []
    for j in range(per_index):
        word, shift = divmod(j * bits, 32)
        x = grid[..., word] >> shift
        if shift + bits > 32:
            x = x | (grid[..., word + 1] << (32 - shift))
        out.append(x & mask)
    return mx.stack(out, axis=-1).reshape(*lead, periods * per_index)[..., :n]


# -- nearest centroid and k-means ---------------------------------------------------------
def nearest(x: mx.array, centroids: mx.array) -> mx.array:
    """The index of the nearest centroid (squared Euclidean) of each row of x (..., s):
    (...,) uint32, exact (ties: the lowest index), in blocks of rows. ``centroids`` (K, s),
    or (B, K, s): a codebook per row of the batch, x (B, ..., s) (see the module docstring)."""
    if centroids.ndim == 3 and x.shape[0] == 1 and centroids.shape[0] == 1:  # one row: (K, s)'s
        return nearest(x[0], centroids[0])[None]
    *lead, s = x.shape
    flat = x.reshape(*lead[: centroids.ndim - 2], -1, s).astype(mx.float32)  # (M, s) or (B, M, s)
    fused = nearest_rows(flat, centroids)
    if fused is not None:
        return fused.reshape(lead)
    c = centroids.astype(mx.float32)
    ext = mx.concatenate([-2.0 * c, (c * c).sum(axis=-1, keepdims=True)], axis=-1).swapaxes(-1, -2)  # (s+1, K)
    flat = mx.concatenate([flat, mx.ones((*flat.shape[:-1], 1), mx.float32)], axis=-1)
    on_cpu = mx.default_device() == mx.cpu
    m = flat.shape[-2]
    rows = max(1, (NEAREST_CHUNK if on_cpu else NEAREST_CHUNK_GPU) // c.shape[-2])
    out = []
    for i in range(0, m, rows):
        out.append(mx.argmin(flat[..., i : i + rows, :] @ ext, axis=-1))
        if not on_cpu and m > rows:  # a prompt's codes: pace the blocks (see above)
            mx.async_eval(out[-1])
            if len(out) > 1:
                mx.eval(out[-2])
    idx = out[0] if len(out) == 1 else mx.concatenate(out, axis=-1)
    return idx.astype(mx.uint32).reshape(lead)


def kmeans(x: mx.array, k: int, *, iters: int, key: mx.array, sample: int | None = None,
           progress: Progress | None = None) -> mx.array:
    """``k`` centroids (k, s) float32 of the rows of x (..., s), seeded by ``key``."""
    return kmeans_rows(x.reshape(1, -1, x.shape[-1]), k, iters=iters, key=key, sample=sample,
                       progress=progress)[0]


def kmeans_rows(x: mx.array, k: int, *, iters: int, key: mx.array, sample: int | None = None,
                progress: Progress | None = None, read_host: bool = True) -> mx.array:
    """``kmeans`` of each row of x (B, ..., s) on its own: (B, k, s) float32, row by row what
    ``kmeans`` gives that row alone. Every row takes the same seeded sample and initial
    centroids (by index: the rows hold as many points); the iterations stop when every row's
    assignment has settled, a row that settled before keeping the centroids of the
    iteration where it settled (those ``kmeans`` returns for it) while the others go on.
    ``read_host=False`` (a fit inside a decode step, which reads nothing on the host): all
    ``iters`` iterations are built lazily, settled rows keeping their centroids: the same
    centroids."""
    b, s = x.shape[0], x.shape[-1]
    x = x.reshape(b, -1, s).astype(mx.float32)
    k_sample, k_init = mx.random.split(key)
    if sample is not None and x.shape[1] > sample:
        x = x[:, mx.random.permutation(x.shape[1], key=k_sample)[:sample]]
    n = x.shape[1]
    if n <= k:  # every point a centroid (the rest repeat them)
        if progress:
            progress(iters, iters)
        return x[:, mx.arange(k) % n]
    c = x[:, mx.random.permutation(n, key=k_init)[:k]]
    points, ones = x.reshape(b * n, s), mx.ones((b * n,), mx.float32)
    first = (mx.arange(b, dtype=mx.uint32) * k)[:, None]  # where a row's centroids start in the sums
    previous = frozen = None
    for i in range(iters):
        idx = nearest(x, c)  # (B, n)
        at = (idx + first).reshape(-1)
        sums = mx.zeros((b * k, s), mx.float32).at[at].add(points).reshape(b, k, s)
        counts = mx.zeros((b * k,), mx.float32).at[at].add(ones).reshape(b, k, 1)
        moved = mx.where(counts > 0, sums / mx.maximum(counts, 1.0), c)
        c = moved if frozen is None else mx.where(frozen, c, moved)
        same = None if previous is None else mx.all(idx == previous, axis=1).reshape(b, 1, 1)
        previous = idx
        if same is not None:
            frozen = same if frozen is None else frozen | same
        if not read_host:
            continue
        settled = same is not None and bool(mx.all(same))
        mx.eval(c)
        if progress:
            progress(iters if settled else i + 1, iters)
        if settled:
            break
    return c


def relative_error(x: mx.array, x_hat: mx.array) -> float:
    """||x - x_hat||^2 / ||x||^2 over every element."""
    x, x_hat = x.astype(mx.float32), x_hat.astype(mx.float32)
    return float(mx.square(x - x_hat).sum() / mx.square(x).sum())


# -- the rotation -------------------------------------------------------------------------
def rotation_problem(head_dim: int) -> str | None:
    """Why ``head_dim`` cannot be rotated here (None when it can)."""
    m = head_dim
    while m % 2 == 0:
        m //= 2
    if m in (1, 3) and (m == 1 or head_dim % 12 == 0):
        return None
    return (f"head_dim={head_dim}: the Walsh-Hadamard rotation needs head_dim = 2^k or "
            f"12 * 2^k (where MLX's transform is its own inverse)")


def rotate(x: mx.array) -> mx.array:
    """x H (orthonormal, symmetric: applying it twice gives x back), float32."""
    return mx.hadamard_transform(x.astype(mx.float32), scale=x.shape[-1] ** -0.5)


# -- lookup-table scoring ------------------------------------------------------------------
def lookup_scores(q: mx.array, idx: mx.array, centroids: mx.array) -> mx.array:
    """``q . concat_j C[idx_j]`` for q (B, H, R, D) float32 and indices (B, H, T, n):
    (B, H, R, T). One table per sub-space, then a gather by index (no key is rebuilt).
    ``centroids`` (K, s), or (B or 1, K, s): a codebook per row (one product a row)."""
    b, h, r, d = q.shape
    k, s = centroids.shape[-2:]
    n = d // s
    if centroids.ndim == 3:
        table = q.reshape(b, h * r * n, s) @ centroids.astype(mx.float32).swapaxes(-1, -2)  # (B, H R n, K)
    else:
        table = q.reshape(b, h, r, n, 1, s) @ centroids.astype(mx.float32).T  # (B,H,R,n,1,K)
    flat = idx.astype(mx.int32) + mx.arange(n, dtype=mx.int32) * k  # (B, H, T, n)
    t = flat.shape[2]
    picked = mx.take_along_axis(table.reshape(b, h, r, n * k), flat.reshape(b, h, 1, t * n), axis=-1)
    return picked.reshape(b, h, r, t, n).sum(axis=-1)


def gather_centroids(idx: mx.array, centroids: mx.array) -> mx.array:
    """(..., n) indices -> (..., n * s) float32: each sub-vector's centroid. ``centroids``
    (K, s), or (B, K, s) with idx (B, ..., n): row b's from codebook b (B = 1: one for all)."""
    c = centroids.astype(mx.float32)
    at = idx.astype(mx.int32)
    if c.ndim == 3:
        rows, k, s = c.shape
        if rows > 1:
            at = at + (mx.arange(rows, dtype=mx.int32) * k).reshape(rows, *[1] * (idx.ndim - 1))
        c = c.reshape(rows * k, s)
    return c[at].reshape(*idx.shape[:-1], -1)


@dataclass(frozen=True, eq=False)
class ProductVQ:
    """The codec: x -> (x / scale) H (keys: per-channel smoothing, then the rotation) ->
    sub-vectors of ``centroids.shape[-1]`` channels -> nearest centroid, packed at ``bits``.

    ``centroids``: (2**bits, s), one codebook for every row of the batch, or (1 or B,
    2**bits, s), one per row; a batch reads either as a codebook per row (``codebooks``),
    so that a row's products are those it has alone. ``scale``: (1 or B, H, 1, D) per-channel
    divisors, or None; ``rotated``: whether the Hadamard rotation is applied. The centroids
    are stored as given (their dtype) and every comparison is made against the stored
    values."""

    centroids: mx.array  # (2**bits, s) or (1 or B, 2**bits, s)
    bits: int
    scale: mx.array | None = None
    rotated: bool = False

    @property
    def sub_dim(self) -> int:
        return self.centroids.shape[-1]

    def codebooks(self, rows: int) -> mx.array:
        """The centroids as a batch of ``rows`` rows reads them: a codebook per row (1 or B,
        2**bits, s); one codebook (2**bits, s) stays as it is for one row (its products are
        that row's)."""
        c = self.centroids
        return c[None] if c.ndim == 2 and rows > 1 else c

    def to_code_space(self, x: mx.array) -> mx.array:
        y = x.astype(mx.float32)
        if self.scale is not None:
            y = y / self.scale
        return rotate(y) if self.rotated else y

    def from_code_space(self, y: mx.array) -> mx.array:
        x = rotate(y) if self.rotated else y
        return x * self.scale if self.scale is not None else x

    def query_to_code_space(self, q: mx.array) -> mx.array:
        """q~ with q~ . y = q . x for x in the model's frame: (q * scale) H."""
        y = q.astype(mx.float32)
        if self.scale is not None:
            y = y * self.scale
        return rotate(y) if self.rotated else y

    def indices(self, x: mx.array) -> mx.array:
        """(B, H, T, D) -> (B, H, T, D / s) uint32 nearest-centroid indices."""
        y = self.to_code_space(x)
        return nearest(y.reshape(*y.shape[:-1], -1, self.sub_dim), self.codebooks(x.shape[0]))

    def encode(self, x: mx.array) -> mx.array:
        return pack_indices(self.indices(x), self.bits)

    def decode(self, words: mx.array, head_dim: int, dtype) -> mx.array:
        """(B, H, T, W) packed words -> (B, H, T, head_dim) in ``dtype``, one pass compiled
        for each shape (``kernels/compiled.py``: a prompt chunk's history grows each chunk)."""
        return _decoder(self.bits, head_dim // self.sub_dim, self.rotated, dtype)(words, self.centroids, self.scale)

    def words(self, head_dim: int) -> int:
        return index_words(head_dim // self.sub_dim, self.bits)


@functools.lru_cache(maxsize=None)
def _decoder(bits: int, n: int, rotated: bool, dtype):
    """``ProductVQ.decode`` of ``n`` indices a row, as a function of the arrays it reads."""
    def decode(words, centroids, scale):
        x = gather_centroids(unpack_indices(words, bits, n), centroids)
        x = rotate(x) if rotated else x
        return (x * scale if scale is not None else x).astype(dtype)

    return PerShape(decode)


@dataclass(frozen=True)
class _CodebookRows:
    """Product-VQ tokens as the pure-MLX decode path reads them (``PackedScores``): the
    whole index buffer, ``count`` valid tokens."""

    words: mx.array  # (B, H, rows, W)
    count: int
    codec: ProductVQ
    head_dim: int

    @property
    def n_heads(self) -> int:
        return self.words.shape[1]

    def indices(self) -> mx.array:
        n = self.head_dim // self.codec.sub_dim
        return unpack_indices(self.words[:, :, : self.count], self.codec.bits, n)


class CodebookKeys(_CodebookRows):
    """Keys, scored through lookup tables."""

    def scores(self, q: mx.array) -> mx.array:
        """float32 q K^T (B, H, R, count): q~ = (q * scale) H against the centroids, once
        per sub-space, gathered by each token's indices."""
        codebooks = self.codec.codebooks(q.shape[0])
        return lookup_scores(self.codec.query_to_code_space(q), self.indices(), codebooks)


class CodebookValues(_CodebookRows):
    """Values (no transform): ``p V`` with V's rows gathered from the centroids by index
    (the history is never rebuilt in its codec's frame because values have none)."""

    def mix(self, p: mx.array) -> mx.array:
        rows = self.codec.from_code_space(gather_centroids(self.indices(), self.codec.centroids))
        return token_mix(p, rows)
