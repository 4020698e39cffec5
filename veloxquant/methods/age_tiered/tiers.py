"""Tiers of segments by token age: precision that falls as tokens grow old.

A ``TieredStore`` keeps a layer's tokens in position order as tiers, oldest first. Each
tier is a ``Segment`` (``quant/store.py``): keys and values over the same tokens, in one
codec at the tier's bits: group-affine with keys per channel in groups of ``block``
tokens (KIVI's layout) and values per token in groups of ``block`` channels
(``TierTokens``), or model-dtype rows for a tier of 16 bits (``RawTokens``: full
precision by design, counted in ``nbytes`` like everything else). A per-channel key
group needs a whole block of tokens, so the newest ``N mod block`` tokens wait in full
precision in a tail (written in place, at most ``block - 1`` rows); the tail and the
youngest tier form the open part.

Which tier holds a token is a function of the stored count N alone (``tier_ends``): a
block belongs to the oldest tier whose age boundary its youngest token has reached
(age = N - 1 - position). Blocks therefore move whole, once every ``block`` steps, and a
tier overshoots its boundary by less than a block. When N grows, tokens new to the
store are quantized straight from full precision into the tier their age gives them
(a prompt chunk: each tier from the input); stored blocks whose age crossed a boundary
are demoted: decoded from their current codes, re-encoded in the older tier's codec
(moved as they are when the codecs are equal; there is no full-precision original by
then) and removed from the front of their tier. Front removal copies the rest of that
tier once (its buffers keep their capacity): at a decode step this happens only at the
step where a block crosses a boundary, every ``block`` steps per boundary, so its cost
is a tier's bytes every ``block`` steps; the other steps write one tail row in place. Tiers other than the oldest never outgrow their span, so their
buffers stop growing there.

Decode: one part per non-empty tier, the tail joined to the youngest, merged by
log-sum-exp (``kernels/decode.py``). Group-affine tiers at 2, 4 and 8 bits are served by
the fused kernel on Metal; tiers at widths the kernels do not read (3 bits) and 16-bit
tiers (full-precision rows) take the pure-MLX path. On CUDA a decode step decodes every
stored row in the queries' dtype and reads them with one fused attention.
"""

from __future__ import annotations

from itertools import accumulate

import mlx.core as mx

from ...cache.buffers import GrowingArray
from ...kernels import kivi_decode as kd
from ...kernels.decode import DecodePart
from ...quant.affine import packed_length
from ...quant.packed import GROWTH_TOKENS, GroupAffine, PackedTokens
from ...quant.store import PackedStore, Segment, joined_history
from ...quant.token_rows import ReadViews

FULL_PRECISION_BITS = 16  # a tier of this width (or more) stores the model's rows


