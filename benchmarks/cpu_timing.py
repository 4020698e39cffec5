"""Median wall time of evaluated MLX calls, candidates interleaved in one run.

``timed(fns, reps)``: each named zero-argument function is called ``warmup`` times, then
``reps`` rounds call every function once each (the result evaluated), so that a change of
load on a shared machine falls on every candidate alike; the median per function, in ms.
Used by the CPU decode scripts of the quantization methods (kvquant_decode_cpu.py,
skvq_decode_cpu.py, token_mixed_decode.py, gear_decode.py), whose ratios are between
candidates of the same run.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx


def timed(fns: dict, reps: int = 15, warmup: int = 3) -> dict[str, float]:
    for fn in fns.values():
        for _ in range(warmup):
            mx.eval(fn())
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            mx.eval(fn())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
