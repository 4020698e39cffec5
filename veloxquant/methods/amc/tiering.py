"""The tiers of a window of decode tokens, in order, in one compiled pass (the window's flush).

A decode token waits, exact, in the cache's window; when ``FLUSH`` of them are held, this
pass gives each its tier with the per-token rule of ``cache.py`` (its saliency against the
thresholds as they stood before it, then its saliency into the saliency window and the
thresholds moved), the room rule of ``TieredRowsStore`` (from host counters: the tiers'
room before each token) and writes each into its tier at its head's count. What does
not depend on order is computed for the whole window at once: saliencies, the rank of
each against the window before it, the window's quantiles after each token, the tier
codes of every token. What does (the thresholds' moving average and the tiers' counts)
is a scan of the tokens unrolled, elementwise over (B, H). Nothing reads values on the
host.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx

from ...cache.rope import Rotary, derotate
from ...kernels.compiled import index_range
from ...quant.saliency import n_salient
from ...quant.token_rows import quantize_rows


def thresholds(s: mx.array, k_high: float, k_mid: float) -> mx.array:
    """(θ_high, θ_mid) (..., 2) of saliencies (..., n): the smallest of the top
    round(k_high n), and of the top round(k_high n) + round(k_mid n)."""
    n = s.shape[-1]
    top = -mx.sort(-s, axis=-1)
    n_hi = n_salient(k_high, n)
    out = []
    for k in (n_hi, n_hi + min(n - n_hi, n_salient(k_mid, n))):
        out.append(mx.full(s.shape[:-1], math.inf) if k == 0 else
                   mx.full(s.shape[:-1], -math.inf) if k == n else top[..., k - 1])
    return mx.stack(out, axis=-1)


@dataclass(frozen=True)
class _Flush:
    n: int  # tokens flushed
    seen: int  # saliencies in the window before them
    size: int  # the window's room (amc_threshold_window)
    k_high: float
    k_mid: float
    adaptive: bool
    gamma: float
    by_rank: bool  # query saliency: a decode token's s is the rank of its s_int in the window
    saliency_rotary: Rotary | None  # saliency reads keys before RoPE with these settings
    limits: tuple[tuple[int, ...], ...]  # each token's room: a tier takes it below these counts
    codecs: tuple[tuple[int, int], ...]  # (bits, group) of each tier
    projected: tuple[bool, ...]
    positioned: tuple[bool, ...]
    rotary: Rotary | None  # projected keys taken before RoPE with these settings


def _windows(seq: mx.array, ends: range, size: int) -> list[tuple[range, mx.array]]:
    """The last ``size`` entries of ``seq`` (..., L) before each end in ``ends``: those whose
    window is whole gathered as one (..., m, size) array, the earlier ones (shorter) one by
    one (..., 1, end)."""
    first_whole = next((i for i, e in enumerate(ends) if e >= size), len(ends))
    out = [(range(i, i + 1), seq[..., None, : ends[i]]) for i in range(first_whole)]
    if first_whole < len(ends):
        starts = mx.array([ends[i] - size for i in range(first_whole, len(ends))], mx.int32)
        out.append((range(first_whole, len(ends)), seq[..., starts[:, None] + mx.arange(size)]))
    return out


def _graph(how: _Flush, keys, values, positions, ring_order, ring_slots, mu, var, theta,
           window, window_int, counts, buffers, projections):
    n, size, seen, limits = how.n, how.size, how.seen, how.limits
    k = keys if how.saliency_rotary is None else derotate(keys, positions, how.saliency_rotary)
    dev = k.astype(mx.float32) - mu[:, :, None]
    s_int = (dev * dev / var[:, :, None]).sum(axis=-1)  # (B, H, n)
    s = s_int
    if how.by_rank:  # against the window just before each token joins it
        seq_int = mx.concatenate([window_int[..., ring_order], s_int], axis=-1)
        parts = []
        for tokens, before in _windows(seq_int, range(seen, seen + n), size):
            own = s_int[..., tokens.start : tokens.stop, None]
            parts.append((before < own).astype(mx.float32).mean(axis=-1))
        s = mx.concatenate(parts, axis=-1)
    seq = mx.concatenate([window[..., ring_order], s], axis=-1)
    moved = [None] * n  # θ' after each token, (high, mid): the thresholds of the window it leaves
    if how.adaptive:
        for tokens, after in _windows(seq, range(seen + 1, seen + n + 1), size):
            if after.shape[-1] >= 2:
                new = thresholds(after, how.k_high, how.k_mid)  # (B, H, m, 2)
                parts = [mx.split(new[..., j], len(tokens), axis=2) for j in (0, 1)]
                for j, i in enumerate(tokens):
                    moved[i] = (parts[0][j], parts[1][j])
    # The scan in token order, elementwise over (B, H, 1) (compiled, it fuses): a token's tier
    # by the thresholds before it, the thresholds moved after it, then the nearest tier with
    # room for its head (ties toward the finer one) by the host's room plan (``limits``).
    n_tiers = len(counts)
    prefer = [sorted(range(n_tiers), key=lambda o, w=w: 2 * abs(o - w) + (o > w)) for w in range(n_tiers)]
    high, mid = theta[..., :1], theta[..., 1:]
    if not how.adaptive:  # frozen thresholds: every token's wish at once
        wishes = mx.where(s >= high, 0, mx.where(s >= mid, 1, 2))
        wishes = mx.split(wishes, n, axis=2) if n > 1 else [wishes]
    held = [c[..., None] for c in counts]
    taken = []
    for i in range(n):
        if how.adaptive:
            si = s[..., i : i + 1]
            wanted = mx.where(si >= high, 0, mx.where(si >= mid, 1, 2))
        else:
            wanted = wishes[i]
        if moved[i] is not None:
            new_high, new_mid = moved[i]
            if how.gamma == 1:
                high, mid = new_high, new_mid
            else:
                high = mx.where(new_high == high, high, (1 - how.gamma) * high + how.gamma * new_high)
                mid = mx.where(new_mid == mid, mid, (1 - how.gamma) * mid + how.gamma * new_mid)
        room = [held[t] < limits[i][t] for t in range(n_tiers)]
        pick = None
        for w in range(n_tiers):
            choice = None
            for o in reversed(prefer[w]):
                choice = o if choice is None else mx.where(room[o], o, choice)
            pick = choice if pick is None else mx.where(wanted == w, choice, pick)
        taken.append(pick)
        held = [held[t] + (pick == t) for t in range(n_tiers)]
    theta = mx.concatenate([high, mid], axis=-1)
    taken = mx.concatenate(taken, axis=-1)  # (B, H, n)
    # each token's row in its tier: the count before it (the tokens before it that took it)
    mine = [(taken == t).astype(mx.int32) for t in range(n_tiers)]
    slots = [c[..., None] + mx.cumsum(m, axis=-1) - m for c, m in zip(counts, mine)]

    b, h = keys.shape[:2]
    bi, hi = index_range(b).reshape(b, 1, 1), index_range(h).reshape(1, h, 1)
    out_buffers = []
    for t in range(n_tiers):
        bits, group = how.codecs[t]
        k_rows, v_rows = keys, values
        if how.projected[t]:
            # one product a token, as a step of one token computes it (a product of n rows
            # sums in another order on some BLAS)
            k_mean, k_basis, v_mean, v_basis = (a.astype(mx.float32) for a in projections[t])
            k32 = derotate(keys, positions, how.rotary) if how.rotary is not None else keys.astype(mx.float32)
            k_rows = ((k32 - k_mean[:, :, None])[..., None, :] @ k_basis[:, :, None]).squeeze(-2).astype(keys.dtype)
            v32 = values.astype(mx.float32) - v_mean[:, :, None]
            v_rows = (v32[..., None, :] @ v_basis[:, :, None]).squeeze(-2).astype(values.dtype)
        # a token the head does not take lands on the spare row past the tier's count
        rows = mx.where(taken == t, slots[t], held[t])
        bufs = list(buffers[t])
        for i, x in ((0, k_rows), (1, v_rows)):
            for buf, coded in zip(bufs[3 * i : 3 * i + 3], quantize_rows(x, group, bits)):
                buf[bi, hi, rows] = coded
                out_buffers.append(buf)
        if how.positioned[t]:
            p = bufs[6]
            p[bi, hi, rows] = mx.broadcast_to(positions, rows.shape)
            out_buffers.append(p)
    ring = window
    m = min(n, size)
    ring[..., ring_slots] = s[..., n - m :]
    out = [theta, ring]
    if how.by_rank:
        window_int[..., ring_slots] = s_int[..., n - m :]
        out.append(window_int)
    return (*out, taken.astype(mx.uint8), *(held[t][..., 0] for t in range(n_tiers)), *out_buffers)


@functools.lru_cache(maxsize=None)
def _flush_fn(how: _Flush):
    n_tiers = len(how.codecs)

    def run(keys, values, positions, ring_order, ring_slots, mu, var, theta, window, *args):
        rest = list(args)
        window_int = rest.pop(0) if how.by_rank else None
        counts, rest = rest[:n_tiers], rest[n_tiers:]
        buffers, projections = [], {}
        for t in range(n_tiers):
            m = 7 if how.positioned[t] else 6
            buffers.append(tuple(rest[:m]))
            rest = rest[m:]
        for t in range(n_tiers):
            if how.projected[t]:
                projections[t], rest = tuple(rest[:4]), rest[4:]
        return _graph(how, keys, values, positions, ring_order, ring_slots, mu, var, theta,
                      window, window_int, counts, buffers, projections)

    return mx.compile(run)


def flush(cache, keys: mx.array, values: mx.array) -> mx.array:
    """Decode tokens (B, H, n, D), the next after the stored ones, into their tiers: the
    cache's thresholds and saliency window, its store's tiers, counts, flags and host
    counters move as n decode steps of one token each would move them. The tiers taken."""
    o, store = cache.config, cache.store  # the flat fields (no options object built a flush)
    n, start, w = keys.shape[2], store.length, o.amc_threshold_window
    ks, vs = store.k_tiers, store.v_tiers
    caps = store.step_capacities(n)  # each token's room, from host counters
    b, h = keys.shape[:2]
    for t, (kt, vt) in enumerate(zip(ks, vs)):
        widths = ((store.projections[t][1].shape[-1],) * 2 if t in store.projections
                  else (keys.shape[-1], values.shape[-1]))
        for tier, x, width in ((kt, keys, widths[0]), (vt, values, widths[1])):
            tier.start_buffers(b, h, width, x.dtype)
            tier.grow_to(caps[-1][t])
    projected = tuple(t in store.projections for t in range(len(ks)))
    positioned = tuple(k.positions is not None for k in ks)
    by_rank = cache.window_int is not None
    how = _Flush(n, cache.seen, w, o.amc_k_high, o.amc_k_mid, o.amc_adaptive_thresholds, o.amc_gamma, by_rank,
                 cache.rotary, tuple(tuple(c - 1 for c in cap) for cap in caps), tuple((k.codec.bits, k.codec.group) for k in ks), projected, positioned,
                 store.rotary if any(positioned) else None)
    m = min(n, w)
    args = [keys, values, mx.array(list(range(start, start + n)), mx.int32),
            _indices(tuple((cache.at - cache.seen + j) % w for j in range(cache.seen))),
            _indices(tuple((cache.at + i) % w for i in range(n - m, n))),
            cache.mu, cache.var, cache.theta, cache.window]
    if by_rank:
        args.append(cache.window_int)
    args += [k.counts for k in ks]
    for k, v in zip(ks, vs):
        args += [k.codes, k.scales, k.biases, v.codes, v.scales, v.biases]
        if k.positions is not None:
            args.append(k.positions)
    for t in range(len(ks)):
        if projected[t]:
            args += list(store.projections[t])
    out = list(_flush_fn(how)(*args))
    cache.theta, cache.window = out.pop(0), out.pop(0)
    if by_rank:
        cache.window_int = out.pop(0)
    cache.at, cache.seen = (cache.at + n) % w, min(cache.seen + n, w)
    taken = out.pop(0)
    counts, out = out[: len(ks)], out[len(ks) :]
    for t, (k, v) in enumerate(zip(ks, vs)):
        k.codes, k.scales, k.biases, v.codes, v.scales, v.biases = out[:6]
        out = out[6:]
        if k.positions is not None:
            k.positions, out = out[0], out[1:]
        k.counts, v.counts = counts[t], counts[t] + 0  # the values' own copy, kept and counted
        for tier in (k, v):
            for cap in caps:  # as n steps move the bound (the room grows with them)
                tier.bound = min(tier.bound + 1, cap[t] - 1)
    store.flags.append(taken)
    return taken


@functools.lru_cache(maxsize=64)
def _indices(values: tuple[int, ...]) -> mx.array:
    """int32 indices, made once per distinct tuple (the ring's few orders)."""
    return mx.array(values, mx.int32) if values else mx.zeros((0,), mx.int32)
