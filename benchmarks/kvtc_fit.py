"""kvtc's prompt fit at one layer's shape, the old way against the new, in one process,
alternated; median seconds of each, their ratio, and whether the results agree:

- the bit allocation: the DP over every component (``allocate``) against the DP over the
  components that can get bits (``allocate_by_variance``); the widths must be equal;
- the whole fit (``fit_codec``): the exact eigendecomposition (``exact=True``) against the
  leading components by subspace iteration (the default where it is cheaper), on keys made
  as the random-weight device model makes them (Gaussian rows through a random projection);
  the reconstruction errors of the two codecs;
- the eigen part alone, the covariance given (what runs on the CPU stream once a device has
  made the covariance): the CPU stream's ``eigh`` of it against ``gram_leading`` of the k leading.

A prompt at the 8B shape runs 64 fits (keys and values of 32 layers), 1,024 channels each.

    python benchmarks/kvtc_fit.py [--channels 1024] [--tokens 4096] [--budget 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import veloxquant_mlx  # noqa: F401  (the package's BLAS first, as everywhere)
import mlx.core as mx
import numpy as np

from veloxquant_mlx.lowrank.factors import gram_leading
from veloxquant_mlx.methods.kvtc.allocation import allocate, allocate_by_variance, leading_count, uniform_distortion
from veloxquant_mlx.methods.kvtc.transform import fit_codec


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _error(codec, x) -> float:
    x_hat = codec.decode(codec.encode(x))
    return float(mx.linalg.norm(x_hat - x) / mx.linalg.norm(x - x.mean(axis=0)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--channels", type=int, default=1024, help="H * d: 8 KV heads of 128 at the 8B shape")
    ap.add_argument("--tokens", type=int, default=4096, help="rows of the fit (FIT_SAMPLE_TOKENS at most)")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--choices", default="0,1,2,3,4,6,8")
    ap.add_argument("--beta", type=float, default=3.5)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    choices = tuple(int(c) for c in args.choices.split(","))
    r = np.random.default_rng(0)
    lam = np.sort(r.gamma(0.5, 1.0, args.channels))[::-1]
    x = mx.array((r.standard_normal((args.tokens, 4096)) @ (r.standard_normal((4096, args.channels)) / 64))
                 .astype(np.float32))
    centred = x - x.mean(axis=0)
    gram = centred.T @ centred
    mx.eval(x, gram)
    k = leading_count(args.channels, choices, args.budget, args.beta)
    times = {name: [] for name in ("whole DP", "leading DP", "exact fit", "default fit", "eigh", "leading")}
    same, errors = True, {}
    for _ in range(args.repeats):
        t, a = _timed(lambda: allocate(uniform_distortion(lam, choices, args.beta), choices, args.budget))
        times["whole DP"].append(t)
        t, b = _timed(lambda: allocate_by_variance(lam, choices, args.budget, args.beta))
        times["leading DP"].append(t)
        same &= bool(np.array_equal(a, b))
        for name, exact in (("exact fit", True), ("default fit", False)):
            t, (codec, _, _) = _timed(lambda: fit_codec(x, args.budget, choices, args.beta, exact=exact))
            times[name].append(t)
            errors[name] = _error(codec, x)
        t, _ = _timed(lambda: mx.eval(*mx.linalg.eigh(gram, stream=mx.cpu)))
        times["eigh"].append(t)
        t, _ = _timed(lambda: mx.eval(*gram_leading(gram, k)))
        times["leading"].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.channels} channels, {args.tokens} tokens, {args.budget} bits, {args.repeats} repeats (median)\n")
    print("| step | old ms | new ms | old / new | agree |")
    print("|---|---:|---:|---:|---|")
    print(f"| allocation | {med['whole DP'] * 1e3:.1f} | {med['leading DP'] * 1e3:.1f} | "
          f"{med['whole DP'] / med['leading DP']:.2f}x | widths equal: {same} |")
    print(f"| whole fit | {med['exact fit'] * 1e3:.1f} | {med['default fit'] * 1e3:.1f} | "
          f"{med['exact fit'] / med['default fit']:.2f}x | error {errors['exact fit']:.4f} -> "
          f"{errors['default fit']:.4f} ({errors['default fit'] / errors['exact fit']:.4f}x) |")
    print(f"| eigen part, covariance given | {med['eigh'] * 1e3:.1f} | {med['leading'] * 1e3:.1f} | "
          f"{med['eigh'] / med['leading']:.2f}x | {k} leading of {args.channels} |")


if __name__ == "__main__":
    main()
