"""Q-Filters: keep the keys that project most on the direction a head's queries share.

A head's queries lie mostly on one side of a dominant direction v, so
<q, k> ~ <q, v><k, v>: a key's projection on v predicts the attention it draws, with no
query at hand. Calibration, per query head: an uncentred float32 SVD of its post-RoPE
queries, Q = U S V^T; v = V[:, 0], oriented so most queries project positively
(sigma = +1 if more than half of U[:, 0] is positive, else -1). A KV head's filter f is
the mean of its query heads' sigma v (not renormalised). Score: ``qfilters_sign`` * <k, f>,
the highest kept (the official filter is stored negated, -sigma v, and scored with
-<k, filter>: the same ranking). A token's projection never changes (the filter is
frozen), so it is computed once, in float32, and kept beside the token.

Scores when the prompt is in and every ``EVICT_EVERY`` decode steps (``evict/base.py``): the
paper frees the slot of the lowest score at every step; here the ``EVICT_EVERY`` lowest leave
at once, so attention sees up to budget + ``EVICT_EVERY`` - 1 tokens between evictions, and
a decode step only writes its token (its projection, one product). The sinks and the newest
tokens are never evicted: the ``qfilters_recent`` newest,
and at least ``RECENT_FLOOR`` (``recent_floor``, at most a quarter of the budget), since
with none, as at the contract's default of 0, a new token that projects below the kept
ones is evicted at once and the text degenerates. Attention always sees
every stored token; the score itself needs no query.

Calibrated offline (the paper's procedure; the config's ``calibration_file``, written by
``veloxquant calibrate --method qfilters``): the file holds each layer's filter per KV head
(``filter``, (1, Hkv, D) float32), fitted by ``QFiltersCache.calibrate`` with the prompt
calibration's arithmetic on every post-RoPE query of the text past the first
``qfilters_n_sink`` (the paper samples about 3000 queries of generic text; the command's
default 2048 tokens give 2044). The cache reads and checks it at once when it has a model
context (refusing a file made for another method, ``qfilters_n_sink``, model or key shape,
by name) and installs it, broadcast over the batch rows, at its first ``update_and_fetch``,
before any token is written: every token's projection is taken as it comes, no query is
buffered and no filter is fitted, and the filter never changes (Q-Filters has no refits;
``qfilters_calib_tokens`` is not read, and trimming is exact while nothing is evicted).
The retention check does not apply with a file: it measures a filter on the queries it
was fitted on, which the cache never sees, and the
queries at hand at the first eviction are the prompt's last one only (mlx-lm hands it
alone), so ``qfilters_min_retention`` and ``qfilters_on_low_retention`` are not read either.
Given the same queries, a file calibrated on a prompt's own tokens holds the prompt
calibration's filter, bit for bit, whenever that calibration also takes every query past
the sinks (at most ``qfilters_calib_tokens`` of them); on a longer prompt the calibration
takes an even subset of them, the file all.

Adapted, without a file: the filter is calibrated online, once per layer and sequence, from
``qfilters_calib_tokens`` queries of the sequence itself (min(T - n_sink, that)), at an
even stride across it, the sinks excluded. The queries are never all held: a buffer keeps
every s-th one, at most twice the calibration count, s doubling as the sequence grows. The
filter is fixed at the first eviction: the prompt's end when the prompt exceeds the
budget, else the first decode step over it (whose queries then calibrate too).

Retention check (inferred; online calibration only), run then unless
``qfilters_min_retention`` is None or ``qfilters_on_low_retention`` is 'ignore': the
calibration queries' exact causal attention over the stored keys; the mass on the tokens
the filter keeps, averaged over the queries and the query heads of a KV head, is that
head's retention. Below the threshold, 'warn' issues a ``LowRetentionWarning`` and 'raise'
a ``LowRetentionError`` (before anything is evicted), each naming the layer, the worst KV
head and its value. In a model's cache the warnings wait for the last layer's prompt end,
which reads every layer's retention at once (one host read a prompt, not one a layer);
'raise' reads its layer's at once, to fail before anything is evicted.
"""

from __future__ import annotations

import warnings

import mlx.core as mx

from ..cache.calibration import batch_rows, layer_calibration
from ..diagnostics import VeloxQuantWarning
from ..evict.attention import attention_mass
from ..evict.base import EVICT_EVERY, RECENT_FLOOR, Roles, Schedule, ScoredEvictionCache
from ..evict.select import group_mean, top_k_sorted


