"""Median wall time of evaluated MLX calls, candidates interleaved in one run, and the
calls the CPU decode scripts time.

``timed(fns, reps)``: each named zero-argument function is called ``warmup`` times, then
``reps`` rounds call every function once each (the result evaluated), so that a change of
load on a shared machine falls on every candidate alike; the median per function, in ms.
Used by the CPU decode scripts of the quantization and low-rank methods
(kvquant_decode_cpu.py, skvq_decode_cpu.py, token_mixed_decode.py, gear_decode.py,
latent_decode.py, vq_decode_cpu.py), whose ratios are between candidates of the same run.

The candidates they share: ``packed_decode`` (what a decode step runs) and the
baselines ``history_sdpa`` and ``history_pure`` (the history decoded, then attended),
together as ``decode_candidates`` (checked by ``assert_agree``) or as
``packed_against_dense``; ``fill_store``, ``context_arguments`` and ``print_sdpa_floor``
set up the GEAR and latent scripts' runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import veloxquant_mlx  # noqa: F401  (before mlx: OpenBLAS on Linux)
import mlx.core as mx  # noqa: E402

from veloxquant_mlx.kernels.decode import DecodePart, decode_attention  # noqa: E402


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


def packed_decode(store, q, *, scale, n_kv_heads, use_kernel=True, empty=None):
    """What a decode step runs: ``decode_attention`` over the store's parts."""
    empty = mx.zeros((0,), q.dtype) if empty is None else empty
    return decode_attention(q, store.decode_parts(empty), scale=scale, use_kernel=use_kernel,
                            n_kv_heads=n_kv_heads)


def history_sdpa(store, q, *, scale, dtype):
    """The history decoded into ``dtype``, then one ``scaled_dot_product_attention``."""
    k, v = store.history(dtype)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)


def history_pure(store, q, *, scale, dtype):
    """The decoded history as one full-precision part of the pure-MLX path: the same
    matrix products as the packed path, a stricter baseline where SDPA is slow."""
    k, v = store.history(dtype)
    return decode_attention(q, [DecodePart(None, k, None, v)], scale=scale, use_kernel=False)


def fill_store(store, context: int, heads: int, head_dim: int, decode_steps: int = 200,
               chunk: int = 2048) -> None:
    """``context`` seeded random tokens committed to ``store`` (batch 1): a prompt in
    chunks of ``chunk``, then ``decode_steps`` tokens one at a time. Keys' channels have
    scales 1..7, so that per-channel codecs see unequal channels."""
    shape = (1, heads, context, head_dim)
    keys = mx.random.normal(shape, key=mx.random.key(0)) * (1 + mx.arange(head_dim) % 7)
    values = mx.random.normal(shape, key=mx.random.key(1))
    n_prompt = context - decode_steps
    for i in range(0, n_prompt, chunk):
        store.commit(keys[:, :, i : min(i + chunk, n_prompt)], values[:, :, i : min(i + chunk, n_prompt)])
    for i in range(n_prompt, context):
        store.commit(keys[:, :, i : i + 1], values[:, :, i : i + 1])


def decode_candidates(store, q, *, scale, dtype, n_kv_heads) -> dict:
    """``packed_decode`` (pure-MLX path), ``history_sdpa`` and ``history_pure`` over
    ``store`` as ``timed`` takes them: {"packed", "sdpa", "pure"}."""
    empty = mx.zeros((0,), dtype)
    return {"packed": lambda: packed_decode(store, q, scale=scale, n_kv_heads=n_kv_heads, use_kernel=False,
                                            empty=empty),
            "sdpa": lambda: history_sdpa(store, q, scale=scale, dtype=dtype),
            "pure": lambda: history_pure(store, q, scale=scale, dtype=dtype)}


def assert_agree(calls: dict, tol: float) -> None:
    """Every call's output equals the first one's within ``tol`` (absolute and relative)."""
    first, *rest = (fn().astype(mx.float32) for fn in calls.values())
    diffs = [float(mx.abs(first - x).max()) for x in rest]
    assert all(mx.allclose(first, x, atol=tol, rtol=tol) for x in rest), diffs


def context_arguments():
    """The GEAR and latent scripts' command line: ``--context`` tokens, ``--reps``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=20)
    return parser.parse_args()


def print_sdpa_floor(q, context: int, heads: int, reps: int) -> None:
    """The run's first line: fp32 SDPA over ``context`` dense random tokens, the floor a
    packed path is read against."""
    head_dim = q.shape[-1]
    k = mx.random.normal((1, heads, context, head_dim))
    v = mx.random.normal((1, heads, context, head_dim))
    ms = timed({"sdpa": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5)}, reps)["sdpa"]
    print(f"context {context}, {heads} KV heads x {head_dim}, {q.shape[1]} query heads, float32, CPU; "
          f"fp32 SDPA over dense tokens: {ms:.2f} ms")


def packed_against_dense(store, q, *, n_kv_heads: int, reps: int) -> tuple[float, dict[str, float]]:
    """``packed_decode`` against ``history_sdpa`` (float32) over ``store``: the largest
    |difference| of their outputs, then each one's ms ({"packed", "dense"})."""
    scale = q.shape[-1] ** -0.5
    calls = {"packed": lambda: packed_decode(store, q, scale=scale, n_kv_heads=n_kv_heads),
             "dense": lambda: history_sdpa(store, q, scale=scale, dtype=mx.float32)}
    diff = float(mx.abs(calls["packed"]() - calls["dense"]()).max())
    return diff, timed(calls, reps)
