"""Where an eviction cache keeps its tokens: slots, and the position each slot holds.

Every kept token occupies one slot along axis 2 of a few arrays that move together: its
key, its value, its position and whatever per-token state the method keeps (H2O's
accumulated attention). A token evicted at a decode step leaves its slot *free*: the
next token is written there, so eviction costs one row per array, never a copy of the
cache. Slots are therefore not in token order once one was reused; ``positions`` says
which token is where. A multi-token write fills the free slot with its first token and
appends the rest, so the chunk's causal mask (lower-right aligned) stays right: the
first token of a chunk is visible to every query of the chunk.
"""

from __future__ import annotations

import mlx.core as mx

from ..cache.buffers import GrowingArray, take_rows


class SlotStore:
    """Named arrays of shape (B, H, slots, ...) that share one slot axis."""

    def __init__(self, names: tuple[str, ...], step: int = 256):
        self.names = names
        # room follows what is kept (``geometric``): a short prompt holds no 256-slot step
        self.arrays = {name: GrowingArray(axis=2, step=step, geometric=True) for name in names}
        self.free: mx.array | None = None  # (B, H) int32: the slot the next token takes

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

    def write(self, new: dict[str, mx.array]) -> None:
        """Store new tokens (each array (B, H, N, ...)): the free slot first, then appended."""
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
                grown.append(new[name])

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
        self.free = None

    def truncate(self, rows: int) -> None:
        """Drop the last slots (only meaningful while slots are in token order)."""
        for grown in self.arrays.values():
            grown.truncate(rows)

    def restore(self, arrays: dict[str, mx.array | None], free: mx.array | None) -> None:
        for name, grown in self.arrays.items():
            grown.reset(arrays.get(name))
        self.free = free