class _LowRetention:
    def __init__(self, layer: int, head: int, retention: float, threshold: float, failing: int, heads: int):
        self.layer, self.head, self.retention, self.threshold = layer, head, retention, threshold
        super().__init__(
            f"qfilters layer {layer}, KV head {head}: the tokens the filter keeps hold "
            f"{retention:.3f} of the calibration queries' attention, below "
            f"qfilters_min_retention={threshold} ({failing} of {heads} KV heads are below)"
        )


class LowRetentionWarning(_LowRetention, VeloxQuantWarning):
    """A Q-filter keeps less of its calibration queries' attention than asked for."""


class LowRetentionError(_LowRetention, RuntimeError):
    """``qfilters_on_low_retention='raise'`` and a Q-filter keeps too little attention."""


WAITING_CHECKS = "qfilters_waiting_checks"  # the model context's (layer, per-head retention, threshold)s


def _report_low_retention(layer: int, per_head: list[float], threshold: float, action: str) -> None:
    """Warn or raise (``action``) when a KV head's retention is below ``threshold``."""
    worst = min(range(len(per_head)), key=per_head.__getitem__)
    if per_head[worst] >= threshold:
        return
    args = (layer, worst, per_head[worst], threshold, sum(v < threshold for v in per_head), len(per_head))
    if action == "raise":
        raise LowRetentionError(*args)
    warnings.warn(LowRetentionWarning(*args), stacklevel=4)


def oriented(u: mx.array, v: mx.array) -> mx.array:
    """sigma * v, sigma = +1 where more than half of ``u`` (U[:, 0], (..., N)) is positive."""
    positive = (u > 0).astype(mx.float32).mean(axis=-1, keepdims=True) > 0.5
    return mx.where(positive, 1.0, -1.0) * v


#: Squarings of each head's Gram matrix: its top eigenvector dominates the rest by
#: (lambda_2 / lambda_1) ** (2 ** SQUARINGS), 3e-5 at an eigenvalue ratio of 0.99.
SQUARINGS = 10


def top_right_vectors(x: mx.array) -> mx.array:
    """The top right singular vector of each (..., N, D) matrix, (..., D) float32 of unit
    norm (sign arbitrary), by matrix products only, on the default device: the D x D Gram
    matrix squared ``SQUARINGS`` times (normalised each time) is rank one along it; its
    largest column, refined by two power steps through ``x`` itself (which keep float32's
    precision instead of the Gram's squared condition), is the vector."""
    g = x.swapaxes(-1, -2) @ x
    for _ in range(SQUARINGS):
        g = g @ g
        g = g / mx.maximum(mx.abs(g).max(axis=(-2, -1), keepdims=True), 1e-30)
    column = mx.argmax((g * g).sum(axis=-2), axis=-1)
    v = mx.take_along_axis(g, column[..., None, None], axis=-1)  # (..., D, 1)
    for _ in range(2):
        v = x.swapaxes(-1, -2) @ (x @ v)
        v = v / mx.maximum(mx.linalg.norm(v, axis=-2, keepdims=True), 1e-30)
    return v[..., 0]


def query_filters(queries: mx.array) -> mx.array:
    """Unit filter per query head from its queries (B, Hq, N, D): (B, Hq, D), float32: the
    oriented top right singular vector of the uncentred queries (the card's SVD), found by
    ``top_right_vectors`` on the default device instead of an SVD by LAPACK on the CPU
    stream, which on a GPU is a round trip a layer in the prefill (issue 31)."""
    x = queries.astype(mx.float32)
    v = top_right_vectors(x)
    return oriented((x @ v[..., None])[..., 0], v)


def retention(queries, q_positions, keys, k_positions, kept, scale) -> mx.array:
    """Mass the queries' causal attention puts on the ``kept`` keys (B, Hkv, n) bool,
    averaged over the queries and the query heads of each KV head: (B, Hkv). Each key's
    share is ``attention_mass`` with every query weighted 1/N: the prompt-mass kernels on a
    GPU, no softmax written per head and query."""
    n = queries.shape[2]
    mass = attention_mass(queries, keys, scale, q_positions, k_positions, mx.full((n,), 1.0 / n, mx.float32))
    return mx.where(kept, mass, 0.0).sum(axis=-1)


