"""A latent store's rows at a CUDA decode step: MLX's ops against the latent-rows kernel.

Issue 30: palu's and svdq's fused read attends over every latent of a run in the queries'
dtype, zero-padded to a fused width. MLX's ops build those rows from a dequantization a
span, a cut, a join along the channels with zeros and one with the window; the kernel
(``lowrank/latent_rows_kernel.py``) writes them in one launch. This times one run's rows
both ways in one process (the arms taking turns), at the 8B shape's layouts at their
defaults: palu 4 head groups of 256 channels at rank 209 (a quarter at 4 bits, the rest
at 2), svdq 8 heads of 128 at rank 110 (``svdq_bit_schedule`` [8, 4, 2, 1, 1, 0, 0, 0]),
``--tokens`` latents flushed plus a window one short of a group. It checks the arms
agree first (the kernel's values are the float32 pass's, rounded once; MLX's round the
product and the sum in float16). Each figure is the median over ``--repeats`` of one
``rows`` call evaluated alone (its launches and their wait), in microseconds.

    python benchmarks/latent_rows.py                   # on a GPU: both arms
    python benchmarks/latent_rows.py --tokens 32768
"""

from __future__ import annotations

import argparse
import statistics
import time

import veloxquant_mlx  # noqa: F401  first: it may load an optimized BLAS before mlx

import mlx.core as mx  # noqa: E402

from veloxquant_mlx.lowrank import latent_rows_kernel as lr  # noqa: E402
from veloxquant_mlx.lowrank.latent import LatentTokens, split_channels  # noqa: E402

GROUP = 32
LAYOUTS = {  # name: (lead (B, G), rank, bit schedule, fused width)
    "palu": ((1, 4), 209, [4] + [2] * 3, 256),
    "svdq": ((1, 8), 110, [8, 4, 2, 1, 1, 0, 0, 0], 128),
}


def store(lead, rank, schedule, tokens: int, dtype) -> LatentTokens:
    """A run of ``tokens`` flushed latents and ``GROUP - 1`` in the window, as a prefill then
    decode steps leave it."""
    run = LatentTokens(split_channels(rank, schedule), GROUP, 256, lead)
    x = mx.random.normal((*lead, tokens + GROUP - 1, rank), key=mx.random.key(0)).astype(dtype)
    run.append(x[:, :, :tokens])
    for t in range(tokens, tokens + GROUP - 1):
        run.append(x[:, :, t : t + 1])
    mx.eval([a for a in run.read_inputs()] + [run.buf.buffer])
    return run


def rows(run: LatentTokens, dtype, width: int, kernel: bool) -> mx.array:
    saved, lr._SWITCHED_ON = lr._SWITCHED_ON, kernel
    try:
        return run.rows(dtype, width, iter(run.read_inputs(dtype)))
    finally:
        lr._SWITCHED_ON = saved


def rows_kernel_runs(layout, dtype) -> bool:
    saved, lr._SWITCHED_ON = lr._SWITCHED_ON, True  # whatever VQ_LATENT_ROWS_KERNEL says
    try:
        return lr.runs_for(layout, dtype)
    finally:
        lr._SWITCHED_ON = saved


def time_us(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        out.append((time.perf_counter() - start) * 1e6)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    a = p.parse_args()
    dtype = getattr(mx, a.dtype)
    print(f"{mx.default_device()}, {a.tokens} tokens + {GROUP - 1} in the window, {a.dtype}; "
          f"median of {a.repeats}, us a call")
    print("\n| layout | MLX ops us | kernel us | kernel vs ops | agree |\n|---|---:|---:|---:|---|")
    for name, (lead, rank, schedule, width) in LAYOUTS.items():
        run = store(lead, rank, schedule, a.tokens, dtype)
        ops = rows(run, dtype, width, kernel=False)
        if not rows_kernel_runs(run.rows_layout, dtype):
            t_ops = time_us(lambda: rows(run, dtype, width, False), a.repeats)
            print(f"| {name} | {t_ops:.1f} | - | - | no kernel here |")
            continue
        got = rows(run, dtype, width, kernel=True)
        diff = mx.abs(got.astype(mx.float32) - ops.astype(mx.float32))
        agree = bool((diff <= 2 ** -9 * mx.maximum(mx.abs(ops.astype(mx.float32)), 1.0)).all().item())
        for _ in range(10):  # warm both
            mx.eval(rows(run, dtype, width, False), rows(run, dtype, width, True))
        t_ops, t_kernel = [], []
        for _ in range(5):  # the arms take turns
            t_ops.append(time_us(lambda: rows(run, dtype, width, False), a.repeats // 5))
            t_kernel.append(time_us(lambda: rows(run, dtype, width, True), a.repeats // 5))
        o, k = statistics.median(t_ops), statistics.median(t_kernel)
        print(f"| {name} | {o:.1f} | {k:.1f} | {o / k:.2f}x | {agree} |")


if __name__ == "__main__":
    main()
