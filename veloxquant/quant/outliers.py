"""Dense-and-sparse splits: a few entries per vector kept exactly in a sparse side table.

The outliers of a block are chosen before the block's quantization range is computed
(so they do not stretch it), stored as (position, value) pairs in the input's dtype and
written back over the dense reconstruction (``restore_*``): they come back bit for bit.
A fixed count per vector keeps the table a plain array (no ragged CSR), so its memory is
``count x (2 + value bytes)`` per vector exactly. ``per_tail`` and ``tail_indices`` (how
many, and which: a vector's k smallest and k largest) serve every such split, GEAR's
sparse residual (``sparse.py``) too.

- ``split_vectors``: per vector along the last axis (a token's channels), the ``k``
  largest and the ``k`` smallest entries; positions uint16.
- ``split_channel_groups``: per-channel data (``(..., D, n)``, tokens along the last axis)
  in groups of ``group`` tokens: each group keeps ``group * k`` entries per tail, the
  entries farthest above (below) their own channel's median in units of that channel's
  interquartile range over the group, i.e. a threshold per channel, as per-channel
  calibrated thresholds are, at the same count as ``k`` per token; positions are
  ``channel * group + token`` within the group (uint16 while ``group * D <= 65536``).
"""

from __future__ import annotations

import math

import mlx.core as mx


def per_tail(fraction: float, n: int) -> int:
    """Entries kept per tail of a vector of ``n``: ceil(f * n / 2), at most n / 2 (0 when f is 0)."""
    return 0 if fraction <= 0 else min(n // 2, math.ceil(fraction * n / 2 - 1e-9))


# MLX's CUDA sort puts the sorted rows on a grid axis capped at 65,535 blocks: more rows in
# one call fail to launch (cudaGraphAddKernelNode: invalid argument). Sort in slices.
MAX_SORT_ROWS = 32768


def sort_rows(x: mx.array, arg: bool = False) -> mx.array:
    """``mx.sort`` (``mx.argsort`` with ``arg``) along the last axis, at most MAX_SORT_ROWS
    rows a call; the same result as one call."""
    sort = mx.argsort if arg else mx.sort
    n = x.shape[-1]
    rows = x.size // max(n, 1)
    if rows <= MAX_SORT_ROWS:
        return sort(x, axis=-1)
    flat = x.reshape(rows, n)
    parts = [sort(flat[i : i + MAX_SORT_ROWS], axis=-1) for i in range(0, rows, MAX_SORT_ROWS)]
    return mx.concatenate(parts).reshape(x.shape)


def tail_indices(x: mx.array, k: int) -> mx.array:
    """(..., 2k) int32: positions of the k smallest then the k largest entries of each row
    of ``x`` (..., n), in increasing order of value."""
    order = sort_rows(x, arg=True)
    return mx.concatenate([order[..., :k], order[..., x.shape[-1] - k :]], axis=-1).astype(mx.int32)


def _positions(x: mx.array, k: int) -> mx.array:
    return tail_indices(x, k).astype(mx.uint16 if x.shape[-1] <= 1 << 16 else mx.uint32)


def _mask(shape, pos: mx.array) -> mx.array:
    return mx.put_along_axis(mx.zeros(shape, mx.bool_), pos.astype(mx.int32), mx.array(True), axis=-1)


def split_vectors(x: mx.array, k: int):
    """``x`` (..., n) -> (mask (..., n) of the outliers, positions (..., 2k), values (..., 2k)
    in x's dtype): the k smallest and the k largest entries of each vector."""
    pos = _positions(x.astype(mx.float32), k)
    return _mask(x.shape, pos), pos, mx.take_along_axis(x, pos.astype(mx.int32), axis=-1)


def split_channel_groups(x: mx.array, k: int, group: int, dtype=None):
    """``x`` (..., D, n) per channel, n a multiple of ``group`` -> (mask (..., D, n), positions
    (..., n / group, 2 * group * k), values (same, in ``dtype`` or x's)); see the module doc."""
    *lead, d, n = x.shape
    g = x.astype(mx.float32).reshape(*lead, d, n // group, group).swapaxes(-2, -3)  # (..., ng, D, G)
    s = sort_rows(g)
    median = (s[..., (group - 1) // 2] + s[..., group // 2]) / 2
    spread = s[..., group - 1 - group // 4] - s[..., group // 4]
    spread = mx.maximum(spread, 1e-6 * mx.maximum(mx.abs(median), 1.0))[..., None]
    score = ((g - median[..., None]) / spread).reshape(*lead, n // group, d * group)
    pos = _positions(score, group * k)
    flat = g.reshape(*lead, n // group, d * group)
    values = mx.take_along_axis(flat, pos.astype(mx.int32), axis=-1).astype(dtype or x.dtype)
    mask = _mask(flat.shape, pos).reshape(*lead, n // group, d, group).swapaxes(-2, -3)
    return mask.reshape(*lead, d, n), pos, values


def restore_vectors(dense: mx.array, pos: mx.array, values: mx.array) -> mx.array:
    """Outliers written over ``dense`` (..., n)."""
    return mx.put_along_axis(dense, pos.astype(mx.int32), values.astype(dense.dtype), axis=-1)
