"""Run each CUDA kernel of the fused KIVI decode attention a few times on one shape, for a
profiler (Nsight Compute) to attach to:

    ncu --kernel-name regex:vq_kivi --launch-skip 3 --launch-count 1 \
        python3 benchmarks/profile_fused_attention.py --algo frag --bits 4

Shape: 1 x 32 query heads / 8 kv heads x 32k tokens x head_dim 128, group 64, float16.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fused_attention as fa  # loads the kernels module on its own
import mlx.core as mx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--algo", default="frag", choices=fa.ALGOS)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=6)
    args = ap.parse_args()
    mx.set_default_device(mx.gpu)
    B, H, R, D, G = args.batch, 8, 4, 128, 64
    K, V = fa.random_kv(B, H, args.context, D, mx.float16)
    cache = fa.make_cache(K, V, 64, 128, args.bits, G, spare=False)
    q = mx.random.normal((B, H * R, 1, D)).astype(mx.float16)
    mx.eval(q, *[a for a in cache if isinstance(a, mx.array)])
    for _ in range(args.calls):
        mx.eval(fa.kx.attention(q, *cache, scale=D ** -0.5, bits=args.bits, group_size=G,
                                algo=args.algo))
    mx.synchronize()
    print("done", args)


if __name__ == "__main__":
    main()
