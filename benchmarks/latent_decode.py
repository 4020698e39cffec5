"""Decode over the latent and anchor forms (svdq, palu, anchorkv) against
reconstruct-then-attend, on the CPU.

    .venv/bin/python benchmarks/latent_decode.py                 # 4k tokens, the table
    .venv/bin/python benchmarks/latent_decode.py --context 16384

A store holds a ``--context``-token history of 8 KV heads x 128 channels (a prompt in
chunks of 2048 held exactly, compressed at the first decode step, then 200 decode
steps), 32 query heads, float32. Per decode call, median over ``--reps`` interleaved
calls after a warm-up:

- **latent**: what a decode step runs (``kernels/decode.decode_attention`` over the
  store's part): svdq and palu score through the query folded onto the basis and mix in
  the latent space (``lowrank/latent.py``); anchorkv scores anchors, gathers them per
  token and adds the coded residuals (``lowrank/anchors.py``);
- **reconstruct-then-attend**: the history rebuilt dense (``store.history``), then
  ``scaled_dot_product_attention``;
- **fp32 SDPA** over as many dense tokens, for reference.

Both paths are first checked to agree (max |difference| printed).
"""

from __future__ import annotations

import argparse

import veloxquant_mlx  # noqa: F401  (before mlx: OpenBLAS on Linux)
import mlx.core as mx  # noqa: E402
from cpu_timing import timed  # noqa: E402

from veloxquant_mlx import KVCacheConfig  # noqa: E402
from veloxquant_mlx.kernels.decode import decode_attention  # noqa: E402
from veloxquant_mlx.registry import METHODS  # noqa: E402

H, HQ, D = 8, 32, 128


def store(method: str, context: int, **options):
    cache = METHODS[method].load_implementation()(KVCacheConfig.from_dict({"method": method, "options": options}), None, 0)
    keys = mx.random.normal((1, H, context, D), key=mx.random.key(0)) * (1 + mx.arange(D) % 7)
    values = mx.random.normal((1, H, context, D), key=mx.random.key(1))
    n_prompt = context - 200
    for i in range(0, n_prompt, 2048):
        cache.store.commit(keys[:, :, i : min(i + 2048, n_prompt)], values[:, :, i : min(i + 2048, n_prompt)])
    for i in range(n_prompt, context):
        cache.store.commit(keys[:, :, i : i + 1], values[:, :, i : i + 1])
    mx.eval([a for a in cache.state["arrays"].values() if a is not None])
    return cache.store


def latent(s, q):
    return decode_attention(q, s.decode_parts(mx.zeros((0,), q.dtype)), scale=D**-0.5, n_kv_heads=H)


def dense(s, q):
    k, v = s.history(mx.float32)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    q = mx.random.normal((1, HQ, 1, D), key=mx.random.key(2))
    k = mx.random.normal((1, H, args.context, D))
    v = mx.random.normal((1, H, args.context, D))
    sdpa = timed({"sdpa": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5)}, args.reps)["sdpa"]
    print(f"context {args.context}, {H} KV heads x {D}, {HQ} query heads, float32, CPU; "
          f"fp32 SDPA over dense tokens: {sdpa:.2f} ms")
    print("| method, setting | latent (ms) | reconstruct-then-attend (ms) | ratio | max |diff| |")
    print("|---|---|---|---|---|")
    for method, options in [("svdq", {}), ("svdq", {"svdq_rank": 32}), ("palu", {}), ("palu", {"palu_rank": 64}),
                            ("anchorkv", {}), ("anchorkv", {"anchorkv_theta": 0.3})]:
        s = store(method, args.context, **options)
        diff = float(mx.abs(latent(s, q) - dense(s, q)).max())
        ms = timed({"latent": lambda: latent(s, q), "dense": lambda: dense(s, q)}, args.reps)
        name = ", ".join([method] + [f"{k}={v}" for k, v in options.items()] or ["defaults"])
        print(f"| {name} | {ms['latent']:.2f} | {ms['dense']:.2f} | {ms['latent'] / ms['dense']:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
