"""Prefill fits at Llama-3-8B's shapes (8 KV heads of 128, a 4,096-token chunk): the
exact decompositions the prefill path used against the bounded ones that replace them
(issue 31). Times one fit each (median of --repeats, evaluated), and its error.

    python benchmarks/fit_prefill.py                      # CPU
    python benchmarks/fit_prefill.py --tokens 32768       # a longer prompt

- xkv: the joint SVD of two layers' keys side by side (T x 2048): the exact thin SVD
  (QR over the tokens, then an SVD) against ``randomized_basis`` (rank 256, and the
  energy rule at 0.95);
- gear's fixed rank: power iteration with a QR over the chunk's tokens at every loop
  against ``leading_basis`` (subspace iteration on the d x d Gram matrix);
- spectral: the eigenbasis of the unit rows' second moment over every token against the
  bounded sample (``sample_rows``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import veloxquant_mlx  # noqa: F401  first: it may load an optimized BLAS before mlx

import mlx.core as mx  # noqa: E402

from veloxquant_mlx.lowrank import factors  # noqa: E402
from veloxquant_mlx.methods.spectral.eigen_store import eigenbasis  # noqa: E402


def timed(fn, repeats):
    out, times = None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        mx.eval(out)
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def keys(shape, seed=0):
    """Keys with a decaying spectrum per head (what low-rank fits are for)."""
    *lead, t, d = shape
    a = mx.random.normal((*lead, t, d), key=mx.random.key(seed)) * (0.97 ** mx.arange(d))
    frame, _ = mx.linalg.qr(mx.random.normal((d, d), key=mx.random.key(seed + 1)), stream=mx.cpu)
    return a @ frame.T


def qr_power_iteration(x, rank, iterations=factors.POWER_ITERATIONS, seed=factors.SEED):
    """The replaced path: a QR over the T rows at every loop."""
    x = x.astype(mx.float32)
    p = mx.random.normal((*x.shape[:-2], x.shape[-1], rank), key=mx.random.key(seed))
    for _ in range(iterations):
        q, _ = mx.linalg.qr(x @ p, stream=mx.cpu)
        p = x.swapaxes(-1, -2) @ q
    return q, p


def exact_unit_basis(x):
    unit = x / mx.linalg.norm(x, axis=-1, keepdims=True)
    _, v = mx.linalg.eigh(unit.swapaxes(-1, -2) @ unit / x.shape[2], stream=mx.cpu)
    return v[..., ::-1]


def rel(a, b):
    return float(mx.linalg.norm((a - b).reshape(-1)) / mx.linalg.norm(b.reshape(-1)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    t, rows = args.tokens, []

    x = keys((1, t, 2 * 8 * 128))  # xkv: 2 layers x 8 heads x 128, side by side
    (a, v, _), t_old = timed(lambda: factors.svd_factors(x), args.repeats)
    best = rel(a[..., :256] @ v[..., :256].swapaxes(-1, -2), x)
    (vr, r), t_new = timed(lambda: factors.randomized_basis(x, 256), args.repeats)
    rows.append(("xkv joint fit, rank 256", t_old, t_new, best, rel((x @ vr) @ vr.swapaxes(-1, -2), x)))
    (vr, r), t_new = timed(lambda: factors.randomized_basis(x, None, 0.95), args.repeats)
    rows.append((f"xkv joint fit, energy 0.95 (r={r})", t_old, t_new, None, rel((x @ vr) @ vr.swapaxes(-1, -2), x)))

    residual = mx.random.normal((1, 8, t, 128), key=mx.random.key(3))  # gear: a nearly white residual
    (q, p), t_old = timed(lambda: qr_power_iteration(residual, 4), args.repeats)
    e_old = rel(q @ p.swapaxes(-1, -2), residual)
    (v, _, _), t_new = timed(lambda: factors.leading_basis(residual, 4), args.repeats)
    rows.append(("gear fixed rank 4", t_old, t_new, e_old, rel((residual @ v) @ v.swapaxes(-1, -2), residual)))

    k = keys((1, 8, t, 128), seed=5)
    v_old, t_old = timed(lambda: exact_unit_basis(k), args.repeats)
    v_new, t_new = timed(lambda: eigenbasis(k)[0], args.repeats)
    held = lambda v: float((((k / mx.linalg.norm(k, axis=-1, keepdims=True)) @ v[..., :8]) ** 2).sum())  # noqa: E731
    rows.append(("spectral eigenbasis (top-8 energy held)", t_old, t_new, held(v_old), held(v_new)))

    print(f"{t} tokens, device {mx.default_device()}")
    print("| fit | exact s | bounded s | exact error | bounded error |")
    print("|---|---:|---:|---:|---:|")
    for name, a_s, b_s, e_a, e_b in rows:
        print(f"| {name} | {a_s:.3f} | {b_s:.3f} | {'' if e_a is None else f'{e_a:.4g}'} | {e_b:.4g} |")


if __name__ == "__main__":
    main()
