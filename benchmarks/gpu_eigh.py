"""The Jacobi eigensolver on a GPU against the CPU stream's LAPACK eigh (issue 31's fits).

For the fits' shapes (svdq's and amc's 128 x 128 a head, palu's 256 x 256 a group of two
heads, kvtc's 1,024 x 1,024 a layer), one batch of random Grams a layer's tensor holds:
the kernel's eigenpairs are checked against float64 LAPACK first (eigenvalues and residuals
within 8 n eps ||A||, V^T V within 8 n eps of I), then both routes are timed, each
evaluated alone, median of ``--repeats`` after a warm-up. The table says which sizes
``kernels/jacobi_eigh.GPU_MAX_N`` should let through.

    python benchmarks/gpu_eigh.py [--sizes 128:16 256:8 512:4 1024:2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import veloxquant_mlx  # noqa: F401  (before mlx: the system BLAS)
import mlx.core as mx
import numpy as np

from veloxquant_mlx.kernels import jacobi_eigh as je

EPS = 2.0 ** -24


def grams(b: int, n: int, seed: int) -> mx.array:
    x = np.random.default_rng(seed).standard_normal((b, 2 * n, n)).astype(np.float32)
    return mx.array(x.swapaxes(-1, -2) @ x)


def problems(a: mx.array, w: mx.array, v: mx.array) -> list[str]:
    a64, w, v = np.array(a, np.float64), np.array(w, np.float64), np.array(v, np.float64)
    n = a64.shape[-1]
    w64 = np.linalg.eigvalsh(a64)
    bound = 8 * n * EPS * np.abs(w64).max()
    found = []
    if not np.abs(w - w64).max() <= bound:
        found.append(f"eigenvalues off by {np.abs(w - w64).max():.3g} (bound {bound:.3g})")
    residual = np.linalg.norm(a64 @ v - v * w[:, None, :], axis=-2).max()
    if not residual <= bound:
        found.append(f"residual {residual:.3g} (bound {bound:.3g})")
    ortho = np.abs(v.swapaxes(-1, -2) @ v - np.eye(n)).max()
    if not ortho <= 8 * n * EPS:
        found.append(f"V^T V - I {ortho:.3g}")
    return found


def seconds(fn, repeats: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["128:16", "256:8", "512:4", "1024:2"],
                    help="n:batch pairs")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    backend = je.gpu_backend()
    if backend is None:
        raise SystemExit("no GPU: the kernel runs on CUDA (or, untested, Metal) only")
    print(f"| n | batch | CPU-stream eigh ms | Jacobi kernel ms | kernel vs eigh | checks |")
    print("|---:|---:|---:|---:|---:|---|")
    for spec in args.sizes:
        n, b = (int(x) for x in spec.split(":"))
        a = grams(b, n, seed=n)
        mx.eval(a)
        kernel = lambda: je.ordered(*je._kernel(backend)(**je.launch_args(a)))  # noqa: E731
        found = problems(a, *kernel())
        cpu = seconds(lambda: mx.linalg.eigh(a, stream=mx.cpu), args.repeats)
        gpu = seconds(kernel, args.repeats)
        print(f"| {n} | {b} | {cpu * 1e3:.2f} | {gpu * 1e3:.2f} | {gpu / cpu:.2f}x | "
              f"{'; '.join(found) or 'pass'} |", flush=True)


if __name__ == "__main__":
    main()
