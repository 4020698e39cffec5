"""Keyformer: keep the key tokens, those with the largest accumulated Gumbel-softmax score.

Each token carries a score S (float32). After every attention call, S += the column sums
of softmax((x + zeta) / tau_t) over this update's queries, summed (not averaged) over the
query heads of its KV head, as the official ``_attn`` sums over queries and heads: x are
the real logits q.k * scale, causal by position, and zeta ~ Gumbel(0, 1) i.i.d. per
sequence, query head, query and key, added to the logits before dividing by tau. Noise
and temperature only score: the layer's output is the plain softmax over the stored
tokens. Scores when the prompt is in (keeping the top ``keyformer_budget``) and every
``EVICT_EVERY`` decode steps (``evict/base.py``: the lowest ``EVICT_EVERY`` S leave at once,
where the paper frees the slot of the lowest at every step; a step between adds its
noisy column sums to S); the sinks and the newest tokens are never
evicted: the ``keyformer_recent`` newest, and at least ``RECENT_FLOOR`` (``recent_floor``,
at most a quarter of the budget) in place of the paper's recent share of the cache, since
with none, as at the contract's default of 0, a new token, scored by its own attention
alone, is mostly the one evicted and the text degenerates. An evicted token's S leaves with it; a new token starts
from its own contribution. The prompt's queries are scored in blocks (``gumbel_mass``).

Temperature at step t (0 for the prompt, then 1, 2, ... for the decode steps after it):
``keyformer_tau`` when set; else tau_init + (tau_end - tau_init) * min(t, A) / A for
A = ``keyformer_anneal_steps`` > 0; else tau_init (tau_end then has no effect).

Noise is a counter-based hash of the positions, never MLX's global seed or PRNG: zeta of a
logit is -log(-log(u)) for u in (0, 1), never 0 or 1, from a 32-bit hash of its sequence
row and query head (numbered b * Hq + h), query position and key position, keyed by
``keyformer_seed`` and the layer. With r and c the halves of splitmix64's finaliser of
(seed, layer) and fmix32 murmur3's finaliser: row = fmix32(fmix32(head ^ r) ^ query
position), column = fmix32(key position ^ c), h = (row ^ column) * 0x85EBCA6B and
u = float32(h | 1) / float32(2**32 / (1 - 2**-24)), a divisor of 2**32 (1 + 2**-23), and
-log(u) is taken as the log of _C / float32(h | 1). It is computed elementwise in the
compiled pass that scales and masks a block's logits (``gumbel_mass``: one kernel, no
full-size intermediate besides the logits), and is i.i.d. Gumbel(0, 1) per sequence, query head,
query and key as in the paper (the tests check its moments, its Kolmogorov-Smirnov
distance and its neighbours' correlations over 2**20 draws). It replaced
``mx.random.gumbel`` draws per block of queries (a threefry draw per logit, its bits,
uniforms and logs each a full-size pass), which were the prefill's cost
(benchmarks/notes/prefill.md). A logit's
noise depends only on the seed, the layer and its coordinates, so the scores do not depend
on the block size (``SCORE_ELEMENTS``) or on how the prompt is chunked (a decode step's
query gets the same formula at its position), and a saved, loaded or copied cache draws
what a fresh one would. In a packed batch (``evict/batch.py``) each sequence's logits take
the noise it would draw alone (its own query position, the head keys of row 0) and its own
temperature step, so a batch keeps what each sequence keeps alone.

Adapted: an absolute budget and protected sinks instead of the paper's prompt percentages
(kv_cache 60%, recent 30%); the anneal runs over ``keyformer_anneal_steps`` instead of
max_new_tokens; scores are kept per sequence (the official code sums over the batch).
``keyformer_rope_base`` is not used: the hook hands over the real post-RoPE queries, so
nothing is un-rotated or re-rotated for scoring.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from ..cache.buffers import row_indices
from ..evict import fused_mass_kernel
from ..evict.attention import SCORE_ELEMENTS, reduce_query_blocks  # a module global: tests vary the block
from ..evict.base import EVICT_EVERY, RECENT_FLOOR, Roles, Schedule, ScoredEvictionCache
from ..evict.prng import MASK64, mix64
from ..kernels.checks import checked_once


def _fmix32(h: mx.array) -> mx.array:
    """murmur3's 32-bit finaliser on uint32: a bijection, every output bit depends on every input bit."""
    h = (h ^ (h >> 16)) * 0x85EBCA6B
    h = (h ^ (h >> 13)) * 0xC2B2AE35
    return h ^ (h >> 16)


