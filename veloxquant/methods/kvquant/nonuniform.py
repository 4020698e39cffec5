"""Non-uniform quantization with a dense-and-sparse split: codebook indices plus exact outliers.

``NonUniform`` is a codec in the ``GroupAffine`` mould (per token or per channel groups):
per group of ``group`` entries (one token's channels, or one channel's tokens) the
outliers are set aside first (``quant/outliers.py``), then the group's offset and range
over the rest, ``o = (M + m) / 2`` and ``rho = (M - m) / 2`` (stored in the input's dtype),
normalize it to ``z = (x - o) / rho`` in [-1, 1], and each z is stored as the index of its
nearest centroid in its row's codebook for the tensor (``quant/codebook.py``; packed bit
planes, any width). ``x_hat = c[idx] * rho + o``, the outliers written back exactly.

``NonUniformTokens`` keeps one codec's output for a growing run of tokens (grown buffers,
the ``PackedTokens`` interface): codes, offsets, ranges, outlier positions and values, and
its codebooks, one set per row of the batch (a sequence's own: rows never share one, so
that a cache fed B rows holds what each row's cache holds alone and sequences can be
stacked, ``cache/stacked.py``). A row's codebook is fitted (``codebook.fit``: quantile
or uniform start and Lloyd, each row on its own values) on the row's non-outlier z of the
first tokens it encodes (``fit_codebook`` gives that fit alone, for offline calibration),
or installed before them (``install``: a calibration file's, no fit), then frozen; with
``refits`` each encode after it also adds its z to the row's histogram, and ``refit()``
runs warm-started Lloyd on every row's at once and appends a new codebook a row that only
tokens encoded afterwards use: every token (per channel: every group) keeps the id of its
codebook, old indices are never read with new centroids.
Keys may be kept pre-RoPE (``quant/prerope.py``): de-rotated at their positions before
encoding, rotated again when read.

Reading: ``NonUniformScores`` (the ``PackedScores`` protocol of ``kernels/decode.py``)
is the one pass a decode step makes over the packed run, compiled as one graph
(``_dense_graph``): every bit plane unpacked at once, per group a table of its codebook's
centroids scaled and offset (``c * rho + o``, 2^bits entries) read by index (one gather
on the CPU, a fused tree of selects on CUDA: ``_table_read``), the outlier table
scattered over that tile, pre-RoPE keys rotated back (one reversed view of the channel
halves), then ``q K^T`` or ``p V`` as one matrix product (``p V`` cut along the tokens
on CUDA: ``kernels/kivi_decode.token_mix``).
It reads
the packed form directly: the history is never decoded into the model's dtype, nor
concatenated with the other parts. No fused GPU kernel reads codebooks, so this is the
pure-MLX path on every device.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import mlx.core as mx

from ...cache.buffers import GrowingArray
from ...cache.rope import derotate
from ...kernels.compiled import PerShape
from ...kernels import kivi_decode as kd
from ...kernels.kivi_decode import token_mix
from ...quant import codebook as cb
from ...quant.outliers import per_tail, split_channel_groups, split_vectors
from ...quant.packed import GROWTH_TOKENS, selected_along_last
from ...quant.prerope import rotary_angles, to_pre_rope
from ...quant.token_rows import KeptRead, ReadViews, held


@dataclass(frozen=True)
class NonUniform:
    """``bits``-bit codebook indices in groups of ``group`` along ``axis`` ("token": a token's
    channels; "channel": a channel's tokens, stored transposed); a ``fraction`` of the
    entries are outliers: ``per_tail(f, D)`` per tail per token (per channel: ``group``
    times that per group of tokens); ``iters`` Lloyd steps per fit."""

    bits: int
    group: int
    axis: str
    fraction: float
    iters: int

    @property
    def append_axis(self) -> int:
        return -1 if self.axis == "channel" else 2

    def per_tail(self, head_dim: int) -> int:
        return per_tail(self.fraction, head_dim)

    def outliers_per_unit(self, head_dim: int) -> int:
        """Outliers per token (axis "token") or per group of tokens (axis "channel")."""
        return 2 * self.per_tail(head_dim) * (self.group if self.axis == "channel" else 1)

    def prepare(self, x: mx.array, dtype):
        """(B, H, n, D) -> z (groups, float32), weights (1: fit on it), offsets, ranges (in
        ``dtype``), outlier positions and values. z is (B, H, n, D/g, g) per token and
        (B, H, D, n/g, g) per channel."""
        g, k = self.group, self.per_tail(x.shape[-1])
        x = x.swapaxes(-1, -2) if self.axis == "channel" else x
        mask = pos = val = None
        if k:
            if self.axis == "channel":
                mask, pos, val = split_channel_groups(x, k, g, dtype)
            else:
                mask, pos, val = split_vectors(x, k)
        groups = x.astype(mx.float32).reshape(*x.shape[:-1], x.shape[-1] // g, g)
        if mask is None:
            low, high, weights = groups.min(axis=-1), groups.max(axis=-1), mx.ones(groups.shape)
        else:
            mask = mask.reshape(groups.shape)
            low = mx.where(mask, mx.inf, groups).min(axis=-1)
            high = mx.where(mask, -mx.inf, groups).max(axis=-1)
            low, high = mx.where(low > high, 0.0, low), mx.where(low > high, 0.0, high)
            weights = (~mask).astype(mx.float32)
        offsets, ranges = ((high + low) / 2).astype(dtype), ((high - low) / 2).astype(dtype)
        o, r = offsets.astype(mx.float32)[..., None], ranges.astype(mx.float32)[..., None]
        z = mx.clip(mx.where(r > 0, (groups - o) / mx.where(r > 0, r, 1.0), 0.0), -1.0, 1.0)
        return z, weights, offsets, ranges, pos, val

    def assign(self, z: mx.array, centroids: mx.array) -> mx.array:
        """Bit planes of the nearest-centroid indices, each row's z against its own
        codebook (``centroids`` (B, 1, 1, 1, 2^bits)): (B, H, n, bits, W) per token,
        (B, H, D, bits, n/32) per channel."""
        idx = cb.nearest(z, centroids)
        return cb.pack_planes(idx.reshape(*idx.shape[:-2], -1), self.bits)

    def encode(self, x: mx.array, centroids: mx.array, dtype):
        z, weights, offsets, ranges, pos, val = self.prepare(x, dtype)
        return self.assign(z, centroids), offsets, ranges, pos, val, z, weights


@functools.lru_cache(maxsize=None)
def _compiled_encode(codec: NonUniform, dtype):
    """``encode`` of one token (values at a decode step), one compiled graph."""
    return mx.compile(lambda x, centroids: codec.encode(x, centroids, dtype))


@functools.lru_cache(maxsize=None)
def _chunk_encode(codec: NonUniform, dtype, rotary):
    """``encode`` of a prompt chunk after the first (its keys de-rotated at ``positions``
    first when ``rotary``), compiled for each chunk shape (``kernels/compiled.py``)."""
    def encode(x, positions, centroids):
        return codec.encode(x if rotary is None else derotate(x, positions, rotary), centroids, dtype)

    return PerShape(encode)


class NonUniformTokens:
    """A growing run of tokens in one ``NonUniform`` codec, with its codebooks."""

    def __init__(self, codec: NonUniform, *, refits: bool = False, rotary=None, start: int = 0,
                 step_tokens: int = GROWTH_TOKENS):
        self.codec, self.rotary, self.start = codec, rotary, start
        g, ax = codec.group, codec.append_axis
        channel = codec.axis == "channel"
        # Per token, every buffer has one row a token, appended together, so they can grow
        # with what they hold (geometric) and keep equal capacities: a short prompt pays no
        # 256-row step. Per channel, words of 32 tokens and groups of g must grow by aligned steps.
        rows = not channel
        self.codes = GrowingArray(axis=ax, step=step_tokens // 32 if channel else step_tokens, geometric=rows)
        self.offsets = GrowingArray(axis=ax, step=step_tokens // g if channel else step_tokens, geometric=rows)
        self.ranges = GrowingArray(axis=ax, step=step_tokens // g if channel else step_tokens, geometric=rows)
        unit_step = step_tokens // g if channel else step_tokens
        self.out_pos = GrowingArray(axis=2, step=unit_step, geometric=rows)
        self.out_val = GrowingArray(axis=2, step=unit_step, geometric=rows)
        # Codebooks per row, each fitted on its row's values alone (quant/codebook.py), and
        # kept in the shape the read broadcasts them in, so that a decode step's read
        # reshapes nothing: (B, 1, 1, codebooks, 2^bits) float32; the ids of the units'
        # codebooks (equal across rows: refits follow the step counter) per row too, so
        # that every kept array has the batch first, (B, 1, 1, groups, 1) per channel,
        # (B, 1, tokens, 1, 1) per token; the refit histograms (B, 2, HIST_BINS).
        self.books = GrowingArray(axis=3, step=1)
        self.book_ids = GrowingArray(axis=3 if channel else 2, step=unit_step, geometric=rows) if refits else None
        self.hist = GrowingArray(axis=1, step=2) if refits else None
        # Whether encodes have reached the histogram since the last fit, kept on the host so
        # that a scheduled refit at a decode step needs no read of the histogram (unknown
        # after a load: a refit over an empty histogram returns the codebook it started at).
        self.observed_since_fit = True
        # what a read takes of the kept arrays, in the layouts it reads them in (views,
        # ``_tile_views``), kept until a write changes them
        self._views = ReadViews()
        self._pass = KeptRead()  # the decode read's compiled pass and inputs (``read_pass``)

    @property
    def count(self) -> int:
        if self.codec.axis == "channel":
            return self.offsets.length * self.codec.group
        return self.codes.length

    @property
    def centroids(self) -> mx.array:
        """The codebooks new tokens are encoded with, one a row (B, 2^bits)."""
        return self.books.buffer[:, 0, 0, self.books.length - 1]

    def _newest(self) -> mx.array:
        """``centroids`` as encoding reads them, (B, 1, 1, 1, 2^bits)."""
        n = self.books.length
        return self.books.buffer[:, :, :, n - 1 : n]

    # -- writing ---------------------------------------------------------------------------
    def _pre_rope(self, x: mx.array) -> mx.array:
        """``x`` as it is encoded after the tokens kept: de-rotated at its positions when
        the run keeps keys pre-RoPE."""
        return x if self.rotary is None else to_pre_rope(x, self.start + self.count, self.rotary)

    def fit_codebook(self, x: mx.array) -> mx.array:
        """(B, 2^bits): the codebooks ``append`` fits on ``x`` (B, H, n, D) as the run's
        first tokens (what an offline calibration of the run keeps), nothing stored."""
        c = self.codec
        z, weights, *_ = c.prepare(self._pre_rope(x), x.dtype)
        return cb.fit(z, c.bits, c.iters, weights)

    def install(self, book: mx.array) -> None:
        """Start on the codebooks ``book`` (B, 2^bits) (a calibration file's; ``append``'s
        first fit installs its own): no fit follows, and with refits every later encode is
        observed as encoded since that fit."""
        self._views.clear()  # no view pins the codebooks written in place
        self._pass_holder().value = None
        self.books.append(book.reshape(book.shape[0], 1, 1, 1, book.shape[1]))

    def append(self, x: mx.array, decoding: bool = False) -> None:
        """Encode ``x`` (B, H, n, D) after the tokens kept (per channel: n a multiple of 32
        and of the group); the first call, unless codebooks were installed, fits them on
        its own data."""
        c, dtype = self.codec, x.dtype
        self._views.clear()  # no view pins a buffer the appends below write in place
        self._pass_holder().value = None
        if not self.books.length:
            z, weights, offsets, ranges, pos, val = c.prepare(self._pre_rope(x), dtype)
            self.install(cb.fit(z, c.bits, c.iters, weights))
            codes = c.assign(z, self._newest())
        elif decoding:
            codes, offsets, ranges, pos, val, z, weights = _compiled_encode(c, dtype)(self._pre_rope(x), self._newest())
            self._observe(z, weights)
        else:  # a prompt chunk: de-rotation and encoding in one compiled pass a chunk shape
            positions = None if self.rotary is None else mx.arange(self.start + self.count, self.start + self.count + x.shape[2])
            codes, offsets, ranges, pos, val, z, weights = _chunk_encode(c, dtype, self.rotary)(x, positions, self._newest())
            self._observe(z, weights)
        self.codes.append(codes)
        self.offsets.append(offsets)
        self.ranges.append(ranges)
        if pos is not None:
            self.out_pos.append(pos)
            self.out_val.append(val)
        if self.book_ids is not None:
            rows = x.shape[0]
            shape = (rows, 1, 1, offsets.shape[-1], 1) if c.axis == "channel" else (rows, 1, offsets.shape[2], 1, 1)
            self.book_ids.append(mx.full(shape, self.books.length - 1, mx.int32))

    def _observe(self, z, weights) -> None:
        if self.hist is not None:
            self.hist.reset(cb.accumulate(self.hist.buffer, z, weights))
            self.observed_since_fit = True

    def refit(self) -> None:
        """Warm-started Lloyd on what was encoded since the last fit: a new codebook for
        the tokens encoded from now on (nothing seen, or no Lloyd steps: no new codebook)."""
        if self.hist is None or self.hist.buffer is None or not self.codec.iters:
            return
        if not self.observed_since_fit:
            return
        book = cb.compiled_refit(self.hist.buffer, self.centroids, self.codec.iters)
        self._views.clear()
        self._pass_holder().value = None
        self.books.append(book.reshape(book.shape[0], 1, 1, 1, book.shape[1]))
        self.hist.reset(mx.zeros_like(self.hist.buffer))
        self.observed_since_fit = False

    # -- reading ------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Tokens every buffer has room for: what readers compute over, so that the shapes
        of their compiled passes change only when the buffers grow (rows past ``count`` are
        zeros and come out as zeros)."""
        g = self.codec.group
        if self.codec.axis == "channel":
            rooms = [self.codes.capacity * 32, self.offsets.capacity * g, self.ranges.capacity * g]
            units = [a.capacity * g for a in (self.out_pos, self.book_ids) if a is not None and a.buffer is not None]
        else:
            rooms = [self.codes.capacity, self.offsets.capacity, self.ranges.capacity]
            units = [a.capacity for a in (self.out_pos, self.book_ids) if a is not None and a.buffer is not None]
        return min(rooms + units)

    def _read(self) -> tuple["_Read", tuple]:
        """How the kept arrays are read (the compiled pass's settings) and its inputs, over
        ``capacity`` tokens: every buffer sliced to it (a no-op where it is the buffer's
        room), the memoised shift, group-start and rotary tables after them. Where the
        packed axis and the groups tile whole words (``_tile``), the inputs are views kept
        between writes (``_tile_views``) in the layout ``_tile_graph`` reads."""
        c, g, n = self.codec, self.codec.group, self.capacity
        channel = c.axis == "channel"
        per_unit = self.books.length > 1 and self.book_ids is not None
        outliers = self.out_pos.buffer is not None
        rope = self.rotary.traditional if channel and self.rotary is not None else None
        tile = _tile(g, n if channel else self.offsets.buffer.shape[-1] * g,
                     n // 32 if channel else self.codes.buffer.shape[-1])
        if tile is not None and (1 << c.bits) <= g:
            select = gpu_backend() == "cuda"
            how = _Read(channel, g, per_unit, outliers, rope, (*tile, c.bits), select)
            args = self._tile_views(how, n)
            if rope is not None:
                args = (*args, *_rotation(self.rotary, self.codes.buffer.shape[2], self.start, n, rope))
            return how, args
        units = n // g if channel else n
        if channel:
            args = [self.codes.buffer[..., : n // 32], self.books.buffer,
                    self.ranges.buffer[..., :units], self.offsets.buffer[..., :units]]
        else:
            args = [self.codes.buffer[:, :, :n], self.books.buffer,
                    self.ranges.buffer[:, :, :n], self.offsets.buffer[:, :, :n]]
        args += _shifts(c.bits)
        if per_unit:
            args.append(self.book_ids.buffer[..., :units, :] if channel else self.book_ids.buffer[:, :, :units])
        if outliers:
            args += [self.out_pos.buffer[:, :, :units], self.out_val.buffer[:, :, :units]]
            if channel:
                args.append(_group_starts(units, g))
        if rope is not None:
            args += _rotation(self.rotary, self.codes.buffer.shape[2], self.start, n, rope)
        return _Read(channel, g, per_unit, outliers, rope), tuple(args)

    def _tile_views(self, how: "_Read", n: int) -> tuple:
        """``_tile_graph``'s inputs over ``n`` (the capacity) tokens, every one a view of a kept
        array (slices, reshapes, broadcasts: no bytes of their own), built when an array or
        a count they view changes and kept until then: a decode step slices, reshapes and
        broadcasts nothing of the run. In order: each bit plane (..., A, Mp, 1); the
        codebook entries (..., A, Mu, 1) one by one where a step selects among them (CUDA)
        with one codebook, else the codebooks (per unit: to be gathered by the ids after
        them); ranges and offsets (..., A, Mu, 1); the outlier positions and values (per
        channel flat over the groups, with each one's group start after them)."""
        arrays = (self.codes, self.offsets, self.ranges, self.out_pos, self.out_val, self.books, self.book_ids)
        key = (n, int(how.select), int(how.per_unit), self.books.length, self.count) + tuple(
            x for a in arrays if a is not None for x in (a.buffer, a.length))
        return self._views.get(self, key, lambda: self._build_tile_views(how, n))

    def _build_tile_views(self, how: "_Read", n: int) -> tuple:
        c, g = self.codec, self.codec.group
        a, mp, mu, _, _ = how.tile
        k = 1 << c.bits
        codes = self.codes.buffer
        if how.channel:  # (B, H, D, bits, W): a plane's words are a channel's tokens
            units = n // g
            words = codes[..., : n // 32]
            planes = [words[:, :, :, j].reshape(*words.shape[:3], a, mp)[..., None] for j in range(c.bits)]
            ranges, offsets = (x.buffer[..., :units] for x in (self.ranges, self.offsets))
        else:  # (B, H, n, bits, W): a plane's words are a token's channels
            units = n
            words = codes[:, :, :n]
            planes = [words[:, :, :, j].reshape(*words.shape[:3], a, mp)[..., None] for j in range(c.bits)]
            ranges, offsets = (x.buffer[:, :, :n] for x in (self.ranges, self.offsets))
        ranges, offsets = (x.reshape(*x.shape[:3], a, mu)[..., None] for x in (ranges, offsets))
        nb = self.books.length
        books = self.books.buffer[:, :, :, :nb]  # (B, 1, 1, codebooks, 2^bits)
        rows = books.shape[0]
        if how.per_unit:
            ids = self.book_ids.buffer
            if how.channel:  # (B, 1, 1, units, 1) -> (B, 1, 1, A, Mu, 2^bits); codebooks along axis 3
                ids = mx.broadcast_to(ids[..., :units, :].reshape(rows, 1, 1, a, mu, 1), (rows, 1, 1, a, mu, k))
                books = mx.broadcast_to(books[..., None, :], (rows, 1, 1, nb, mu, k))
            else:  # (B, 1, n, 1, 1) -> (B, 1, n, 1, 1, 2^bits); codebooks along axis 2
                ids = mx.broadcast_to(ids[:, :, :n, :, :, None], (rows, 1, n, 1, 1, k))
                books = books.swapaxes(2, 3)[..., None, :]  # (B, 1, codebooks, 1, 1, 2^bits)
            source = (books, ids)
        else:
            book = books[:, :, :, nb - 1 :].reshape(rows, 1, 1, 1, 1, k)
            source = tuple(book[..., j : j + 1] for j in range(k)) if how.select else (book,)
        out = [*planes, *source, ranges, offsets]
        if how.outliers:
            pos, val = self.out_pos.buffer[:, :, :units], self.out_val.buffer[:, :, :units]
            if how.channel:  # a group's (channel * g + token) -> channel * n + token, flat over the groups
                per = pos.shape[-1]
                out += [pos.reshape(*pos.shape[:2], -1), val.reshape(*val.shape[:2], -1), _flat_group_starts(units, g, per)]
            else:
                out += [pos, val]
        return tuple(out)

    def dense(self) -> mx.array:
        """float32 reconstruction of ``capacity`` tokens in the storage layout: (B, H, n, D)
        per token, (B, H, D, n) per channel (post-RoPE again for pre-RoPE keys)."""
        how, args = self._read()
        return _read_fn(how, False)(*args)

    def times_dense(self, left: mx.array) -> mx.array:
        """``left @ dense()`` in the same compiled pass as the reconstruction (float32)."""
        fn, args, _ = self.read_pass()
        return fn(left, *args)

    def _pass_holder(self) -> "KeptRead":
        return held(self, "_pass", KeptRead)

    def read_pass(self) -> tuple:
        """(``times_dense``'s compiled pass, its inputs after ``left``, ``capacity``), built
        at the first read after a write (``append``, ``install`` and ``refit`` drop it) and
        kept while the kept arrays (by identity), the count, the codebooks and the
        dispatcher's backend stay: a step calls the pass alone."""
        grown = (self.codes, self.offsets, self.ranges, self.out_pos, self.out_val, self.books, self.book_ids)
        state = (gpu_backend(), self.count, self.books.length, self.rotary)
        holder = self._pass_holder()
        kept = holder.value
        if kept is not None and kept[0] == state and all(map(operator.is_, map(_buffer, grown), kept[1])):
            return kept[2]
        how, args = self._read()
        out = (_read_fn(how, True), args, self.capacity)
        holder.value = (state, tuple(map(_buffer, grown)), out)
        return out

    def decode(self, dtype) -> mx.array | None:
        """The valid tokens (B, H, count, D) in ``dtype`` (transient: prefill chunks and tests)."""
        if not self.count:
            return None
        x, n = self.dense(), self.count
        x = x[..., :n].swapaxes(-1, -2) if self.codec.axis == "channel" else x[:, :, :n]
        return x.astype(dtype)

    def layout(self, empty: mx.array) -> "NonUniformScores":
        return NonUniformScores(self, self.count)

    # -- what is kept -------------------------------------------------------------------------
    def arrays(self, prefix: str) -> dict[str, GrowingArray]:
        out = {f"{prefix}_{name}": getattr(self, name) for name in
               ("codes", "offsets", "ranges", "out_pos", "out_val", "books")}
        if self.book_ids is not None:
            out.update({f"{prefix}_book_ids": self.book_ids, f"{prefix}_hist": self.hist})
        return out

    def with_batch_axis(self, prefix: str, arrays: dict) -> dict:
        """``arrays`` (a saved state, by ``arrays``' names) with a layout saved before the
        codebooks were per row given today's: its codebooks (codebooks, 2^bits), ids (units,)
        and histogram (2, HIST_BINS), one for all the rows, become every row's."""
        codes = arrays.get(f"{prefix}_codes")
        rows = 1 if codes is None else codes.shape[0]
        out = dict(arrays)
        books, ids, hist = (out.get(f"{prefix}_{name}") for name in ("books", "book_ids", "hist"))
        if books is not None and books.ndim == 2:
            out[f"{prefix}_books"] = mx.broadcast_to(books[None, None, None], (rows, 1, 1, *books.shape))
        if ids is not None and ids.ndim == 1:
            shape = (1, 1, 1, -1, 1) if self.codec.axis == "channel" else (1, 1, -1, 1, 1)
            out[f"{prefix}_book_ids"] = mx.broadcast_to(ids.reshape(shape), (rows, *ids.reshape(shape).shape[1:]))
        if hist is not None and hist.ndim == 2:
            out[f"{prefix}_hist"] = mx.broadcast_to(hist[None], (rows, *hist.shape))
        return out

    def problems(self, name: str, head_dim: int):
        """(field, found, expected) where the kept arrays contradict the codec or each other."""
        c, n = self.codec, self.count
        channel = c.axis == "channel"
        units = n // c.group if channel else n

        def shape(g: GrowingArray):
            return None if g.buffer is None else tuple(g.view().shape[2:])

        want_codes = (head_dim, c.bits, n // 32) if channel else (n, c.bits, cb.plane_words(head_dim))
        want_ranges = (head_dim, units) if channel else (n, head_dim // c.group)
        k = c.per_tail(head_dim)
        want_out = (units, c.outliers_per_unit(head_dim)) if k else None
        for g, label, want in ((self.codes, "codes", want_codes), (self.ranges, "ranges", want_ranges),
                               (self.offsets, "offsets", want_ranges), (self.out_pos, "outlier positions", want_out),
                               (self.out_val, "outlier values", want_out)):
            if shape(g) != want and (n or shape(g)):
                yield f"{name} {label} (trailing dims)", shape(g), f"{want} ({c.bits}-bit, groups of {c.group})"
        rows = None if self.codes.buffer is None else self.codes.buffer.shape[0]
        n_books, size = self.books.length, 1 << c.bits
        if n and (n_books < 1 or self.books.view().shape != (rows, 1, 1, n_books, size)):
            yield f"{name} codebooks", None if self.books.buffer is None else tuple(self.books.view().shape), \
                f"(rows, 1, 1, codebooks, centroids): ({rows}, 1, 1, at least 1, {size})"
        if self.book_ids is not None and n:
            ids = self.book_ids.view()
            want = (rows, 1, 1, units, 1) if channel else (rows, 1, units, 1, 1)
            if ids.shape != want:
                yield f"{name} codebook ids", tuple(ids.shape), f"{want}: one per row and {'group' if channel else 'token'}"
            elif int(ids.max()) >= n_books:
                yield f"{name} codebook id", int(ids.max()), f"below the {n_books} codebooks kept"
            if self.hist.buffer is not None and self.hist.buffer.shape != (rows, 2, cb.HIST_BINS):
                yield f"{name} refit histogram", tuple(self.hist.buffer.shape), f"({rows}, 2, {cb.HIST_BINS})"
        if k and n and int(self.out_pos.view().max()) >= (head_dim * c.group if channel else head_dim):
            yield f"{name} outlier position", int(self.out_pos.view().max()), "inside its vector"


def _buffer(grown: GrowingArray | None):
    return None if grown is None else grown.buffer


@functools.lru_cache(maxsize=None)
def _shifts(bits: int):
    """The shifts of an index's bits: along a plane's word (32), across the planes (bits);
    built once (the first step that reads them evaluates them with itself: no mx.eval, which
    would wait for the steps mlx-lm's loop has queued)."""
    return mx.arange(32, dtype=mx.uint32), mx.arange(bits, dtype=mx.uint32)[:, None, None]


@functools.lru_cache(maxsize=8)
def _group_starts(units: int, group: int) -> mx.array:
    """Each group's first token (units, 1), int32, built once per group count (it changes
    once per flush) and evaluated with the step that first reads it."""
    return (mx.arange(units, dtype=mx.int32) * group)[:, None]


def _tile(group: int, length: int, words: int) -> tuple[int, int, int, int] | None:
    """How ``_tile_graph`` lays out the ``length`` indices of a packed axis (a channel's
    tokens, or a token's channels) held in ``words`` words of each bit plane: as (A, M, C),
    a word or a group split so that each of its bits is one element and each group's
    offset and range broadcast over its own: returns (A, Mp, Mu, C), a plane's words
    viewed as (A, Mp), the groups' statistics as (A, Mu), with M = max(Mp, Mu): groups of
    whole words (Mp = group / 32 words a group, Mu = 1) or words of whole groups (Mp = 1,
    Mu = 32 / group groups a word). None: neither, or indices past ``length`` in the last
    word (the general ``_dense_graph`` reads those)."""
    if words * 32 != length:
        return None
    if group % 32 == 0 and length % group == 0:
        return length // group, group // 32, 1, 32
    if 32 % group == 0:
        return words, 1, 32 // group, group
    return None


@functools.lru_cache(maxsize=None)
def _bit_masks(mp: int, mu: int, width: int) -> mx.array:
    """Each element's bit in its word, ``1 << position`` (uint32), in the (M, C) shape of a
    tile's last axes: (32,) for groups of whole words, (32 / g, g) for words of groups."""
    masks = mx.array([1 << i for i in range(32)], dtype=mx.uint32)
    return masks if mu == 1 else masks.reshape(mu, width)


@functools.lru_cache(maxsize=8)
def _flat_group_starts(units: int, group: int, per: int) -> mx.array:
    """Each outlier's group's first token, (units * per,) int32, in the order of a run's
    outlier table flattened over its groups (``per`` a group); built once per group count."""
    return mx.repeat(mx.arange(units, dtype=mx.int32) * group, per)


def _tile_graph(how: "_Read", *args):
    """``_dense_graph``'s reconstruction from ``NonUniformTokens._tile_views``' views: each
    element's index bits tested in its word of each plane, in the views' layout (..., A, M,
    C) (no unpacking sum, no reshape of the codes); on CUDA the centroid they name picked
    by a tree of selects over the entries (2^bits - 1 selects, one fused elementwise pass
    with the bit tests and ``c * rho + o``), elsewhere a table of ``c * rho + o`` per group
    read by the index (a gather); then the outliers and the rotation as there."""
    a, mp, mu, width, bits = how.tile
    k, g = 1 << bits, how.group
    args = list(args)
    planes = args[:bits]
    del args[:bits]
    if how.per_unit:  # each unit's codebook, by its id
        books, ids = args[:2]
        del args[:2]
        entries = mx.take_along_axis(books, ids, axis=3 if how.channel else 2)
        if how.select:
            entries = mx.split(entries, k, axis=-1)  # one node, not a slice an entry
    elif how.select:
        entries = args[:k]
        del args[:k]
    else:
        entries = args.pop(0)
    ranges, offsets = (x.astype(mx.float32) for x in args[:2])
    del args[:2]
    masks = _bit_masks(mp, mu, width)
    on = [(p & masks) != 0 for p in planes]  # (..., A, M, C): bit j of each element's index
    if how.select:
        level = list(entries)
        for bit in on:  # the lowest bit picks within pairs, the next within pairs of pairs, ...
            level = [mx.where(bit, level[i + 1], level[i]) for i in range(0, len(level), 2)]
        x = level[0] * ranges + offsets
    else:
        codes = on[0].astype(mx.uint32)
        for j, bit in enumerate(on[1:], 1):
            codes = codes + (bit.astype(mx.uint32) << j)
        table = entries * ranges + offsets  # (..., A, Mu, 2^bits)
        x = mx.take_along_axis(table, codes, axis=-1)
    lead = x.shape[:2]
    length = a * max(mp, mu) * width
    if how.channel:
        d, n = x.shape[2], length
        flat = (*lead, d, n)
    else:
        n, d = x.shape[2], length
        flat = (*lead, n, d)
    if how.outliers:
        if how.channel:  # flat over the groups: a group's (channel * g + token) -> channel * n + token
            pos, val, starts = args[:3]
            del args[:3]
            pos = pos.astype(mx.int32)
            index = (pos // g) * n + starts + pos % g
            x = mx.put_along_axis(x.reshape(*lead, d * n), index, val.astype(x.dtype), axis=-1)
        else:
            pos, val = args[:2]
            del args[:2]
            x = mx.put_along_axis(x.reshape(flat), pos, val.astype(x.dtype), axis=-1)
    return _rotated(how, x, flat, args)


def _rotated(how: "_Read", x: mx.array, flat: tuple, extra) -> mx.array:
    """``x`` (any shape of ``flat``'s size) as ``flat``, pre-RoPE keys rotated back."""
    if how.rope is None:
        return x.reshape(flat)
    # y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin: x cos + x_swapped (-sin, sin)
    lead, d, n = flat[:2], flat[2], flat[3]
    cos, signed_sin = extra
    if how.rope:  # pairs (2i, 2i + 1): (..., D/2, 2, n)
        x = x.reshape(*lead, d // 2, 2, n)
        swapped = x[..., ::-1, :]
    else:  # halves: (..., 2, D/2, n)
        x = x.reshape(*lead, 2, d // 2, n)
        swapped = x[:, :, ::-1]
    return (x * cos + swapped * signed_sin).reshape(flat)


@dataclass(frozen=True)
class _Read:
    """What a read of a run depends on besides its arrays' shapes."""

    channel: bool  # per channel (B, H, D, n), else per token (B, H, n, D)
    group: int
    per_unit: bool  # several codebooks: each unit reads its own (``book_ids``)
    outliers: bool
    rope: bool | None  # pre-RoPE keys rotated back (True: traditional pairs); None: no rotation
    tile: tuple | None = None  # (A, Mp, Mu, C) of ``_tile``: the views' layout; None: ``_dense_graph``
    select: bool = False  # entries taken by a tree of selects (CUDA), not a gather


def gpu_backend():
    """The dispatcher's answer, asked through its module at each call (the CPU guards' CUDA
    stub replaces it there, and so reaches this read)."""
    return kd.gpu_backend()


def _table_read(table: mx.array, codes: mx.array) -> mx.array:
    """``table[..., codes]`` along the last axis, exactly: a gather on the CPU; on CUDA a
    tree of selects (``quant/packed.py``'s ``selected_along_last``) that the compiled read
    fuses (MLX's axis gather took twice as long as a chain of selects at these shapes:
    benchmarks/notes/decode_kernels.md; the tree, fewer operations deep, is not timed)."""
    if gpu_backend() != "cuda":
        return mx.take_along_axis(table, codes, axis=-1)
    return selected_along_last(table, codes)


def _dense_graph(how: _Read, planes, books, ranges, offsets, along, across, *extra):
    """The reconstruction (``NonUniformTokens.dense``), float32: every bit plane unpacked
    at once; per unit (group) a table of its codebook's centroids scaled and offset,
    ``c * rho + o`` (2^bits entries, at most the group's), read by index (``_table_read``)
    (``c[idx] * rho + o`` exactly); the outliers written over that; pre-RoPE keys rotated back with one reversed
    view of the channel halves (or pairs)."""
    extra, g = list(extra), how.group
    codes = (((planes[..., None] >> along) & 1) << across).sum(axis=-3, keepdims=True)  # (..., 1, W, 32)
    lead = planes.shape[:2]
    if how.channel:  # (B, H, D, bits, W) -> (B, H, D, units, g)
        d, n = planes.shape[2], planes.shape[-1] * 32
        units, flat = n // g, (*lead, d, n)
        codes = codes.reshape(*lead, d, units, g)
    else:  # (B, H, n, bits, W) -> (B, H, n, D/g, g)
        n, d = planes.shape[2], offsets.shape[-1] * g
        units, flat = n, (*lead, n, d)
        if planes.shape[-1] * 32 == d:
            codes = codes.reshape(*lead, n, d // g, g)
        else:
            codes = codes.reshape(*lead, n, -1)[..., :d].reshape(*lead, n, d // g, g)
    # books: (B, 1, 1, codebooks, 2^bits), a row's own; ids (per_unit): (B, 1, 1, units, 1)
    # per channel, (B, 1, n, 1, 1) per token, as the tables and codes below broadcast them
    ids = extra.pop(0) if how.per_unit else None
    if books.shape[-1] <= g:  # a table per unit, no larger than its group
        if ids is not None:  # each unit's own codebook: (B, 1, 1, units, 2^bits), per token (B, 1, n, 1, 2^bits)
            books = mx.take_along_axis(books, ids, axis=3)
        table = books * ranges[..., None] + offsets[..., None]  # (..., units, 2^bits)
        x = _table_read(table, codes)
    else:  # small groups: the centroids read from the codebooks laid end to end, then scaled
        if ids is not None:  # a unit's codebook id offsets its indices
            codes = codes + ids.astype(mx.uint32) * books.shape[-1]
        rows, per_row = books.shape[0], books.shape[-2] * books.shape[-1]
        if rows > 1:  # and its row's: row b's codebooks follow the earlier rows'
            codes = codes + (mx.arange(rows, dtype=mx.uint32) * per_row).reshape(rows, 1, 1, 1, 1)
        x = mx.take(books.reshape(-1), codes) * ranges[..., None] + offsets[..., None]
    if how.outliers:
        pos, val = extra.pop(0), extra.pop(0)
        if how.channel:  # a group's (channel * g + token) -> channel * n + token
            pos = pos.astype(mx.int32)
            index = (pos // g) * n + extra.pop(0) + pos % g
            x = mx.put_along_axis(x.reshape(*lead, d * n), index.reshape(*lead, -1),
                                  val.reshape(*lead, -1).astype(x.dtype), axis=-1)
        else:
            x = mx.put_along_axis(x.reshape(flat), pos.astype(mx.int32), val.astype(x.dtype), axis=-1)
    return _rotated(how, x, flat, extra)


@functools.lru_cache(maxsize=1)
def _rotation(rotary, dims: int, start: int, n: int, traditional: bool):
    """cos and (-sin, sin) of positions start.. in the shapes ``_dense_graph`` reads: built
    once per run length (shared by every layer) and evaluated with the step that first
    reads them."""
    cos, sin = rotary_angles(rotary, dims, start, n)  # (D/2, n)
    if traditional:
        return cos[:, None], mx.stack([-sin, sin], axis=1)  # (D/2, 1, n), (D/2, 2, n)
    return cos, mx.stack([-sin, sin])  # (D/2, n), (2, D/2, n)


@functools.lru_cache(maxsize=None)
def _read_fn(how: _Read, product: bool):
    """The reconstruction as one compiled pass (``product``: ``left @`` it, in the same
    pass): the layers of a step, of equal shapes, replay one traced graph."""
    graph = _dense_graph if how.tile is None else _tile_graph
    if product:
        return mx.compile(lambda left, *args: token_mix(left, graph(how, *args)))
    return mx.compile(lambda *args: graph(how, *args))


@dataclass(frozen=True)
class NonUniformScores:
    """A ``NonUniformTokens`` run as the pure-MLX decode path reads it (``PackedScores``)."""

    tokens: NonUniformTokens
    count: int

    @property
    def n_heads(self) -> int:
        return self.tokens.codes.buffer.shape[1]

    def scores(self, q: mx.array) -> mx.array:
        """float32 ``q K^T`` (B, H, R, count) over per-channel keys."""
        fn, args, capacity = self.tokens.read_pass()
        scores = fn(q, *args)
        return scores if capacity == self.count else scores[..., : self.count]

    def mix(self, p: mx.array) -> mx.array:
        """float32 ``p V`` (B, H, R, D) over per-token values (p padded to the capacity)."""
        fn, args, capacity = self.tokens.read_pass()
        room = capacity - self.count
        if room:
            p = mx.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, room)])
        return fn(p, *args)
