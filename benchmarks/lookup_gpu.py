"""Reading codes through per-group tables on a GPU: kvquant's per-channel keys
(``methods/kvquant/nonuniform.py``: each group of ``g`` tokens of a channel has its own
table of 2^bits centroids, scaled and offset) as a gather along the table axis, as one
flat gather, and as a compiled chain of selects. ncu put the gather at 241 us a layer and
step at 4k (notes/decode_kernels.md). Every variant is checked for exact equality with
the gather, then timed as ``--calls`` calls in one evaluation.

    python benchmarks/lookup_gpu.py --tokens 4096 32768
"""

from __future__ import annotations

import argparse
import time

import veloxquant_mlx  # noqa: F401  (first: it may load OpenBLAS)

import mlx.core as mx  # noqa: E402


def along(table, codes):
    return mx.take_along_axis(table, codes, axis=-1)


def flat(table, codes):
    n = table.shape[-1]
    units = table.size // n
    offsets = (mx.arange(units, dtype=mx.uint32) * n).reshape(*table.shape[:-1], 1)
    return mx.take(table.reshape(-1), codes + offsets)


def _select(table, codes):
    out = mx.broadcast_to(table[..., :1], codes.shape)
    for j in range(1, table.shape[-1]):
        out = mx.where(codes == j, table[..., j : j + 1], out)
    return out


select = mx.compile(_select)


def timed(fn, calls, repeats=5):
    mx.eval(fn())
    best = float("inf")
    for _ in range(repeats):
        outs = [fn() for _ in range(calls)]
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best / calls * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--calls", type=int, default=32)
    args = ap.parse_args()
    rows = ["| tokens | variant | us a call | equal to the gather |", "|---:|---|---:|---|"]
    for t in args.tokens:
        units, n = t // args.group, 1 << args.bits
        table = mx.random.normal((1, 8, 128, units, n))
        codes = mx.random.randint(0, n, (1, 8, 128, units, args.group)).astype(mx.uint32)
        mx.eval(table, codes)
        ref = along(table, codes)
        for name, fn in (("take_along_axis (the code's)", along), ("flat take", flat), ("compiled select chain", select)):
            same = bool(mx.array_equal(fn(table, codes), ref).item())
            rows.append(f"| {t} | {name} | {timed(lambda: fn(table, codes), args.calls):.1f} | {same} |")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
