"""VecInfer decode on the CPU: lookup-table key scores against dequantize-then-attend.

One layer's codebook store (``quant/vq_store.py``: keys smoothed per channel, rotated,
product-VQ'd at ``key_sub_dim`` 4; values at ``value_sub_dim`` 8 and 8 bits; a 128-token
full-precision window) holding T tokens: codebooks fitted by a short k-means on random
keys (a few large channels) and values, T - 128 tokens of codes drawn at random (the
timing depends on neither which centroids they name nor the codebooks' quality), 128
float16 window rows; then one decode query (B=1, 32 query heads over 8 KV heads, head_dim 128:
Llama-3-8B's attention shape). Timed, each the median of ``--reps`` evaluated calls after
warm-up, runs interleaved:

- ``lut``: what a decode step runs (``decode_attention`` over ``store.decode_parts``): the
  query smoothed and rotated once, a table ``q~_j . C_K`` per sub-space (R x D x 2^bits
  products), a gather by index and a sum for the scores; values' centroids gathered by
  index; the window as full-precision rows; log-sum-exp merge;
- ``dequant+sdpa``: the history decoded into float16 (``store.history``: indices unpacked,
  centroids gathered, rotated back, multiplied by the smoothing factors, joined to the
  window), one ``scaled_dot_product_attention``;
- ``dequant+pure``: the same decoded history through the pure-MLX path as one
  full-precision part (matrix products, as ``lut``): a stricter baseline where SDPA is slow;
- ``keys lut`` / ``keys dequant``: the key scores alone (``CodebookKeys.scores`` against
  ``q @ decode(keys)^T``, float32), where the two differ.

Outputs are checked equal (float16 tolerance). Ratios are against the baselines measured in
the same run. Run: ``python benchmarks/vq_decode_cpu.py [--contexts 1024 4096]
[--key-bits 8 12] [--reps 15]``.
"""

from __future__ import annotations

import argparse

import veloxquant_mlx  # noqa: F401 - first: it may load OpenBLAS

import mlx.core as mx  # noqa: E402
from cpu_timing import assert_agree, decode_candidates, timed  # noqa: E402

from veloxquant_mlx.quant.vq import CodebookKeys, pack_indices  # noqa: E402
from veloxquant_mlx.quant.vq_store import CodebookFit, CodebookStore  # noqa: E402

WINDOW = 128


def make_store(t, key_bits, dtype, b=1, h=8, d=128):
    k = mx.random.normal((b, h, 512, d), key=mx.random.key(1)) * mx.where(mx.arange(d) % 37 == 0, 10.0, 1.0)
    v = mx.random.normal((b, h, 512, d), key=mx.random.key(2))
    fit = CodebookFit(4, key_bits, 8, 8, iters=2, sample=2, seed=0)
    store = CodebookStore(WINDOW, fit, fit.fit(k, v))
    coded = t - WINDOW
    for name, sub, bits, seed in (("k_codes", 4, key_bits, 3), ("v_codes", 8, 8, 4)):
        idx = mx.random.randint(0, 1 << bits, (b, h, coded, d // sub), key=mx.random.key(seed))
        getattr(store, name).append(pack_indices(idx, bits))
    store.commit(k[:, :, :WINDOW].astype(dtype), v[:, :, :WINDOW].astype(dtype))  # the window
    mx.eval(store.arrays())
    assert store.count == coded and store.length == t
    return store


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--key-bits", type=int, nargs="+", default=[8, 12])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    scale = 128**-0.5
    print("| T | key bits | lut ms | dequant+sdpa ms | dequant+pure ms | lut / sdpa | lut / pure "
          "| keys lut ms | keys dequant ms | keys lut / dequant |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for t in args.contexts:
        for bits in args.key_bits:
            store = make_store(t, bits, dtype)
            q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(3)).astype(dtype)
            q32 = q.astype(mx.float32).reshape(1, 8, 4, 128) * scale
            keys = CodebookKeys(store.k_codes.buffer, store.count, store.key_codec, 128)
            calls = decode_candidates(store, q, scale=scale, dtype=dtype, n_kv_heads=8)
            assert_agree(calls, 5e-3)

            def keys_lut():
                return keys.scores(q32)

            def keys_dequant():
                k_hat = store.key_codec.decode(store.k_codes.view(), 128, mx.float32)
                return q32 @ k_hat.swapaxes(-1, -2)

            assert mx.allclose(keys_lut(), keys_dequant(), atol=1e-3, rtol=1e-4)
            ms = timed({**calls, "klut": keys_lut, "kdeq": keys_dequant}, args.reps)
            print(f"| {t} | {bits} | {ms['packed']:.1f} | {ms['sdpa']:.1f} | {ms['pure']:.1f} | "
                  f"{ms['packed'] / ms['sdpa']:.2f} | {ms['packed'] / ms['pure']:.2f} | {ms['klut']:.1f} | "
                  f"{ms['kdeq']:.1f} | {ms['klut'] / ms['kdeq']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
