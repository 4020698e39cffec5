"""One layer's last prompt chunk: peak memory of a cache's prefill against mlx-lm's KVCache.

Chunks of ``--chunk`` tokens fill one layer's cache up to ``--context``, then the prompt's
last token comes alone (where snapkv and tova score). Peak is ``mx.get_peak_memory`` over
that last chunk and token, less what was in use before it. mlx-lm's KVCache attends with
``mx.fast.scaled_dot_product_attention``; the other caches with their own ``attend``, their
prefill scores included. On the CPU, SDPA itself materializes the chunk's float32 scores
(printed as the first line), for mlx-lm's cache as for every other.

    python benchmarks/prefill_peak.py                                     # CPU-sized
    python benchmarks/prefill_peak.py --heads 32 8 --context 32768 --dtype float16   # 8B layer
"""

from __future__ import annotations

import argparse

from veloxquant_mlx import KVCacheConfig  # first: it may load OpenBLAS

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from veloxquant_mlx.cache.options import H2OOptions, KIVIOptions, SnapKVOptions, TOVAOptions  # noqa: E402
from veloxquant_mlx.methods.h2o import H2OCache  # noqa: E402
from veloxquant_mlx.methods.kivi import KIVICache  # noqa: E402
from veloxquant_mlx.methods.snapkv import SnapKVCache  # noqa: E402
from veloxquant_mlx.methods.tova import TOVACache  # noqa: E402

CACHES = {
    "mlx-lm KVCache": KVCache,
    "h2o 1024": lambda: H2OCache(KVCacheConfig(options=H2OOptions(h2o_budget=1024))),
    "snapkv 1024": lambda: SnapKVCache(KVCacheConfig(options=SnapKVOptions(snap_budget=1024))),
    "tova 1024": lambda: TOVACache(KVCacheConfig(options=TOVAOptions(tova_budget=1024))),
    "kivi-4bit": lambda: KIVICache(KVCacheConfig(method="kivi", options=KIVIOptions(kivi_group_size=32), kv_bits=4)),
}


def peak(make, hq, hkv, d, context, chunk, dtype) -> float:
    cache = make()
    starts = list(range(0, context - 1, chunk))
    base = None
    for i, s in enumerate(starts + [context - 1]):
        n = min(chunk, context - 1 - s) if i < len(starts) else 1
        k, v, q = (mx.random.normal((1, h, n, d), key=mx.random.key(3 * s + j)).astype(dtype)
                   for j, h in enumerate((hkv, hkv, hq)))
        mx.eval(k, v, q)
        if i == len(starts) - 1:
            mx.synchronize()
            mx.clear_cache()
            mx.reset_peak_memory()
            base = mx.get_active_memory()
        keys, values = cache.update_and_fetch(k, v)
        mask = "causal" if n > 1 else None
        if isinstance(cache, KVCache):
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=d**-0.5, mask=mask)
        else:
            out = cache.attend(q, keys, values, scale=d**-0.5, mask=mask)
        mx.eval(out, cache.state)
    return (mx.get_peak_memory() - base) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs=2, default=[8, 2], metavar=("Q", "KV"))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    args = ap.parse_args()
    (hq, hkv), dtype = args.heads, getattr(mx, args.dtype)
    scores = hq * args.chunk * args.context * 4 / 2**20
    print(f"{mx.default_device()}: {hq}/{hkv} heads x {args.head_dim}, {args.context} tokens in "
          f"{args.chunk}-token chunks, {args.dtype}; one chunk's float32 scores: {scores:.0f} MiB")
    results = {name: peak(CACHES[name], hq, hkv, args.head_dim, args.context, args.chunk, dtype)
               for name in args.caches}
    base = results.get("mlx-lm KVCache")
    for name, mib in results.items():
        ratio = f"  {mib / base:.2f}x" if base else ""
        print(f"  {name:16s} peak {mib:8.1f} MiB{ratio}")


if __name__ == "__main__":
    main()