def tier_ends(n: int, ages: list[int], block: int) -> list[int]:
    """Where each tier ends (token positions, oldest tier first) when ``n`` tokens are
    stored: tier ``i < len(ages)`` ends after the last block whose youngest token is at
    least ``ages[i]`` old; the youngest tier ends after the last whole block."""
    return [max(n - a, 0) // block * block for a in ages] + [n // block * block]


def _span(axis: int, start: int, stop: int):
    return (..., slice(start, stop)) if axis < 0 else (slice(None),) * axis + (slice(start, stop),)


def _drop_front(g: GrowingArray, n: int) -> None:
    """Remove the first ``n`` rows: one copy of the rest; the capacity is kept."""
    if n == 0:
        return
    if n < g.length:
        room = list(g.buffer.shape)
        room[g.axis] = n
        rest = g.buffer[_span(g.axis, n, g.capacity)]
        g.buffer = mx.concatenate([rest, mx.zeros(room, g.buffer.dtype)], axis=g.axis)
    g.length -= n


class TierTokens(PackedTokens):
    """Group-affine packed tokens that give up their oldest tokens (demotion)."""

    def __init__(self, codec: GroupAffine, step_tokens: int = GROWTH_TOKENS,
                 limit_tokens: int | None = None):
        super().__init__(codec, step_tokens)
        if limit_tokens:
            words, groups = self._sizes(limit_tokens)
            self.codes.limit, self.scales.limit, self.biases.limit = words, groups, groups

    def _sizes(self, n: int) -> tuple[int, int]:
        """Code words (or rows) and scale groups (or rows) that ``n`` tokens take."""
        c = self.codec
        return (packed_length(n, c.bits), n // c.group) if c.axis == "channel" else (n, n)

    def front(self, n: int) -> tuple[mx.array, ...]:
        """The first ``n`` tokens as stored (``n`` a multiple of the group for keys)."""
        words, groups = self._sizes(n)
        axis = self.codec.append_axis
        return (self.codes.buffer[_span(axis, 0, words)],
                self.scales.buffer[_span(axis, 0, groups)],
                self.biases.buffer[_span(axis, 0, groups)])

    def drop_front(self, n: int) -> None:
        words, groups = self._sizes(n)
        for g, k in ((self.codes, words), (self.scales, groups), (self.biases, groups)):
            _drop_front(g, k)

    def append_encoded(self, encoded) -> None:
        for g, a in zip((self.codes, self.scales, self.biases), encoded):
            g.append(a)

    def reconstruct(self, encoded, dtype) -> mx.array:
        return self.codec.decode(*encoded, dtype)


class RawTokens:
    """A 16-bit tier: the tokens' rows (B, H, n, D) in the model's dtype, unquantized."""

    codec = None

    def __init__(self, step_tokens: int = GROWTH_TOKENS, limit_tokens: int | None = None):
        self.rows = GrowingArray(axis=2, step=step_tokens, limit=limit_tokens or None)

    @property
    def count(self) -> int:
        return self.rows.length

    def append(self, x: mx.array, decoding: bool = False) -> None:
        self.rows.append(x)

    def front(self, n: int) -> tuple[mx.array]:
        return (self.rows.buffer[:, :, :n],)

    def drop_front(self, n: int) -> None:
        _drop_front(self.rows, n)

    def append_encoded(self, encoded) -> None:
        self.rows.append(encoded[0])

    def reconstruct(self, encoded, dtype) -> mx.array:
        return encoded[0].astype(dtype)

    def decode(self, dtype) -> mx.array | None:
        return self.rows.view().astype(dtype) if self.count else None

    def arrays(self, prefix: str) -> dict[str, GrowingArray]:
        return {f"{prefix}_rows": self.rows}


class TieredStore(PackedStore):
    """Tiers (oldest first) of a layer's tokens, by age, and a full-precision tail.

    ``bits``: each tier's width, oldest first (16: unquantized); ``ages``: the age
    boundaries between them, oldest first (decreasing, one fewer than ``bits``);
    ``block``: tokens per key group and channels per value group, the demotion unit.
    """

    def __init__(self, bits: list[int], ages: list[int], block: int,
                 step_tokens: int = GROWTH_TOKENS):
        if len(bits) != len(ages) + 1:
            raise ValueError(f"{len(bits)} tiers need {len(bits) - 1} age boundaries, got {ages}")
        self.ages, self.block = list(ages), block
        # a tier between two boundaries never holds more than their distance, in blocks
        spans = [-(-(older - younger) // block) * block
                 for older, younger in zip(self.ages, self.ages[1:] + [0])]
        self.tiers = [self._tier(b, limit, step_tokens) for b, limit in zip(bits, [None] + spans)]
        self.k_tail = GrowingArray(axis=2, step=block, limit=block)
        self.v_tail = GrowingArray(axis=2, step=block, limit=block)
        self._views = ReadViews()  # the tiers' decode parts, kept until a settle or a restore
        # (tokens in the tiers, the stored count at which a boundary next moves), kept
        # likewise: a decode step between blocks then settles nothing, computes no tier ends
        self._moves = ReadViews()
        self._row_views = ReadViews()  # the tiers' valid tokens a CUDA step decodes, kept likewise

    def _tier(self, bits: int, limit: int | None, step: int) -> Segment:
        if bits >= FULL_PRECISION_BITS:
            return Segment(RawTokens(step, limit), RawTokens(step, limit))
        return Segment(TierTokens(GroupAffine(bits, self.block, "channel"), step, limit),
                       TierTokens(GroupAffine(bits, self.block, "token"), step, limit))

    @property
    def counts(self) -> list[int]:
        """Tokens in each tier, oldest first (the tail not included)."""
        return [t.keys.count for t in self.tiers]

    @property
    def length(self) -> int:
        return sum(self.counts) + self.k_tail.length

    # -- writing -------------------------------------------------------------------------
    def commit(self, keys: mx.array, values: mx.array) -> None:
        """Take new tokens in; quantize whole blocks and demote what crossed a boundary."""
        n_tail, n = self.k_tail.length, keys.shape[2]
        if n_tail + n < self.block:
            packed, moves_at = self._moves.get(self, (), self._next_move)
            if packed + n_tail + n < moves_at:  # between blocks, no boundary reached: a row in place
                self.k_tail.append(keys)
                self.v_tail.append(values)
                return
        ends = tier_ends(self.length + n, self.ages, self.block)
        new_k = new_v = None
        if n_tail + n < self.block:  # a decode step between blocks: one row in place
            self.k_tail.append(keys)
            self.v_tail.append(values)
        else:
            k = keys if not n_tail else mx.concatenate([self.k_tail.view(), keys], axis=2)
            v = values if not n_tail else mx.concatenate([self.v_tail.view(), values], axis=2)
            whole = k.shape[2] // self.block * self.block
            self.k_tail.truncate(0)
            self.v_tail.truncate(0)
            if whole < k.shape[2]:
                self.k_tail.append(k[:, :, whole:])
                self.v_tail.append(v[:, :, whole:])
            new_k, new_v = k[:, :, :whole], v[:, :, :whole]
        # a boundary that is not a multiple of the block is crossed between blocks
        if new_k is not None or ends[:-1] != list(accumulate(self.counts))[:-1]:
            self._settle(ends, new_k, new_v, keys.dtype, decoding=n == 1)

    def _next_move(self) -> tuple[int, int]:
        """(tokens in the tiers, the stored count at which a tier's end first moves): tier
        ``i``'s end (``tier_ends``, at its cumulative count once settled) moves at
        ``end + block + ages[i]`` stored tokens, the youngest's at ``end + block`` (ends
        rounded up to a block first: a restored state's tiers need not be settled)."""
        ends = [-(-end // self.block) * self.block for end in accumulate(self.counts)]
        packed = sum(self.counts)
        return packed, min([end + self.block + age for end, age in zip(ends, self.ages)] + [ends[-1] + self.block])

    def _settle(self, ends: list[int], new_k, new_v, dtype, decoding: bool = False) -> None:
        """``decoding``: a decode step's block (shapes that recur: the compiled encoders)."""
        self._views.clear()  # no view of a tier kept across its writes
        self._moves.clear()
        self._row_views.clear()
        packed = sum(self.counts)  # stored tokens before the new ones
        for i in range(len(self.tiers) - 1):  # older tiers pull from the fronts of younger ones
            j = i + 1
            while (want := min(ends[i], packed) - sum(self.counts[: i + 1])) > 0:
                while not self.tiers[j].keys.count:
                    j += 1
                self._demote(self.tiers[j], self.tiers[i], min(want, self.tiers[j].keys.count), dtype, decoding)
        if new_k is None:
            return
        start = packed  # the new tokens go straight to the tiers their ages give them
        for tier, end in zip(self.tiers, ends):
            if end > start:
                tier.keys.append(new_k[:, :, start - packed : end - packed], decoding=decoding)
                tier.values.append(new_v[:, :, start - packed : end - packed], decoding=decoding)
                start = end

    @staticmethod
    def _demote(src: Segment, dst: Segment, n: int, dtype, decoding: bool = False) -> None:
        """Move the first ``n`` tokens of ``src`` to the end of ``dst``, re-encoded from
        their reconstruction when the codecs differ."""
        for s, d in ((src.keys, dst.keys), (src.values, dst.values)):
            encoded = s.front(n)
            if s.codec == d.codec:
                d.append_encoded(encoded)
            else:
                d.append(s.reconstruct(encoded, dtype), decoding=decoding)
            s.drop_front(n)

    # -- reading --------------------------------------------------------------------------
    def history(self, dtype) -> tuple[mx.array | None, mx.array | None]:
        """Every stored token in ``dtype``, in order (transient: prefill chunks and tests)."""
        tiers = [t for t in self.tiers if t.keys.count]
        parts_k = [t.keys.decode(dtype) for t in tiers]
        parts_v = [t.values.decode(dtype) for t in tiers]
        return joined_history(parts_k, parts_v, self.k_tail.view(), self.v_tail.view(), dtype)

    def attend_parts(self, queries, *, scale, use_kernel, n_kv_heads: int) -> mx.array:
        """A decode step's attention. On CUDA: every stored row decoded in the queries' dtype
        and one fused attention, which spends less device time there than the tiers' float32
        parts, each its own products before the merge (benchmarks/results/h200_s68);
        elsewhere the parts' joint read."""
        if use_kernel and queries.shape[2] == 1 and self.length and kd.gpu_backend() == "cuda":
            return self._decoded_attention(queries, scale)
        return super().attend_parts(queries, scale=scale, use_kernel=use_kernel, n_kv_heads=n_kv_heads)

    def _decoded_attention(self, queries, scale) -> mx.array:
        """``history_after`` over the tiers' valid tokens as views kept between settles (a
        step slices none of them), then one fused attention: the codes are decoded once the
        queries exist, so that MLX does not decode later layers' rows ahead and hold them all."""
        dtype = queries.dtype
        tiers = self._row_views.get(self, (), self._tier_views)
        codes = [a[0] for a in tiers if a[-1] is not None]
        gated = iter(mx.depends(codes, [queries]) if codes else [])
        rows = [a[0].astype(dtype) if a[-1] is None else a[-1].decode(next(gated), *a[1:-1], dtype) for a in tiers]
        k, v = joined_history(rows[::2], rows[1::2], self.k_tail.view(), self.v_tail.view(), dtype)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale)

    def _tier_views(self) -> list[tuple]:
        """Each non-empty tier's keys, then its values: (codes, scales, biases, codec) views of
        its valid tokens, or (rows, None) for a 16-bit tier."""
        out = []
        for t in self.tiers:
            if t.keys.count:
                for x in (t.keys, t.values):
                    out.append((x.rows.view(), None) if isinstance(x, RawTokens) else
                               (x.codes.view(), x.scales.view(), x.biases.view(), x.codec))
        return out

    def decode_parts(self, empty: mx.array) -> list[DecodePart]:
        """One part per non-empty tier, oldest first; the tail joins the youngest (its whole
        buffer, rows from 0: no slice a step). The tiers' parts are kept between settles."""
        parts = list(self._views.get(self, (empty,), lambda: self._tier_parts(empty)))
        n = self.k_tail.length
        if n:
            rows = (n, self.v_tail.length)
            if parts and parts[-1].key_tail is None:
                last = parts[-1]
                parts[-1] = DecodePart(last.keys, self.k_tail.buffer, last.values, self.v_tail.buffer,
                                       tail_rows=rows)
            else:
                parts.append(DecodePart(None, self.k_tail.buffer, None, self.v_tail.buffer, tail_rows=rows))
        return parts

    def _tier_parts(self, empty: mx.array) -> tuple[DecodePart, ...]:
        parts = []
        for t in self.tiers:
            if not t.keys.count:
                continue
            if isinstance(t.keys, RawTokens):  # full precision: rows, as tails
                parts.append(DecodePart(None, t.keys.rows.view(), None, t.values.rows.view()))
            else:
                parts.append(DecodePart(t.keys.layout(empty), None, t.values.layout(empty), None))
        return tuple(parts)

    # -- checks of a restored state ------------------------------------------------------------
    def layout_problems(self, head_dims: tuple[int, int]):
        """(field, found, expected) for stored arrays whose shapes contradict their codecs;
        ``head_dims``: the key and value head_dim they must have."""
        for i, tier in enumerate(self.tiers):
            for packed, name, dim in ((tier.keys, "key", head_dims[0]), (tier.values, "value", head_dims[1])):
                if isinstance(packed, RawTokens):
                    found, expected = packed.rows.view(), (packed.count, dim)
                    found = None if found is None else tuple(found.shape[2:])
                    detail = "16-bit rows"
                else:
                    expected = packed.expected_shapes(dim)
                    found = (None if packed.codes.buffer is None else
                             (tuple(packed.codes.view().shape[2:]), tuple(packed.scales.view().shape[2:])))
                    detail = f"{packed.codec.bits}-bit codes and scales, groups of {self.block}"
                if found is not None and found != expected:
                    yield f"tier {i} {name}s", found, f"{expected} ({detail})"
        for tail, name, dim in ((self.k_tail, "key", head_dims[0]), (self.v_tail, "value", head_dims[1])):
            if tail.buffer is not None and tail.buffer.shape[3] != dim:
                yield f"full-precision {name}s' head_dim", tail.buffer.shape[3], dim

    def problems(self, offset: int):
        """(field, found, expected) for each way the stored tokens contradict the tiers."""
        if self.length != offset:
            yield "tokens stored", self.length, f"the offset {offset}"
        if self.k_tail.length != self.v_tail.length or self.k_tail.length >= self.block:
            yield ("full-precision tail", f"{self.k_tail.length} keys / {self.v_tail.length} values",
                   f"as many values as keys, fewer than the block {self.block}")
        values = [t.values.count for t in self.tiers]
        if values != self.counts:
            yield "tier values", values, f"the tier keys {self.counts}"
        ends = tier_ends(self.length, self.ages, self.block)
        expected = [b - a for a, b in zip([0] + ends, ends)]
        if self.counts != expected:
            yield "tier sizes", self.counts, f"{expected} for {self.length} tokens (oldest first)"

    # -- what is kept ------------------------------------------------------------------------
    def arrays(self) -> dict[str, GrowingArray]:
        out = {"k_tail": self.k_tail, "v_tail": self.v_tail}
        for i, t in enumerate(self.tiers):
            out.update(t.keys.arrays(f"tier{i}_k"))
            out.update(t.values.arrays(f"tier{i}_v"))
        return out

    def restore(self, meta: dict, arrays: dict) -> None:
        self._views.clear()
        self._moves.clear()
        self._row_views.clear()
        for name, kept in self.arrays().items():
            kept.reset(arrays.get(name))
