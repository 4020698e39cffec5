"""TurboQuant's decode read on a GPU: checked against the pure-MLX reference, then timed.

One attention layer of Llama-3-8B's shape (32 query heads, 8 KV heads of 128), a prompt of
random keys and values (prefilled in 2048-token chunks), at each context:

1. check: one decode step's read of the cache (on a GPU the fused kernel of
   ``methods/turboquant/kernel.py``, which first checks itself once against its reference;
   ``turboquant-pure``: the pure-MLX read) against SDPA over the cache's decoded rows
   (``dequantized``: the pure-MLX reference of what it stores), in float32; max abs error
   printed, and the run fails past ``--tolerance``, or if the kernel failed its self-check;
2. time: the median of ``--steps`` completed decode steps (``update_and_fetch`` + ``attend``,
   evaluated each step) for turboquant at its defaults and at 4 bits, KIVI-2 and KIVI-4
   (the fused kernel on a GPU) and mlx-lm's ``KVCache`` + SDPA, with the KV bytes a token.

    python benchmarks/turboquant_gpu.py --contexts 4096 32768 --steps 50
    python benchmarks/turboquant_gpu.py --contexts 512 --steps 3 --heads 4 1   # a CPU check
"""

from __future__ import annotations

import argparse
import statistics
import time

from veloxquant_mlx import KVCacheConfig  # first: it may load OpenBLAS

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from veloxquant_mlx.cache.options import KIVIOptions, TurboQuantOptions  # noqa: E402
from veloxquant_mlx.kernels.decode import decode_attention  # noqa: E402
from veloxquant_mlx.methods.kivi import KIVICache  # noqa: E402
from veloxquant_mlx.methods.turboquant import TurboQuantCache  # noqa: E402

CONFIGS = {
    "turboquant": lambda: TurboQuantCache(KVCacheConfig(method="turboquant"), None, 0),
    "turboquant-4bit": lambda: TurboQuantCache(KVCacheConfig(options=TurboQuantOptions(
        turboquant_key_bits=4, turboquant_value_bits=4)), None, 0),
    "turboquant-pure": lambda: TurboQuantCache(KVCacheConfig(method="turboquant", fused_attention=False), None, 0),
    "kivi-2bit": lambda: KIVICache(KVCacheConfig(options=KIVIOptions(kivi_group_size=32), kv_bits=2), None, 0),
    "kivi-4bit": lambda: KIVICache(KVCacheConfig(options=KIVIOptions(kivi_group_size=32), kv_bits=4), None, 0),
}
D = 128


def prefill(cache, k, v, hq, chunk=2048):
    for s in range(0, k.shape[2], chunk):
        kk, vv = k[:, :, s:s + chunk], v[:, :, s:s + chunk]
        q = mx.random.normal((1, hq, kk.shape[2], D), key=mx.random.key(s)).astype(k.dtype)
        keys, values = cache.update_and_fetch(kk, vv)
        mx.eval(cache.attend(q, keys, values, scale=D ** -0.5, mask="causal"))


def check(cache, hq, dtype) -> float:
    """max |read - SDPA over the decoded rows| for one query token, in float32."""
    q = mx.random.normal((1, hq, 1, D), key=mx.random.key(7)).astype(dtype)
    parts = cache.store.decode_parts(mx.zeros((0,), dtype))
    out = decode_attention(q.astype(mx.float32), parts, scale=D ** -0.5, use_kernel=cache.use_kernel,
                           n_kv_heads=cache.kv_shape[1])
    k_hat, v_hat = cache.dequantized(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), k_hat, v_hat, scale=D ** -0.5)
    return mx.abs(out - ref).max().item()


def time_steps(cache, hq, hk, dtype, steps, warmup=5) -> float:
    """Median seconds of a completed decode step."""
    times = []
    for i in range(warmup + steps):
        key = mx.random.key(1000 + i)
        k, v = (mx.random.normal((1, hk, 1, D), key=kk).astype(dtype) for kk in mx.random.split(key))
        q = mx.random.normal((1, hq, 1, D), key=key).astype(dtype)
        mx.eval(k, v, q)
        t0 = time.perf_counter()
        if isinstance(cache, KVCache):
            keys, values = cache.update_and_fetch(k, v)
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=D ** -0.5)
        else:
            keys, values = cache.update_and_fetch(k, v)
            out = cache.attend(q, keys, values, scale=D ** -0.5, mask=None)
        mx.eval(out)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("QUERY", "KV"))
    ap.add_argument("--methods", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--tolerance", type=float, default=1e-3,
                    help="largest |read - reference| allowed (float32; outputs are O(1))")
    args = ap.parse_args()
    hq, hk = args.heads
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.float16
    failed = []
    print(f"device {mx.default_device()}, {dtype}, {hq} query / {hk} KV heads of {D}")
    for context in args.contexts:
        k = mx.random.normal((1, hk, context, D), key=mx.random.key(1)).astype(dtype)
        v = mx.random.normal((1, hk, context, D), key=mx.random.key(2)).astype(dtype)
        full = KVCache()
        full.update_and_fetch(k, v)
        base = time_steps(full, hq, hk, dtype, args.steps)
        print(f"{context:>7} mlx-lm KVCache   step {base * 1e6:9.1f} us  1.00x  "
              f"{full.nbytes / (context + args.steps + 5) / hk:7.1f} B/token/head")
        for name in args.methods:
            cache = CONFIGS[name]()
            prefill(cache, k, v, hq)
            err = check(cache, hq, dtype) if name.startswith("turboquant") else float("nan")
            if err > args.tolerance:
                failed.append((context, name, err))
            per_head = cache.nbytes / context / hk
            s = time_steps(cache, hq, hk, dtype, args.steps)
            print(f"{context:>7} {name:<16} step {s * 1e6:9.1f} us  {s / base:5.2f}x  "
                  f"{per_head:7.1f} B/token/head  max err vs reference {err:.2e}")
            del cache
            mx.clear_cache()
    from veloxquant_mlx.methods.turboquant import kernel as tk

    print("kernel self-checks (None: passed):", tk._CHECKED or "none ran (no GPU back-end)")
    failed += [("self-check", k, v) for k, v in tk._CHECKED.items() if v is not None]
    if failed:
        raise SystemExit(f"reads off the reference: {failed}")


if __name__ == "__main__":
    main()
