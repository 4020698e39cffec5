"""CurDKV: keep the tokens whose key and value rows carry the most leverage (CUR row selection).

Query-free and prefill-only: scores once, when the prompt is in, per layer and KV head,
in float32, from the stored keys and values alone. Keys are first rotated back to
pre-RoPE (at their own positions, with the model's rotary settings). Both K and V are
sketched by one seeded Gaussian G (head_dim x r, r = min(``curdkv_rank_cap``, head_dim),
seeded by the layer index, so a run is reproducible); r >= head_dim takes K and V whole.
A token's leverage in X (the T x r sketch) is l_i = x_i^T (X^T X)^+ x_i, the squared norm
of its row in an orthonormal basis of X's columns: the rank-r leverage of the randomized
range finder, which sums to rank(X); at the default sketch width it is computed on the
device, by Gauss-Jordan sweeps of the r x r Gram matrix. Leverage is made local (divided
by its sum over consecutive windows of 16 tokens, aligned at the first token, the last
one short), the key and value shares are multiplied (the card's kv_product) and
normalised to sum 1; the sinks and the prompt's last 32 tokens are kept and the rest of
``curdkv_budget`` goes to the best-scored tokens. Decode only appends.

Adapted: the reference code (kvpress's CURPress, the third-party original) scores squared
row norms of the sketch; here the sketch's true leverage is taken (the CUR definition,
the card's optional "exact" mode), so de-rotation matters with or without a sketch.
The last 32 prompt tokens are kept too (fewer if the budget is smaller): the reference
code runs in kvpress, which compresses a context before its question is appended; here
the question is the prompt's tail. Window and combination are constants, not fields.
``curdkv_rope_base``: the model's own rotary settings (``context.model_args``: theta,
traditional, scaling) are used when known; the field is what de-rotates otherwise (no
make_prompt_cache context), and a non-default value that contradicts the model's
rope_theta is refused, naming both. The settings used travel with the cache's state.
"""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx

from ..cache.options import CurDKVOptions
from ..evict.base import Roles, Schedule, ScoredEvictionCache
from ..cache.rope import Rotary, derotate
from ..kernels.compiled import PerShape
from ..lowrank.cpu_streams import cpu_eigh

LOCAL_WINDOW = 16  # tokens per local normalisation window (the card's constant)
RECENT = 32  # the prompt's last tokens (its question) are kept, like SnapKV's window
RANK_RTOL = 1e-6  # directions below this fraction of the largest eigenvalue (or its bound r) are absent
SWEPT_MAX_RANK = 32  # sketches up to this wide are inverted on the device (``_swept_inverse``)
DEFAULT_BASE = {f.name: f.default for f in dataclasses.fields(CurDKVOptions)}["curdkv_rope_base"]


def leverage_scores(x: mx.array) -> mx.array:
    """Row leverage of x (..., T, r): x_i^T (x^T x)^+ x_i, float32 (...,T); sums to rank(x).

    The columns are scaled to unit norm first (leverage depends on their span alone). Up to
    ``SWEPT_MAX_RANK`` columns (the sketch at its default, 16) the r x r Gram matrix is
    inverted by sweeping its pivots in turn (``_swept_inverse``), r compiled elementwise
    steps: the whole score stays on the device, where an ``eigh`` is a round trip to the
    CPU at every layer's prompt end. Wider (the exact mode's head_dim), the r steps would
    cost more than that round trip, and the CPU stream's ``eigh`` takes the pseudo-inverse."""
    x = x.astype(mx.float32)
    x = x / mx.maximum(mx.linalg.norm(x, axis=-2, keepdims=True), 1e-30)
    gram = x.swapaxes(-1, -2) @ x
    if gram.shape[-1] <= SWEPT_MAX_RANK:
        return ((x @ _swept_inverse(gram)) * x).sum(axis=-1)
    eigenvalues, basis = cpu_eigh(gram)
    present = eigenvalues > RANK_RTOL * eigenvalues.max(axis=-1, keepdims=True)
    inverse = mx.where(present, 1.0 / mx.where(present, eigenvalues, 1.0), 0.0)
    return (mx.square(x @ basis) * inverse[..., None, :]).sum(axis=-1)


