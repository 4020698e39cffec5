"""Two layers' rows merged into one direction each (SLERP), and the reader of merged rows.

``slerp_merge(x1, x2, t, threshold)`` merges, per token and KV head, the rows of two
layers ``x1``, ``x2`` (B, H, n, d): magnitudes ``m_i = |x_i|``, unit directions ``u_i``,
angle ``W = arccos(clip(u1·u2))`` and the direction
``e = sin((1-t)W)/sin W u1 + sin(tW)/sin W u2`` (normalised linear interpolation below
``W < 1e-6``). A pair whose cosine is below ``threshold`` is *retained*: not merged, both
originals kept. Its slot of ``e`` holds the first layer's own direction (so the first
layer reads every token the same way, ``m1 * e``) and the second layer keeps the
difference ``x2 - m2 * e`` for it, with its (row, token) index, added back when read.
Antipodal pairs (sin W ~ 0 with cos W < 0) are always retained: their merge is undefined.

``MergedRows`` is a ``PackedScores`` (``kernels/decode.py``) over the first ``count``
tokens of ``e`` (B, H, T, d) with one layer's magnitudes ``m`` (B, H, T) and, for the
second layer, the retained differences: scores ``m_t (q·e_t)`` plus ``q·delta`` at the
retained tokens, mixes ``Σ p_t m_t e_t`` plus ``Σ p_j delta_j``, read in place (the merged
history is never rebuilt at a decode step; ``dense`` rebuilds it for prompt chunks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

SMALL_ANGLE = 1e-6  # below: normalised linear interpolation (sin W ~ W ~ 0)


def _unit(x):
    m = mx.sqrt((x * x).sum(axis=-1))
    return x / mx.maximum(m, 1e-30)[..., None], m


def norms(x: mx.array) -> mx.array:
    """Row magnitudes (B, H, n) in ``x``'s dtype."""
    return _unit(x.astype(mx.float32))[1].astype(x.dtype)


def slerp_merge(x1: mx.array, x2: mx.array, t: float, threshold: float):
    """(e (B, H, n, d), m2 (B, H, n), retained bool (B, H, n), delta (B, H, n, d):
    ``x2 - m2 e`` where retained, against the stored (dtype-rounded) e and m2), e, m2
    and delta in ``x2``'s dtype. Compiled: a decode step merges one token a pair, and its
    few dozen elementwise operations fuse into a handful."""
    return _compiled_merge(float(t), float(threshold))(x1, x2)


@functools.lru_cache(maxsize=None)
def _compiled_merge(t: float, threshold: float):
    return mx.compile(functools.partial(_slerp_merge, t=t, threshold=threshold))


def _slerp_merge(x1: mx.array, x2: mx.array, t: float, threshold: float):
    # per-row quantities kept as (..., 1) columns (keepdims): no squeeze and re-expand nodes
    def unit(x):
        m = mx.sqrt((x * x).sum(axis=-1, keepdims=True))
        return x / mx.maximum(m, 1e-30), m

    u1, _ = unit(x1.astype(mx.float32))
    u2, m2 = unit(x2.astype(mx.float32))
    cos = mx.clip((u1 * u2).sum(axis=-1, keepdims=True), -1.0, 1.0)
    omega = mx.arccos(cos)
    sin = mx.sin(omega)
    small = omega < SMALL_ANGLE
    safe = mx.where(small, 1.0, sin)
    w1 = mx.where(small, 1.0 - t, mx.sin((1.0 - t) * omega) / safe)
    w2 = mx.where(small, t, mx.sin(t * omega) / safe)
    e, _ = unit(w1 * u1 + w2 * u2)
    retained = (cos < threshold) | ((sin < SMALL_ANGLE) & (cos < 0))
    e = mx.where(retained, u1, e).astype(x2.dtype)
    m2 = m2.astype(x2.dtype)
    delta = x2.astype(mx.float32) - m2.astype(mx.float32) * e.astype(mx.float32)
    return e, m2[..., 0], retained[..., 0], delta.astype(x2.dtype)


