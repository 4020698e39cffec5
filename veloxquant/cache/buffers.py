"""Arrays that grow along one axis in steps, so that appending a token is not a copy."""

from __future__ import annotations

import functools

import mlx.core as mx


@functools.lru_cache(maxsize=16)
def row_indices(n: int) -> mx.array:
    """``arange(n)`` int32, built once per size: a compiled decode pass's row positions over
    a buffer's room (it changes only when the buffer grows), evaluated with the step that
    first reads it."""
    return mx.arange(n, dtype=mx.int32)


@functools.lru_cache(maxsize=16)
def row_starts(b: int, h: int, rows: int) -> mx.array:
    """(B, H, 1) int32: where each sequence's and head's rows start once a (B, H, rows, ...)
    buffer is flattened to (B H rows, ...) (built once per shape)."""
    return (mx.arange(b * h, dtype=mx.int32) * rows).reshape(b, h, 1)


def take_rows(x: mx.array, index: mx.array) -> mx.array:
    """``x[b, h, index[b, h, k], ...]``: (B, H, K, ...) from ``x`` (B, H, T, ...) and ``index``
    (B, H, K), either broadcast. For a batch (or 2^31 elements and more), a take of the
    flattened rows, one index a row: MLX's CUDA ``take_along_axis`` with the index broadcast
    over the row reads an index an element; on the H200 it ran 3.1x slower at 8 x 8 x 8k x 128
    and 7.6x at 32 x 8 x 32k x 128, and gave wrong rows at 2^31 elements
    (benchmarks/results/h200_s57). One sequence keeps ``take_along_axis``: there the two ran
    within 1.07-1.32x of each other, and the flat index costs a decode step's graph 2-3 nodes a
    buffer."""
    if x.shape[0] == 1 and index.shape[0] == 1 and x.size < 2**31:
        return mx.take_along_axis(x, index.reshape(*index.shape, *(1,) * (x.ndim - 3)), axis=2)
    if index.dtype != mx.int32:  # argpartition's uint32 would promote the flat index to int64
        index = index.astype(mx.int32)
    return mx.take(x.reshape(-1, *x.shape[3:]), index + row_starts(*x.shape[:3]), axis=0)


def fitted_rows(x: mx.array, n: int, axis: int) -> mx.array:
    """``x`` cut or zero-padded to ``n`` rows along ``axis`` (a no-op where it has them)."""
    have = x.shape[axis]
    if have > n:
        return x[(slice(None),) * axis + (slice(0, n),)]
    if have < n:
        return mx.pad(x, [(0, 0)] * axis + [(0, n - have)] + [(0, 0)] * (x.ndim - axis - 1))
    return x


def _along(axis: int, start: int, stop: int):
    """Index that slices ``[start:stop]`` along ``axis`` (2 = tokens, -1 = last)."""
    if axis < 0:
        return (..., slice(start, stop))
    return (slice(None),) * axis + (slice(start, stop),)


