"""One attention layer's prefill, per method, against the ``full`` cache and mlx-lm's KVCache.

Issue 31: where a method's prefill time goes, one layer at a time, without the model's
other work. The prompt is fed as ``bench/runner.prefill`` feeds it: chunks of ``--chunk``
tokens (``update_and_fetch`` + ``attend``, then the output and the cache's state
evaluated, as mlx-lm reads every cache's state after a chunk), then the last token alone;
synthetic keys, values and queries. Each repeat uses a fresh cache and the caches take
turns, so that the machine's drift hits them alike; the first run of each is a warm-up
(compilation, first use) and is reported apart. Ratios are to mlx-lm's KVCache
(``mx.fast.scaled_dot_product_attention``) measured in the same run.

    MLX_DEFAULT_DEVICE=cpu python benchmarks/prefill_layer.py --context 2048 --chunk 1024 --methods h2o tova
    python benchmarks/prefill_layer.py --context 4096 --chunk 2048 --dtype float16 --methods h2o keyformer   # the 8B layer
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from veloxquant_mlx import KVCacheConfig  # first: it may load OpenBLAS

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from veloxquant_mlx.registry import METHODS  # noqa: E402

BASELINE = "mlx-lm KVCache"


class _SDPACache(KVCache):
    """mlx-lm's KVCache with the attention mlx-lm's models run over it."""

    def attend(self, queries, keys, values, scale, mask):
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def maker(name: str):
    if name == BASELINE:
        return _SDPACache
    config = KVCacheConfig(method=name)
    impl = METHODS[name].load_implementation()
    return lambda: impl(config, None, 0)


def prefill(cache, k, v, q, chunk) -> list[float]:
    """Seconds each chunk takes to be fed, its output and the cache's state evaluated; the
    prompt's last token (where the eviction methods score and evict) is the last entry."""
    n, scale = k.shape[2], k.shape[-1] ** -0.5
    times = []
    for s in list(range(0, n - 1, chunk)) + [n - 1]:
        e = n if s == n - 1 else min(n - 1, s + chunk)
        t0 = time.perf_counter()
        keys, values = cache.update_and_fetch(k[:, :, s:e], v[:, :, s:e])
        out = cache.attend(q[:, :, s:e], keys, values, scale=scale, mask="causal" if e - s > 1 else None)
        mx.eval(out, cache.state)
        times.append(time.perf_counter() - t0)
    return times


def synthetic_layer(hq: int, hkv: int, head_dim: int, context: int, dtype):
    """Keys, values (1, Hkv, T, D) and queries (1, Hq, T, D), standard normal, seeded, evaluated."""
    shape = (1, hkv, context, head_dim)
    k, v = (mx.random.normal(shape, key=mx.random.key(i)).astype(dtype) for i in (0, 1))
    q = mx.random.normal((1, hq, context, head_dim), key=mx.random.key(2)).astype(dtype)
    mx.eval(k, v, q)
    return k, v, q


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HKV"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    p.add_argument("--repeats", type=int, default=3, help="warm repeats per cache (after one warm-up)")
    p.add_argument("--methods", nargs="+", required=True, help="method keys (full and the baseline are added)")
    p.add_argument("--out", help="write the figures as JSON")
    a = p.parse_args()

    hq, hkv = a.heads
    k, v, q = synthetic_layer(hq, hkv, a.head_dim, a.context, getattr(mx, a.dtype))

    names = [BASELINE, "full"] + [m for m in a.methods if m not in (BASELINE, "full")]
    makers, first, failed = {}, {}, {}
    for name in names:
        try:
            make = maker(name)
            first[name] = sum(prefill(make(), k, v, q, a.chunk))
            makers[name] = make
        except Exception as e:  # noqa: BLE001 - a row says why
            failed[name] = f"{type(e).__name__}: {e}"[:160]
        print(f"  warm-up {name}: " + (f"{first[name]:.3f} s" if name in first else failed[name]), flush=True)
    times = {name: [] for name in makers}
    for _ in range(a.repeats):
        for name, make in makers.items():
            times[name].append(prefill(make(), k, v, q, a.chunk))

    print(f"\n{mx.default_device()}, one layer of {hq}/{hkv} heads x {a.head_dim}, {a.dtype}, {a.context} tokens "
          f"in {a.chunk}-token chunks + the last alone, every method at its defaults, "
          f"median of {a.repeats} warm prefills\n")
    base = statistics.median(sum(t) for t in times[BASELINE])
    print("| cache | first ms | warm ms | vs KVCache | of which the last token, ms |\n|---|---:|---:|---:|---:|")
    rows = {}
    for name in names:
        if name in failed:
            print(f"| {name} | failed: {failed[name]} ||||")
            continue
        m = statistics.median(sum(t) for t in times[name])
        last = statistics.median(t[-1] for t in times[name])
        rows[name] = dict(first_s=first[name], warm_s=m, last_token_s=last, chunks=times[name], ratio=m / base)
        print(f"| {name} | {first[name] * 1e3:.1f} | {m * 1e3:.1f} | {m / base:.2f}x | {last * 1e3:.2f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(args=vars(a), device=str(mx.default_device()), rows=rows, failed=failed), f, indent=1)


if __name__ == "__main__":
    main()
