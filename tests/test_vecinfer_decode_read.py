"""VecInfer's CUDA decode read (``CodebookStore._decoded_attention``): the coded keys'
centroids gathered in the code space, the window's keys taken there, the values' centroids
and window rows, one ``scaled_dot_product_attention`` by the queries taken into the code
space. Against attention over the reconstructed history (``dequantized``) in float64, over
40 decode steps that flush the window.

Tolerance: the read computes ``q~ . y`` with ``q~ = (q λ) H`` and ``y = (k / λ) H`` (a
coded key's ``y`` is its centroids, stored as they are); the reference ``q . k`` with the
stored key rebuilt in float32, ``k = (y H) λ``. H is orthonormal, so both are the same sum;
they differ by float32 rounding only: the product of D terms, ``gamma(D + 2) Σ |q~| |y|``,
and each fast Walsh-Hadamard transform's log2(D) butterfly stages plus its scaling and the
λ product, on the query's side and on the key's, ``gamma(log2 D + 3)`` times the entries'
1-norms over sqrt(D) (an orthonormal H's entries are ±1/sqrt(D)), twice. Scores off by at
most delta move each softmax weight by a factor within ``exp(+-2 delta)``, and the softmax
and the weighted sum of N rows round ``gamma(N + 3)``: the output by at most ``(exp(2
delta) - 1 + gamma(N + 3)) Σ_t p_t |v_t|``, per query row and channel."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from test_vecinfer import SMALL, kv, vecinfer
from veloxquant_mlx.kernels import kivi_decode as kd
from sdpa_calls import one_row, recorded

U = 2.0**-24


def gamma(n: float) -> float:
    return n * U / (1 - n * U)


def hadamard(d: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(d)


def reference_and_bound(cache, q, scale):
    k_hat, v_hat = (np.array(x, dtype=np.float64) for x in cache.dequantized(mx.float32))
    b, hq, _, d = q.shape
    h = k_hat.shape[1]
    lam = np.array(cache.store.key_codec.scale, dtype=np.float64)
    qs = np.array(q, dtype=np.float64).reshape(b, h, hq // h, d) * scale
    y, qt = (k_hat / lam) @ hadamard(d), (qs * lam) @ hadamard(d)
    norms = np.abs(qs * lam).sum(-1, keepdims=True) * np.maximum(np.abs(k_hat / lam).sum(-1), np.abs(y).sum(-1))[:, :, None]
    delta = gamma(d + 2) * (np.abs(qt) @ np.abs(y).swapaxes(-1, -2)) + 2 * gamma(math.log2(d) + 3) * norms / math.sqrt(d)
    delta = delta.max(axis=-1, keepdims=True)
    s = qs @ k_hat.swapaxes(-1, -2)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    bound = (np.expm1(2 * delta) + gamma(k_hat.shape[2] + 3)) * (p @ np.abs(v_hat))
    return (p @ v_hat).reshape(b, hq, 1, d), bound.reshape(b, hq, 1, d)


def steps_against(cache, keys, values, t0: int, steps: int, heads: int, scale, reference_and_bound, count):
    """``steps`` decode steps from token ``t0``, each output against ``reference_and_bound``
    (cache, queries, scale) -> (float64 reference, bound): the largest error as a fraction
    of its bound, and the ``count()`` values seen (the coded tokens, to see flushes)."""
    counts, worst = set(), 0.0
    b, _, _, d = keys.shape
    for i in range(t0, t0 + steps):
        k, v = keys[:, :, i : i + 1], values[:, :, i : i + 1]
        q = mx.random.normal((b, heads, 1, d), key=mx.random.key(100 + i))
        cache.update_and_fetch(k, v)
        out = cache.attend(q, k, v, scale=scale, mask=None)
        ref, bound = reference_and_bound(cache, q, scale)
        err = np.abs(np.array(out, dtype=np.float64) - ref)
        assert (err <= bound).all(), (i, (err - bound).max(), bound.max())
        worst = max(worst, (err / bound).max())
        counts.add(count())
    return worst, counts


@pytest.mark.parametrize("options", [dict(SMALL), dict(SMALL, key_sub_dim=8, value_sub_dim=4)])
@pytest.mark.parametrize("batch", [1, 2])  # one codebook read by one row; a codebook a row
def test_forty_steps_through_one_fused_attention_match_the_reconstructed_history(options, batch, monkeypatch):
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    calls = recorded(monkeypatch)
    d, h, t0, steps = 64, 2, 120, 40
    keys, values = kv(t0 + steps, d=d, h=h)
    keys, values = mx.concatenate([keys] * batch), mx.concatenate([values] * batch) * mx.arange(1, batch + 1)[:, None, None, None]
    cache, scale = vecinfer(residual_length=16, **options), d**-0.5
    cache.update_and_fetch(keys[:, :, :t0], values[:, :, :t0])
    cache.attend(mx.random.normal((batch, 2 * h, t0, d), key=mx.random.key(3)), keys[:, :, :t0], values[:, :, :t0],
                 scale=scale, mask="causal")
    worst, counts = steps_against(cache, keys, values, t0, steps, 2 * h, scale, reference_and_bound,
                                  lambda: cache.store.count)
    assert len(counts) > 1 and len(one_row(calls)) == steps and 0 < worst < 1
