"""A decode step's read of an error-feedback run: backbone, low rank and outliers in one pass.

``ResidualScores`` reads the backbone and each term on its own and adds the results; here
the keys' scores (the mix of values) are one compiled pass over the buffers' whole room:
the backbone's ``quantized_matmul`` (a float32 dequantization on a GPU), the low-rank term
(``chunked.token_scores`` / ``chunked.group_mix``) and the outliers scatter-added into the
sum (``sparse.along_rows``: keys per channel, values per token, the other term's query rows
broadcast along the table's rows). Rows past the valid count are zeros in every buffer:
their scores are cut off after the pass, their weights padded with zeros before it, so a
step's shapes change only when a buffer grows and the compiled pass is traced again.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ...kernels import kivi_decode as kd
from ...quant.residual import ResidualScores
from ...cache.buffers import fitted_rows
from .chunked import LowRankTerm, group_mix, token_scores
from .sparse import SparseTerm, along_rows, row_offsets


def backbone_room(base) -> int:
    """Tokens every backbone buffer has room for (a multiple of the group)."""
    if base.axis == "channel":
        return min(base.codes.shape[-1] * 32 // base.bits, base.scales.shape[-1] * base.group)
    return min(base.codes.shape[2], base.scales.shape[2])


def _key_pass(bits, group, lowrank, sparse, q, codes, scales, biases, *rest):
    n = min(codes.shape[-1] * 32 // bits, scales.shape[-1] * group)  # the room
    s = kd.affine_key_scores(q, codes, scales, biases, n, bits, group)  # (B, H, R, n)
    if lowrank:
        s = s + token_scores(q, *rest[:3])
        rest = rest[3:]
    if sparse:  # per channel: q's channel broadcasts along its entries
        s = along_rows(s, q, *rest)
    return s


def _value_pass(bits, group, lowrank, sparse, p, codes, scales, biases, *rest):
    n = p.shape[-1]  # the room, the weights past the valid rows zeros
    o = kd.affine_value_mix(p, codes, scales, biases, n, bits, group)  # (B, H, R, D)
    if lowrank:
        o = group_mix(p, *rest[:3], o)
        rest = rest[3:]
    if sparse:  # per token: p's token broadcasts along its entries
        delta, index, offsets = rest
        o = along_rows(o, p, fitted_rows(delta, n, 2), fitted_rows(index, n, 2), offsets)
    return o


@functools.lru_cache(maxsize=None)
def _compiled(keys: bool, bits: int, group: int, lowrank: bool, sparse: bool, path: str):
    """One read as one compiled pass, per static setting (``path``: the pure path, which
    decides the backbone's reader)."""
    read = _key_pass if keys else _value_pass
    return mx.compile(functools.partial(read, bits, group, lowrank, sparse))


class ErrorFeedbackScores(ResidualScores):
    """``ResidualScores`` whose ``terms`` (a ``LowRankTerm``, a ``SparseTerm``, either or
    both) read the buffers' whole room, and whose scores and mix are one compiled pass."""

    def _inputs(self, lead: tuple, n: int, out_rows: int) -> tuple:
        """The compiled pass's settings (low rank, sparse) and its inputs after the queries
        (weights) of leading shape ``lead`` (B, H, R)."""
        lowrank = sparse = False
        rest = []
        for term in self.terms:
            if isinstance(term, LowRankTerm):
                lowrank = True
                rest = list(term.views) + rest
            elif isinstance(term, SparseTerm):
                sparse = True
                rest += [*term.inputs(), row_offsets(*lead, out_rows)]
        b = self.base
        return (lowrank, sparse), (b.codes, b.scales, b.biases, *rest)

    def score_pass(self, lead: tuple, path: str):
        """(the compiled key pass, its inputs after the queries, the valid count or None
        where it is the room): ``scores`` of queries of leading shape ``lead``, kept by a
        store between writes (``joint.GEARStore``) so that a step calls the pass alone."""
        b, n = self.base, backbone_room(self.base)
        flags, inputs = self._inputs(lead, n, n)
        return _compiled(True, b.bits, b.group, *flags, path), inputs, (None if n == self.count else self.count)

    def mix_pass(self, lead: tuple, path: str):
        """(the compiled value pass, its inputs after the weights, the pad of the weights
        to the room or None): ``mix`` of weights of leading shape ``lead``, kept as
        ``score_pass``."""
        b, n = self.base, backbone_room(self.base)
        d = b.codes.shape[-1] * 32 // b.bits
        flags, inputs = self._inputs(lead, n, d)
        pad = [(0, 0)] * 3 + [(0, n - self.count)] if self.count < n else None
        return _compiled(False, b.bits, b.group, *flags, path), inputs, pad

    def scores(self, q: mx.array) -> mx.array:
        fn, inputs, cut = self.score_pass(q.shape[:3], kd._pure_path())
        s = fn(q, *inputs)
        return s if cut is None else s[..., :cut]

    def mix(self, p: mx.array) -> mx.array:
        b, n = self.base, backbone_room(self.base)
        if p.shape[-1] < n:  # the weights of the rows past ``count``: zeros
            p = mx.pad(p, [(0, 0)] * 3 + [(0, n - p.shape[-1])])
        d = b.codes.shape[-1] * 32 // b.bits
        flags, inputs = self._inputs(p.shape[:3], n, d)
        return _compiled(False, b.bits, b.group, *flags, kd._pure_path())(p, *inputs)
