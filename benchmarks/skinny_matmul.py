"""The pure-MLX decode path's products on a GPU: ``q Kᵀ`` then ``p V`` for one query token's
GQA rows a KV head, float32 as the pure path runs them, against split and float16 forms of
the same products and fp16 SDPA.

Each variant is checked against the float64 numpy products, then timed two ways:
``independent``, ``--chain`` calls that share no data in one evaluation (MLX's CUDA graphs
may run them side by side), and ``chained``, each call's queries the previous call's output
(as a decode step's layers are: one call at a time on the GPU, so a product with few
blocks pays its full latency). Run it under ``MLX_USE_CUDA_GRAPHS=0`` too: a chain's figures
include what MLX's CUDA graphs cost it (benchmarks/notes/cuda_graphs.md).

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


def _best(build, repeats):
    mx.eval(build())
    best = float("inf")
    for _ in range(repeats):
        outs = build()
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def timed(attend, q, chain, repeats=5):
    """(independent, chained) microseconds a call of ``attend(q) -> q-shaped``."""
    independent = _best(lambda: [attend(q) for _ in range(chain)], repeats) / chain

    def chained():
        x = q
        for _ in range(chain):
            x = attend(x)
        return x

    return independent * 1e6, _best(chained, repeats) / chain * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--chain", type=int, default=64)
    args = ap.parse_args()
    b, h, r, d = 1, args.heads, args.rows, args.dim
    rows = ["| tokens | variant | independent us a call | chained us a call | max rel err vs float64 |",
            "|---:|---|---:|---:|---:|"]
    for t in args.tokens:
        rng = np.random.default_rng(t)
        k64, v64 = rng.standard_normal((b, h, t, d)), rng.standard_normal((b, h, t, d))
        q64 = rng.standard_normal((b, h, r, d)) / np.sqrt(d)
        s64 = q64 @ k64.swapaxes(-1, -2)
        p64 = np.exp(s64 - s64.max(-1, keepdims=True))
        ref = (p64 / p64.sum(-1, keepdims=True)) @ v64
        k32, v32, q32 = (mx.array(x.astype(np.float32)) for x in (k64, v64, q64))
        k16, v16 = k32.astype(mx.float16), v32.astype(mx.float16)
        kt32 = mx.contiguous(k32.swapaxes(-1, -2))

        def softmax_mix(scores, mix):
            return mix(mx.softmax(scores, axis=-1))

        variants = {
            "float32 q Kᵀ, p V (the pure path)": lambda q: softmax_mix(q @ k32.swapaxes(-1, -2), lambda p: p @ v32),
            "float32, Kᵀ (D, T) contiguous": lambda q: softmax_mix(q @ kt32, lambda p: p @ v32),
            "float32, K and V cast from float16": lambda q: softmax_mix(
                q @ k16.astype(mx.float32).swapaxes(-1, -2), lambda p: p @ v16.astype(mx.float32)),
            "float32, p V split 512": lambda q: softmax_mix(q @ k32.swapaxes(-1, -2), lambda p: split_mix(p, v32, 512)),
            "float32, p V split 128": lambda q: softmax_mix(q @ k32.swapaxes(-1, -2), lambda p: split_mix(p, v32, 128)),
            "float16 products, float32 softmax": lambda q: softmax_mix(
                (q.astype(mx.float16) @ k16.swapaxes(-1, -2)).astype(mx.float32),
                lambda p: (p.astype(mx.float16) @ v16).astype(mx.float32)),
            # each GQA row its own matrix-vector product, K and V broadcast over the rows:
            # MLX's own gemv kernel instead of a cuBLAS product (a plain kernel node in
            # MLX's CUDA graphs, where a captured cuBLAS call is a child graph)
            "float32, rows as a batch of matrix-vector products": lambda q: softmax_mix(
                (q[..., None, :] @ kt32[:, :, None]).squeeze(-2),
                lambda p: (p[..., None, :] @ v32[:, :, None]).squeeze(-2)),
            "fp16 SDPA (GQA rows as query heads)": lambda q: mx.fast.scaled_dot_product_attention(
                q.astype(mx.float16).reshape(b, h * r, 1, d), k16, v16, scale=1.0).reshape(b, h, r, d).astype(mx.float32),
        }
        for name, attend in variants.items():
            out = np.array(attend(q32), dtype=np.float64)
            err = np.abs(out - ref).max() / np.abs(ref).max()
            independent, chained = timed(attend, q32, args.chain)
            rows.append(f"| {t} | {name} | {independent:.1f} | {chained:.1f} | {err:.1e} |")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
