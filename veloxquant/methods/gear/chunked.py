"""Low-rank factors of a growing run of chunks, and the decode terms that read them.

A run of tokens is cut into chunks of consecutive tokens; chunk c holds ``L_c = A_c B_cᵀ``
per (batch, head). What is kept, in the factors' dtype:

- ``a``: (B, H, T, r) one row of A per token (``GrowingArray`` along the tokens);
- ``b``: (B, H, C, d, r) one B per chunk (along the chunks);
- ``chunk``: (T,) int32, the chunk of each token, and ``ends`` (C,) int32, where each
  chunk ends (shared by every batch row and head).

r is the widest chunk's rank: a narrower chunk's factors are zero-padded (kept and
counted), and a wider one widens what is kept (a copy when it arrives, never at a step).
Never the dense L. ``LowRankTerm`` reads the factors at a decode step, over the buffers'
room (rows past the valid ones are zeros), a group of tokens at a time (chunks start at
multiples of the quantization group: a prompt flushes whole groups, a decode chunk is n_b
tokens): scores ``q Lᵀ = (q B_c) A_tᵀ`` (``q B`` for every chunk, gathered per group, one
product with the group's rows of A) and mixes ``p L = Σ_g (Σ_{t in g} p_t A_t) B_c(g)ᵀ``
(one product per group, then B gathered per group); O(T r) and O(T d r / group): no
scatter (slow in MLX on the CPU), no dense L, no table per token and rank.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import mlx.core as mx

from ...cache.buffers import GrowingArray, fitted_rows

CHUNK_STEP = 2  # chunks of room added to ``b`` at a time (a copy of B, which is small)
# factors -> (buffers, stamp, views): the views a decode step reads (``ChunkedFactors.term``)
_VIEWS: "weakref.WeakKeyDictionary[ChunkedFactors, tuple]" = weakref.WeakKeyDictionary()


def _widen(g: GrowingArray, rank: int) -> None:
    if g.buffer is not None and g.buffer.shape[-1] < rank:
        extra = rank - g.buffer.shape[-1]
        g.buffer = mx.pad(g.buffer, [(0, 0)] * (g.buffer.ndim - 1) + [(0, extra)])


def _pad(x: mx.array, rank: int) -> mx.array:
    extra = rank - x.shape[-1]
    return x if not extra else mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


class ChunkedFactors:
    def __init__(self, step_tokens: int, step_chunks: int = CHUNK_STEP):
        self.a = GrowingArray(axis=2, step=step_tokens)
        self.b = GrowingArray(axis=2, step=step_chunks)
        self.chunk = GrowingArray(axis=0, step=step_tokens)
        self.ends = GrowingArray(axis=0, step=step_chunks)
        # where each chunk ends, on the host as appended, for ``dense`` (a prompt chunk's
        # history, per layer: reading ``ends`` there waited for the device every time);
        # valid while ``ends`` holds the buffer and length ``append`` left (a restore
        # replaces the buffer, a trim shortens it)
        self._ends: list[int] = []
        self._ends_buffer = None

    @property
    def count(self) -> int:
        return self.a.length

    @property
    def n_chunks(self) -> int:
        return self.b.length

    @property
    def rank(self) -> int:
        return 0 if self.a.buffer is None else self.a.buffer.shape[-1]

    def append(self, a: mx.array, b: mx.array) -> None:
        """One chunk: ``a`` (B, H, n, r_c), ``b`` (B, H, d, r_c), in the dtype to keep."""
        rank = max(self.rank, a.shape[-1])
        _widen(self.a, rank)
        _widen(self.b, rank)
        ends = self.chunk_ends() + [self.count + a.shape[2]]
        self.chunk.append(mx.full((a.shape[2],), self.n_chunks, mx.int32))
        self.ends.append(mx.array(ends[-1:], mx.int32))
        self._ends, self._ends_buffer = ends, self.ends.buffer
        self.a.append(_pad(a, rank))
        self.b.append(_pad(b, rank)[:, :, None])

    def chunk_ends(self) -> list[int]:
        """Where each chunk ends, from the host's record of the appends (read from ``ends``
        only after a restore)."""
        if self.ends.buffer is not self._ends_buffer or self.ends.length != len(self._ends):
            self._ends = [] if self.ends.buffer is None else self.ends.view().tolist()
            self._ends_buffer = self.ends.buffer
        return self._ends

    def term(self, room: int, group: int, scores: bool) -> "LowRankTerm":
        """What decode reads over ``room`` tokens (the backbone's buffers' room): the whole
        buffers (their room zeros), the valid count, and the views of them that the read
        takes (``token_scores`` for keys' ``scores``, ``group_mix`` for values, chunks
        starting at multiples of ``group``). The views share the buffers' memory (they are
        not more to keep, so they are held beside the factors, not in them: ``_VIEWS``) and
        are made once per chunk kept, so a step reads them as evaluated arrays."""
        buffers = (self.a.buffer, self.b.buffer, self.chunk.buffer)
        stamp = (self.count, self.n_chunks, room, group, scores)
        memo = _VIEWS.get(self)
        if memo is None or memo[1] != stamp or any(x is not y for x, y in zip(memo[0], buffers)):
            a, b, chunk = buffers
            a, chunk = fitted_rows(a, room, 2), fitted_rows(chunk, room, 0)
            a = a.reshape(*a.shape[:2], room // group, group, a.shape[-1])  # (B, H, groups, group, r)
            views = (a.swapaxes(-1, -2), b, chunk[::group]) if scores else (a, b.swapaxes(-1, -2), chunk[::group])
            memo = _VIEWS[self] = (buffers, stamp, views)
        return LowRankTerm(*buffers, self.count, memo[2])

    def dense(self) -> mx.array:
        """L of every token (B, H, T, d), float32, chunk by chunk (transient: prefill and
        tests)."""
        a, b = self.a.view().astype(mx.float32), self.b.view().astype(mx.float32)
        parts, start = [], 0
        for c, end in enumerate(self.chunk_ends()):
            parts.append(a[:, :, start:end] @ b[:, :, c].swapaxes(-1, -2))
            start = end
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    def arrays(self, prefix: str) -> dict[str, GrowingArray]:
        return {f"{prefix}_lr_a": self.a, f"{prefix}_lr_b": self.b, f"{prefix}_lr_chunk": self.chunk,
                f"{prefix}_lr_ends": self.ends}

    def problems(self, head_dim: int, count: int):
        """(field, found, expected) where the factors contradict each other or ``count``."""
        kept = [g.buffer is not None for g in (self.a, self.b, self.chunk, self.ends)]
        if not any(kept):
            return
        if not all(kept):
            yield "low-rank factors", "some of A, B, chunk indices and ends", "all four or none"
            return
        a, b, chunk, ends = self.a.view(), self.b.view(), self.chunk.view(), self.ends.view()
        if (a.shape[2], chunk.shape[0]) != (count, count):
            yield "low-rank rows (A, chunk indices)", (a.shape[2], chunk.shape[0]), f"{count} each"
        elif b.shape[3:] != (head_dim, a.shape[3]) or b.shape[2] != ends.shape[0]:
            yield "low-rank B (chunks, head_dim, rank)", b.shape[2:], (ends.shape[0], head_dim, a.shape[3])
        else:
            expected = mx.concatenate([mx.full((int(e - s),), c, mx.int32) for c, (s, e) in
                                       enumerate(zip([0] + ends.tolist()[:-1], ends.tolist()))])
            if ends.tolist()[-1] != count or not mx.array_equal(chunk, expected):
                yield "low-rank chunk indices", "not the runs its chunk ends give", f"ends {ends.tolist()}"


@dataclass(frozen=True)
class LowRankTerm:
    """The additive low-rank term of a decode step, read over the buffers' whole room (rows
    past the valid ones are zeros): ``a`` (B, H, T, r), ``b`` (B, H, C, d, r), ``chunk``
    (T,), ``count`` valid tokens. ``scores``/``mix`` over the valid tokens; the decode step
    traces ``token_scores``/``group_mix`` into its one compiled pass (``reader.py``)."""

    a: mx.array
    b: mx.array
    chunk: mx.array
    count: int
    views: tuple  # what ``token_scores`` or ``group_mix`` reads (``ChunkedFactors.term``)

    def scores(self, q: mx.array) -> mx.array:
        """(B, H, R, count) float32 ``q Lᵀ`` for float32 queries (B, H, R, d)."""
        return token_scores(q, *self.views)[..., : self.count]

    def mix(self, p: mx.array) -> mx.array:
        """(B, H, R, d) float32 ``p L`` for float32 probabilities (B, H, R, count)."""
        a = self.views[0]  # (B, H, groups, group, r)
        room = a.shape[2] * a.shape[3] - p.shape[-1]
        p = p if not room else mx.pad(p, [(0, 0)] * 3 + [(0, room)])
        return group_mix(p, *self.views, mx.zeros((*p.shape[:3], self.views[1].shape[-1]), mx.float32))


def token_scores(q: mx.array, a_t: mx.array, b: mx.array, chunk_of_group: mx.array) -> mx.array:
    """(B, H, R, n) float32 ``q Lᵀ`` over ``n`` rows of room, chunks starting at multiples of
    a group of tokens: ``a_t`` (B, H, groups, r, group), ``b`` (B, H, C, d, r),
    ``chunk_of_group`` (groups,). ``q B_c`` for every chunk, gathered per group (its
    chunk's), then one product per group with the group's rows of A: O(T r) reads and no
    (R, T, r) table (a gather of ``q B_c`` per token and a sum over r cost 430 us of a
    layer's step at 32k on the H200, ``benchmarks/notes/decode_kernels.md``)."""
    bs, h, groups, _, group = a_t.shape
    qb = q[:, :, None] @ b.astype(mx.float32)  # (B, H, C, R, r)
    s = mx.take(qb, chunk_of_group, axis=2) @ a_t.astype(mx.float32)  # (B, H, groups, R, group)
    return s.swapaxes(2, 3).reshape(bs, h, q.shape[2], groups * group)


def group_mix(p: mx.array, a: mx.array, b_t: mx.array, chunk_of_group: mx.array, out: mx.array) -> mx.array:
    """``out`` (B, H, R, d) plus ``p L`` (float32) for weights ``p`` (B, H, R, n) over ``n``
    rows of room, zero past the valid ones, chunks starting at multiples of a group of
    tokens: ``a`` (B, H, groups, group, r), ``b_t`` (B, H, C, r, d), ``chunk_of_group``
    (groups,). Per group ``Σ_t p_t A_t`` (one product per group), then one product with B
    gathered per group (its chunk's) and added to ``out``: O(n r + n d r / group)."""
    bs, h, r, n = p.shape
    _, _, groups, group, rank = a.shape
    per_group = p.reshape(bs, h, r, groups, group).swapaxes(2, 3) @ a.astype(mx.float32)  # (B, H, groups, R, r)
    b_g = mx.take(b_t, chunk_of_group, axis=2).astype(mx.float32)  # (B, H, groups, r, d)
    return mx.addmm(out, per_group.swapaxes(2, 3).reshape(bs, h, r, groups * rank),
                    b_g.reshape(bs, h, groups * rank, -1))
