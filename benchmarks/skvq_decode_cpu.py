"""SKVQ decode attention on the CPU: the packed path against dequantize-then-attend.

One layer's store (``methods/skvq/sliding_store.py``, SKVQ's defaults: 5 sinks, a 128-token
window, groups of 32) filled with T random tokens, then one decode query (B=1, 32 query
heads over 8 KV heads, head_dim 128: Llama-3-8B's attention shape):

- ``packed``: what a decode step runs (``store.attend``): queries through the key order,
  per-token keys read by ``TokenRows`` (one ``quantized_matmul``, transpose=True) and the
  values by the shared per-token reader (``quantized_matmul``), sinks and window as
  full-precision parts, log-sum-exp merge, the output back through the value order;
- ``dequantize``: the best dequantize-then-attend in the same reordered space: the
  packed keys and values dequantized (``mx.dequantize``), joined to the sinks and the
  window, one ``scaled_dot_product_attention``, the same two gathers.

Each is timed as the median of ``--reps`` evaluated calls after warm-up, interleaved; both outputs are
checked equal (float32). Run: ``python benchmarks/skvq_decode_cpu.py [--dtype float16]``.
"""

from __future__ import annotations

import argparse

import veloxquant_mlx  # noqa: F401 - first: it may load OpenBLAS

import mlx.core as mx  # noqa: E402
from cpu_timing import timed  # noqa: E402

from veloxquant_mlx.methods.skvq.clip import CLIP_GRID  # noqa: E402
from veloxquant_mlx.methods.skvq.reorder import RangeOrder, permute_heads  # noqa: E402
from veloxquant_mlx.methods.skvq.sliding_store import SlidingWindowStore  # noqa: E402


def dequantize_then_attend(store, q, scale):
    q = permute_heads(q, store.perm_k)
    k = mx.concatenate([store.sink_k.view(), store.keys.decode(q.dtype), store.k_res], axis=2)
    v = mx.concatenate([store.sink_v.view(), store.values.decode(q.dtype), store.v_res], axis=2)
    return permute_heads(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale), store.inv_v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    b, hq, h, d = 1, 32, 8, 128
    print(f"| T | bits | packed (ms) | dequantize-then-attend (ms) | ratio | max abs diff |")
    print("|---|---|---|---|---|---|")
    for t in args.contexts:
        for bits in args.bits:
            store = SlidingWindowStore(key_bits=bits, value_bits=bits, group=32, window=128, n_sink=5,
                                       key_order=RangeOrder("half"), value_order=RangeOrder(),
                                       clip_grid=CLIP_GRID)
            k = mx.random.normal((b, h, t, d)).astype(dtype)
            v = mx.random.normal((b, h, t, d)).astype(dtype)
            store.commit(k, v)
            q = mx.random.normal((b, hq, 1, d)).astype(dtype)
            scale = d**-0.5
            packed = lambda: store.attend(q, scale=scale, use_kernel=True, n_kv_heads=h)  # noqa: E731
            deq = lambda: dequantize_then_attend(store, q, scale)  # noqa: E731
            diff = float(mx.abs(packed().astype(mx.float32) - deq().astype(mx.float32)).max())
            ms = timed({"packed": packed, "dequantize": deq}, args.reps)
            a, c = ms["packed"], ms["dequantize"]
            print(f"| {t} | {bits} | {a:.2f} | {c:.2f} | {a / c:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
