"""A group-affine base plus additive residual terms, read by the pure-MLX decode path.

Error-feedback codecs (GEAR: a low-rank and a sparse residual on a quantized backbone)
keep ``x_hat = dequant(base) + Σ terms``. Scores and mixes are linear in ``x_hat``, so
decode reads each piece in its own packed form and adds the results: the base through
the shared group-affine readers (``kernels/kivi_decode.py``: ``quantized_matmul`` on the
CPU), each term through its own ``scores``/``mix`` (``lowrank/chunked.LowRankTerm``,
``quant/sparse.SparseTerm``). Nothing is dequantized to a dense history.

The terms add to the scores before the softmax, so such a part cannot be a fused-kernel
part of its own in the log-sum-exp merge: ``ResidualScores`` is a ``PackedScores``
(``kernels/decode.py``) on every device. A store with no terms hands the base's
``AffineLayout`` itself, which the fused kernel serves at 2, 4 and 8 bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..kernels import kivi_decode as kd
from .packed import AffineLayout


@dataclass(frozen=True)
class ResidualScores:
    base: AffineLayout  # per channel for keys, per token for values (whole buffers)
    terms: tuple  # objects with scores(q) / mix(p) over the same ``count`` tokens

    @property
    def count(self) -> int:
        return self.base.count

    @property
    def n_heads(self) -> int:
        return self.base.codes.shape[1]

    def scores(self, q: mx.array) -> mx.array:
        """Keys: float32 ``q Kᵀ`` (B, H, R, count) for scaled float32 queries."""
        b = self.base
        s = kd.affine_key_scores(q, b.codes, b.scales, b.biases, b.count, b.bits, b.group)
        return sum((term.scores(q) for term in self.terms), s)

    def mix(self, p: mx.array) -> mx.array:
        """Values: float32 ``p V`` (B, H, R, D) for float32 probabilities (B, H, R, count)."""
        b = self.base
        o = kd.affine_value_mix(p, b.codes, b.scales, b.biases, b.count, b.bits, b.group)
        return sum((term.mix(p) for term in self.terms), o)
