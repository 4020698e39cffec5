"""A minicache decode step and a flush as compiled passes over the buffers' room.

What ``kernels/decode.py``'s joint path computes over ``MergedRows`` and the exact rows a
layer holds, and what ``slerp.slerp_merge`` plus ``slerp.write_retained`` compute for a
run of decode tokens' pairs, with shapes that change only when the buffers grow: the
merged directions and magnitudes are read over the rows both buffers hold room for (rows
past the merged count score -inf: their weights are zero), the held rows over their
buffer's room (rows past those held likewise), the retained table over its whole buffer
(rows past its length weigh zero and point at row 0, token 0), and every count (merged
tokens, held rows, the table's rows, its used rows, the first token's position) comes in
as a small array. The passes
are lru_cached per static setting (scale, t, threshold), so they are traced again only
when a buffer grows; the row indices are built once per size, lazily, and evaluated with
the first step that reads them. Nothing here reads an array's value on the host.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ...cache.buffers import row_indices
from .slerp import _slerp_merge, norms


@functools.lru_cache(maxsize=8)
def _entries(rows: int, tokens: int) -> tuple[mx.array, mx.array]:
    """The (row, k) pairs of ``tokens`` tokens' ``rows`` (b*H + h) rows, int32 (tokens*rows,
    2), token-major (the order merging one token at a time wrote them), and the token
    column's selector [0, 1]: the retained entries are ``base + start * column``."""
    i = mx.arange(rows * tokens, dtype=mx.int32)
    return mx.stack([i % rows, i // rows], axis=1), mx.array([0, 1], mx.int32)


def count(n: int) -> mx.array:
    return mx.array(n, dtype=mx.int32)


# -- attention ------------------------------------------------------------------------------
def _attend(scale: float, tables: tuple[bool, bool], queries, ek, mk, ev, mv, n, token_rows, tail_k,
            tail_v, held, tail_rows, *table_args):
    # The retained tables are read over their whole buffers: rows past those held are zeros
    # (reserved rows are appended as zeros, a buffer's room is zeros, minicache is never
    # trimmed), which point at row 0, token 0 and add exactly 0 there.
    b, hq, _, d = queries.shape
    h = ek.shape[1]
    r = min(ek.shape[2], mk.shape[2], ev.shape[2], mv.shape[2])
    ek, mk, ev, mv = (x if x.shape[2] == r else x[:, :, :r] for x in (ek, mk, ev, mv))
    q = queries.astype(mx.float32).reshape(b, h, hq // h, d) * scale
    g = q.shape[2]
    ekf, evf = ek.astype(mx.float32), ev.astype(mx.float32)
    mkf, mvf = mk.astype(mx.float32)[:, :, None], mv.astype(mx.float32)[:, :, None]
    s = (q @ ekf.swapaxes(-1, -2)) * mkf
    if tables[0]:
        where, delta = table_args[0], table_args[1].astype(mx.float32)
        table_args = table_args[2:]
        head = where[:, 0]
        index = head * r + where[:, 1]
        q_rows = q.reshape(b * h, g, d)[head]  # (n, R, d)
        extra = (q_rows @ delta[:, :, None])[..., 0]  # (n, R)
        flat = s.transpose(0, 1, 3, 2).reshape(b * h * r, g)
        flat = flat.at[index].add(extra)
        s = flat.reshape(b, h, r, g).transpose(0, 1, 3, 2)
    s = mx.where(token_rows[:r] < n, s, -mx.inf)
    tail = mx.where(tail_rows < held, q @ tail_k.astype(mx.float32).swapaxes(-1, -2), -mx.inf)
    p = mx.softmax(mx.concatenate([s, tail], axis=-1), axis=-1)
    pm = p[..., :r]
    o = (pm * mvf) @ evf
    if tables[1]:
        where, delta = table_args[0], table_args[1].astype(mx.float32)
        head = where[:, 0]
        index = head * r + where[:, 1]
        weights = pm.transpose(0, 1, 3, 2).reshape(b * h * r, g)[index]  # (n, R)
        extra = weights[..., None] * delta[:, None]  # (n, R, d)
        o = o.reshape(b * h, g, d).at[head].add(extra).reshape(b, h, g, d)
    o = o + p[..., r:] @ tail_v.astype(mx.float32)
    return o.reshape(queries.shape).astype(queries.dtype)


@functools.lru_cache(maxsize=None)
def _attend_fn(scale: float, tables: tuple[bool, bool]):
    return mx.compile(functools.partial(_attend, scale, tables))


def decode_attention(queries, ek, mk, ev, mv, n: int, tail_k, tail_v, held: int, k_table, v_table, *,
                     scale: float):
    """One query token over the merged history and the exact rows held: the merged
    directions ``e*`` (B, H, room, d) and magnitudes ``m*`` (B, H, room') as whole buffers,
    the first ``n`` tokens valid; ``tail_*`` (B, H, room'', d) whole buffers, the first
    ``held`` rows valid; ``*_table``: [] or the second layer's retained (where, delta) whole
    buffers and the rows they hold."""
    room = max(x.shape[2] for x in (ek, mk, ev, mv))
    args = [queries, ek, mk, ev, mv, count(n), row_indices(room), tail_k, tail_v, count(held),
            row_indices(tail_k.shape[2])]
    for table in (k_table, v_table):
        if table:
            where, delta, _ = table  # whole buffers: rows past those held are zeros (see _attend)
            args += [where, delta]
    return _attend_fn(float(scale), (bool(k_table), bool(v_table)))(*args)


# -- the pair's merge -----------------------------------------------------------------------
def _write(where, table, used, reserved, before, retained, delta, start, base, column):
    """``slerp.write_retained`` for a run of tokens, token after token (token-major: the
    rows a run merged one token at a time took, in that order), with the counts as integer
    identities of the running count: ``keep.sum() == min(total, reserved - used)``
    (``used <= reserved``)."""
    b, h, n = retained.shape
    flag = retained.transpose(2, 0, 1).reshape(-1)
    running = mx.cumsum(flag.astype(mx.int32))
    pos = used + running - 1
    fits = flag & (pos < reserved)
    target = mx.where(fits, pos, 0)
    keep = fits.astype(mx.int32)[:, None]
    where = where.at[target].add((base + start * column) * keep)  # (b*H + h, start) where kept
    table = table.at[target].add(delta.transpose(2, 0, 1, 3).reshape(n * b * h, -1) * keep.astype(delta.dtype))
    total = used + running[-1]
    new_used = mx.minimum(total, reserved)
    dropped = total - new_used
    return where, table, new_used, dropped if before is None else before + dropped


def _merge(t: float, threshold: float, counted: bool, start, base, column, *args):
    out = []
    for x1, x2, where, table, used, reserved, *before in (args[:7], args[7:]):
        e, m, retained, delta = _slerp_merge(x1, x2, t, threshold)
        out += [e, norms(x1), m, *_write(where, table, used, reserved, before[0] if counted else None,
                              retained, delta, start, base, column)]
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _merge_fn(t: float, threshold: float, counted: bool):
    return mx.compile(functools.partial(_merge, t, threshold, counted))


def merge_decode(t: float, threshold: float, start: int, per_tensor):
    """A run of decode tokens' pairs merged and their retained pairs written, keys and values
    in one pass: ``per_tensor`` holds, for keys then values, (first layer's rows, second
    layer's rows (B, H, n, d), where buffer, table buffer, used (array), reserved rows (int),
    dropped before (array or None)); ``start``: the first token's position. Returns, per
    tensor, (e, first layer's magnitudes, second's, where, table, used, dropped)."""
    counted = per_tensor[0][6] is not None
    b, h, n = per_tensor[0][0].shape[:3]
    args = []
    for x1, x2, where, table, used, reserved, before in per_tensor:
        args += [x1, x2, where, table, used, count(reserved)]
        if counted:
            args.append(before)
    if not counted:  # pad to the fixed layout of seven a tensor
        args = args[:6] + [None] + args[6:] + [None]
    # None is no array: pass a placeholder the pass ignores
    args = [count(0) if a is None else a for a in args]
    out = _merge_fn(float(t), float(threshold), counted)(count(start), *_entries(b * h, n), *args)
    return out[:7], out[7:]
