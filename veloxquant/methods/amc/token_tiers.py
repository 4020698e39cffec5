"""Tiers chosen per token and KV head: each tier a codec, each head its own count of rows.

A token's tier may differ from head to head, and at a decode step one head's token goes
to one tier, another head's to another, so a tier's heads hold different numbers of
rows. ``RaggedTier`` keeps one codec's rows per (batch, head) at their own count
(``counts`` (B, H)), in arrival order, in buffers of ``capacity`` rows shared by the
heads and grown by at most ``step`` rows, fewer while the tier is small (``added_room``'s
geometric rule: a short prompt pays no whole step; no fused kernel reads the tiers, so
nothing needs aligned steps). A write gathers the rows each head takes
(a prompt chunk: the same number per head; a flush of decode tokens: each token in
order, a token a head does not take written past its count) and writes them after its
own run. Rows past a
head's count are masked out of its scores (``MaskedRows``), so readers run over the whole
buffer. The host never reads the counts: ``bound`` (an upper bound of the largest count,
from the writes' sizes) sizes a prompt chunk's room; one spare row stays past every count
(where a decode row lands for a head that does not take it).

``TieredRowsStore`` holds keys and values in such tiers (the value of a token in its
key's tier), the tier of every token and head in position order (uint8 ``flags``, which
put the history back in order), and optional projections per tier (a low tier kept as
coefficients on a basis, ``methods/amc/projection.py``; keys before RoPE, with their
positions, when the rotary settings are given). A decode step's room comes from host
counters: each tier grows by its share of the decode tokens, and a token whose tier is
full for its head goes to the nearest tier with room (``step_capacities`` plans each
token's room; the cache's flush, ``tiering.py``, applies it to a window of decode tokens
at once). A prompt chunk attends over the decoded history plus itself; a decode step
attends over every tier's whole buffer (and the cache's window) under one softmax, one
compiled pass (``decode_step.py``; the parts below, ``decode_parts``, where a tier's keys
and values differ in room).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import mlx.core as mx

from ...cache.buffers import GrowingArray, added_room
from ...kernels.compiled import PerShape, index_range
from ...kernels.decode import DecodePart
from .projection import ProjectedRows, RotatedRows
from ...quant.token_rows import TokenGroups, TokenRows
from ...quant.packed import GROWTH_TOKENS, AffineLayout
from ...quant.store import PackedStore
from ...cache.rope import derotate
from ...quant.prerope import to_pre_rope

MASKED = -1e30  # the score of a row a head does not hold: finite, so an empty head's
# partial softmax state stays a number (its weight in the merge is 2^-inf = 0)


class RaggedTier:
    """Rows of one ``TokenGroups`` codec, each (batch, head) with its own count."""

    def __init__(self, codec: TokenGroups, step: int = GROWTH_TOKENS, positioned: bool = False):
        self.codec, self.step, self.positioned = codec, step, positioned
        self.codes = self.scales = self.biases = self.counts = self.positions = None
        self.bound = 0  # host-side: no head holds more rows than this (Python counters only)

    @property
    def capacity(self) -> int:
        return 0 if self.codes is None else self.codes.shape[2]

    def grow_to(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        pad = lambda a: mx.pad(a, [(0, 0), (0, 0), (0, capacity - self.capacity)] + [(0, 0)] * (a.ndim - 3))  # noqa: E731
        if self.positions is not None:
            self.positions = pad(self.positions)
        self.codes, self.scales, self.biases = pad(self.codes), pad(self.scales), pad(self.biases)

    def room_for(self, n: int) -> int:
        """The capacity a write of up to n rows a head needs: past every count one spare row
        stays, where a decode step's row lands for a head that does not take it."""
        need = self.bound + n + 1
        if need <= self.capacity:
            return self.capacity
        return self.capacity + added_room(self.capacity, need - self.capacity, self.step, None, geometric=True)

    def write(self, rows: mx.array, take: mx.array, most: int, positions: mx.array | None = None,
              capacity: int | None = None) -> None:
        """Rows (B, H, n, ·); ``take`` (B, H, n) bool: the rows each head keeps, in order;
        ``most``: no head takes more (host-side: the room a write needs); ``positions``
        (B, H, n) int32 of a positioned tier; ``capacity``: the room planned by the caller
        (a decode step), else ``room_for(most)``. A head that takes fewer writes its last
        slots past its count, where nothing reads them."""
        b, h, n = take.shape
        if self.counts is None:
            self.counts = mx.zeros((b, h), mx.int32)
        if most < n:  # each head's taken rows first, in order
            pick = mx.argsort(mx.where(take, 0, n) + index_range(n), axis=-1)[..., :most]
            rows = mx.take_along_axis(rows, pick[..., None], axis=2)
            take = mx.take_along_axis(take, pick, axis=-1)
            if positions is not None:
                positions = mx.take_along_axis(positions, pick, axis=-1)
        codes, scales, biases = self.codec.encode(rows)
        if self.codes is None:
            self.codes, self.scales, self.biases = (mx.zeros((b, h, 0, a.shape[-1]), a.dtype)
                                                    for a in (codes, scales, biases))
            if self.positioned:
                self.positions = mx.zeros((b, h, 0), mx.int32)
        self.grow_to(self.room_for(most) if capacity is None else capacity)
        pos = self.counts[..., None] + index_range(most)
        bi, hi = index_range(b).reshape(b, 1, 1), index_range(h).reshape(1, h, 1)
        self.codes[bi, hi, pos] = codes
        self.scales[bi, hi, pos] = scales
        self.biases[bi, hi, pos] = biases
        if self.positions is not None:
            self.positions[bi, hi, pos] = positions.astype(mx.int32)
        self.counts = self.counts + take.astype(mx.int32).sum(axis=-1)
        self.bound = min(self.bound + most, self.capacity - 1)

    def start_buffers(self, b: int, h: int, width: int, dtype) -> None:
        """Empty buffers of the codec's widths for rows of ``width`` values in ``dtype``, and
        zero counts, where the tier has none yet."""
        if self.counts is None:
            self.counts = mx.zeros((b, h), mx.int32)
        if self.codes is None:
            coded = self.codec.encode(mx.zeros((b, h, 1, width), dtype))
            self.codes, self.scales, self.biases = (mx.zeros((b, h, 0, a.shape[-1]), a.dtype) for a in coded)
            if self.positioned:
                self.positions = mx.zeros((b, h, 0), mx.int32)

    def layout(self) -> AffineLayout:
        c = self.codec
        return AffineLayout(self.codes, self.scales, self.biases, self.capacity, c.bits, c.group, "token")


