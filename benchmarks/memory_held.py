"""Memory a cache holds against its nbytes, with the allocator's pool on and off, at an 8B
attention shape (32 query heads, 8 KV heads, head_dim 128; random weights, 2 layers).

For each method: prefill ``--context`` tokens in 512-token chunks, decode ``--decode``
steps, evaluate the state, then delete the cache and report what that freed against its
nbytes. With the pool on (MLX's default) a buffer may sit in a freed block up to
min(2x, +2 pages) larger, so ``pool on`` can exceed 1.000 by up to 2 pages a buffer; with
the pool off (``mx.set_cache_limit(0)``) every buffer is allocated at its own size and the
ratio is the cache's own (benchmarks/notes/memory_held.md). Also a short prompt
(``--short`` tokens + 4 steps): nbytes against the full cache's rows.

    python3 benchmarks/memory_held.py [--context 4096] [--decode 16] [--short 20] [--methods kivi,snapkv,...]
"""

from __future__ import annotations

import argparse
import gc
import warnings

import veloxquant_mlx  # noqa: F401  (before mlx: the system BLAS)
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.registry import implemented_methods

import mlx.core as mx
from mlx_lm.models import llama


def model_8b_attention(layers: int = 2):
    args = llama.ModelArgs(model_type="llama", hidden_size=4096, num_hidden_layers=layers,
                           intermediate_size=1024, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=128, rms_norm_eps=1e-5, vocab_size=1024, rope_theta=500000.0)
    model = llama.Model(args)
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    return model


def active() -> int:
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    return mx.get_active_memory()


def freed_and_nbytes(model, method, context, decode, pool_off):
    tokens = mx.random.randint(0, 1024, (context + decode,), key=mx.random.key(0))
    active()
    limit = mx.set_cache_limit(0) if pool_off else None
    try:
        cache = make_prompt_cache(model, KVCacheConfig(method=method))
        for start in range(0, context, 512):
            mx.eval(model(tokens[None, start : min(start + 512, context)], cache=cache))
        for i in range(context, context + decode):
            mx.eval(model(tokens[None, i : i + 1], cache=cache))
        mx.eval([c.state for c in cache])
        nbytes = sum(c.nbytes for c in cache)
        before = active()
        del cache
        return before - active(), nbytes
    finally:
        if pool_off:
            mx.set_cache_limit(limit)


def short_ratio(model, method, n):
    cache = make_prompt_cache(model, KVCacheConfig(method=method))
    tokens = mx.random.randint(0, 1024, (n + 4,), key=mx.random.key(1))
    mx.eval(model(tokens[None, :n], cache=cache))
    for i in range(n, n + 4):
        mx.eval(model(tokens[None, i : i + 1], cache=cache))
    a = model.args
    full = len(cache) * a.num_key_value_heads * (n + 4) * 2 * a.head_dim * 2
    return sum(c.nbytes for c in cache) / full


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--short", type=int, default=20)
    p.add_argument("--methods", default=",".join(implemented_methods()))
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    model = model_8b_attention()
    print(f"device {mx.default_device()}, context {args.context} + {args.decode} steps, float16")
    print("| method | nbytes | freed/nbytes pool on | pool off | short prompt: nbytes / full rows |")
    print("|---|---|---|---|---|")
    for method in args.methods.split(","):
        try:
            on, nbytes = freed_and_nbytes(model, method, args.context, args.decode, False)
            off, _ = freed_and_nbytes(model, method, args.context, args.decode, True)
            short = short_ratio(model, method, args.short)
            print(f"| {method} | {nbytes:,} | {on / nbytes:.4f} | {off / nbytes:.4f} | {short:.2f}x |", flush=True)
        except Exception as e:  # one method's failure must not hide the others' figures
            print(f"| {method} | error: {type(e).__name__}: {str(e)[:80]} | | | |", flush=True)


if __name__ == "__main__":
    main()
