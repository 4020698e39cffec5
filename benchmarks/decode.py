"""Decode benchmark: stored KV bytes, peak memory and decode speed per method.

A random llama (8 layers, head_dim 128, GQA 4:1), prompts of 1k/4k/16k tokens prefilled
the way mlx-lm does it (2048-token chunks, then the last token alone), then timed
single-token decode steps, the methods taking turns (rounds x steps each) so that the
machine's drift hits them alike; speed is the median step. Every figure is also given
as a ratio to mlx-lm's own ``KVCache`` measured in the same run, on the same model and
prompt. Peak memory is over each method's prefill and first two decode steps.

    python benchmarks/decode.py                      # 1k, 4k, 16k
    python benchmarks/decode.py --contexts 1024 4096 --steps 16 --out bench-out/decode.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from veloxquant_mlx import KVCacheConfig, make_prompt_cache  # first: it may load OpenBLAS

import mlx.core as mx  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from veloxquant_mlx.bench.cli import compute_dtype  # noqa: E402
from veloxquant_mlx.bench.runner import prefill  # noqa: E402
from veloxquant_mlx.cache.options import KIVIOptions, SnapKVOptions, StreamingLLMOptions  # noqa: E402

METHODS = {
    "mlx-lm KVCache": None,
    "full": KVCacheConfig(),
    "streaming_llm": KVCacheConfig(options=StreamingLLMOptions(stream_n_sink=4, stream_window_size=508)),
    "snapkv": KVCacheConfig(options=SnapKVOptions(snap_budget=512)),
    "kivi-2bit": KVCacheConfig(method="kivi", options=KIVIOptions(kivi_group_size=32), kv_bits=2),
    "kivi-4bit": KVCacheConfig(method="kivi", options=KIVIOptions(kivi_group_size=32), kv_bits=4),
}


def build_model(dtype):
    args = llama.ModelArgs(
        model_type="llama", hidden_size=512, num_hidden_layers=8, intermediate_size=1024,
        num_attention_heads=4, num_key_value_heads=1, head_dim=128, rms_norm_eps=1e-5,
        vocab_size=1024, rope_theta=500000.0, tie_word_embeddings=True,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def start(model, config, context):
    """Prefill one method's cache; its KV bytes and peak memory over prefill + 2 steps."""
    tokens = mx.random.randint(0, 1024, (context,), key=mx.random.key(context))
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    cache = [KVCache() for _ in model.layers] if config is None else make_prompt_cache(model, config)
    y = mx.argmax(prefill(model, cache, tokens))[None]
    for _ in range(2):
        y = decode(model, cache, y)
    return cache, y, {"kv_bytes": sum(c.nbytes for c in cache), "peak_bytes": mx.get_peak_memory() - base}


def decode(model, cache, y):
    y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
    mx.eval(y)
    return y


def time_interleaved(model, states, steps, rounds):
    """Per-step decode times, the methods taking turns so that drift hits them alike."""
    times = {name: [] for name in states}
    for _ in range(rounds):
        for name, state in states.items():
            cache, y = state
            for _ in range(steps):
                t = time.perf_counter()
                y = decode(model, cache, y)
                times[name].append(time.perf_counter() - t)
            states[name] = (cache, y)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--steps", type=int, default=8, help="decode steps per method per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of interleaved timing")
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--out", default=None, help="write every figure as JSON here")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"],
                    help="auto: float32 on the CPU (MLX's fast CPU path), float16 on a GPU")
    args = ap.parse_args()

    model = build_model(compute_dtype(args.dtype) or mx.float16)
    results = []
    for context in args.contexts:
        names = ["mlx-lm KVCache", *[m for m in args.methods if m != "mlx-lm KVCache"]]
        states, figures = {}, {}
        for name in names:
            cache, y, figures[name] = start(model, METHODS[name], context)
            states[name] = (cache, y)
        step = time_interleaved(model, states, args.steps, args.rounds)
        for name in names:
            r = {**figures[name], "decode_s_per_token": step[name], "decode_tokens_per_s": 1 / step[name]}
            results.append({"method": name, "context": context, **r})
            print(f"  {name:16s} {context:6d}: {r['decode_tokens_per_s']:8.2f} tok/s", flush=True)
        del states

    rows = ["| context | method | KV bytes | KV ratio | peak ratio | decode tok/s | speed ratio |",
            "|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        base = next(b for b in results if b["context"] == r["context"] and b["method"] == "mlx-lm KVCache")
        rows.append(
            f"| {r['context']} | {r['method']} | {r['kv_bytes']:,} | {r['kv_bytes'] / base['kv_bytes']:.3f} "
            f"| {r['peak_bytes'] / base['peak_bytes']:.3f} | {r['decode_tokens_per_s']:.2f} "
            f"| {r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.3f} |"
        )
    env = {"mlx": mx.__version__, "device": str(mx.default_device()), "machine": platform.machine(),
           "processor": platform.processor(), "steps": args.steps, "rounds": args.rounds, "dtype": str(model.model.embed_tokens.weight.dtype)}
    print("\n" + "\n".join(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": env, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