class MaskedRows:
    """A reader over a tier's whole buffer whose rows past each head's count score MASKED."""

    def __init__(self, inner, counts: mx.array, capacity: int):
        self.inner, self.counts, self.count = inner, counts, capacity

    @property
    def n_heads(self) -> int:
        return self.counts.shape[1]

    def scores(self, q: mx.array) -> mx.array:
        valid = index_range(self.count) < self.counts[..., None]
        return mx.where(valid[:, :, None], self.inner.scores(q), MASKED)

    def mix(self, p: mx.array) -> mx.array:
        return self.inner.mix(p)


class TieredRowsStore(PackedStore):
    """Keys and values in ``len(codecs)`` ragged tiers; ``projections[tier]``: the
    (mean, basis) pairs of keys and values for a tier kept as coefficients (in the dtype
    they are kept in, cast to float32 where they are used), for each tier in ``projected``.
    With ``rotary``, the projected tiers' keys are kept before RoPE (their coefficients
    on a basis of pre-RoPE keys) with their positions, and rotated again when read.
    ``shares``: the fraction of decode tokens each tier is expected to take (its room
    grows by it)."""

    def __init__(self, key_codecs, value_codecs, step: int = GROWTH_TOKENS, *, shares=None,
                 projected=(), rotary=None):
        self.k_tiers = [RaggedTier(c, step, positioned=rotary is not None and t in projected)
                        for t, c in enumerate(key_codecs)]
        self.v_tiers = [RaggedTier(c, step) for c in value_codecs]
        self.flags = GrowingArray(axis=2, step=step, geometric=True)  # (B, H, n) uint8 tier ids
        self.projections: dict[int, tuple[mx.array, mx.array, mx.array, mx.array]] = {}
        self.shares = list(shares) if shares is not None else [1 / len(key_codecs)] * len(key_codecs)
        self.step, self.rotary = step, rotary
        self.expected = [0.0] * len(key_codecs)  # host-side: rows a head is expected to hold per tier

    @property
    def length(self) -> int:
        return self.flags.length

    def _coefficients(self, tier: int, x: mx.array, which: int, start: int) -> mx.array:
        if tier not in self.projections:
            return x
        mean, basis = (a.astype(mx.float32) for a in self.projections[tier][2 * which : 2 * which + 2])
        if which == 0 and self.rotary is not None:
            x32 = to_pre_rope(x, start, self.rotary)
        else:
            x32 = x.astype(mx.float32)
        return ((x32 - mean[:, :, None]) @ basis).astype(x.dtype)  # scales in x's dtype

    def _write(self, keys, values, tiers, most, capacities=None) -> None:
        start, n = self.length, keys.shape[2]
        positions = mx.broadcast_to(mx.arange(start, start + n, dtype=mx.int32), tiers.shape)
        for t, (kt, vt) in enumerate(zip(self.k_tiers, self.v_tiers)):
            if most[t]:
                take = tiers == t
                cap = None if capacities is None else capacities[t]
                kt.write(self._coefficients(t, keys, 0, start), take, most[t], positions, cap)
                vt.write(self._coefficients(t, values, 1, start), take, most[t], None, cap)
                # the same rows a head as the keys': a copy of the counts attention reads (an
                # array of its own, kept and counted), so no chain of its own grows unevaluated
                vt.counts = kt.counts + 0
        self.flags.append(tiers.astype(mx.uint8))

    def commit(self, keys: mx.array, values: mx.array, tiers: mx.array, most: list[int],
               capacities: list[int | None] | None = None) -> None:
        """Tokens (B, H, n, D) with their tiers (B, H, n) uint8; ``most[t]``: at most this
        many of them in tier t for any head; ``capacities``: each tier's room (None: what
        the write needs)."""
        self._write(keys, values, tiers, most, capacities)
        self.expected = [float(t.bound) for t in self.k_tiers]

    def stepwise_room(self, t: int, n: int) -> int:
        """Tier t's room after n writes of one row each (a tier grows by its rule, from
        the room the last left), where one write of n rows may grow it otherwise."""
        tier = self.k_tiers[t]
        capacity, bound = tier.capacity, tier.bound
        for _ in range(n):
            if bound + 2 > capacity:
                capacity += added_room(capacity, bound + 2 - capacity, self.step, None, geometric=True)
            bound = min(bound + 1, capacity - 1)
        return capacity

    def step_capacities(self, n: int) -> list[list[int]]:
        """Each tier's room for each of n decode tokens in turn, from host counters only:
        a tier grows when the rows it is expected to hold (its share of the decode tokens)
        reach its room, and the tiers together always leave every head one row more than
        it holds."""
        out, caps = [], [max(tier.capacity, 1) for tier in self.k_tiers]  # the spare row
        for i in range(n):
            for t in range(len(caps)):
                self.expected[t] += self.shares[t]
                while self.expected[t] + 1 > caps[t] - 1 and self.shares[t] > 0:
                    caps[t] += self._growth(caps[t])
            while sum(c - 1 for c in caps) < self.length + i + 1:  # some tier has room for every head
                caps = [c + (self._growth(c) if s > 0 else 0) for c, s in zip(caps, self.shares)]
            out.append(list(caps))
        return out

    def _growth(self, capacity: int) -> int:
        """Rows a full tier of ``capacity`` rows grows by for one more (the tiers' rule)."""
        return added_room(capacity, 1, self.step, None, geometric=True)

    def _readers(self, t: int):
        kt, vt = self.k_tiers[t], self.v_tiers[t]
        keys, values = TokenRows(kt.layout()), TokenRows(vt.layout())
        if t in self.projections:
            k_mean, k_basis, v_mean, v_basis = (a.astype(mx.float32) for a in self.projections[t])
            if kt.positions is not None:
                keys = RotatedRows(self._decoded(t, 0))
            else:
                keys = ProjectedRows(keys, k_basis, k_mean)
            values = ProjectedRows(values, v_basis, v_mean)
        return MaskedRows(keys, kt.counts, kt.capacity), values

    def decode_parts(self, empty) -> list[DecodePart]:
        return [DecodePart(*self._reader_pair(t)) for t in range(len(self.k_tiers)) if self.k_tiers[t].capacity]

    def _reader_pair(self, t):
        keys, values = self._readers(t)
        return keys, None, values, None

    def _decoded(self, t: int, which: int) -> mx.array:
        tier = (self.k_tiers, self.v_tiers)[which][t]
        projection = self.projections[t][2 * which : 2 * which + 2] if t in self.projections else None
        return _tier_rows(tier.codec, tier.codes, tier.scales, tier.biases, projection,
                          tier.positions if projection is not None else None, self.rotary)

    def history(self, dtype):
        """Every token in position order, decoded (transient: prefill chunks and tests), one
        pass compiled for the tiers' shapes (``kernels/compiled.py``)."""
        if not self.length:
            return None, None
        plan, arrays = [], []
        for which, tiers in enumerate((self.k_tiers, self.v_tiers)):
            for t, tier in enumerate(tiers):
                if not tier.capacity:
                    continue
                projection = self.projections[t][2 * which : 2 * which + 2] if t in self.projections else None
                positions = tier.positions if projection is not None else None
                plan.append((which, t, tier.codec, projection is not None, positions is not None))
                arrays.append((tier.codes, tier.scales, tier.biases, projection, positions))
        return _history_fn(tuple(plan), self.rotary, dtype)(self.flags.view(), arrays)

    # -- what is kept -------------------------------------------------------------------------
    def arrays(self) -> dict[str, Any]:
        out: dict[str, Any] = {"flags": self.flags}
        for name, tiers in (("k", self.k_tiers), ("v", self.v_tiers)):
            for t, tier in enumerate(tiers):
                for field in ("codes", "scales", "biases", "counts", "positions"):
                    if field != "positions" or tier.positions is not None:
                        out[f"{name}{t}_{field}"] = getattr(tier, field)
        for t, arrays in self.projections.items():
            for field, a in zip(("k_mean", "k_basis", "v_mean", "v_basis"), arrays):
                out[f"tier{t}_{field}"] = a
        return out

    def restore(self, meta, arrays) -> None:
        for key, value in arrays.items():
            if key == "flags":
                self.flags.reset(value)
            elif key.startswith("tier"):
                t, field = int(key[4 : key.index("_")]), key[key.index("_") + 1 :]
                got = list(self.projections.get(t, (None,) * 4))
                got[("k_mean", "k_basis", "v_mean", "v_basis").index(field)] = value
                self.projections[t] = tuple(got)
            elif key[0] in "kv" and key[1:2].isdigit():
                tier = (self.k_tiers if key[0] == "k" else self.v_tiers)[int(key[1 : key.index("_")])]
                setattr(tier, key[key.index("_") + 1 :], value)
        tiers = self.k_tiers + self.v_tiers
        counters = json.loads(meta["tier_counters"]) if "tier_counters" in meta else None
        for i, tier in enumerate(tiers):
            if counters is not None:  # as saved: the tiers' room, and so where a step's token goes, follow them
                tier.bound = int(counters["bounds"][i])
            else:  # a state saved without them (loading, not decoding: the counts may be read)
                tier.bound = 0 if tier.counts is None else int(tier.counts.max())
            if tier.codes is not None and tier.bound >= tier.capacity:
                tier.grow_to(tier.bound + 1)
        self.expected = ([float(e) for e in counters["expected"]] if counters is not None
                         else [float(t.bound) for t in self.k_tiers])

    def meta(self) -> dict[str, Any]:
        """The host counters a decode step sizes the tiers' room by (``_step_capacities``): a
        restored store continues as the saved one would, token for token."""
        return {"tier_counters": json.dumps({"bounds": [t.bound for t in self.k_tiers + self.v_tiers],
                                             "expected": self.expected})}

    def layout_problems(self, head_dims):
        for name, tiers, dim in (("key", self.k_tiers, head_dims[0]), ("value", self.v_tiers, head_dims[1])):
            for t, tier in enumerate(tiers):
                if tier.codes is None:
                    continue
                width = self.projections[t][1].shape[-1] if t in self.projections else dim
                c = tier.codec
                want = (width * c.bits // 32, width // c.group)
                if (tier.codes.shape[-1], tier.scales.shape[-1]) != want:
                    yield (f"tier {t} {name} codes and scales per row", (tier.codes.shape[-1], tier.scales.shape[-1]),
                           f"{want} ({c.bits}-bit codes of {width} values, groups of {c.group})")

    def problems(self, offset: int):
        if self.length != offset:
            yield "tokens stored", self.length, f"the offset {offset}"
        if not self.length:
            return
        flags = self.flags.view()
        for t, (kt, vt) in enumerate(zip(self.k_tiers, self.v_tiers)):
            flagged = (flags == t).astype(mx.int32).sum(axis=-1)
            for name, tier in (("key", kt), ("value", vt)):
                held = mx.zeros(flagged.shape, mx.int32) if tier.counts is None else tier.counts
                if not bool(mx.all(held == flagged)) or (tier.counts is not None and int(held.max()) > tier.capacity):
                    yield f"tier {t} {name} rows per head", held.tolist(), f"the tokens flagged {t}: {flagged.tolist()}"


def _tier_rows(codec, codes, scales, biases, projection, positions, rotary) -> mx.array:
    """A tier's whole buffer of rows (B, H, capacity, D) float32: decoded, lifted from the
    projection's coefficients (mean, basis) where it has one, and turned to their
    positions where it keeps them (keys kept before RoPE)."""
    rows = codec.decode(codes, scales, biases, mx.float32)
    if projection is not None:
        mean, basis = (a.astype(mx.float32) for a in projection)
        rows = rows @ basis.swapaxes(-1, -2) + mean[:, :, None]
        if positions is not None:
            # derotate by -position is the rotation by +position (angles are linear in it)
            rows = derotate(rows, -positions, rotary)
    return rows


@functools.lru_cache(maxsize=None)
def _history_fn(plan: tuple, rotary, dtype):
    """``TieredRowsStore.history`` as a function of the flags and, per tier in ``plan``
    ((tensor, tier, codec, projected, positioned), keys' tiers then values'), its codes,
    scales, biases, projection (mean, basis) and positions (``_tier_rows``), the rows taken
    in position order by where each token's tier holds it."""
    def history(flags, arrays):
        flags = flags.astype(mx.int32)
        out = []
        for which in (0, 1):
            parts, source, start = [], mx.zeros(flags.shape, mx.int32), 0
            for (w, t, codec, _, _), (codes, scales, biases, projection, positions) in zip(plan, arrays):
                if w != which:
                    continue
                parts.append(_tier_rows(codec, codes, scales, biases, projection, positions, rotary))
                mine = flags == t
                source = mx.where(mine, start + mx.cumsum(mine.astype(mx.int32), axis=-1) - 1, source)
                start += codes.shape[2]
            rows = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
            out.append(mx.take_along_axis(rows, source[..., None], axis=2).astype(dtype))
        return out[0], out[1]

    return PerShape(history)
