"""Low-rank factors of a growing run of chunks, and the decode terms that read them.

A run of tokens is cut into chunks of consecutive tokens; chunk c holds ``L_c = A_c B_cᵀ``
per (batch, head). What is kept, in the factors' dtype:

- ``a``: (B, H, T, r) one row of A per token (``GrowingArray`` along the tokens);
- ``b``: (B, H, C, d, r) one B per chunk (along the chunks);
- ``chunk``: (T,) int32, the chunk of each token, and ``ends`` (C,) int32, where each
  chunk ends (shared by every batch row and head).

r is the widest chunk's rank: a narrower chunk's factors are zero-padded (kept and
counted), and a wider one widens what is kept (a copy when it arrives, never at a step).
Never the dense L. ``LowRankTerm`` reads the factors at a decode step: scores
``q Lᵀ = (q B_c) A_tᵀ`` (``q B`` for every chunk, gathered per token) and mixes
``p L = Σ_c (Σ_{t in c} p_t A_t) B_cᵀ`` (the per-chunk sums as differences of one cumulative
sum at the chunk ends), O(T r) each: no scatter (slow in MLX on the CPU), no dense L.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ...cache.buffers import GrowingArray

CHUNK_STEP = 2  # chunks of room added to ``b`` at a time (a copy of B, which is small)


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
        self.chunk.append(mx.full((a.shape[2],), self.n_chunks, mx.int32))
        self.ends.append(mx.array([self.count + a.shape[2]], mx.int32))
        self.a.append(_pad(a, rank))
        self.b.append(_pad(b, rank)[:, :, None])

    def term(self) -> "LowRankTerm":
        return LowRankTerm(self.a.view(), self.b.view(), self.chunk.view(), self.ends.view())

    def dense(self) -> mx.array:
        """L of every token (B, H, T, d), float32, chunk by chunk (transient: prefill and
        tests; the chunk lengths are read on the host)."""
        a, b = self.a.view().astype(mx.float32), self.b.view().astype(mx.float32)
        parts, start = [], 0
        for c, end in enumerate(self.ends.view().tolist()):
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
    """The additive low-rank term of a decode step, over the valid rows and chunks: ``a``
    (B, H, T, r), ``b`` (B, H, C, d, r), ``chunk`` (T,), ``ends`` (C,)."""

    a: mx.array
    b: mx.array
    chunk: mx.array
    ends: mx.array

    def scores(self, q: mx.array) -> mx.array:
        """(B, H, R, T) float32 ``q Lᵀ`` for float32 queries (B, H, R, d)."""
        qb = (q[:, :, None] @ self.b.astype(mx.float32)).swapaxes(2, 3)  # (B, H, R, C, r)
        per_token = mx.take(qb, self.chunk, axis=3)  # (B, H, R, T, r): one gather
        return (per_token * self.a.astype(mx.float32)[:, :, None]).sum(axis=-1)

    def mix(self, p: mx.array) -> mx.array:
        """(B, H, R, d) float32 ``p L`` for float32 probabilities (B, H, R, T)."""
        w = mx.cumsum(p[..., None] * self.a.astype(mx.float32)[:, :, None], axis=3)  # (B, H, R, T, r)
        through = mx.take(w, self.ends - 1, axis=3)  # Σ up to each chunk's end: (B, H, R, C, r)
        before = mx.pad(through[:, :, :, :-1], [(0, 0), (0, 0), (0, 0), (1, 0), (0, 0)])
        per_chunk = (through - before).swapaxes(2, 3)  # (B, H, C, R, r)
        return (per_chunk @ self.b.astype(mx.float32).swapaxes(-1, -2)).sum(axis=2)