def added_room(length: int, n: int, step: int, limit: int | None, geometric: bool = False) -> int:
    """Rows ``GrowingArray.append`` adds when ``n`` rows do not fit after ``length``."""
    if geometric:
        step = max(1, min(step, -(-(length + n) // 2)))
    room = (n + step - 1) // step * step
    if limit is not None and length + n <= limit:
        room = min(room, limit - length)
    return room


def arrays_written(kept: dict) -> list:
    """The arrays among ``kept`` (a store's or cache's arrays by name; growing buffers
    as their buffers). A prompt chunk's output that depends on them makes the chunk's
    storing run with its layer, not when the state is evaluated after the whole model:
    until then the arrays it reads (the chunk's queries, a decoded history) stay alive in
    every layer at once."""
    values = (x.buffer if isinstance(x, GrowingArray) else x for x in kept.values())
    return [x for x in values if isinstance(x, mx.array)]


class GrowingArray:
    """Rows appended along ``axis`` into a buffer grown ``step`` rows at a time.

    The same policy as mlx-lm's ``KVCache``: when full, keep the valid rows and add
    ``step``-aligned room. ``nbytes`` counts the whole buffer, spare room included: it is
    what is kept.

    ``geometric``: the step follows the content, ``min(step, ceil(rows / 2))`` for ``rows``
    held after the append, so a short prompt does not pay a whole ``step``: a 20-row prompt
    is stored exactly, its first decode row adds 11. After a growth the buffer holds fewer
    than ``1.5 * rows`` rows (``rows + step`` once the content passes ``2 * step``), and
    growths stay geometric, so appending a row is still amortised constant work. For
    arrays whose axis counts rows only: packed words and their scales grow by steps that
    must stay aligned with each other.
    """

    def __init__(self, axis: int = 2, step: int = 256, limit: int | None = None,
                 geometric: bool = False):
        self.axis = axis
        self.step = step
        self.limit = limit  # rows the content never outgrows in steady state: room stops there
        self.geometric = geometric
        self.buffer: mx.array | None = None
        self.length = 0
        self.emptied: mx.array | None = None  # no rows, the shape and dtype of rows reset to none

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.shape[self.axis]

    def append(self, rows: mx.array) -> None:
        n, length, buffer = rows.shape[self.axis], self.length, self.buffer
        if length and length + n <= buffer.shape[self.axis]:  # a decode step's row: room is there
            buffer[_along(self.axis, length, length + n)] = rows
            self.length = length + n
            return
        if self.length + n > self.capacity:
            shape = list(rows.shape)
            shape[self.axis] = added_room(self.length, n, self.step, self.limit, self.geometric)
            room = mx.zeros(shape, rows.dtype)
            if self.buffer is None:
                self.buffer = room
            else:
                kept = self.buffer[_along(self.axis, 0, self.length)]
                self.buffer = mx.concatenate([kept, room], axis=self.axis)
        if self.length == 0 and n == self.capacity:
            # A write over the whole buffer returns the rows' own storage: rows sliced from a
            # larger chunk would keep all of that chunk alive. A copy holds only the rows.
            self.buffer = mx.contiguous(rows)
            self.length = n
            return
        self.buffer[_along(self.axis, self.length, self.length + n)] = rows
        self.length += n

    def view(self) -> mx.array | None:
        """The valid rows (the buffer itself when it is exactly full)."""
        if self.buffer is None or self.length == self.capacity:
            return self.buffer
        return self.buffer[_along(self.axis, 0, self.length)]

    def reset(self, rows: mx.array | None) -> None:
        """Replace the content by ``rows`` (exactly sized: no spare room)."""
        self.emptied = None
        if rows is not None and rows.shape[self.axis] == 0:
            # an empty slice still holds the storage of the array it was cut from: only its
            # shape is kept, for the room a saved buffer emptied in place gets back
            self.emptied, rows = mx.zeros(rows.shape, rows.dtype), None
        self.buffer = rows
        self.length = 0 if rows is None else rows.shape[self.axis]

    def restore_room(self, room: int | None) -> None:
        """Zero rows after the content up to ``room``: the rows a saved buffer had room for
        (an emptied one's too, ``truncate(0)``: saved as no rows). A reader over a whole buffer
        (capacity-fixed shapes) then sums over the shapes it summed over before the save, and
        the cache keeps the bytes it kept, so a loaded cache continues bit for bit. A room more
        than a step beyond the content is not one growth leaves: ignored."""
        if self.buffer is None and self.emptied is not None and room is not None and 0 < room <= self.step:
            shape = list(self.emptied.shape)
            shape[self.axis % len(shape)] = room
            self.buffer = mx.zeros(shape, self.emptied.dtype)
            return
        if self.buffer is None or room is None or not 0 < room - self.capacity <= self.step:
            return
        pad = [(0, 0)] * self.buffer.ndim
        pad[self.axis % self.buffer.ndim] = (0, room - self.capacity)
        self.buffer = mx.pad(self.buffer, pad)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.nbytes


class RecentRows(GrowingArray):
    """The newest rows of a sliding window, written in place: rows join at the end and
    leave from the front (``pop_front``) without a copy; the rows are moved to the front of
    the buffer only when a new row would not fit. ``view`` is the rows held."""

    def __init__(self, axis: int = 2, step: int = 256, limit: int | None = None,
                 geometric: bool = False):
        super().__init__(axis, step, limit, geometric)
        self.start = 0

    @property
    def held(self) -> int:
        return self.length - self.start

    def append(self, rows: mx.array) -> None:
        if self.start and self.length + rows.shape[self.axis] > self.capacity:
            self.compact()
        super().append(rows)

    def compact(self) -> None:
        """Move the rows held to the front of the buffer (one copy of the window)."""
        if self.start:
            held = self.held
            if held:
                self.buffer[_along(self.axis, 0, held)] = self.buffer[_along(self.axis, self.start, self.length)]
            self.start, self.length = 0, held

    def pop_front(self, n: int) -> mx.array:
        """The ``n`` oldest rows, which leave the window."""
        rows = self.buffer[_along(self.axis, self.start, self.start + n)]
        self.start += n
        return rows

    def view(self) -> mx.array | None:
        if self.buffer is None or not self.held:
            return None
        if self.start == 0:
            return super().view()
        return self.buffer[_along(self.axis, self.start, self.length)]

    def reset(self, rows: mx.array | None) -> None:
        self.start = 0
        super().reset(rows)

    def truncate(self, length: int) -> None:
        super().truncate(self.start + length)
