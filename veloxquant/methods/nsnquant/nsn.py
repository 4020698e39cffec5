"""Normalize-shift-normalize (NSN) vector quantization with one universal codebook.

A chunk X (R tokens x D channels, one KV head) is one unit:

1. **N**: ``s1_t = ||x_t|| / sqrt(D)``, ``x' = x / s1``;
2. **S**: ``o = mean_t x'_t`` (the chunk's own channel mean), ``x'' = x' - o``;
3. **N**: ``s2_t = ||x''_t|| / sqrt(D)``, ``z = x'' / s2`` (every token of norm sqrt(D),
   about zero mean per channel);
4. **rotation**: ``y = z H`` (orthonormal Walsh-Hadamard), so y is close to N(0, I).

y is cut into sub-vectors of ``s`` channels, each stored as the index of a centroid of
one **universal codebook** built from seeded N(0, I_s) samples by k-means
(``universal_codebook``: explicit MLX PRNG keys from the seed, so the same seed gives the
same codebook, and no calibration data): at 2 bits the codebook is fitted on |samples|
(the positive orthant) and each sub-vector keeps its signs (s bits) plus the index of the
centroid nearest to its magnitudes; at 1 bit the codebook is fitted on the samples and
only the index is kept. Euclidean k-means: no renormalisation after lookup is needed.

Metadata are float16: s1 and s2 per token, o per chunk; the transform uses their rounded
values, so that ``s1 (s2 z + o) == x`` holds to float32 rounding before VQ. Decoding is
``x_hat = s1 (s2 y_hat H + o)``.

``NSNStore`` keeps a layer's keys and values this way: the newest ``N mod R`` tokens in
full precision (a tail, written in place), every complete chunk coded once, when its R-th
token comes; the coded frontier is always a multiple of R, whatever the chunking.

Decode attention reads the codes without rebuilding the history (``NSNKeys``,
``NSNValues``: the ``PackedScores`` parts, the pure-MLX path on every device):
``q . x_hat_t = s1_t (s2_t (q H) . y_hat_t + q . o_c)``, so the query is rotated once and
the per-chunk means are scored once per chunk; ``p X_hat = (sum_t p_t s1_t s2_t y_hat_t) H
+ sum_c (sum_{t in c} p_t s1_t) o_c``, one rotation per step. At 1 bit the keys' y_hat
scores go through lookup tables (``vq.lookup_scores``); at 2 bits the signs differ per
token, so the centroids are gathered by index and signed. Each read is one compiled pass
over the buffers' whole room (rows past the count are zeros: their scores are cut off,
their weights are zero), so a step's shapes change only when the buffers grow. On CUDA a
step reads in the rotated frame instead (``NSNStore.attend_parts``): every row rebuilt as
``s1 (s2 y_hat + o H)`` in the queries' dtype (one launch a tensor: ``kernel.py``), the tails
rotated, one fused attention of the rotated queries, its output rotated back.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ...cache.buffers import GrowingArray
from ...kernels import kivi_decode as kd
from ...kernels.compiled import PerShape
from ...kernels.decode import DecodePart
from ...quant.packed import GROWTH_TOKENS
from ...quant.store import WINDOW_STEP, PackedStore, joined_history
from ...quant.token_rows import ReadViews, held
from ...quant.vq import gather_centroids, index_words, kmeans, lookup_scores, nearest, pack_indices, rotate, unpack_indices
from .kernel import code_rows

UNIVERSAL_SAMPLES = 1 << 16  # N(0, I) samples the universal codebook is fitted on (at least 16 a centroid)
UNIVERSAL_ITERS = 20  # its Lloyd iterations, at most
NORM_FLOOR = 1e-4  # smallest s1, s2 (a zero token stays zero)


def _half(x: mx.array) -> mx.array:
    return x.astype(mx.float16).astype(mx.float32)


@functools.lru_cache(maxsize=16)
def universal_codebook(bits: int, size: int, sub_dim: int, seed: int) -> mx.array:
    """(size, sub_dim) float32 centroids of seeded N(0, I) samples (|samples| at 2 bits)."""
    k_samples, k_fit = mx.random.split(mx.random.key(seed))
    x = mx.random.normal((max(UNIVERSAL_SAMPLES, 16 * size), sub_dim), key=k_samples)
    codebook = kmeans(mx.abs(x) if bits == 2 else x, size, iters=UNIVERSAL_ITERS, key=k_fit)
    mx.eval(codebook)
    return codebook


@functools.lru_cache(maxsize=1)
def _sign_tables() -> tuple[mx.array, mx.array]:
    """Constants of the process, like the codebook, evaluated with the first step that
    reads them: the 32 bit positions of a sign word (uint32), and (256, 8) float32 byte
    patterns, channel k of the byte negative where bit k is set (``pack_indices(y < 0, 1)``'s
    order), for head_dims that are not whole words."""
    shifts = mx.arange(32, dtype=mx.uint32)
    bits = (mx.arange(256, dtype=mx.uint32)[:, None] >> shifts[:8]) & 1
    return shifts, 1.0 - 2.0 * bits.astype(mx.float32)


def _y_hat(codebook, bits: int, idx_words, sign_words, head_dim: int, signs=None) -> mx.array:
    """``NSNCodec.y_hat`` with the codebook (and the sign tables, ``_sign_tables()``) given:
    the form traced into the decode step's compiled passes."""
    index_bits, n = codebook.shape[0].bit_length() - 1, head_dim // codebook.shape[1]
    if index_bits in (8, 16):
        idx = mx.view(idx_words, mx.uint8 if index_bits == 8 else mx.uint16)
        idx = idx if idx.shape[-1] == n else idx[..., :n]
        y = codebook[idx].reshape(*idx.shape[:-1], head_dim)
    else:
        y = gather_centroids(unpack_indices(idx_words, index_bits, n), codebook)
    if bits == 1:
        return y
    shifts, patterns = signs if signs is not None else _sign_tables()
    lead = y.shape[:-1]
    if head_dim % 32 == 0:  # bit k of word w: channel 32 w + k negative
        words = head_dim // 32
        negative = (sign_words >> shifts if words == 1 else sign_words[..., None] >> shifts) & 1
        y = y if words == 1 else y.reshape(*lead, words, 32)
        return (y * (1.0 - 2.0 * negative.astype(mx.float32))).reshape(*lead, head_dim)
    if head_dim % 8 == 0:
        signs = mx.view(sign_words, mx.uint8)
        signs = signs if signs.shape[-1] == head_dim // 8 else signs[..., :head_dim // 8]
        return y * patterns[signs].reshape(*signs.shape[:-1], head_dim)
    negative = unpack_indices(sign_words, 1, head_dim).astype(mx.bool_)
    return mx.where(negative, -y, y)


