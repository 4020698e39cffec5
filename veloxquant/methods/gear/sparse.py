"""A sparse residual table: a few entries per vector kept exactly, beside a dense codec.

Vectors run along one axis of a (B, H, T, D) run of tokens: "token" (a token's D channels;
the entries are indexed by channel, uint8 up to 256 channels) or "channel" (one channel's
tokens; the entries are indexed by token position in the run, int32). For each vector the
table keeps ``delta`` (what the dense codec misses at that entry, in the model dtype) and
its index, so that dense + table is exact there:

- "token": ``delta``/``index`` (B, H, T, k), growing along the tokens;
- "channel": ``delta``/``index`` (B, H, D, K), growing along the last axis (a block of n
  tokens adds its k entries per channel; K is their sum over blocks).

``outliers.tail_indices`` picks a vector's k largest and k smallest entries (GEAR's outliers).
``SparseTerm`` adds the table to decode scores (``q Kᵀ``) and mixes (``p V``) from its
few entries: the queries (probabilities) at the entries' own rows (broadcast; a gather
where a read crosses the table's orientation), a product, and one scatter-add into the
scores (output), O(entries), no dense matrix.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from ...cache.buffers import GrowingArray


def channel_index_dtype(head_dim: int):
    return mx.uint8 if head_dim <= 256 else mx.uint16


class SparseTable:
    def __init__(self, orientation: str, step: int):
        if orientation not in ("token", "channel"):
            raise ValueError(f"orientation={orientation!r}: allowed 'token' or 'channel'")
        self.orientation = orientation
        axis = 2 if orientation == "token" else -1
        self.delta = GrowingArray(axis=axis, step=step)
        self.index = GrowingArray(axis=axis, step=step)

    @property
    def entries(self) -> int:
        """Entries per vector ("token") or per channel summed over blocks ("channel")."""
        view = self.delta.view()
        return 0 if view is None else view.shape[-1]

    def append(self, delta: mx.array, index: mx.array) -> None:
        """"token": (B, H, n, k) and channel indices (``channel_index_dtype``); "channel":
        (B, H, D, k) and token positions in the run (int32)."""
        self.delta.append(delta)
        self.index.append(index)

    def term(self, head_dim: int, count: int) -> "SparseTerm":
        """What decode reads for a run of ``count`` tokens of ``head_dim`` channels: the
        whole buffers (their room zeros: no entry, or one adding zero at token 0)."""
        return SparseTerm(self.orientation, self.delta.buffer, self.index.buffer, head_dim, count)

    def arrays(self, prefix: str) -> dict[str, GrowingArray]:
        return {f"{prefix}_sp_delta": self.delta, f"{prefix}_sp_index": self.index}

    def problems(self, head_dim: int, count: int):
        """(field, found, expected) where the table contradicts its run of ``count`` tokens."""
        delta, index = self.delta.view(), self.index.view()
        if delta is None and index is None:
            return
        rows = count if self.orientation == "token" else head_dim
        bound = head_dim if self.orientation == "token" else count
        if delta is None or index is None or delta.shape != index.shape:
            yield "sparse table (values, indices)", (None if delta is None else delta.shape,
                                                      None if index is None else index.shape), "equal shapes"
        elif delta.shape[2] != rows:
            yield f"sparse table rows ({self.orientation}s)", delta.shape[2], rows
        elif delta.size and int(index.max()) >= bound:
            yield "sparse table index", int(index.max()), f"below {bound}"


@functools.lru_cache(maxsize=16)
def row_offsets(b: int, h: int, r: int, n: int) -> mx.array:
    """(R, B, H, 1, 1) int32: where each (batch row, head, query row) of a (B, H, R, n)
    array starts, flattened, the query rows leading (a constant, computed with the first
    step that reads it)."""
    rows = mx.arange(b * h * r, dtype=mx.int32).reshape(b, h, r) * n
    return rows.transpose(2, 0, 1)[..., None, None]


def along_rows(out: mx.array, x: mx.array, delta: mx.array, index: mx.array, offsets: mx.array) -> mx.array:
    """``out`` (B, H, R, n) float32 plus ``x[r, row] * delta[row, j]`` at ``index[row, j]``,
    for ``x`` (B, H, R, rows) read along the table's own rows (a broadcast, no gather):
    one scatter-add into ``out`` flattened, ``offsets`` its ``row_offsets``. The entries
    run (R, B, H, rows, k): the table broadcasts against the query rows as it is."""
    where = offsets + index.astype(mx.int32)  # (R, B, H, rows, k)
    contrib = x.transpose(2, 0, 1, 3)[..., None] * delta.astype(mx.float32)
    return out.reshape(-1).at[where].add(contrib).reshape(out.shape)


@dataclass(frozen=True)
class SparseTerm:
    """The table as decode reads it: ``delta``/``index`` the whole buffers of a run of
    ``count`` tokens of ``head_dim`` channels (rows or entries past the valid ones zeros)."""

    orientation: str
    delta: mx.array
    index: mx.array
    head_dim: int
    count: int

    def _flat(self):
        """Each entry's token and channel (B, H, N) int32, and its value (B, H, N, 1) (rows
        of tokens past ``count``, a buffer's room, left out)."""
        delta, index = self.delta, self.index
        if self.orientation == "token" and delta.shape[2] > self.count:
            delta, index = delta[:, :, : self.count], index[:, :, : self.count]
        b, h, rows, k = delta.shape
        own = mx.broadcast_to(mx.arange(rows, dtype=mx.int32)[:, None], (b, h, rows, k))
        other = index.astype(mx.int32)
        token, channel = (own, other) if self.orientation == "token" else (other, own)
        flat = lambda x: x.reshape(b, h, rows * k)  # noqa: E731
        return flat(token), flat(channel), flat(delta.astype(mx.float32))[..., None]

    @staticmethod
    def _rows(x: mx.array, where: mx.array) -> mx.array:
        """(B, H, N, R): ``x`` (B, H, R, n) at positions ``where`` (B, H, N) of its last axis."""
        return mx.take_along_axis(x.swapaxes(-1, -2), where[..., None], axis=2)

    @staticmethod
    def _scatter(where: mx.array, rows: mx.array, n: int) -> mx.array:
        """(B, H, R, n): ``rows`` (B, H, N, R) summed at positions ``where`` (B, H, N), one
        flat scatter of whole rows (MLX's CPU scatter is fastest this way)."""
        b, h, _, r = rows.shape
        flat = (mx.arange(b * h, dtype=mx.int32).reshape(b, h, 1) * n + where).reshape(-1)
        out = mx.zeros((b * h * n, r), mx.float32).at[flat].add(rows.reshape(-1, r))
        return out.reshape(b, h, n, r).swapaxes(-1, -2)

    def inputs(self) -> tuple:
        return self.delta, self.index

    def _along_rows(self, x: mx.array, n: int) -> mx.array:
        b, h, r = x.shape[:3]
        rows = self.delta.shape[2]
        x = x if x.shape[-1] == rows else mx.pad(x, [(0, 0)] * 3 + [(0, rows - x.shape[-1])])
        out = along_rows(mx.zeros((b, h, r, n), mx.float32), x, self.delta, self.index, row_offsets(b, h, r, n))
        return out

    def scores(self, q: mx.array) -> mx.array:
        """(B, H, R, count) float32: ``s[r, token] += q[r, channel] * delta``."""
        if self.orientation == "channel":  # a channel's entries: q broadcasts along them
            return self._along_rows(q, self.count)
        token, channel, delta = self._flat()
        return self._scatter(token, self._rows(q, channel) * delta, self.count)

    def mix(self, p: mx.array) -> mx.array:
        """(B, H, R, head_dim) float32: ``o[r, channel] += p[r, token] * delta``."""
        if self.orientation == "token":  # a token's entries: p broadcasts along them
            return self._along_rows(p, self.head_dim)
        token, channel, delta = self._flat()
        return self._scatter(channel, self._rows(p, token) * delta, self.head_dim)

    def dense(self) -> mx.array:
        """The table as a dense (B, H, count, head_dim) float32 matrix (transient: prefill
        chunks and tests)."""
        token, channel, delta = self._flat()
        b, h, d = delta.shape[0], delta.shape[1], self.head_dim
        return self._scatter(token * d + channel, delta, self.count * d).reshape(b, h, self.count, d)
