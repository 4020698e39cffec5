"""The pure-MLX decode path's products on a GPU: ``p V`` (weights over T tokens times values)
and ``q Kᵀ``, one query token's GQA rows a KV head, float32 as the pure path runs them
against split and float16 forms of the same product. Each variant is checked against the
float64 numpy product, then timed as ``--chain`` independent calls in one evaluation
(back-to-back launches: per-call device time plus launch cost, no host sync between).

    python benchmarks/skinny_matmul.py --tokens 4096 32768
"""

from __future__ import annotations

import argparse
import time

import veloxquant_mlx  # noqa: F401  (first: it may load OpenBLAS)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


def split_mix(p, v, chunk):
    """``p V`` with the token axis cut into chunks, each chunk's product a batch entry."""
    *lead, r, t = p.shape
    d = v.shape[-1]
    whole = t - t % chunk
    s = whole // chunk
    ps = p[..., :whole].reshape(*lead, r, s, chunk).swapaxes(-3, -2)
    vs = v[..., :whole, :].reshape(*lead, s, chunk, d)
    out = (ps @ vs).sum(axis=-3)
    if whole < t:
        out = out + p[..., whole:] @ v[..., whole:, :]
    return out


def timed(fn, chain, repeats=5):
    outs = [fn() for _ in range(chain)]
    mx.eval(outs)
    best = float("inf")
    for _ in range(repeats):
        outs = [fn() for _ in range(chain)]
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best / chain * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--chain", type=int, default=64)
    args = ap.parse_args()
    rows = ["| tokens | product | variant | us a call | max rel err vs float64 |", "|---:|---|---|---:|---:|"]
    for t in args.tokens:
        rng = np.random.default_rng(t)
        p64 = rng.random((1, args.heads, args.rows, t))
        p64 /= p64.sum(-1, keepdims=True)
        v64 = rng.standard_normal((1, args.heads, t, args.dim))
        q64 = rng.standard_normal((1, args.heads, args.rows, args.dim)) / np.sqrt(args.dim)
        ref_mix, ref_scores = p64 @ v64, q64 @ v64.swapaxes(-1, -2)
        p32, v32, q32 = (mx.array(x.astype(np.float32)) for x in (p64, v64, q64))
        v16 = v32.astype(mx.float16)
        vt32 = mx.contiguous(v32.swapaxes(-1, -2))
        variants = {
            ("p V", "float32 (the pure path)"): lambda: p32 @ v32,
            ("p V", "float32, values cast from float16"): lambda: p32 @ v16.astype(mx.float32),
            ("p V", "float32 split 256"): lambda: split_mix(p32, v32, 256),
            ("p V", "float32 split 512"): lambda: split_mix(p32, v32, 512),
            ("p V", "float32 split 1024"): lambda: split_mix(p32, v32, 1024),
            ("p V", "float16 p, float16 V"): lambda: p32.astype(mx.float16) @ v16,
            ("p V", "float16 split 512"): lambda: split_mix(p32.astype(mx.float16), v16, 512),
            ("p V", "(Vᵀ pᵀ)ᵀ float32"): lambda: (vt32 @ p32.swapaxes(-1, -2)).swapaxes(-1, -2),
            ("q Kᵀ", "float32, K (T, D) transposed"): lambda: q32 @ v32.swapaxes(-1, -2),
            ("q Kᵀ", "float32, Kᵀ (D, T) contiguous"): lambda: q32 @ vt32,
            ("q Kᵀ", "float16 q, float16 K"): lambda: q32.astype(mx.float16) @ v16.swapaxes(-1, -2),
        }
        for (product, name), fn in variants.items():
            out = np.array(fn().astype(mx.float32), dtype=np.float64)
            ref = ref_mix if product == "p V" else ref_scores
            err = np.abs(out - ref).max() / np.abs(ref).max()
            rows.append(f"| {t} | {product} | {name} | {timed(fn, args.chain):.1f} | {err:.1e} |")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