def _sweep(gram: mx.array) -> mx.array:
    """(G_SS)^-1 (zero outside S) of Gram matrices (..., r, r) with unit diagonal, S the
    columns that stand off the span of the columns before them: Gauss-Jordan sweeps
    over the pivots in order (a symmetric positive semidefinite matrix needs no pivoting).
    A pivot is column k's squared distance to the earlier columns' span; one at most
    ``RANK_RTOL`` x r (of the trace, which bounds the largest eigenvalue) is skipped, so
    x_i^T (G_SS)^-1 x_i projects on the span of all the columns, the pseudo-inverse's
    leverage with its cut where ``eigh``'s was."""
    r = gram.shape[-1]
    floor = RANK_RTOL * r  # of the trace, the largest eigenvalue's bound, as eigh's cut was of it
    index = mx.arange(r)
    swept = mx.zeros(gram.shape[:-1], dtype=mx.bool_)
    a = gram
    for k in range(r):
        d = a[..., k : k + 1, k : k + 1]
        take = d > floor
        d = mx.where(take, d, 1.0)
        col, row = a[..., :, k : k + 1], a[..., k : k + 1, :]
        on_row, on_col = (index == k)[:, None], (index == k)[None, :]
        swept_a = mx.where(on_row & on_col, -1.0 / d,
                           mx.where(on_row, row / d, mx.where(on_col, col / d, a - col * row / d)))
        a = mx.where(take, swept_a, a)
        swept = swept | (take[..., 0] & (index == k))
    both = swept[..., :, None] & swept[..., None, :]
    return mx.where(both, -a, 0.0)


_swept_inverse = PerShape(_sweep)  # r fused steps, not some 10 r kernels


def local_share(scores: mx.array, window: int = LOCAL_WINDOW) -> mx.array:
    """Each score divided by the sum over its window of ``window`` consecutive tokens."""
    n = scores.shape[-1]
    pad = -n % window
    padded = mx.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(0, pad)])
    blocks = padded.reshape(*scores.shape[:-1], -1, window)
    total = blocks.sum(axis=-1, keepdims=True)
    return (blocks / mx.where(total > 0, total, 1.0)).reshape(*scores.shape[:-1], -1)[..., :n]


class CurDKVCache(ScoredEvictionCache):
    roles = Roles(budget="curdkv_budget", n_sink="curdkv_n_sink")
    schedule = Schedule(prefill_end=True)
    batchable = True  # packed decode: evict/batch.py runs the base's decode steps for the batch

    def _init_storage(self) -> None:
        super()._init_storage()
        base = self.options.curdkv_rope_base
        model = Rotary.from_model_args(getattr(self.context, "model_args", None))
        if model is not None and base not in (DEFAULT_BASE, model.base):
            raise ValueError(f"curdkv_rope_base={base!r} contradicts the model's rope_theta="
                             f"{model.base!r}: keys are de-rotated with the model's; leave "
                             f"curdkv_rope_base at {DEFAULT_BASE!r} or set it to {model.base!r}")
        self.rotary = model or Rotary(base)

    @property
    def recent(self) -> int:  # within the budget: what the sinks leave, at most RECENT
        return max(0, min(RECENT, self.budget - self.n_sink))

    def _meta(self):
        return {**super()._meta(), "rotary": self.rotary.to_json()}

    def _restore_meta(self, meta):
        super()._restore_meta(meta)
        self.rotary = Rotary.from_json(meta["rotary"])

    def sketch(self, head_dim: int) -> mx.array | None:
        """This layer's Gaussian G (head_dim, r), entries N(0, 1/r); None when r >= head_dim."""
        r = min(self.options.curdkv_rank_cap, head_dim)
        if r >= head_dim:
            return None
        return mx.random.normal((head_dim, r), key=mx.random.key(self.layer)) / math.sqrt(r)

    def score(self, inputs):
        # slots are in token order here: a prefill-only cache gathers in order and appends
        keys = derotate(inputs.keys, inputs.positions, self.rotary)
        values = inputs.values.astype(mx.float32)
        g = self.sketch(keys.shape[-1])
        if g is not None:
            keys, values = keys @ g, values @ g
        share = local_share(leverage_scores(keys)) * local_share(leverage_scores(values))
        total = share.sum(axis=-1, keepdims=True)
        return share / mx.where(total > 0, total, 1.0)
