"""NSNQuant's CUDA decode read (``NSNStore.attend_parts``): every row rebuilt in the rotated
frame, ``x_hat H = s1 (s2 y_hat + o H)``, the tails rotated, one fused attention of the
rotated queries, its output rotated back. Against attention over the reconstructed history
(``dequantized``, ``s1 (s2 y_hat H + o)`` in float32) in float64, over 40 decode steps that
code a chunk.

Tolerance, from float32 rounding (u = 2^-24, ``gamma(n) = n u / (1 - n u)``): H is
orthonormal and symmetric, so the read's ``(q H) . (x_hat H)`` and the reference's
``q . x_hat`` are one sum. The read rounds the fast Walsh-Hadamard transforms (log2 D
butterfly stages and the scaling: ``gamma(L + 2)`` times the 1-norm over sqrt(D), for the
query, each chunk's mean and each tail row), a rebuilt row's two products and one sum
(``gamma(3)`` of ``s1 s2 |y| + s1 |o H|``) and the product of D terms; the reference
rounds its own rebuild (a transform and three operations). A score is off by at most
``delta = gamma(D + 4) Σ_j |q H|_j A_tj + 2 gamma(L + 5) |q|_1 B_t / sqrt(D)``, A the
rotated row's magnitudes, B the larger of its 1-norms in either frame. That moves each
softmax weight by a factor within ``exp(+-2 delta)``; the softmax and the weighted sum of N
rows round ``gamma(N + 3)``; the rows' rebuild ``gamma(3)``: in the rotated frame channel j
is off by ``E_j = (exp(2 delta) - 1 + gamma(N + 6)) Σ_t p_t A_tj``, and rotated back by at
most ``Σ_j E_j / sqrt(D) + gamma(L + 2) |out H|_1 / sqrt(D)`` per output channel."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from test_nsnquant import card_data, nsnquant
from test_vecinfer_decode_read import gamma, hadamard, steps_against
from veloxquant_mlx.kernels import kivi_decode as kd
from sdpa_calls import one_row, recorded


def _f64(x):
    return np.array(x.astype(mx.float32), dtype=np.float64)


def rotated_magnitudes(tokens, tail, d: int, hmat):
    """Per token, in the rotated frame: |entries| bounding the rebuilt row (A) and the
    row's 1-norm in either frame (B), coded tokens then the tail's."""
    y, s1, s2, means = (_f64(x) for x in tokens.parts(d))
    s1, s2 = s1.swapaxes(-1, -2), s2.swapaxes(-1, -2)
    o = np.repeat(means @ hmat, tokens.chunk, axis=2)
    a = s1 * s2 * np.abs(y) + s1 * np.abs(o)
    x = s1 * (s2 * (y @ hmat) + o @ hmat)  # the row in the model's frame
    b = np.maximum(np.abs(x).sum(-1), a.sum(-1))
    if tail.length:
        t = _f64(tail.view())
        ta = np.abs(t @ hmat) + gamma(math.log2(d) + 2) * np.abs(t).sum(-1, keepdims=True) / math.sqrt(d)
        a, b = np.concatenate([a, ta], axis=2), np.concatenate([b, np.maximum(np.abs(t).sum(-1), ta.sum(-1))], axis=2)
    return a, b


def reference_and_bound(cache, q, scale):
    k_hat, v_hat = (_f64(x) for x in cache.dequantized(mx.float32))
    store = cache.store
    b, hq, _, d = q.shape
    h, L = k_hat.shape[1], math.log2(d)
    hmat = hadamard(d)
    qs = _f64(q).reshape(b, h, hq // h, d) * scale
    ka, kb = rotated_magnitudes(store.keys, store.k_tail, d, hmat)
    va, _ = rotated_magnitudes(store.values, store.v_tail, d, hmat)
    delta = gamma(d + 4) * (np.abs(qs @ hmat) @ ka.swapaxes(-1, -2)) \
        + 2 * gamma(L + 5) * np.abs(qs).sum(-1, keepdims=True) * kb[:, :, None] / math.sqrt(d)
    delta = delta.max(axis=-1, keepdims=True)
    s = qs @ k_hat.swapaxes(-1, -2)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ v_hat
    e = (np.expm1(2 * delta) + gamma(k_hat.shape[2] + 6)) * (p @ va)
    bound = (e.sum(-1, keepdims=True) + gamma(L + 2) * np.abs(out @ hmat).sum(-1, keepdims=True)) / math.sqrt(d)
    return out.reshape(b, hq, 1, d), np.broadcast_to(bound, out.shape).reshape(b, hq, 1, d)


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("d", [32, 128])  # one sign word a token, four
def test_forty_steps_through_one_fused_attention_match_the_reconstructed_history(bits, d, monkeypatch):
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    calls = recorded(monkeypatch)
    h, t0, steps = 2, 100, 40
    keys, values = card_data(t0 + steps, d=d, h=h), card_data(t0 + steps, d=d, h=h, seed=7) * 0.5
    cache, scale = nsnquant(nsn_bits=bits, nsn_residual_length=32), d**-0.5
    cache.update_and_fetch(keys[:, :, :t0], values[:, :, :t0])
    cache.attend(mx.random.normal((1, 2 * h, t0, d), key=mx.random.key(3)), keys[:, :, :t0], values[:, :, :t0],
                 scale=scale, mask="causal")
    worst, counts = steps_against(cache, keys, values, t0, steps, 2 * h, scale, reference_and_bound,
                                  lambda: cache.store.keys.count)
    assert len(counts) > 1 and len(one_row(calls)) == steps and 0 < worst < 1