def retained_entries(retained: mx.array, delta: mx.array, start: int):
    """The retained (row = b*H + h, token) pairs of a prompt chunk starting at token
    ``start``, as int32 (n, 2), and their differences (n, d); None when there are none.
    (A prompt chunk's table is sized by the data: read on the host, once a chunk; a
    decode step writes into reserved rows instead, ``write_retained``.)"""
    b, h, n = retained.shape
    flat = np.flatnonzero(np.array(retained.reshape(-1)))
    if not flat.size:
        return None, None
    idx = mx.array(flat.astype(np.int32))
    where = mx.stack([idx // n, start + idx % n], axis=1).astype(mx.int32)
    return where, delta.reshape(b * h * n, -1)[idx]


def write_retained(where: mx.array, table: mx.array, used: mx.array, reserved: int,
                   retained: mx.array, delta: mx.array, start: int):
    """A decode token's retained pairs written into the table's reserved rows, on the
    device: the k-th retained pair of the token goes to row ``used + k`` if that is below
    ``reserved``, else it is dropped (merged after all). Rows past ``used`` hold zeros
    (row 0, token 0, a zero difference), which add nothing where read. Returns the new
    (where, table, used, dropped this step)."""
    b, h, _ = retained.shape
    flag = retained.reshape(-1)
    pos = used + mx.cumsum(flag.astype(mx.int32)) - 1
    fits = flag & (pos < reserved)
    target = mx.where(fits, pos, 0)
    keep = fits.astype(mx.int32)[:, None]
    rows = mx.stack([mx.arange(b * h, dtype=mx.int32), mx.full((b * h,), start, mx.int32)], axis=1) * keep
    where = where.at[target].add(rows)
    table = table.at[target].add(delta.reshape(b * h, -1) * keep.astype(delta.dtype))
    return where, table, used + keep.sum(), (flag & ~fits).astype(mx.int32).sum()


@dataclass(frozen=True)
class MergedRows:
    e: mx.array  # (B, H, >= count, d) merged directions (whole buffer)
    m: mx.array  # (B, H, >= count) this layer's magnitudes
    count: int
    where: mx.array | None = None  # (n, 2) int32: (b*H + h, token) of retained pairs
    delta: mx.array | None = None  # (n, d): this layer's x - m e there

    @property
    def n_heads(self) -> int:
        return self.e.shape[1]

    def _flat(self, x: mx.array) -> tuple[mx.array, tuple]:
        """(B, H, R, count) -> (B*H*count, R) and the transposed shape to go back."""
        b, h, r, t = x.shape
        return x.transpose(0, 1, 3, 2).reshape(b * h * t, r), (b, h, t, r)

    def _index(self) -> mx.array:
        return self.where[:, 0] * self.count + self.where[:, 1]

    def scores(self, q: mx.array) -> mx.array:
        e = self.e[:, :, : self.count].astype(mx.float32)
        s = (q @ e.swapaxes(-1, -2)) * self.m[:, :, None, : self.count].astype(mx.float32)
        if self.where is None:
            return s
        b, h, r, d = q.shape
        q_rows = q.reshape(b * h, r, d)[self.where[:, 0]]  # (n, R, d)
        extra = (q_rows @ self.delta.astype(mx.float32)[:, :, None])[..., 0]  # (n, R)
        flat, shape = self._flat(s)
        flat = flat.at[self._index()].add(extra)
        return flat.reshape(shape).transpose(0, 1, 3, 2)

    def mix(self, p: mx.array) -> mx.array:
        e = self.e[:, :, : self.count].astype(mx.float32)
        o = (p * self.m[:, :, None, : self.count].astype(mx.float32)) @ e
        if self.where is None:
            return o
        b, h, r, d = o.shape
        flat, _ = self._flat(p)
        weights = flat[self._index()]  # (n, R)
        extra = weights[..., None] * self.delta.astype(mx.float32)[:, None]  # (n, R, d)
        return o.reshape(b * h, r, d).at[self.where[:, 0]].add(extra).reshape(b, h, r, d)

    def dense(self, dtype) -> mx.array:
        """The rows (B, H, count, d) (transient: prompt chunks and tests)."""
        x = self.m[:, :, : self.count, None].astype(mx.float32) * self.e[:, :, : self.count].astype(mx.float32)
        if self.where is not None:
            b, h, t, d = x.shape
            x = x.reshape(b * h * t, d).at[self._index()].add(self.delta.astype(mx.float32)).reshape(b, h, t, d)
        return x.astype(dtype)
