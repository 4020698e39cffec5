"""The cache's share of a decode step, without the model: 32 layers of the 8B attention
shape (8 KV heads / 32 query heads of 128), each a cache prefilled to ``--context`` tokens,
then decode steps that do only what a layer's cache does (update, attention), layer after
layer, each layer's query depending on the previous layer's output as in a model.

Timed as mlx-lm's ``generate_step`` runs steps (the next step's graph built while the
device runs this one, ``mx.async_eval``) and, separately, with the host's share (building
the step's graph) and the device's (evaluating it) apart. Variants isolate the parts of a
quantized store's step: ``attend-only`` attends over the packed cache without writing,
``commit-only`` writes without attending.

    python benchmarks/layer_step.py --context 4096 --methods fp16 full kivi-4bit
"""

from __future__ import annotations

import argparse
import statistics
import time

from veloxquant_mlx import KVCacheConfig, make_prompt_cache  # first: it may load OpenBLAS

import mlx.core as mx  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from veloxquant_mlx.cache.attention_hook import hooked_sdpa  # noqa: E402
from veloxquant_mlx.cache.options import KIVIOptions, SnapKVOptions  # noqa: E402
from veloxquant_mlx.kernels.decode import decode_attention  # noqa: E402
from veloxquant_mlx.quant.store import absent_buffer  # noqa: E402

LAYERS, HQ, HKV, D = 32, 32, 8, 128
CONFIGS = {
    "fp16": None,
    "full": KVCacheConfig(),
    "kivi-4bit": KVCacheConfig(method="kivi", options=KIVIOptions(kivi_group_size=32), kv_bits=4),
    "kivi-2bit": KVCacheConfig(method="kivi", options=KIVIOptions(kivi_group_size=32), kv_bits=2),
    "snapkv 2048": KVCacheConfig(options=SnapKVOptions(snap_budget=2048)),
}


def shell_model():
    """A model object only for make_prompt_cache: the 8B attention shape, tiny MLP/vocab."""
    args = llama.ModelArgs(model_type="llama", hidden_size=HQ * D, num_hidden_layers=LAYERS,
                           intermediate_size=64, num_attention_heads=HQ, num_key_value_heads=HKV,
                           vocab_size=64, head_dim=D, rms_norm_eps=1e-5, rope_theta=500000.0,
                           tie_word_embeddings=False)
    return llama.Model(args)


def caches_for(name, model):
    config = CONFIGS[name.split(":")[0]]
    return [KVCache() for _ in range(LAYERS)] if config is None else make_prompt_cache(model, config)


def layer(cache, q, k, v, mode):
    scale = D ** -0.5
    if isinstance(cache, KVCache):
        k, v = cache.update_and_fetch(k, v)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    if mode == "attend-only":
        parts = cache.store.decode_parts(absent_buffer(q.dtype))
        return decode_attention(q, parts, scale=scale, use_kernel=cache.use_kernel, n_kv_heads=HKV)
    if mode == "commit-only":
        cache.store.commit(k, v)
        cache.offset += 1
        return q
    k, v = cache.update_and_fetch(k, v)
    return hooked_sdpa(q, k, v, cache=cache, scale=scale, mask=None)


def prefill(caches, context, dtype):
    mx.random.seed(1)
    for c in caches:
        k = mx.random.normal((1, HKV, context, D)).astype(dtype)
        v = mx.random.normal((1, HKV, context, D)).astype(dtype)
        q = mx.random.normal((1, HQ, context, D)).astype(dtype)
        k2, v2 = c.update_and_fetch(k, v)
        if isinstance(c, KVCache):
            mx.eval(c.keys, c.values)
            continue
        mx.eval(hooked_sdpa(q, k2, v2, cache=c, scale=D ** -0.5, mask="causal"))
        mx.eval(c.state)


def build_step(caches, x, kvs, mode):
    for c, (k, v) in zip(caches, kvs):
        out = layer(c, (x + 0.001 * x.sum()).astype(x.dtype), k, v, mode)
        x = out
    return x


def check(name, context=300, steps=80):
    """The kernel path against the pure-MLX path, step by step, for one method's cache:
    the largest relative error over the steps (printed first: timing means nothing if
    this is off)."""
    model = shell_model()
    pair = [caches_for(name, model)[:1], caches_for(name, model)[:1]]
    pair[1][0].use_kernel = False
    for caches in pair:
        prefill(caches, context, mx.float16)
    worst = 0.0
    for i in range(steps):
        k, v, q = (mx.random.normal(s, key=mx.random.key(100 + 3 * i + j)).astype(mx.float16)
                   for j, s in enumerate([(1, HKV, 1, D), (1, HKV, 1, D), (1, HQ, 1, D)]))
        outs = [layer(c[0], q, k, v, "step").astype(mx.float32) for c in pair]
        err = (mx.abs(outs[0] - outs[1]).max() / mx.abs(outs[1]).max()).item()
        worst = max(worst, err)
    print(f"check {name}: kernel vs pure-MLX over {steps} steps after {context}: max rel err {worst:.2e}")
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--methods", nargs="+", default=["fp16", "full", "kivi-4bit", "kivi-2bit"])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--check", nargs="*", default=[], help="methods to check kernel vs pure-MLX first")
    args = ap.parse_args()
    for name in args.check:
        assert check(name) < 2e-2, name
    dtype = mx.float16
    model = shell_model()
    mx.random.seed(2)
    kvs = [(mx.random.normal((1, HKV, 1, D)).astype(dtype), mx.random.normal((1, HKV, 1, D)).astype(dtype))
           for _ in range(LAYERS)]
    x0 = mx.random.normal((1, HQ, 1, D)).astype(dtype)
    mx.eval(kvs, x0)
    states = {}
    for name in args.methods:
        caches = caches_for(name, model)
        prefill(caches, args.context, dtype)
        states[name] = caches
    results = {n: {"overlapped": [], "host": [], "device": []} for n in states}
    for _ in range(args.rounds):
        for name, caches in states.items():
            mode = name.split(":")[1] if ":" in name else "step"
            x = build_step(caches, x0, kvs, mode)
            mx.eval(x)
            # overlapped, as generate_step
            mx.async_eval(x)
            t0 = time.perf_counter()
            host = 0.0
            for _ in range(args.steps):
                h0 = time.perf_counter()
                nxt = build_step(caches, x0, kvs, mode)
                host += time.perf_counter() - h0
                mx.async_eval(nxt)
                mx.eval(x)
                x = nxt
            mx.eval(x)
            results[name]["overlapped"].append((time.perf_counter() - t0) / args.steps)
            results[name]["host"].append(host / args.steps)
            # device alone: build, then time the evaluation
            dev = []
            for _ in range(8):
                nxt = build_step(caches, x0, kvs, mode)
                t1 = time.perf_counter()
                mx.eval(nxt)
                dev.append(time.perf_counter() - t1)
            results[name]["device"].append(statistics.median(dev))
    base = statistics.median(results[args.methods[0]]["overlapped"])
    print(f"\n{LAYERS} layers, context {args.context}, batch 1, float16, {args.steps} steps x {args.rounds} rounds")
    print("| cache | step ms (overlapped) | vs first | host ms | device ms | us a layer (overlapped) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        o = statistics.median(r["overlapped"])
        print(f"| {name} | {o * 1e3:.3f} | {o / base:.2f}x | {statistics.median(r['host']) * 1e3:.3f} "
              f"| {statistics.median(r['device']) * 1e3:.3f} | {o / LAYERS * 1e6:.1f} |")


if __name__ == "__main__":
    main()
