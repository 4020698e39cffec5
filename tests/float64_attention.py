"""Attention in float64 (numpy) and the most a float32 evaluation of it may differ from it:
the reference and tolerance of the decode-read tests (``test_*_decode_read.py``).

For scores s = q.k (D terms) rounded in float32 with unit roundoff u = 2^-24, the error of
each is at most gamma(D + 3) sum |q||k| (Higham's gamma_n = n u / (1 - n u)); a softmax whose
scores move by at most delta moves each weight by a factor within e^(+-2 delta); the weighted
sum of N values adds gamma(N + 3) sum p |v|. So each output element is within
(e^(2 delta) - 1 + gamma(N + 3)) sum p |v| of the exact one.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

U = 2.0**-24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def exact_attention_and_bound(q, keys, values, scale):
    """Attention of ``q`` (B, Hq, 1, D) over float32 ``keys``, ``values`` (B, H, N, D) in
    float64 (numpy), and per output element the most a float32 evaluation may differ
    from it (the module's docstring, per query row and channel)."""
    b, hq, _, d = q.shape
    h, n = keys.shape[1], keys.shape[2]
    qs = np.array(q.astype(mx.float32), dtype=np.float64).reshape(b, h, hq // h, d) * scale
    k = np.array(keys, dtype=np.float64)
    v = np.array(values, dtype=np.float64)
    s = qs @ k.swapaxes(-1, -2)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    delta = gamma(d + 3) * (np.abs(qs) @ np.abs(k).swapaxes(-1, -2)).max(axis=-1, keepdims=True)  # (B, H, R, 1)
    bound = (np.expm1(2 * delta) + gamma(n + 3)) * (p @ np.abs(v))
    return (p @ v).reshape(b, hq, 1, -1), bound.reshape(b, hq, 1, -1)