def calibration_stride(seen: int, capacity: int) -> int:
    """The smallest power of two s with ceil(seen / s) <= capacity."""
    s = 1
    while -(-seen // s) > capacity:
        s *= 2
    return s


class QFiltersCache(ScoredEvictionCache):
    roles = Roles(budget="qfilters_budget", n_sink="qfilters_n_sink", recent="qfilters_recent")
    schedule = Schedule(prefill_end=True, decode_every=EVICT_EVERY)
    batchable = True
    # Packed once calibrated: the filter is then fixed (each sequence's, joined), ``_evict``
    # is the base's and ``trim`` has no calibration queries left to cut.
    sequence_state = ("filter",)
    # ``update_and_fetch`` only installs a calibration file's filter, before the first token
    same_at_decode = ("update_and_fetch", "_evict", "is_trimmable", "trim")
    token_state = ("proj",)
    recent_floor = RECENT_FLOOR  # the contract's default recent window is 0 (module docstring)
    # offline calibration (``veloxquant calibrate --method qfilters``): the filters are fitted
    # on a text's queries, which the command collects when this is true
    calibration_queries = True
    calibration_fields = ("qfilters_n_sink",)  # the queries fitted are the text's past the sinks

    def _init_storage(self) -> None:
        super()._init_storage()
        self.filter = None  # (B, Hkv, D) float32, once calibrated
        self.calib = None  # (B, Hq, <= 2 * calib_tokens, D): queries n_sink + j * stride
        if self.config.calibration_file and self.context is not None:  # a wrong file fails at once
            self._calibration(None)

    # -- a calibration file's filter, installed before the first token -------------------
    def _calibration(self, kv_shape) -> mx.array:
        """This layer's filter (1, Hkv, D) in ``calibration_file``, checked against the
        config, the model and the keys' (heads, head_dim) when known."""
        return layer_calibration(self.config, self.calibration_fields, ("filter",), self.layer,
                                 model_args=getattr(self.context, "model_args", None),
                                 kv_shape=kv_shape)["filter"]

    def update_and_fetch(self, keys, values):
        if self.filter is None and self.config.calibration_file:
            b, hkv, _, d = keys.shape
            self.filter = batch_rows(self._calibration((hkv, d)).astype(mx.float32), b)
        return super().update_and_fetch(keys, values)

    @classmethod
    def calibrate(cls, keys, values, config, *, iters: int, seed: int, progress=None, model_args=None,
                  queries=None):
        """A layer's filter per KV head, ``{"filter": (1, Hkv, D) float32}``, from the
        post-RoPE queries (1, Hq, T, D) of a text: the prompt calibration's arithmetic on
        every query past the first ``qfilters_n_sink`` (the paper's thousands of queries;
        ``qfilters_calib_tokens`` bounds only the online buffer). ``iters``, ``seed``,
        ``values`` and ``model_args`` change nothing: the fit is deterministic."""
        if queries is None:
            raise ValueError("qfilters calibrates on the text's queries (calibrate(..., queries=)); none given")
        sink = config.qfilters_n_sink
        if queries.shape[2] <= sink:
            raise ValueError(f"{queries.shape[2]} calibration tokens leave no query past "
                             f"qfilters_n_sink={sink} to fit the filters on (use more --tokens)")
        filters = group_mean(query_filters(queries[:, :, sink:]), keys.shape[1])
        if progress:
            progress("queries", 1, 1)
        return {"filter": filters}

    def packs_now(self) -> bool:
        return self.filter is not None

    # -- calibration queries: every stride-th after the sinks ---------------------------
    @property
    def capacity(self) -> int:
        return 2 * self.options.qfilters_calib_tokens

    def seen(self, offset: int) -> int:
        return max(0, offset - self.n_sink)

    def observe(self, inputs):
        if self.filter is not None:
            return
        before, after = self.seen(self.offset - inputs.n_new), self.seen(self.offset)
        if after == before:
            return
        old, new = calibration_stride(before, self.capacity), calibration_stride(after, self.capacity)
        kept = None if self.calib is None else self.calib[:, :, :: new // old]
        first = -(-before // new) * new  # the first multiple of the stride not yet held
        if first < after:
            start = self.n_sink + first - (self.offset - inputs.n_new)
            fresh = mx.contiguous(inputs.queries[:, :, start::new])  # a view would pin all of q
            kept = fresh if kept is None else mx.concatenate([kept, fresh], axis=2)
        self.calib = kept

    def _queries_kept(self):
        return super()._queries_kept() + ([] if self.calib is None else [self.calib])

    # -- the filter, fixed at the first eviction ---------------------------------------
    def _evict(self, inputs, decode_step):
        if self.filter is None and self.store.rows > self.budget:
            self._calibrate(inputs)
        super()._evict(inputs, decode_step)
        ctx = self.context
        if ctx is not None and self.layer == ctx.local_compressed_layers[-1]:
            self._report_waiting_checks()

    def _calibrate(self, inputs) -> None:
        b, hkv, _, d = inputs.keys.shape
        if self.calib is None:  # every token is a sink: nothing to calibrate on, nothing to rank
            self.filter = mx.zeros((b, hkv, d), mx.float32)
            return
        held = self.calib.shape[2]
        n = min(held, self.options.qfilters_calib_tokens)
        pick = [i * held // n for i in range(n)]  # an even subset of the held queries
        queries = self.calib[:, :, mx.array(pick)]
        filters = group_mean(query_filters(queries), hkv)
        proj = (inputs.keys.astype(mx.float32) * filters[:, :, None]).sum(axis=-1)
        options = self.options
        if options.qfilters_min_retention is not None and options.qfilters_on_low_retention != "ignore":
            stride = calibration_stride(self.seen(self.offset), self.capacity)
            q_positions = self.n_sink + stride * mx.array(pick)
            score = mx.where(self.protected(inputs.positions), float("inf"), options.qfilters_sign * proj)
            slots = top_k_sorted(score, self.budget)
            kept = mx.put_along_axis(mx.zeros(proj.shape, mx.bool_), slots, mx.array(True), axis=-1)
            mass = retention(queries, q_positions, inputs.keys, inputs.positions, kept, inputs.scale)
            per_head, threshold = mass.min(axis=0), options.qfilters_min_retention
            if options.qfilters_on_low_retention == "warn" and self.context is not None:
                self._wait_to_check(per_head, threshold)
            else:  # "raise" fails before anything is evicted or fixed
                _report_low_retention(self.layer, per_head.tolist(), threshold, options.qfilters_on_low_retention)
        self.filter, self.calib = filters, None
        self.store.update("proj", proj)

    def _wait_to_check(self, per_head: mx.array, threshold: float) -> None:
        """Hold a warning's check until the last layer's prompt end (``_report_waiting_checks``):
        one host read for every layer, where a read a layer made the device wait at each."""
        waiting = self.context.shared.setdefault(WAITING_CHECKS, [])
        if self.layer == self.context.local_compressed_layers[0]:
            waiting.clear()  # a step that stopped before its last layer left nothing to report
        waiting.append((self.layer, per_head, threshold))

    def _report_waiting_checks(self) -> None:
        waiting = self.context.shared.pop(WAITING_CHECKS, None)
        if waiting:
            values = mx.stack([per_head for _, per_head, _ in waiting]).tolist()
            for (layer, _, threshold), row in zip(waiting, values):
                _report_low_retention(layer, row, threshold, "warn")

    def new_token_state(self, keys, values):
        if self.filter is None:
            return super().new_token_state(keys, values)
        return {"proj": (keys.astype(mx.float32) * self.filter[:, :, None]).sum(axis=-1)}

    def score(self, inputs):
        return self.options.qfilters_sign * inputs.state("proj")

    # -- state and trim ------------------------------------------------------------------
    def _arrays(self):
        return {**super()._arrays(), "filter": self.filter, "calib": self.calib}

    def _restore_arrays(self, arrays):
        super()._restore_arrays(arrays)
        self.filter, self.calib = arrays.get("filter"), arrays.get("calib")

    def is_trimmable(self) -> bool:  # exact while every calibration query is held (stride 1)
        if self.config.calibration_file:  # the file's filter: no query is held
            return super().is_trimmable()
        return super().is_trimmable() and calibration_stride(self.seen(self.offset), self.capacity) == 1

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if n and self.calib is not None:
            left = self.seen(self.offset)
            self.calib = self.calib[:, :, :left] if left else None
        return n
