"""AMC's decode read (``methods/amc/decode_step.py``: the three tiers and the window under one
softmax, scores as keys times the transposed queries, one mask over the parts from the
tiers' counts, the Low keys rebuilt on their basis and turned to their positions in one
pass over a (2, D/2) view, rows of groups MLX does not take unpacked against a constant)
against attention over the history reconstructed the straightforward way, in float64,
over 70 decode steps that flush twice, on the CPU's path and on a GPU's (its pure path,
``token_mix`` cutting the token axis as on CUDA).

The reference is computed from what the cache holds after each step (the state the step
attended): every tier's rows dequantized (``code * scale + minimum``), the Low tier's
``c Bᵀ + μ`` and, with the rotary settings, each Low key turned by RoPE at its position
(the angle ``float32(position) * w`` taken as the read takes it: one float32 product, the
same bits on both sides), the window's rows, each head's rows up to its count; then
softmax attention, all in float64.

Tolerance (Higham's ``gamma(n) = n u / (1 - n u)``, u = 2^-24, ``float64_attention.gamma``):
a key element reached through at most ``n_k`` float32 roundings (dequantization 2, the
basis product r + 1, the mean 1, the turn 3 and its cos or sin, a few ulp: counted as 8)
is off by at most ``gamma(n_k) A`` where A is the sum of the magnitudes of the terms that
form it (``|q s| + |m|`` a dequantized value, ``Σ_j A(c_j) |B_ij| + |μ_i|`` a rebuilt one,
both elements of its pair a turned one); a score, a sum of D products scaled, by at most
``delta = gamma(D + r + 16) scale Σ_i |q_i| A_i``. Scores off by at most delta move the
softmax weights by a factor within ``exp(+-2 delta)``; the mix of N rows (the Low tier's
through its basis, r more terms) and the softmax's own rounding add
``gamma(2 N + r + 16)`` times ``Σ_t p_t A_t``. So each output element is within
``(expm1(2 delta) + gamma(2 N + r + 16)) Σ_t p_t A_t`` (delta the row's largest) of the
reference.
"""

from __future__ import annotations

import functools
import types

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from float64_attention import gamma
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import AMCOptions
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.amc import decode_step
from veloxquant_mlx.methods.amc.cache import FLUSH, AMCCache

PROMPT, STEPS, GQA, H = 200, 70, 2, 2

ROTARIES = {
    "none": None,  # Low keys kept post-RoPE, no positions
    "default": dict(rope_theta=10000.0),
    "traditional": dict(rope_theta=10000.0, rope_traditional=True),
    "llama3": dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64}),
}

# (head_dim, group, rotary): between them every way a tier's rows are read: mx.dequantize
# (groups of 32), groups of several words (8 and 4 bits in groups of 16), a group of one
# word (2 bits, 16) in rows of two words and in rows of one; pre-RoPE Low keys in both pair
# layouts and with a frequency scaling, and post-RoPE ones.
SETTINGS = [(64, 32, "default"), (128, 16, "traditional"), (64, 16, "none"), (128, 32, "llama3")]


def amc(rotary, group):
    args = ROTARIES[rotary]
    context = None if args is None else types.SimpleNamespace(model_args=types.SimpleNamespace(**args))
    options = AMCOptions(amc_adaptive_thresholds=True, amc_threshold_window=8, amc_group_size=group)
    return AMCCache(KVCacheConfig(method="amc", options=options), context, 0)


def rows(shape, seed):
    x = mx.random.normal(shape, key=mx.random.key(seed))
    return x * (1 + 4 * mx.random.uniform(shape=(shape[-1],), key=mx.random.key(seed + 1)))


def call(cache, q, k, v, scale):
    cache.update_and_fetch(k, v)
    return cache.attend(q, k, v, scale=scale, mask="causal" if k.shape[2] > 1 else None)


def f64(a):
    return np.array(a.astype(mx.float32), dtype=np.float64)


def dequantized(codes, scales, minima, bits, group):
    """Rows (exact, float64) and each element's magnitude ``|q s| + |m|``."""
    words = np.array(codes, dtype=np.uint64)
    per_word = 32 // bits
    q = (words[..., None] >> (bits * np.arange(per_word, dtype=np.uint64))) & ((1 << bits) - 1)
    q = q.reshape(*words.shape[:-1], -1).astype(np.float64)
    s = np.repeat(f64(scales), group, axis=-1)
    m = np.repeat(f64(minima), group, axis=-1)
    return q * s + m, np.abs(q * s) + np.abs(m)


