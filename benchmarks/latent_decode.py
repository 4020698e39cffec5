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
  token and adds the coded residuals (``methods/anchorkv/anchors.py``);
- **reconstruct-then-attend**: the history rebuilt dense (``store.history``), then
  ``scaled_dot_product_attention``;
- **fp32 SDPA** over as many dense tokens, for reference.

Both paths are first checked to agree (max |difference| printed).
"""

from __future__ import annotations

import veloxquant_mlx  # noqa: F401  (before mlx: OpenBLAS on Linux)
import mlx.core as mx  # noqa: E402
from cpu_timing import context_arguments, fill_store, packed_against_dense, print_sdpa_floor  # noqa: E402

from veloxquant_mlx import KVCacheConfig  # noqa: E402
from veloxquant_mlx.registry import METHODS  # noqa: E402

H, HQ, D = 8, 32, 128


def store(method: str, context: int, **options):
    cache = METHODS[method].load_implementation()(KVCacheConfig.from_dict({"method": method, "options": options}), None, 0)
    fill_store(cache.store, context, H, D)
    mx.eval([a for a in cache.state["arrays"].values() if a is not None])
    return cache.store


def main():
    args = context_arguments()
    q = mx.random.normal((1, HQ, 1, D), key=mx.random.key(2))
    print_sdpa_floor(q, args.context, H, args.reps)
    print("| method, setting | latent (ms) | reconstruct-then-attend (ms) | ratio | max |diff| |")
    print("|---|---|---|---|---|")
    for method, options in [("svdq", {}), ("svdq", {"svdq_rank": 32}), ("palu", {}), ("palu", {"palu_rank": 64}),
                            ("anchorkv", {}), ("anchorkv", {"anchorkv_theta": 0.3})]:
        s = store(method, args.context, **options)
        diff, ms = packed_against_dense(s, q, n_kv_heads=H, reps=args.reps)
        name = ", ".join([method] + [f"{k}={v}" for k, v in options.items()] or ["defaults"])
        print(f"| {name} | {ms['packed']:.2f} | {ms['dense']:.2f} | {ms['packed'] / ms['dense']:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
