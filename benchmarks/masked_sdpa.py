"""MLX's fused attention at a decode step of a batch, with and without a mask, on this
machine's default device: what mlx-lm's ``BatchKVCache`` (which always passes a boolean
mask, ``create_causal_mask`` with the batch's left padding) costs against the same call
unmasked (what ``full``'s packed batch of equal lengths runs). Queries (B, 32, 1, 128),
keys and values (B, 8, T, 128), float16; ms for ``--layers`` calls in one evaluation.

    python benchmarks/masked_sdpa.py --batch 9 --context 32768     # the device
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import veloxquant_mlx  # noqa: F401  (first: it may load OpenBLAS)
import mlx.core as mx  # noqa: E402

from veloxquant_mlx.kernels.decode import masked_decode_attention  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompt_mass import timed  # noqa: E402  (median seconds after one warm-up call)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=9)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    B, T = args.batch, args.context
    k = mx.random.split(mx.random.key(0), 3)
    q = mx.random.normal((B, 32, 1, 128), key=k[0]).astype(mx.float16)
    keys = mx.random.normal((B, 8, T, 128), key=k[1]).astype(mx.float16)
    values = mx.random.normal((B, 8, T, 128), key=k[2]).astype(mx.float16)
    lengths = T - mx.arange(B) * (T // (2 * B))  # a batch of lengths from T/2 to T
    visible = (mx.arange(T)[None] < lengths[:, None])[:, None, None, :]
    masks = {"none": None, "boolean (B,1,1,T), lengths T/2..T": visible,
             "additive float16 (B,1,1,T)": mx.zeros((B, 1, 1, T), mx.float16)}
    mx.eval(q, keys, values, *[m for m in masks.values() if m is not None])
    print(f"{mx.default_device()} MLX {mx.__version__}; batch {B}, context {T}, {args.layers} calls")
    print("| mask | ms | vs none |\n|---|---:|---:|")
    base = None
    for name, mask in masks.items():
        t = timed(lambda: [mx.fast.scaled_dot_product_attention(q, keys, values, scale=128 ** -0.5,
                                                                mask=mask)
                           for _ in range(args.layers)], args.repeats)
        base = base or t
        print(f"| {name} | {t * 1e3:.2f} | {t / base:.2f}x |", flush=True)
    # the same boolean mask through masked_decode_attention (products, masked softmax, the
    # values' product split over the token axis): checked, then timed
    ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=128 ** -0.5, mask=visible)
    out = masked_decode_attention(q, keys, values, visible, scale=128 ** -0.5)
    error = (mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max() / mx.abs(ref).max()).item()
    t = timed(lambda: [masked_decode_attention(q, keys, values, visible, scale=128 ** -0.5)
                       for _ in range(args.layers)], args.repeats)
    print(f"| boolean, masked_decode_attention (max rel error {error:.1e}) | {t * 1e3:.2f} | "
          f"{t / base:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
