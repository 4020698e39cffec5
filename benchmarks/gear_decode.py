"""GEAR's decode over its packed form against dequantize-then-attend, on the CPU.

    .venv/bin/python benchmarks/gear_decode.py                 # 4k tokens, the table
    .venv/bin/python benchmarks/gear_decode.py --context 16384

A GEAR store holds a 4k-token history (a prompt in chunks of 2048, decode chunks of 128,
a few tokens in the buffer) of 8 KV heads x 128 channels, 32 query heads, float32 (the
CPU's fastest dtype). Per decode call, median over ``--reps`` interleaved calls after a warm-up:

- **packed**: what a decode step runs (``kernels/decode.decode_attention`` over the
  store's part): the backbone through ``quantized_matmul`` (the CPU's pure path), the
  low-rank term (q B_c, gathered per token, times A) and the sparse term (gather, product,
  scatter-add of its entries), added to the scores and the output;
- **dequantize-then-attend**: the history rebuilt dense (backbone dequantized, plus
  ``A Bᵀ`` per chunk, plus the outliers scattered), then ``scaled_dot_product_attention``;
- **fp32 SDPA**: attention over the same number of dense float32 tokens (no rebuild), a
  floor for reference.

Both GEAR paths are first checked to agree (max |difference| printed).
"""

from __future__ import annotations

import veloxquant_mlx  # noqa: F401  (before mlx: OpenBLAS on Linux)
import mlx.core as mx  # noqa: E402
from cpu_timing import context_arguments, fill_store, packed_against_dense, print_sdpa_floor  # noqa: E402

from veloxquant_mlx import KVCacheConfig  # noqa: E402
from veloxquant_mlx.cache.options import GEAROptions  # noqa: E402
from veloxquant_mlx.methods.gear import GEARCache  # noqa: E402

H, HQ, D = 8, 32, 128


def store(context: int, **options):
    cache = GEARCache(KVCacheConfig(method="gear", options=GEAROptions(**options), residual_window=128), None, 0)
    fill_store(cache.store, context, H, D)
    mx.eval([g.buffer for g in cache.store.arrays().values() if g.buffer is not None])
    return cache.store


def main():
    args = context_arguments()
    q = mx.random.normal((1, HQ, 1, D), key=mx.random.key(2))
    print_sdpa_floor(q, args.context, H, args.reps)
    print("| setting | rank kept | packed (ms) | dequantize-then-attend (ms) | ratio | max |diff| |")
    print("|---|---|---|---|---|---|")
    for name, options in [("defaults (energy rule, s=0.01)", {}), ("gear_rank=4", {"gear_rank": 4}),
                          ("gear_rank=4, 4-bit", {"gear_rank": 4, "gear_bits": 4}),
                          ("sparse only (rank 0)", {"gear_rank": 0})]:
        s = store(args.context, **options)
        diff, ms = packed_against_dense(s, q, n_kv_heads=H, reps=args.reps)
        t_packed, t_dense = ms["packed"], ms["dense"]
        rank = s.keys.factors.rank if s.keys.factors is not None else 0
        print(f"| {name} | {rank} | {t_packed:.2f} | {t_dense:.2f} | {t_packed / t_dense:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
