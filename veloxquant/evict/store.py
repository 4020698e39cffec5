"""Where an eviction cache keeps its tokens: slots, and the position each slot holds.

Every kept token occupies one slot along axis 2 of a few arrays that move together: its
key, its value, its position and whatever per-token state the method keeps (H2O's
accumulated attention). A token evicted at a decode step leaves its slot *free*: the
next token is written there, so eviction costs one row per array, never a copy of the
cache. Slots are therefore not in token order once one was reused; ``positions`` says
which token is where. A multi-token write fills the free slot with its first token and
appends the rest, so the chunk's causal mask (lower-right aligned) stays right: the
first token of a chunk is visible to every query of the chunk.

A token appended after the last slot has the next position, so the room past the last slot
is given the positions its rows will hold when room is made: a decode step that appends
writes its key and value and no position (a slice write less a layer and step; a write
into a free slot, an eviction or a restore drops what was written ahead).
"""

from __future__ import annotations

import mlx.core as mx

from ..cache.buffers import GrowingArray, added_room, take_rows


def consecutive_positions(b: int, h: int, first: int, n: int) -> mx.array:
    """Positions ``first .. first + n - 1`` for every sequence and head: (B, H, n) int32."""
    if n == 1:  # made on the host: a constant, no graph node
        return mx.array([[[first]] * h] * b, mx.int32)
    return mx.broadcast_to(mx.arange(first, first + n, dtype=mx.int32), (b, h, n))


def _advanced(first, n: int):
    return tuple(f + n for f in first) if isinstance(first, tuple) else first + n


class _Ahead:
    """Which positions a store wrote past its last slot: the positions buffer they are in,
    the first such slot and its position. No ``__dict__`` (a stacked batch does not walk
    it); a copy of the store starts without it."""

    __slots__ = ("buffer", "slot", "position")

    def __init__(self, buffer=None, slot: int = 0, position: int = 0):
        self.buffer, self.slot, self.position = buffer, slot, position

    def __deepcopy__(self, memo):
        return _Ahead()


class SlotStore:
    """Named arrays of shape (B, H, slots, ...) that share one slot axis."""

    def __init__(self, names: tuple[str, ...], step: int = 256):
        self.names = names
        # room follows what is kept (``geometric``): a short prompt holds no 256-slot step
        self.arrays = {name: GrowingArray(axis=2, step=step, geometric=True) for name in names}
        self.free: mx.array | None = None  # (B, H) int32: the slot the next token takes
        self.ahead = _Ahead()

    @property
    def rows(self) -> int:
        """Slots in use, the free one included (what attention is handed)."""
        return self.arrays[self.names[0]].length

    @property
    def kept(self) -> int:
        """Tokens kept per sequence and head (the free slot's token was evicted)."""
        return self.rows - (self.free is not None)

    def view(self, name: str) -> mx.array | None:
        return self.arrays[name].view()

    def grown(self, name: str) -> GrowingArray:
        """The ``GrowingArray`` of one stored array, to write its buffer in place."""
        return self.arrays[name]

    def buffers(self) -> list[mx.array]:
        """Every array's buffer (what a step wrote, for its output to depend on)."""
        return [g.buffer for g in self.arrays.values() if g.buffer is not None]

    def write(self, new: dict[str, mx.array], first_position: int | None = None) -> None:
        """Store new tokens (each array (B, H, N, ...)): the free slot first, then appended.
        ``first_position``: the tokens are at consecutive positions from it, and their
        ``positions`` (absent from ``new``) are made here; appended, they are written with
        the room's positions ahead of them, or not at all where the room holds them already."""
        first = new[self.names[0]]
        b, h, n = first.shape[:3]
        ahead = "positions" not in new and self.free is None
        if "positions" not in new and not ahead:
            new = {**new, "positions": consecutive_positions(b, h, first_position, n)}
        if self.free is not None:
            slot, index = self.free[:, :, None], {}  # one index per rank, shared by the arrays
            for name, grown in self.arrays.items():
                rows = new[name]
                row = rows if rows.shape[2] == 1 else rows[:, :, :1]  # a decode token: no slice
                if row.ndim not in index:
                    index[row.ndim] = slot.reshape(*slot.shape, *(1,) * (row.ndim - 3))
                grown.buffer = mx.put_along_axis(grown.buffer, index[row.ndim], row, axis=2)
            self.free = None
            new = {name: rows[:, :, 1:] for name, rows in new.items()}
        if new[self.names[0]].shape[2]:
            for name, grown in self.arrays.items():
                if name == "positions" and ahead:
                    self.append_positions(b, h, first_position, n)
                else:
                    grown.append(new[name])

    def append_positions(self, b: int, h: int, first, n: int) -> None:
        """Append the positions ``first .. first + n - 1`` (``first`` an int, or one int a
        sequence); the room after them gets the positions the next tokens will have, unless
        it holds them already (then nothing is written)."""
        grown, held = self.arrays["positions"], self.ahead
        if (held.buffer is not None and held.buffer is grown.buffer and held.slot == grown.length
                and held.position == first and grown.length + n <= grown.capacity):
            grown.length += n
            held.slot, held.position = grown.length, _advanced(first, n)
            return
        length = grown.length
        grows = length + n > grown.capacity
        room = added_room(length, n, grown.step, grown.limit, grown.geometric) if grows else grown.capacity - length
        start = mx.array(first, mx.int32).reshape(-1, 1, 1) if isinstance(first, tuple) else first
        rows = mx.broadcast_to(start + mx.arange(room, dtype=mx.int32), (b, h, room))
        if not grows:
            grown.buffer[:, :, length:] = rows
        elif grown.buffer is None or not length:  # the room GrowingArray.append would add
            grown.buffer = mx.contiguous(rows)
        else:
            grown.buffer = mx.concatenate([grown.buffer[:, :, :length], rows], axis=2)
        grown.length = length + n
        self.ahead = _Ahead(grown.buffer, grown.length, _advanced(first, n))

    def set_limit(self, rows: int) -> None:
        """Stop adding room beyond ``rows`` slots (a budget plus the slot a decode step needs)."""
        for grown in self.arrays.values():
            grown.limit = rows

    def update(self, name: str, values: mx.array) -> None:
        """Replace one array's content (B, H, rows, ...) in place, e.g. a running score."""
        grown = self.arrays[name]
        grown.buffer[:, :, : grown.length] = values

    def evict_one(self, slot: mx.array) -> None:
        """Free ``slot`` (B, H): its token is gone; the next token takes its place."""
        self.free = slot.astype(mx.int32)

    def keep(self, slots: mx.array, spare: int = 0) -> None:
        """Keep only ``slots`` (B, H, K), in that order, with room for ``spare`` more rows."""
        if spare:  # gather the spare rows too (from slot 0: never read), one copy in all
            slots = mx.concatenate([slots, mx.zeros((*slots.shape[:2], spare), slots.dtype)], -1)
        for grown in self.arrays.values():
            grown.buffer = take_rows(grown.buffer, slots)
            grown.length = slots.shape[2] - spare
        self.free, self.ahead = None, _Ahead()

    def truncate(self, rows: int) -> None:
        """Drop the last slots (only meaningful while slots are in token order)."""
        for grown in self.arrays.values():
            grown.truncate(rows)
        self.ahead = _Ahead()

    def restore(self, arrays: dict[str, mx.array | None], free: mx.array | None) -> None:
        for name, grown in self.arrays.items():
            grown.reset(arrays.get(name))
        self.free, self.ahead = free, _Ahead()
