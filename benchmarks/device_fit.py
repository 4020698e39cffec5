"""kvtc's prompt fit at one layer of the 8B shape, its subspace iteration on the CPU streams
against on the GPU (``lowrank/factors.device_leading``), in one process, alternated.

A layer's fit is two of them, keys' and values' (4,096 rows of 1,024 channels each, started
together and evaluated at once, as ``KVTCCache._fit`` runs them). Rows as the random-weight
device model makes them (Gaussian rows through a random projection) and with a power-law
spectrum (the case where TF32 products without the split lose the trailing directions).
First a check: each route's reconstruction error against the exact fit's (issue 31's bound:
within 1%); then the median wall time of a layer's two fits, warm.

    python benchmarks/device_fit.py [--repeats 7] [--channels 1024] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import veloxquant_mlx  # noqa: F401  (the package's BLAS first, as everywhere)
import mlx.core as mx
import numpy as np

from veloxquant_mlx.lowrank import factors
from veloxquant_mlx.methods.kvtc.transform import finish_fit, start_fit

CHOICES = (0, 1, 2, 3, 4, 6, 8)
ROUTES = {
    "CPU streams (Householder)": factors.stream_leading,
    "GPU, split products": functools.partial(factors.device_leading, product=factors.split_product),
    "GPU, TF32 products (no split)": factors.device_leading,
}


def _rows(kind: str, n: int, p: int, seed: int) -> mx.array:
    r = np.random.default_rng(seed)
    if kind == "random projection":
        x = r.standard_normal((n, 4096)) @ (r.standard_normal((4096, p)) / 64)
    else:
        x = (r.standard_normal((n, p)) * (1 + np.arange(p)) ** -1.5) @ np.linalg.qr(r.standard_normal((p, p)))[0].T
    return mx.array(x.astype(np.float32)) + 0.5


def _layer_fit(rows: list, budget: int):
    started = [start_fit(x, budget, CHOICES, 3.5) for x in rows]
    mx.eval([a for s in started for a in s[:3]])
    return [finish_fit(s, budget, CHOICES, 3.5)[0] for s in started]


def _error(codec, x) -> float:
    return float(mx.linalg.norm(codec.decode(codec.encode(x)) - x) / mx.linalg.norm(x - x.mean(axis=0)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--channels", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    print(f"device {mx.default_device()}, MLX {mx.__version__}; {args.channels} channels, {args.tokens} tokens, "
          f"{args.budget} bits", flush=True)
    real = factors.gram_leading
    data = {kind: [_rows(kind, args.tokens, args.channels, seed) for seed in (0, 1)]
            for kind in ("random projection", "power law 1.5")}
    mx.eval(data)
    print("\n| rows | route | error / exact fit's (keys, values) |\n|---|---|---|")
    for kind, rows in data.items():
        exact = [_error(finish_fit(start_fit(x, args.budget, CHOICES, 3.5, exact=True), args.budget, CHOICES, 3.5)[0], x)
                 for x in rows]
        for name, route in ROUTES.items():
            factors.gram_leading = route
            got = [_error(c, x) for c, x in zip(_layer_fit(rows, args.budget), rows)]
            print(f"| {kind} | {name} | {', '.join(f'{g / e:.4f}' for g, e in zip(got, exact))} |", flush=True)
    times = {name: [] for name in ROUTES}
    rows = data["random projection"]
    for name, route in ROUTES.items():  # warm: every shape traced and compiled once
        factors.gram_leading = route
        _layer_fit(rows, args.budget)
    for _ in range(args.repeats):
        for name, route in ROUTES.items():
            factors.gram_leading = route
            t = time.perf_counter()
            _layer_fit(rows, args.budget)
            times[name].append(time.perf_counter() - t)
    factors.gram_leading = real
    base = statistics.median(times[next(iter(ROUTES))])
    print(f"\n| route | a layer's two fits, ms (median of {args.repeats}) | CPU streams' time / this |\n|---|---:|---:|")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m * 1e3:.1f} | {base / m:.2f} |")


if __name__ == "__main__":
    main()