def _fmix32_host(h: np.ndarray) -> np.ndarray:
    """``_fmix32`` on a uint32 numpy array (its products wrap as uint32's do)."""
    h = (h ^ (h >> 16)) * np.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


@functools.lru_cache(maxsize=1024)
def noise_stream(seed: int, layer: int, b: int, hq: int, hkv: int | None = None) -> tuple[mx.array, mx.array]:
    """A layer's noise keys: splitmix64's finaliser of (seed, layer) (as ``evict/prng.py``
    hashes) gives a 32-bit row key r and column key c; the keys are fmix32(head ^ r) for the
    query heads numbered b * Hq + h, shaped (B, Hkv, Hq / Hkv, 1, 1) (``hkv``) or (B, Hq, 1, 1),
    and c, uint32. Host arithmetic, cached: a decode step builds no op for them."""
    heads, s = _head_keys(seed, layer, b, hq)
    shape = (b, hq, 1, 1) if hkv is None else (b, hkv, hq // hkv, 1, 1)
    return mx.array(heads.reshape(shape)), mx.array(s >> 32, mx.uint32)


def _head_keys(seed: int, layer: int, b: int, hq: int) -> tuple[np.ndarray, int]:
    """The query heads' row keys (B * Hq,) uint32 and the layer's 64-bit hash, on the host."""
    s = mix64(mix64(seed & MASK64) ^ layer)
    return _fmix32_host(np.arange(b * hq, dtype=np.uint32) ^ np.uint32(s & 0xFFFFFFFF)), s


def _row_hash(head_keys, q_positions):
    """A hash per (sequence row and query head, query position): distinct per position."""
    return _fmix32(head_keys ^ q_positions.astype(mx.uint32))


def _col_hash(col_key, k_positions):
    """A hash per key position: distinct per position."""
    return _fmix32(k_positions.astype(mx.uint32) ^ col_key)


# 2**32 / (1 - 2**-24) in float32, i.e. 2**32 (1 + 2**-23): u = float32(h | 1) / _C lies in
# [2**-32 (1 - 2**-23), 1 - 2**-23] (float32 keeps h's 24 leading bits), never 0 or 1
_C = float(np.float32(2.0**32 / (1 - 2.0**-24)))


def _log_e(rows, cols):
    """log(E) for E = -log(u) ~ Exp(1), so that zeta = -log(E) ~ Gumbel(0, 1), from a logit's
    row and column hashes: h = (rows ^ cols) * an odd constant, u = float32(h | 1) / _C, in
    (0, 1) and never 0 or 1. E is taken as log(_C / float32(h | 1)), one division where
    u's product and a negation would be two ops: the chain of ``_noisy`` then fits MLX's
    fusion depth with the broadcasts of the hashes inside it (one kernel, no standalone
    broadcast). E is at least log(1 + 2**-23) where log is exact near 1; the floor of 2**-25
    is for a fast-math log that returns 0 there. log, not log1p: MLX's CPU vectorizes log,
    not log1p."""
    return mx.log(mx.maximum(mx.log(_C / ((rows ^ cols) * 0x85EBCA6B | 1).astype(mx.float32)), 2.0**-25))


def _noisy(x, rows, cols, tau, scale):
    """(x * scale + zeta) / tau for the unscaled logits x, one kernel: MLX fuses chains of at
    most 11 ops (compile.cpp's max_compile_depth), and the noise's is 11 with the hashes'
    broadcast: broadcast, xor, *, |, astype, /, log, max, log, -, /. The scale is on x's side of the sum, off that chain, so it
    joins the kernel instead of costing a pass over the queries before the product."""
    return (x * scale - _log_e(rows, cols)) / tau


def _noisy_where(x, keep, rows, cols, tau, scale):
    """``_noisy`` where ``keep``, -inf elsewhere; the mask is taken on x's side of the sum,
    off the noise's chain, so that it stays one kernel."""
    return (mx.where(keep, x * scale, -float("inf")) - _log_e(rows, cols)) / tau


def _noisy_causal(x, rows, cols, tau, scale, k_positions, q_positions):
    """``_noisy`` where the key is at most at the query's position, -inf elsewhere."""
    return _noisy_where(x, k_positions <= q_positions, rows, cols, tau, scale)


def _zeta(rows, cols):
    return -_log_e(rows, cols)


# A prompt's blocks are traced per shape: a shapeless trace broadcasts both operands of every
# binary op, which doubles the chain and splits it into 4 kernels with a full-size
# intermediate each; traced per shape, one kernel reads the block's logits and writes the
# noisy ones. A decode step (one query, one key more every step) is traced shapeless, once
# for all steps: its block is one row per head.
_noisy_block, _noisy_causal_block = mx.compile(_noisy), mx.compile(_noisy_causal)
_noisy_step = mx.compile(_noisy, shapeless=True)
_row_hash, _col_hash = (mx.compile(f, shapeless=True) for f in (_row_hash, _col_hash))


def gumbel_noise(stream, q_positions, k_positions) -> mx.array:
    """The noise the scores add, (B, Hq, N, n) float32: zeta of each query head (sequence row
    b, head h), the query at ``q_positions`` (N,) and the key at ``k_positions`` (B, Hq or 1,
    n), for ``stream = noise_stream(seed, layer, B, Hq)`` (the formula ``gumbel_mass`` fuses;
    for tests)."""
    rows = _row_hash(stream[0], q_positions[:, None])
    return _zeta(rows, _col_hash(stream[1], k_positions[:, :, None]))


def gumbel_mass(queries, keys, scale, q_start, k_positions, tau, stream=None) -> mx.array:
    """sum over queries and a KV group's heads of softmax((x + zeta) / tau): (B, Hkv, n).

    queries (B, Hq, N, D) at positions q_start .. q_start + N - 1; keys (B, Hkv, n, D) at
    ``k_positions`` (B, Hkv, n); ``stream``: ``noise_stream(seed, layer, B, Hq, Hkv)``, the noise's keys
    (None: no noise, softmax(x / tau)). zeta of a logit is a hash of its sequence row,
    query head, query position and key position (``gumbel_noise``), so the mass does not
    depend on the block size. A key a query cannot see adds 0 (keys are at most at the last
    query's position). Blocks hold at most SCORE_ELEMENTS logits, one block at a time
    (``reduce_query_blocks``); on a GPU (unless ``VQ_FUSED_MASS=0``), two launches that write no
    logit (``evict/fused_mass_kernel.py``, which also leaves out a padding slot's position -1).
    """
    fused = _fused_backend(queries, keys)
    if fused is not None:  # every query at once, the noise made where each logit is: none written
        return _fused_gumbel_mass(fused, queries, keys, scale, q_start, k_positions, tau, stream)
    return _written_gumbel_mass(queries, keys, scale, q_start, k_positions, tau, stream)


def _fused_gumbel_mass(backend, queries, keys, scale, q_start, k_positions, tau, stream):
    b, hkv, n = keys.shape[:3]
    n_queries = queries.shape[2]
    q_positions = mx.arange(q_start, q_start + n_queries, dtype=mx.int32)
    k_positions = mx.broadcast_to(k_positions, (b, hkv, n))
    ones = mx.ones((n_queries,), mx.float32)
    if stream is None:
        return fused_mass_kernel.fused_mass(backend, queries, keys, scale / tau, q_positions, k_positions, ones)
    return fused_mass_kernel.fused_mass(backend, queries, keys, scale, q_positions, k_positions, ones,
                                        (stream[0], stream[1], tau))


_NOISE_CHECKED: dict = {}


def _fused_backend(queries, keys):
    """``fused_mass_kernel.kernel_backend``, and the kernels' noise checked once a process and
    dtype against the written logits' (the kernels' own check has no noise)."""
    backend = fused_mass_kernel.kernel_backend(queries, keys)
    if backend is None:
        return None
    return backend if checked_once(_NOISE_CHECKED, backend, (backend, str(keys.dtype)),
                                   lambda: _noise_problem(backend, keys.dtype),
                                   "fused prompt-mass kernels' Gumbel noise",
                                   "keyformer's scores are computed through written logits instead") else None


def _noise_problem(backend, dtype):
    try:
        q, k, scale, _, _, _ = fused_mass_kernel.check_case(dtype, nq=70, n=300, d=128)
        b, hq, nq, _ = q.shape
        hkv, n = k.shape[1], k.shape[2]
        k_pos = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (b, hkv, n))
        stream = noise_stream(7, 1, b, hq, hkv)
        got = _fused_gumbel_mass(backend, q, k, scale, n - nq, k_pos, 0.7, stream)
        ref = _written_gumbel_mass(q, k, scale, n - nq, k_pos, 0.7, stream)
        if not fused_mass_kernel.within_check_tolerance(got, ref):
            return f"masses differ from the written logits' by more than {fused_mass_kernel.CHECK_RTOL:g} of the largest"
    except Exception as exc:  # kernels that do not compile or launch fail their check
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def _written_gumbel_mass(queries, keys, scale, q_start, k_positions, tau, stream):
    """``gumbel_mass`` through logits written a block at a time."""
    b, hq, n_queries, d = queries.shape
    hkv = keys.shape[1]
    k = keys.astype(mx.float32).swapaxes(-1, -2)  # a group's heads are one product's rows
    if stream is not None:
        cols = _col_hash(stream[1], k_positions[:, :, None, None, :])  # (B, Hkv, 1, 1, n)
        tau_array, scale_array = mx.array(tau, mx.float32), mx.array(scale, mx.float32)

    def block(q, start, stop):
        q = q.reshape(b, hkv, hq // hkv * (stop - start), d).astype(mx.float32)
        x = (q @ k).reshape(b, hkv, hq // hkv, stop - start, -1)  # (B, Hkv, G, block, n), unscaled
        causal = start < n_queries - 1  # the last query (a decode step's only one) sees every key
        if causal or stream is not None:
            q_positions = mx.arange(q_start + start, q_start + stop)[:, None]
        if stream is not None:
            rows = _row_hash(stream[0], q_positions)  # (B, Hkv, G, block, 1)
            if causal:
                x = _noisy_causal_block(x, rows, cols, tau_array, scale_array, k_positions[:, :, None, None, :],
                                        q_positions)
            else:
                x = (_noisy_step if n_queries == 1 else _noisy_block)(x, rows, cols, tau_array, scale_array)
            return mx.softmax(x, axis=-1, precise=True).sum(axis=(2, 3))
        x = x * scale if tau == 1 else x * scale / tau
        if causal:
            x = mx.where(k_positions[:, :, None, None, :] <= q_positions, x, -float("inf"))
        return mx.softmax(x, axis=-1, precise=True).sum(axis=(2, 3))

    return reduce_query_blocks(queries, keys.shape[2], block, elements=SCORE_ELEMENTS)


@functools.lru_cache(maxsize=None)
def _decode_score(scale: float):
    """A decode step's ``observe`` over the store's room: ``gumbel_mass`` of the one query
    (its heads' ``rows_hash`` made on the host, ``_step_stream``) over the keys of every
    slot, their noise from the slots' positions, rows past the slot count masked on the
    logits' side of the noise (their weight is 0; the kept rows' weights equal the
    unmasked softmax's, bit for bit on the CPU:
    tests/test_compiled_decode_scores.py), added to the score buffer; returns the
    buffer (rows past the count: spare room, never read). One compiled graph; its shapes
    change only when the buffers grow."""

    def step(queries, keys, positions, score, rows, row_ids, rows_hash, col_key, tau):
        # gumbel_mass's product, (B, Hkv, G, slots), a group's heads its rows, no block axis:
        # no broadcast of the keys over the heads, no expanded axis to sum away
        b, hq, _, d = queries.shape
        hkv = keys.shape[1]
        q = queries.reshape(b, hkv, hq // hkv, d).astype(mx.float32)
        x = q @ keys.astype(mx.float32).swapaxes(-1, -2)
        cols = _fmix32(positions.astype(mx.uint32) ^ col_key)[:, :, None, :]  # (B, Hkv, 1, slots)
        noisy = _noisy_where(x, row_ids < rows, rows_hash, cols, tau, scale)
        return score + mx.softmax(noisy, axis=-1, precise=True).sum(axis=2)

    return mx.compile(step)


ROW_HASH_BLOCK = 256  # decode positions whose row hashes a decode step's table holds


@functools.lru_cache(maxsize=1024)
def _step_head_keys(seed: int, layer: int, b: int, hq: int, hkv: int) -> np.ndarray:
    """``noise_stream``'s head keys shaped (B, Hkv, Hq / Hkv, 1), on the host."""
    return _head_keys(seed, layer, b, hq)[0].reshape(b, hkv, hq // hkv, 1)


@functools.lru_cache(maxsize=None)
def _packed_decode_score(scale: float, noise: bool):
    """``_decode_score`` for a packed batch (``evict/batch.py``): sequence b's query at its
    own position ``q_position[b]`` (B, 1, 1, 1, 1), each sequence's noise keys those it has
    alone (its row 0: ``noise_stream`` of one sequence), its padding slots (position -1)
    masked; ``tau`` a number or one per sequence (B, 1, 1, 1, 1)."""

    def step(queries, keys, positions, score, q_position, tau, *stream):
        visible = positions[:, :, None, None, :] >= 0
        return score + _step_mass(queries, keys, positions, visible, q_position, tau,
                                  stream if noise else None, scale)

    return mx.compile(step)


def _step_mass(queries, keys, positions, visible, q_position, tau, stream, scale):
    """A decode query's ``gumbel_mass`` over the slots ``visible`` marks: (B, Hkv, slots)."""
    b, hq, _, d = queries.shape
    hkv = keys.shape[1]
    q = queries.reshape(b, hkv, hq // hkv, 1, d).astype(mx.float32)
    x = q @ keys[:, :, None].astype(mx.float32).swapaxes(-1, -2)
    if stream is None:
        logits = x * scale / tau
    else:
        cols = _col_hash(stream[1], positions[:, :, None, None, :])
        logits = _noisy_step(x, _row_hash(stream[0], q_position), cols, tau, mx.array(scale, mx.float32))
    noisy = mx.where(visible, logits, -float("inf"))
    return mx.softmax(noisy, axis=-1, precise=True).sum(axis=(2, 3))


class KeyformerCache(ScoredEvictionCache):
    roles = Roles(budget="keyformer_budget", n_sink="keyformer_n_sink", recent="keyformer_recent")
    schedule = Schedule(prefill_end=True, decode_every=EVICT_EVERY)
    token_state = ("score",)
    recent_floor = RECENT_FLOOR  # the contract's default recent window is 0 (module docstring)
    state_from_queries = True
    gumbel_noise = True  # False (tests only): score with softmax(x / tau), no noise
    batchable = True
    _row_hashes = None  # (shape, first position, the row hashes of ROW_HASH_BLOCK positions)

    def noise_stream(self, queries, keys) -> tuple[mx.array, mx.array]:
        b, hq = queries.shape[:2]
        return noise_stream(self.options.keyformer_seed, self.layer, b, hq, keys.shape[1])

    def _step_stream(self, queries, keys) -> tuple[mx.array, mx.array]:
        """The row hashes and column key as ``_decode_score`` takes them: the row hashes
        (``_row_hash`` of the head keys and the query's position, ``offset - 1``), (B, Hkv, G,
        1) uint32, a constant made on the host (no kernel in the step), taken from a table of
        the next ``ROW_HASH_BLOCK`` positions' made at once: hashing on the host each step
        cost five times the table's lookup."""
        b, hq = queries.shape[:2]
        seed, hkv = self.options.keyformer_seed, keys.shape[1]
        position, block = self.offset - 1, self._row_hashes
        if block is None or block[0] != (b, hq, hkv) or not 0 <= position - block[1] < len(block[2]):
            heads = _step_head_keys(seed, self.layer, b, hq, hkv)
            ahead = np.arange(position, position + ROW_HASH_BLOCK, dtype=np.int64) & 0xFFFFFFFF
            block = self._row_hashes = ((b, hq, hkv), position,
                                        _fmix32_host(heads[None] ^ ahead.astype(np.uint32)[:, None, None, None, None]))
        return mx.array(block[2][position - block[1]]), noise_stream(seed, self.layer, b, hq, hkv)[1]

    def tau(self, step: int) -> float:
        o = self.options
        if o.keyformer_tau is not None:
            return o.keyformer_tau
        if o.keyformer_anneal_steps:
            frac = min(step, o.keyformer_anneal_steps) / o.keyformer_anneal_steps
            return o.keyformer_tau_init + (o.keyformer_tau_end - o.keyformer_tau_init) * frac
        return o.keyformer_tau_init

    def observe(self, inputs):
        if inputs.decode_steps is not None:
            return self._observe_packed(inputs)
        prompt = inputs.n_new > 1 or self.in_prompt  # a prompt chunk, or the prompt's last token
        step = 0 if prompt else self.decode_steps + 1  # the base counts this step after observe
        room = None if prompt or not self.gumbel_noise or not inputs.every_key_visible else self.key_room()
        if room is not None:  # a decode step: one compiled pass over the keys' whole room
            grown = self.store.arrays["score"]
            grown.buffer = _decode_score(float(inputs.scale))(
                inputs.queries, room, self.store.arrays["positions"].buffer, grown.buffer,
                mx.array(self.store.rows, mx.int32), row_indices(room.shape[2]),
                *self._step_stream(inputs.queries, room), mx.array(self.tau(step), mx.float32))
            return
        mass = gumbel_mass(
            inputs.queries, inputs.keys, inputs.scale, self.offset - inputs.n_new, inputs.positions,
            self.tau(step), self.noise_stream(inputs.queries, inputs.keys) if self.gumbel_noise else None,
        )
        self.store.update("score", inputs.state("score") + mass)

    def _observe_packed(self, inputs):
        """A packed batch's decode step: each sequence's query at its own position, its own
        temperature step and the noise it has alone, over its own slots."""
        queries = inputs.queries
        b, hq = queries.shape[:2]
        taus = [self.tau(step + 1) for step in inputs.decode_steps]  # counted after observe
        tau = (mx.array(taus[0], mx.float32) if len(set(taus)) == 1
               else mx.array(taus, mx.float32).reshape(b, 1, 1, 1, 1))
        mass = _packed_decode_score(float(inputs.scale), self.gumbel_noise)(
            queries, inputs.keys, inputs.positions, inputs.state("score"),
            inputs.query_positions.reshape(b, 1, 1, 1, 1), tau,
            *noise_stream(self.options.keyformer_seed, self.layer, 1, hq, inputs.keys.shape[1]))
        self.store.update("score", mass)

    def score(self, inputs):
        return inputs.state("score")