def turned(x, mag, positions, rotary):
    """RoPE at each row's position (float64, the float32 angle), and the pair-sum magnitude."""
    d = x.shape[-1]
    w = np.array(rotary.inverse_frequencies(d), dtype=np.float32)
    angle = (np.array(positions, dtype=np.float32)[..., None] * w).astype(np.float64)
    cos, sin = np.cos(angle), np.sin(angle)
    if rotary.traditional:
        x1, x2, m1, m2 = x[..., 0::2], x[..., 1::2], mag[..., 0::2], mag[..., 1::2]
    else:
        x1, x2, m1, m2 = x[..., : d // 2], x[..., d // 2 :], mag[..., : d // 2], mag[..., d // 2 :]
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if rotary.traditional:
        y = np.stack([y1, y2], axis=-1).reshape(x.shape)
    else:
        y = np.concatenate([y1, y2], axis=-1)
    pair = m1 + m2
    return y, np.concatenate([pair, pair], axis=-1)


def reference(cache, q, scale):
    """Attention over what the cache holds, in float64, and each output element's bound."""
    store = cache.store
    b, hq, _, d = q.shape
    keys, key_mag, values, value_mag, valid = [], [], [], [], []
    rank = d
    for t, (kt, vt) in enumerate(zip(store.k_tiers, store.v_tiers)):
        if not kt.capacity:
            continue
        bits, group = kt.codec.bits, kt.codec.group
        k, km = dequantized(kt.codes, kt.scales, kt.biases, bits, group)
        v, vm = dequantized(vt.codes, vt.scales, vt.biases, bits, group)
        if t in store.projections:
            k_mean, k_basis, v_mean, v_basis = (f64(a) for a in store.projections[t])
            rank = k_basis.shape[-1]
            k, km = k @ k_basis.swapaxes(-1, -2) + k_mean[:, :, None], km @ np.abs(k_basis).swapaxes(-1, -2) \
                + np.abs(k_mean)[:, :, None]
            v, vm = v @ v_basis.swapaxes(-1, -2) + v_mean[:, :, None], vm @ np.abs(v_basis).swapaxes(-1, -2) \
                + np.abs(v_mean)[:, :, None]
            if kt.positions is not None:
                k, km = turned(k, km, kt.positions, store.rotary)
        keys.append(k), key_mag.append(km), values.append(v), value_mag.append(vm)
        valid.append(np.arange(kt.capacity) < np.array(kt.counts)[..., None])
    if cache.pending_k.length:
        k, v = f64(cache.pending_k.view()), f64(cache.pending_v.view())
        keys.append(k), key_mag.append(np.abs(k)), values.append(v), value_mag.append(np.abs(v))
        valid.append(np.ones(k.shape[:3], bool))
    k, km, v, vm = (np.concatenate(x, axis=2) for x in (keys, key_mag, values, value_mag))
    ok = np.concatenate(valid, axis=2)[:, :, None]  # (B, H, 1, N)
    n = int(ok.sum(axis=-1).max())
    qs = f64(q).reshape(b, H, hq // H, d) * scale
    s = np.where(ok, qs @ k.swapaxes(-1, -2), -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    delta = gamma(d + rank + 16) * np.where(ok, np.abs(qs) @ km.swapaxes(-1, -2), 0).max(axis=-1, keepdims=True)
    bound = (np.expm1(2 * delta) + gamma(2 * n + rank + 16)) * (p @ vm)
    return (p @ v).reshape(b, hq, 1, d), bound.reshape(b, hq, 1, d)


def decode_against_reference(cache, d, monkeypatch, pure_path, batch=2, seed=5):
    monkeypatch.setattr(kd, "_pure_path", lambda: pure_path)
    # the step's graph is traced per path: a trace made under the other one is not reused
    monkeypatch.setattr(decode_step, "_step_fn", functools.lru_cache(maxsize=None)(decode_step._step_fn.__wrapped__))
    if pure_path == "reference":  # a GPU's: token_mix cuts the token axis as on CUDA
        monkeypatch.setattr(kd, "_splits_tokens", lambda: True)
        monkeypatch.setattr(kd, "SPLIT_TOKENS", 32)
    total, scale = PROMPT + STEPS, d**-0.5
    keys, values = rows((batch, H, total, d), seed), rows((batch, H, total, d), seed + 2) * 0.5
    for start, stop in ((0, 120), (120, PROMPT)):  # a chunked prompt
        q = mx.random.normal((batch, H * GQA, stop - start, d), key=mx.random.key(seed + start))
        call(cache, q, keys[:, :, start:stop], values[:, :, start:stop], scale)
    read, flushes, worst, splits = decode_step.decode_attention, 0, 0.0, []
    monkeypatch.setattr(decode_step, "token_mix", lambda w, v: splits.append(
        kd._splits_tokens() and w.shape[-1] >= 2 * kd.SPLIT_TOKENS) or kd.token_mix(w, v))
    used = []
    monkeypatch.setattr(decode_step, "decode_attention", lambda *a, **k: used.append(1) or read(*a, **k))
    for t in range(PROMPT, total):
        q = mx.random.normal((batch, H * GQA, 1, d), key=mx.random.key(100 + t))
        flushes += cache.pending_k.length + 1 == FLUSH
        out = call(cache, q, keys[:, :, t : t + 1], values[:, :, t : t + 1], scale)
        ref, bound = reference(cache, q, scale)
        err = np.abs(np.array(out, dtype=np.float64) - ref)
        assert (err <= bound).all(), (t, (err - bound).max(), bound.max())
        worst = max(worst, float((err / bound).max()))
    assert flushes == 2 and len(used) == STEPS  # every step took the compiled read
    assert any(splits) == (pure_path == "reference")  # a GPU's mix cut the token axis
    assert cache.store.k_tiers[2].counts is not None and int(cache.store.k_tiers[2].counts.min()) > 0
    return worst


@pytest.mark.parametrize("d, group, rotary", SETTINGS)
@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's path, a GPU's
def test_seventy_decode_steps_match_attention_over_the_reconstructed_history(d, group, rotary, pure_path,
                                                                              monkeypatch):
    decode_against_reference(amc(rotary, group), d, monkeypatch, pure_path)


def test_the_reads_small_constants_are_made_once():
    """The unpacking shifts and RoPE's turns are arguments of the step's graph, made once
    (no frequency is rebuilt at a step)."""
    from veloxquant_mlx.cache.rope import Rotary

    assert decode_step._shifts(4).tolist() == [0, 4, 8, 12, 16, 20, 24, 28]
    assert decode_step._turns(Rotary(10000.0), 64) is decode_step._turns(Rotary(10000.0), 64)
