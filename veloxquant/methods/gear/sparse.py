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
        """What decode reads for a run of ``count`` tokens of ``head_dim`` channels."""
        return SparseTerm(self.orientation, self.delta.view(), self.index.view(), head_dim, count)

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


@functools.lru_cache(maxsize=8)
def _heads(n: int) -> mx.array:
    """(n, 1) int32 0..n-1: the first index of a scatter over (batch row x head, position)
    (a constant, computed with the first step that reads it)."""
    return mx.arange(n, dtype=mx.int32)[:, None]


@dataclass(frozen=True)
class SparseTerm:
    """The table as decode reads it: ``delta``/``index`` valid entries of a run of ``count``
    tokens of ``head_dim`` channels."""

    orientation: str
    delta: mx.array
    index: mx.array
    head_dim: int
    count: int

    def _flat(self):
        """Each entry's token and channel (B, H, N) int32, and its value (B, H, N, 1)."""
        b, h, rows, k = self.delta.shape
        own = mx.broadcast_to(mx.arange(rows, dtype=mx.int32)[:, None], (b, h, rows, k))
        other = self.index.astype(mx.int32)
        token, channel = (own, other) if self.orientation == "token" else (other, own)
        flat = lambda x: x.reshape(b, h, rows * k)  # noqa: E731
        return flat(token), flat(channel), flat(self.delta.astype(mx.float32))[..., None]

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

    def _along_rows(self, x: mx.array, where: mx.array, n: int) -> mx.array:
        """(B, H, R, n): ``x[r, row] * delta[row, j]`` summed at ``where[row, j]``, for ``x``
        (B, H, R, rows) read along the table's own rows (no gather: a broadcast), one
        scatter of whole query rows indexed by (batch row and head, position)."""
        b, h, rows, k = self.delta.shape
        r = x.shape[2]
        contrib = self.delta.astype(mx.float32)[..., None] * x.swapaxes(-1, -2)[:, :, :, None, :]
        out = mx.zeros((b * h, n, r), mx.float32).at[_heads(b * h), where.reshape(b * h, rows * k)].add(
            contrib.reshape(b * h, rows * k, r))
        return out.reshape(b, h, n, r).swapaxes(-1, -2)

    def scores(self, q: mx.array) -> mx.array:
        """(B, H, R, count) float32: ``s[r, token] += q[r, channel] * delta``."""
        if self.orientation == "channel":  # a channel's entries: q broadcasts along them
            return self._along_rows(q, self.index, self.count)
        token, channel, delta = self._flat()
        return self._scatter(token, self._rows(q, channel) * delta, self.count)

    def mix(self, p: mx.array) -> mx.array:
        """(B, H, R, head_dim) float32: ``o[r, channel] += p[r, token] * delta``."""
        if self.orientation == "token":  # a token's entries: p broadcasts along them
            return self._along_rows(p, self.index, self.head_dim)
        token, channel, delta = self._flat()
        return self._scatter(channel, self._rows(p, token) * delta, self.head_dim)

    def dense(self) -> mx.array:
        """The table as a dense (B, H, count, head_dim) float32 matrix (transient: prefill
        chunks and tests)."""
        token, channel, delta = self._flat()
        b, h, d = delta.shape[0], delta.shape[1], self.head_dim
        return self._scatter(token * d + channel, delta, self.count * d).reshape(b, h, self.count, d)
