"""Taking whole rows of a (B, H, T, D) buffer by index, two ways, on the device at hand:
``take_along_axis`` with the (B, H, K) index broadcast over D (what ``evict/select.py``'s
``gather_tokens`` and the eviction store's compaction do), and ``take`` of the flattened
(B H T, D) rows by one index a row (what a2ats's decode step does since session 56). The
same values; ms a call, each timed over ``--repeats`` evaluated calls after a warm-up. Each
way's rows of the last (b, h), whose offsets are the largest, are checked against a take from
that (T, D) slice alone: a way that disagrees is named in the last column (on the H200 at
2^31 elements the two ways disagreed, session 57).

    python benchmarks/gather_rows.py --shapes 1,8,8192,128,3300 8,8,8192,128,3300
"""

from __future__ import annotations

import argparse
import time

import veloxquant_mlx  # noqa: F401  first: it may load OpenBLAS

import mlx.core as mx


def along(x, idx):
    return mx.take_along_axis(x, idx[..., None], axis=2)


def by_rows(x, idx):
    b, h, t, d = x.shape
    at = idx + (mx.arange(b * h, dtype=mx.int32) * t).reshape(b, h, 1)
    return mx.take(x.reshape(-1, d), at, axis=0)


def timed(fn, x, idx, repeats):
    mx.eval(fn(x, idx))
    t0 = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn(x, idx))
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1,8,8192,128,3300", "8,8,8192,128,3300"],
                    help="B,H,T,D,K: buffer (B, H, T, D) float16, K rows taken per (B, H)")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    print(f"{mx.default_device()} / MLX {mx.__version__}\n")
    print("| B | H | T | D | K | take_along_axis ms | take of rows ms | ratio | wrong rows |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for spec in args.shapes:
        b, h, t, d, k = (int(v) for v in spec.split(","))
        x = mx.random.normal((b, h, t, d)).astype(mx.float16)
        idx = mx.sort(mx.random.randint(0, t, (b, h, k)).astype(mx.int32), axis=-1)
        mx.eval(x, idx)
        last = mx.take(x[b - 1, h - 1], idx[b - 1, h - 1], axis=0)
        wrong = [name for name, fn in (("take_along_axis", along), ("take of rows", by_rows))
                 if not mx.array_equal(fn(x, idx)[b - 1, h - 1], last)]
        a, r = timed(along, x, idx, args.repeats), timed(by_rows, x, idx, args.repeats)
        print(f"| {b} | {h} | {t} | {d} | {k} | {a:.3f} | {r:.3f} | {a / r:.2f}x | "
              f"{', '.join(wrong) or '-'} |")


if __name__ == "__main__":
    main()
