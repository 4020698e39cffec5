"""KVQuant decode attention on the CPU: the packed path against dequantize-then-attend.

One layer's store (``methods/kvquant/streaming_store.py`` over ``methods/kvquant/nonuniform.py``, KVQuant's
defaults: 1 sink, groups of 32, 1% outliers) filled with T random fp16 tokens (keys with
a few large channels), codebooks fitted on them, then one decode query (B=1, 32 query
heads over 8 KV heads, head_dim 128: Llama-3-8B's attention shape):

- ``packed``: what a decode step runs (``decode_attention`` over ``store.decode_parts``):
  the sinks as a full-precision part; the packed run read by ``NonUniformScores`` (indices
  unpacked and looked up, scaled, outliers scattered, one matrix product for the scores
  and one for the mix), the keys' exact tail; log-sum-exp merge;
- ``dequant+sdpa``: the history decoded into the model's dtype (``store.history``: the
  same unpacking, then the model's layout and dtype, joined to the sinks and the tail),
  one ``scaled_dot_product_attention``;
- ``dequant+pure``: the same decoded history attended by the pure-MLX path as one
  full-precision part (matrix products, as ``packed``), a stricter baseline on a CPU
  where SDPA is slow.

Post-RoPE keys, and pre-RoPE (``--rope``: keys rotated again when read, Llama's theta).
Each is timed as the median of ``--reps`` evaluated calls after warm-up, runs
interleaved; outputs are checked equal (float32 tolerance). Run:
``python benchmarks/kvquant_decode_cpu.py [--contexts 1024 4096] [--bits 3] [--rope]``.
"""

from __future__ import annotations

import argparse

import veloxquant_mlx  # noqa: F401 - first: it may load OpenBLAS

import mlx.core as mx  # noqa: E402
from cpu_timing import assert_agree, decode_candidates, timed  # noqa: E402

from veloxquant_mlx.cache.rope import Rotary  # noqa: E402
from veloxquant_mlx.methods.kvquant.nonuniform import NonUniform, NonUniformTokens  # noqa: E402
from veloxquant_mlx.methods.kvquant.streaming_store import StreamingStore  # noqa: E402


def make_store(t, bits, rotary, dtype, b=1, h=8, d=128):
    keys = NonUniformTokens(NonUniform(bits, 32, "channel", 0.01, 8), rotary=rotary, start=1)
    values = NonUniformTokens(NonUniform(bits, 32, "token", 0.01, 8))
    store = StreamingStore(keys, values, n_sink=1, key_block=32)
    k = mx.random.normal((b, h, t, d), key=mx.random.key(1)) + mx.where(mx.arange(d) < 4, 8.0, 0.0)
    v = mx.random.normal((b, h, t, d), key=mx.random.key(2))
    store.commit(k.astype(dtype), v.astype(dtype))
    mx.eval(store.arrays())
    return store


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--bits", type=int, nargs="+", default=[3])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--rope", action="store_true", help="pre-RoPE keys (rotated again when read)")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    rotary = Rotary(500000.0) if args.rope else None
    scale = 128**-0.5
    print(f"| T | bits | keys | packed ms | dequant+sdpa ms | dequant+pure ms | packed / sdpa | packed / pure |")
    print("|---|---|---|---|---|---|---|---|")
    for t in args.contexts:
        for bits in args.bits:
            store = make_store(t, bits, rotary, dtype)
            q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(3)).astype(dtype)
            calls = decode_candidates(store, q, scale=scale, dtype=dtype, n_kv_heads=8)
            assert_agree(calls, 2e-3)
            ms = timed(calls, args.reps)
            print(f"| {t} | {bits} | {'pre' if rotary else 'post'}-RoPE | {ms['packed']:.1f} | {ms['sdpa']:.1f} | "
                  f"{ms['pure']:.1f} | {ms['packed'] / ms['sdpa']:.2f} | {ms['packed'] / ms['pure']:.2f} |")


if __name__ == "__main__":
    main()
