"""CPU decode attention over a token-mixed store (ZipCache): packed pass vs dequantize-then-attend.

    .venv/bin/python benchmarks/token_mixed_decode.py            # 4k tokens, float32 and float16
    .venv/bin/python benchmarks/token_mixed_decode.py --tokens 16384

A ``TokenMixedStore`` (``veloxquant_mlx.methods.zipcache.token_mixed``) holds a prompt of T tokens in
two classes of channel-separable token-wise codes (20% at 4 bits, 80% at 2 bits, groups of
32 channels) plus 64 decode tokens waiting in full precision; 8 KV heads, 32 query heads,
head_dim 128, batch 1 (an 8B-shaped layer). Timed, per decode call (median of ``--reps``
evaluated calls after a warm-up, the three interleaved):

- ``packed``: what a decode step runs, ``decode_attention`` over the store's parts: per
  class one ``quantized_matmul`` over the packed keys (the channel scales folded into the
  query) and one over the packed values, merged by log-sum-exp;
- ``dequant``: every class dequantized to float32 (times its channel scales), concatenated
  with the buffer, then one SDPA;
- ``history``: the same in position order (``store.history``: the classes put back by
  their flags), then SDPA: what a prefill chunk does.

First it checks that ``packed`` equals the float32 reference (relative L2 < 1e-4).
"""

from __future__ import annotations

import argparse
import functools

import veloxquant_mlx  # noqa: F401  (before mlx: OpenBLAS on Linux)
import mlx.core as mx  # noqa: E402
from cpu_timing import timed  # noqa: E402

from veloxquant_mlx.kernels.decode import decode_attention  # noqa: E402
from veloxquant_mlx.quant.saliency import ProbeSaliency  # noqa: E402
from veloxquant_mlx.methods.zipcache.token_mixed import TokenMixedStore  # noqa: E402
from veloxquant_mlx.quant.token_rows import TokenGroups  # noqa: E402

H, HQ, D, G = 8, 32, 128, 32


def build(tokens: int, dtype) -> TokenMixedStore:
    store = TokenMixedStore(TokenGroups(4, G), TokenGroups(2, G), fraction=0.2, block=128,
                            saliency=ProbeSaliency())
    k = mx.random.normal((1, H, tokens + 64, D), key=mx.random.key(0)).astype(dtype)
    v = mx.random.normal((1, H, tokens + 64, D), key=mx.random.key(1)).astype(dtype)
    scores = mx.random.uniform(shape=(1, H, tokens), key=mx.random.key(2))
    store.compress(k[:, :, :tokens], v[:, :, :tokens], scores)
    store.commit(k[:, :, tokens:], v[:, :, tokens:])
    mx.eval([a.buffer if hasattr(a, "buffer") else a for a in store.arrays().values() if a is not None])
    return store


def packed(store, q, scale):
    return decode_attention(q, store.decode_parts(None), scale=scale, n_kv_heads=H)


def dequant(store, q, scale):
    ks, vs = [], []
    for cls in (store.hi, store.lo):
        k, v = cls.decode(store.k_channel, store.v_channel, mx.float32)
        ks.append(k)
        vs.append(v)
    ks.append(store.k_buf.view().astype(mx.float32))
    vs.append(store.v_buf.view().astype(mx.float32))
    out = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), mx.concatenate(ks, axis=2),
                                               mx.concatenate(vs, axis=2), scale=scale)
    return out.astype(q.dtype)


def history(store, q, scale):
    k, v = store.history(mx.float32)
    return mx.fast.scaled_dot_product_attention(q.astype(mx.float32), k, v, scale=scale).astype(q.dtype)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    scale = D ** -0.5
    print(f"T = {args.tokens} + 64 waiting, {H} KV heads, {HQ} query heads, head_dim {D}, CPU")
    print("| dtype | packed (ms) | dequant + SDPA (ms) | history + SDPA (ms) | packed / dequant |")
    print("|---|---|---|---|---|")
    for dtype in (mx.float32, mx.float16):
        store = build(args.tokens, dtype)
        q = mx.random.normal((1, HQ, 1, D), key=mx.random.key(3)).astype(dtype)
        ref = dequant(store, q.astype(mx.float32), scale)
        got = packed(store, q.astype(mx.float32), scale)
        rel = float(mx.linalg.norm((got - ref).flatten()) / mx.linalg.norm(ref.flatten()))
        assert rel < 1e-4, rel
        calls = {fn.__name__: functools.partial(fn, store, q, scale) for fn in (packed, dequant, history)}
        ms = timed(calls, args.reps)
        t = [ms[name] for name in ("packed", "dequant", "history")]
        print(f"| {dtype} | {t[0]:.2f} | {t[1]:.2f} | {t[2]:.2f} | {t[0] / t[1]:.2f} |")


if __name__ == "__main__":
    main()