def nsn(x: mx.array):
    """Chunks x (..., R, D) -> (y, s1, s2, o): y (..., R, D) float32 rotated, s1 and s2
    (..., R, 1) and o (..., 1, D), float16 values in float32."""
    x = x.astype(mx.float32)
    root_d = math.sqrt(x.shape[-1])
    s1 = _half(mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True) / root_d, NORM_FLOOR))
    x1 = x / s1
    o = _half(x1.mean(axis=-2, keepdims=True))
    x2 = x1 - o
    s2 = _half(mx.maximum(mx.linalg.norm(x2, axis=-1, keepdims=True) / root_d, NORM_FLOOR))
    return rotate(x2 / s2), s1, s2, o


def nsn_inverse(y: mx.array, s1: mx.array, s2: mx.array, o: mx.array) -> mx.array:
    return s1 * (s2 * rotate(y) + o)


@dataclass(frozen=True, eq=False)
class NSNCodec:
    """VQ of NSN-transformed rows with ``codebook`` (size, s); ``bits`` 2: signs + magnitude
    index, 1: signed index."""

    codebook: mx.array
    bits: int

    @property
    def index_bits(self) -> int:
        return self.codebook.shape[0].bit_length() - 1

    @property
    def sub_dim(self) -> int:
        return self.codebook.shape[1]

    def encode(self, y: mx.array):
        """Rotated rows y (..., D) -> (index words, sign words or None)."""
        sub = y.reshape(*y.shape[:-1], -1, self.sub_dim)
        if self.bits == 1:
            return pack_indices(nearest(sub, self.codebook), self.index_bits), None
        idx = nearest(mx.abs(sub), self.codebook)
        return pack_indices(idx, self.index_bits), pack_indices(y < 0, 1)

    def y_hat(self, idx_words: mx.array, sign_words: mx.array | None, head_dim: int) -> mx.array:
        """The rows' reconstruction in the rotated frame, float32 (..., D).

        Byte-wide indices (256 or 65536 centroids) are read as the words' bytes or half
        words (``pack_indices`` fills a word from its low bits: little-endian order), and
        signs a whole word at a time (a sign per bit, against the 32 bit positions), or a
        byte at a time through the table of the 256 sign patterns where the head_dim is not
        whole words: a decode step reads the codes in a few operations, not a shift and mask
        per field."""
        return _y_hat(self.codebook, self.bits, idx_words, sign_words, head_dim)

    def words(self, head_dim: int) -> tuple[int, int]:
        """uint32 words a token takes: indices, signs."""
        return index_words(head_dim // self.sub_dim, self.index_bits), (index_words(head_dim, 1) if self.bits == 2 else 0)


# a chunk's transform, compiled for each shape (kernels/compiled.py)
_nsn_fn = PerShape(nsn)


def _parts(codebook, bits: int, head_dim: int, idx, sign, norms, means):
    """``NSNTokens.parts`` of the valid tokens' arrays."""
    y = _y_hat(codebook, bits, idx, sign, head_dim)
    norms = norms.astype(mx.float32).swapaxes(-1, -2)  # (B, H, 2, T)
    return y, norms[:, :, :1], norms[:, :, 1:], means.astype(mx.float32)


@functools.lru_cache(maxsize=None)
def _decoder(bits: int, head_dim: int, chunk: int, dtype):
    """``NSNTokens.decode`` as a function of the arrays it reads."""
    def decode(codebook, idx, sign, norms, means):
        y, s1, s2, means = _parts(codebook, bits, head_dim, idx, sign, norms, means)
        o = mx.repeat(means, chunk, axis=2)
        return (s1.swapaxes(-1, -2) * (s2.swapaxes(-1, -2) * rotate(y) + o)).astype(dtype)

    return PerShape(decode)


class NSNTokens:
    """One tensor's (keys' or values') coded chunks: index and sign words and the two norms
    per token, the mean per chunk, in growing buffers (capped at ``limit`` tokens)."""

    def __init__(self, codec: NSNCodec, chunk: int, limit: int):
        self.codec, self.chunk = codec, chunk
        self.idx = GrowingArray(axis=2, step=GROWTH_TOKENS, limit=limit)
        self.sign = GrowingArray(axis=2, step=GROWTH_TOKENS, limit=limit)
        self.norms = GrowingArray(axis=2, step=GROWTH_TOKENS, limit=limit)
        self.mean = GrowingArray(axis=2, step=max(1, GROWTH_TOKENS // chunk), limit=-(-limit // chunk))

    @property
    def count(self) -> int:
        return self.norms.length

    def append(self, x: mx.array, decoding: bool = False) -> None:
        """Code whole chunks x (B, H, n * chunk, D)."""
        b, h, t, d = x.shape
        y, s1, s2, o = _nsn_fn(x.reshape(b, h, t // self.chunk, self.chunk, d))
        idx, sign = self.codec.encode(y.reshape(b, h, t, d))
        self.idx.append(idx)
        if sign is not None:
            self.sign.append(sign)
        self.norms.append(mx.concatenate([s1, s2], axis=-1).reshape(b, h, t, 2).astype(mx.float16))
        self.mean.append(o.reshape(b, h, t // self.chunk, d).astype(mx.float16))

    def parts(self, head_dim: int):
        """(y_hat (B, H, T, D), s1 (B, H, 1, T), s2, means (B, H, chunks, D)) of the
        ``count`` coded tokens, float32."""
        return _parts(self.codec.codebook, self.codec.bits, head_dim, *self._valid())

    def _valid(self) -> tuple:
        """The coded tokens' index words, sign words (or None), norms and chunk means (views)."""
        n = self.count
        sign = self.sign.buffer[:, :, :n] if self.codec.bits == 2 else None
        return self.idx.buffer[:, :, :n], sign, self.norms.buffer[:, :, :n], self.mean.buffer[:, :, : n // self.chunk]

    @property
    def capacity(self) -> int:
        """Whole chunks every buffer has room for: what the decode step computes over, so
        that its compiled passes keep their shapes until the buffers grow (rows past
        ``count`` are zeros: a zero norm, a centroid, no sign, a zero mean)."""
        rooms = [self.idx.capacity, self.norms.capacity, self.mean.capacity * self.chunk]
        if self.codec.bits == 2:
            rooms.append(self.sign.capacity)
        return min(rooms) // self.chunk * self.chunk

    def read_args(self) -> tuple:
        """The decode step's inputs over ``capacity`` tokens: index words, sign words (or
        None), norms, means (stored dtypes; each slice a no-op where the buffers agree)."""
        n = self.capacity
        sign = self.sign.buffer[:, :, :n] if self.codec.bits == 2 else None
        return self.idx.buffer[:, :, :n], sign, self.norms.buffer[:, :, :n], self.mean.buffer[:, :, : n // self.chunk]

    def fused_inputs(self) -> tuple:
        """``read_args`` with the chunks' means rotated (``o H``, float32): a CUDA step's
        inputs, kept while the buffers and the count stay (a chunk coded changes them)."""
        def build():
            idx, sign, norms, means = self.read_args()
            return idx, sign, norms, rotate(means.astype(mx.float32))

        key = (self.count, self.idx.buffer, self.sign.buffer, self.norms.buffer, self.mean.buffer)
        return held(self, "_fused_views", ReadViews).get(self, key, build)

    def decode(self, dtype) -> mx.array:
        """The coded tokens in ``dtype`` (a prompt chunk's history), one pass compiled for its shape."""
        return _decoder(self.codec.bits, self.mean.buffer.shape[-1], self.chunk, dtype)(
            self.codec.codebook, *self._valid())

    def arrays(self, prefix: str) -> dict[str, GrowingArray]:
        return {f"{prefix}_idx": self.idx, f"{prefix}_sign": self.sign, f"{prefix}_norms": self.norms,
                f"{prefix}_mean": self.mean}


@dataclass(frozen=True)
class _NSNReader:
    """Coded tokens for the pure-MLX decode path (``PackedScores``)."""

    tokens: NSNTokens
    head_dim: int

    @property
    def count(self) -> int:
        return self.tokens.count

    @property
    def n_heads(self) -> int:
        return self.tokens.norms.buffer.shape[1]


def _key_scores(bits, head_dim, chunk, q, idx, sign, norms, means, codebook, shifts, patterns):
    """``NSNKeys.scores`` over whole buffers (one compiled pass, ``_compiled``)."""
    qh = rotate(q)
    norms = norms.swapaxes(-1, -2)  # (B, H, 2, T)
    s1, s2 = norms[:, :, :1].astype(mx.float32), norms[:, :, 1:].astype(mx.float32)
    if bits == 1:  # no per-token signs: lookup tables
        sub = codebook.shape[1]
        idx = unpack_indices(idx, codebook.shape[0].bit_length() - 1, head_dim // sub)
        main = lookup_scores(qh, idx, codebook)
    else:
        main = qh @ _y_hat(codebook, bits, idx, sign, head_dim, (shifts, patterns)).swapaxes(-1, -2)
    shift = mx.repeat(q @ means.astype(mx.float32).swapaxes(-1, -2), chunk, axis=-1)  # q . o_c, per token
    return s1 * (s2 * main + shift)


def _value_mix(bits, head_dim, chunk, p, idx, sign, norms, means, codebook, shifts, patterns):
    """``NSNValues.mix`` over whole buffers (one compiled pass, ``_compiled``)."""
    norms = norms.swapaxes(-1, -2)  # (B, H, 2, T)
    s1, s2 = norms[:, :, :1].astype(mx.float32), norms[:, :, 1:].astype(mx.float32)
    w = p * s1  # (B, H, R, T)
    b, h, r, n = w.shape
    per_chunk = w.reshape(b, h, r, n // chunk, chunk).sum(axis=-1)
    y = _y_hat(codebook, bits, idx, sign, head_dim, (shifts, patterns))
    return rotate((w * s2) @ y) + per_chunk @ means.astype(mx.float32)


def _code_rows(bits, head_dim, chunk, dtype, idx, sign, norms, rotated_means, codebook, shifts, patterns):
    """Every row of the whole buffers in the rotated frame, ``x_hat H = s1 (s2 y_hat + o H)``
    (H symmetric and orthonormal), in ``dtype``: a CUDA step's keys or values."""
    y = _y_hat(codebook, bits, idx, sign, head_dim, (shifts, patterns))
    b, h, t, d = y.shape
    s = norms.astype(mx.float32)
    o = rotated_means[:, :, :, None]  # (B, H, chunks, 1, D)
    y = s[..., 1:].reshape(b, h, -1, chunk, 1) * y.reshape(b, h, -1, chunk, d) + o
    return (s[..., :1] * y.reshape(b, h, t, d)).astype(dtype)


def _rotated(x, dtype):
    return rotate(x).astype(dtype)


@functools.lru_cache(maxsize=None)
def _compiled(read, bits: int, head_dim: int, chunk: int):
    """A read as one compiled pass: its shapes change only when the buffers grow."""
    return mx.compile(lambda x, idx, sign, *rest: read(bits, head_dim, chunk, x, idx, sign, *rest))


@functools.lru_cache(maxsize=None)
def _code_rows_fn(bits: int, head_dim: int, chunk: int, dtype):
    """``_code_rows`` as one compiled pass: its shapes change only when the buffers grow."""
    return mx.compile(functools.partial(_code_rows, bits, head_dim, chunk, dtype))


@functools.lru_cache(maxsize=None)
def _rotated_fn(dtype):
    return mx.compile(functools.partial(_rotated, dtype=dtype))


class NSNKeys(_NSNReader):
    """Coded keys: ``q K_hatᵀ`` from the codes, the query rotated once."""

    def scores(self, q: mx.array) -> mx.array:
        t, n = self.tokens, self.count
        idx, sign, norms, means = t.read_args()
        scores = _compiled(_key_scores, t.codec.bits, self.head_dim, t.chunk)(
            q, idx, sign, norms, means, t.codec.codebook, *_sign_tables())
        return scores if scores.shape[-1] == n else scores[..., :n]


class NSNValues(_NSNReader):
    """Coded values: ``p X_hat`` with one rotation per step."""

    def mix(self, p: mx.array) -> mx.array:
        t = self.tokens
        idx, sign, norms, means = t.read_args()
        room = norms.shape[2] - p.shape[-1]
        if room:  # the weights of the rows past ``count``: zeros
            p = mx.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, room)])
        return _compiled(_value_mix, t.codec.bits, self.head_dim, t.chunk)(
            p, idx, sign, norms, means, t.codec.codebook, *_sign_tables())


class NSNStore(PackedStore):
    """Keys and values NSN-coded in chunks of ``chunk`` tokens, the incomplete chunk in
    full precision; at most ``limit`` tokens (the buffers stop growing there)."""

    def __init__(self, codec: NSNCodec, chunk: int, limit: int):
        self.chunk, self.limit = chunk, limit
        self.keys = NSNTokens(codec, chunk, limit)  # one universal codebook for keys and values
        self.values = NSNTokens(codec, chunk, limit)
        self.k_tail = GrowingArray(step=min(WINDOW_STEP, chunk), limit=chunk, geometric=True)
        self.v_tail = GrowingArray(step=min(WINDOW_STEP, chunk), limit=chunk, geometric=True)
        self.dims: tuple[int, int] | None = None
        self.codebook_shape = tuple(codec.codebook.shape)  # what the options ask for
        self._readers = None  # (count, dims, NSNKeys, NSNValues) of the last decode step

    @property
    def length(self) -> int:
        return self.keys.count + self.k_tail.length

    def commit(self, keys: mx.array, values: mx.array) -> None:
        self.dims = self.dims or (keys.shape[-1], values.shape[-1])
        n = keys.shape[2]
        if self.k_tail.length + n < self.chunk:  # the chunk is not complete: rows in place
            self.k_tail.append(keys)
            self.v_tail.append(values)
            return
        k = keys if not self.k_tail.length else mx.concatenate([self.k_tail.view(), keys], axis=2)
        v = values if not self.v_tail.length else mx.concatenate([self.v_tail.view(), values], axis=2)
        whole = k.shape[2] // self.chunk * self.chunk
        self.keys.append(k[:, :, :whole])
        self.values.append(v[:, :, :whole])
        self.k_tail.truncate(0)
        self.v_tail.truncate(0)
        if whole < k.shape[2]:
            self.k_tail.append(k[:, :, whole:])
            self.v_tail.append(v[:, :, whole:])

    def attend_parts(self, queries, *, scale, use_kernel, n_kv_heads: int) -> mx.array:
        """On CUDA once chunks are coded: attention in the rotated frame, one fused
        ``scaled_dot_product_attention`` of the queries rotated (``q . x = (q H) . (x H)``)
        over every row rebuilt there in the queries' dtype (``_code_rows``: no rotation of
        the history, the chunks' means rotated once a chunk) and the tails rotated, the output
        rotated back. The joint read's float32 products and per-token gathers are what the
        GPU serves slowly at decode shapes (``benchmarks/notes/cuda_dense_reads.md``). The
        codes are read once the queries exist (``PackedStore.history_after``)."""
        if not (use_kernel and self.keys.count and queries.shape[2] == 1 and kd.gpu_backend() == "cuda"):
            return super().attend_parts(queries, scale=scale, use_kernel=use_kernel, n_kv_heads=n_kv_heads)
        dtype, n = queries.dtype, self.keys.count
        parts = []
        for tokens, tail, d in ((self.keys, self.k_tail, self.dims[0]), (self.values, self.v_tail, self.dims[1])):
            idx, sign, norms, means = tokens.fused_inputs()
            idx = mx.depends([idx], [queries])[0]
            rows = code_rows(idx, sign, norms, means, tokens.codec.codebook, d, tokens.chunk, n, dtype)
            if rows is None:  # no kernel: the same rows through MLX's ops
                rows = _code_rows_fn(tokens.codec.bits, d, tokens.chunk, dtype)(
                    idx, sign, norms, means, tokens.codec.codebook, *_sign_tables())[:, :, :n]
            parts.append(mx.concatenate([rows, _rotated_fn(dtype)(tail.view())], axis=2) if tail.length else rows)
        out = mx.fast.scaled_dot_product_attention(_rotated_fn(dtype)(queries), *parts, scale=scale)
        return _rotated_fn(dtype)(out)

    def history(self, dtype):
        parts_k, parts_v = [], []
        if self.keys.count:
            parts_k.append(self.keys.decode(dtype))
            parts_v.append(self.values.decode(dtype))
        return joined_history(parts_k, parts_v, self.k_tail.view(), self.v_tail.view(), dtype)

    def decode_parts(self, empty: mx.array) -> list[DecodePart]:
        keys = values = None
        n = self.keys.count
        if n:
            kept = self._readers  # immutable readers: the same ones until a flush or a restore
            if kept is None or kept[0] != n or kept[1] != self.dims or kept[2].tokens is not self.keys:
                kept = self._readers = (n, self.dims, NSNKeys(self.keys, self.dims[0]),
                                        NSNValues(self.values, self.dims[1]))
            keys, values = kept[2], kept[3]
        k_tail, v_tail = self.k_tail, self.v_tail
        return [DecodePart(keys, k_tail.view() if k_tail.length else None, values,
                           v_tail.view() if v_tail.length else None)]

    # -- checks of a restored state ---------------------------------------------------------
    def layout_problems(self, head_dims: tuple[int, int]):
        found = tuple(self.keys.codec.codebook.shape)
        if found != self.codebook_shape:
            yield "universal codebook (size, sub-vector width)", found, self.codebook_shape
        for tokens, name, d in ((self.keys, "key", head_dims[0]), (self.values, "value", head_dims[1])):
            words, signs = tokens.codec.words(d)
            for g, label, want in ((tokens.idx, "index words", words), (tokens.sign, "sign words", signs),
                                   (tokens.norms, "norms", 2), (tokens.mean, "chunk means' head_dim", d)):
                if g.buffer is not None and g.buffer.shape[3] != want:
                    yield f"{name} {label} per token", g.buffer.shape[3], want

    def problems(self, offset: int):
        n_k, n_v, tail = self.keys.count, self.values.count, self.k_tail.length
        if n_k != n_v or tail != self.v_tail.length:
            yield "stored tokens", f"{n_k}+{tail} keys / {n_v}+{self.v_tail.length} values", "as many values as keys"
        if n_k % self.chunk or tail >= self.chunk:
            yield "coded tokens", n_k, f"a multiple of the chunk {self.chunk}, fewer than {self.chunk} in the tail"
        for tokens, name in ((self.keys, "key"), (self.values, "value")):
            if tokens.mean.length * self.chunk != tokens.count or tokens.idx.length != tokens.count:
                yield f"{name} chunk means", tokens.mean.length, f"{tokens.count // self.chunk} for {tokens.count} coded tokens"
        if n_k + tail != offset:
            yield "tokens stored", n_k + tail, f"the offset {offset}"

    # -- what is kept ------------------------------------------------------------------------
    def arrays(self) -> dict[str, Any]:
        return {**self.keys.arrays("k"), **self.values.arrays("v"), "k_tail": self.k_tail,
                "v_tail": self.v_tail, "codebook": self.keys.codec.codebook}

    def meta(self) -> dict[str, Any]:
        return {"head_dims": "" if self.dims is None else f"{self.dims[0]},{self.dims[1]}"}

    def restore(self, meta: dict[str, Any], arrays: dict[str, Any]) -> None:
        dims = meta.get("head_dims") or ""
        self.dims = tuple(int(d) for d in dims.split(",")) if dims else None
        for name, kept in self.arrays().items():
            if isinstance(kept, GrowingArray):
                kept.reset(arrays.get(name))
        if arrays.get("codebook") is not None:  # the saved codebook (the seed's, as saved)
            self.keys.codec = self.values.codec = NSNCodec(arrays["codebook"], self.keys.codec.bits)
