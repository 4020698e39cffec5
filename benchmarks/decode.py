"""Decode benchmark: KV bytes, peak memory, prefill time and decode speed of whole-model
generation.

A random-weight llama (no download), prompts prefilled the way mlx-lm does it (2048-token
chunks, then the last token alone), then single-token decode steps, the methods taking
turns (rounds x steps each, after ``--warmup-rounds`` untimed ones) so that the machine's
drift hits them alike. Steps run the way
mlx-lm's ``generate_step`` runs them (``--timing overlapped``, the default: the next step's
graph is built while the device runs this one, so a cache that reads a value on the host
while building a step shows as a slower token); ``--timing completed`` times each step to
completion instead. Per step: the
host time to build the step's graph (the model call, which is lazy), the time from then
until the step's logits are ready (the device's share), and their sum (the step; tokens
per second are ``--batch`` over it, median over every step: every sequence's token
counts). Prefill time: a method's first prefill in the process (its compilation and
first-use work included) and, separately, the median of ``--prefill-repeats`` warm ones, each on a fresh cache (the whole prompt,
the last token included, until its logits are ready). Peak memory is
``mx.get_peak_memory`` after ``mx.reset_peak_memory``, over the last warm prefill and the
first two steps, less the memory in use before it (the model's weights). Every figure is also a ratio to mlx-lm's own ``KVCache`` in the same
run, on the same model and prompt; mlx-lm's ``QuantizedKVCache`` is a peer row (shown as
failed where it fails: on MLX's CUDA back-end it has no ``quantized_matmul`` for these
shapes).

    python benchmarks/decode.py                                   # small model, CPU-sized
    python benchmarks/decode.py --preset llama3-8b --contexts 4096 32768 131072
    python benchmarks/decode.py --methods "mlx-lm KVCache" kivi-4bit --out decode.json
    python benchmarks/decode.py --preset llama3-8b --contexts 4096 --methods all   # every method at its defaults
    python benchmarks/decode.py --preset llama3-8b --contexts 4096 --methods all --isolate   # each in its own process
    python benchmarks/decode.py --preset tiny --contexts 256 --steps 2 --rounds 1   # a CPU check
    python benchmarks/decode.py --preset llama3-8b --contexts 32768 --batch 8 --methods all   # 8 sequences
    python benchmarks/decode.py --preset llama3-8b --contexts 4096 32768 --methods \
        "snapkv 2048" "snapkv 2048 + kivi-4bit" "h2o 2048 + kivi-2bit" "tova 2048 + kivi-4bit"
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from veloxquant_mlx import KVCacheConfig, make_prompt_cache  # first: it may load OpenBLAS

import mlx.core as mx  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import KVCache, QuantizedKVCache  # noqa: E402

from veloxquant_mlx.bench.runner import prefill  # noqa: E402
from veloxquant_mlx.registry import implemented_methods  # noqa: E402
from veloxquant_mlx.cache.options import (  # noqa: E402
    GEAROptions,
    XKVOptions,
    H2OOptions,
    KIVIOptions,
    L2NormOptions,
    SnapKVOptions,
    StreamingLLMOptions,
    TOVAOptions,
    TurboQuantOptions,
)

PRESETS = {
    "tiny": dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                 num_attention_heads=2, num_key_value_heads=1, vocab_size=512),
    "small": dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1024,
                  num_attention_heads=4, num_key_value_heads=1, vocab_size=1024),
    # Llama-3-8B's shape: 32 layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 14336
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
}

BASELINE = "mlx-lm KVCache"
# Untimed steps per method at least: two of the caches' 32-token periods, so that every
# method's first flush, coding or eviction (and the compilation of its kernels, seconds on
# CUDA) falls before the timed rounds. With one warm-up round of 16 steps the H200's first
# flushes fell in the timed steps: skvq 2.1 tok/s, kitty 6.6, vecinfer 2.3; warm, skvq 45.3
# and kitty 51.8 (results/h200_s60).
WARMUP_STEPS = 64
METHODS = {
    BASELINE: None,
    "mlx-lm QuantizedKVCache 4-bit": "QuantizedKVCache",
    "full": KVCacheConfig(),
    "kivi-4bit": KVCacheConfig(method="kivi", options=KIVIOptions(kivi_group_size=32), kv_bits=4),
    "kivi-2bit": KVCacheConfig(method="kivi", options=KIVIOptions(kivi_group_size=32), kv_bits=2),
    "streaming_llm 4+2044": KVCacheConfig(options=StreamingLLMOptions(stream_n_sink=4, stream_window_size=2044)),
    "snapkv 2048": KVCacheConfig(options=SnapKVOptions(snap_budget=2048)),
    # eviction composed with quantized storage (issue 36): the kept tokens at 4 or 2 bits
    "snapkv 2048 + kivi-4bit": KVCacheConfig(options=SnapKVOptions(snap_budget=2048),
                                             storage=KIVIOptions(kivi_group_size=32), kv_bits=4),
    "h2o 2048": KVCacheConfig(options=H2OOptions(h2o_budget=2048)),
    "h2o 2048 + kivi-2bit": KVCacheConfig(options=H2OOptions(h2o_budget=2048),
                                          storage=KIVIOptions(kivi_group_size=32), kv_bits=2),
    "tova 2048 + kivi-4bit": KVCacheConfig(options=TOVAOptions(tova_budget=2048),
                                           storage=KIVIOptions(kivi_group_size=32), kv_bits=4),
    "streaming_llm": KVCacheConfig(method="streaming_llm"),
    "snapkv": KVCacheConfig(method="snapkv"),
    "knorm": KVCacheConfig(options=L2NormOptions()),
    "tova": KVCacheConfig(options=TOVAOptions()),
    "h2o": KVCacheConfig(options=H2OOptions()),
    "kitty": KVCacheConfig(method="kitty"),
    "age_tiered": KVCacheConfig(method="age_tiered"),
    "adakv": KVCacheConfig(method="adakv"),
    "cachegen": KVCacheConfig(method="cachegen"),
    "kvtc": KVCacheConfig(method="kvtc"),
    "svdq": KVCacheConfig(method="svdq"),
    "palu": KVCacheConfig(method="palu"),
    "spectral": KVCacheConfig(method="spectral"),
    "gear": KVCacheConfig(method="gear"),
    # TurboQuant at its defaults (3-bit keys with the QJL sign, 3-bit values: about KIVI-2's
    # bytes) and at 4 bits (about KIVI-4's)
    "turboquant": KVCacheConfig(method="turboquant"),
    "turboquant-4bit": KVCacheConfig(options=TurboQuantOptions(turboquant_key_bits=4, turboquant_value_bits=4)),
    "gear rank 4": KVCacheConfig(method="gear", options=GEAROptions(gear_rank=4)),
    "xkv": KVCacheConfig(method="xkv"),
    "xkv max_ctx 128k": KVCacheConfig(method="xkv", options=XKVOptions(xkv_max_ctx=131072)),  # 32k+ prompts
}


def resolve_methods(names: list[str], ap: argparse.ArgumentParser, every_row: bool) -> list[str]:
    """``--methods`` as rows of ``METHODS``: a method key at its defaults (added), 'all' for
    every implemented method (and, with ``every_row``, this file's other rows); an unknown
    name is the parser's error."""
    implemented, everything = implemented_methods(), "all" in names
    if everything:
        names = [n for n in names if n != "all"] + implemented
    for key in set(names) & set(implemented):
        METHODS.setdefault(key, KVCacheConfig(method=key))
    if everything and every_row:
        names = list(METHODS)
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        ap.error(f"--methods: unknown {unknown}; choose 'all', a method key or one of {list(METHODS)}")
    return names


def build_model(preset: str, dtype, layers: int | None = None):
    """A random-weight llama of ``preset``'s shape (with ``layers`` layers of it, when given)."""
    shape = {**PRESETS[preset], **({"num_hidden_layers": layers} if layers else {})}
    args = llama.ModelArgs(model_type="llama", head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                           tie_word_embeddings=False, **shape)
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def make_cache(model, config):
    if config is None:
        return [KVCache() for _ in model.layers]
    if config == "QuantizedKVCache":
        return [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers]
    return make_prompt_cache(model, config)


def timed_prefill(model, config, tokens):
    """A fresh cache prefilled with ``tokens``: (cache, last logits, seconds until ready)."""
    cache = make_cache(model, config)
    t0 = time.perf_counter()
    logits = prefill(model, cache, tokens)  # evaluates the logits
    return cache, logits, time.perf_counter() - t0


def start(model, config, context, prefill_repeats=2, batch=1):
    """Prefill one method's cache: its first and warm prefill times, KV bytes and peak memory
    over the last prefill + 2 steps. ``batch`` > 1: that many prompts of ``context`` tokens
    (each its own random tokens) prefilled together, one cache holding every sequence."""
    shape = (context,) if batch == 1 else (batch, context)
    tokens = mx.random.randint(0, model.args.vocab_size, shape, key=mx.random.key(context))
    warm = []
    _, _, first = timed_prefill(model, config, tokens)
    for _ in range(prefill_repeats - 1):
        _, _, seconds = timed_prefill(model, config, tokens)
        warm.append(seconds)
    gc.collect()  # the earlier prefills' caches (reference cycles): freed now, not during the measured one
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    cache, logits, seconds = timed_prefill(model, config, tokens)
    warm.append(seconds)
    y = mx.argmax(logits, axis=-1).reshape(batch)
    for _ in range(2):
        y, _ = step(model, cache, y)
    return cache, y, {"kv_bytes": sum(c.nbytes for c in cache), "peak_bytes": mx.get_peak_memory() - base,
                      "prefill_first_s": first, "prefill_warm_s": statistics.median(warm)}


def step(model, cache, y):
    """One decode step: (next token, (host seconds to build it, seconds until it is ready))."""
    t0 = time.perf_counter()
    logits = model(y[:, None], cache=cache)
    y = mx.argmax(logits[:, -1], axis=-1)
    t1 = time.perf_counter()
    mx.eval(y)
    return y, (t1 - t0, time.perf_counter() - t1)


def overlapped_steps(model, cache, y, steps):
    """``steps`` tokens the way mlx-lm's ``generate_step`` runs them: the next step's graph
    is built (host) while the device runs this one (``mx.async_eval``), then this one is
    waited for. Per step: (host seconds to build it, the rest of the wall time per token),
    so host + rest is the wall time per token, and host time hides behind device time
    unless the cache waits for the device while building a step."""
    mx.async_eval(y)
    host = 0.0
    t_start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        next_y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        host += time.perf_counter() - t0
        mx.async_eval(next_y)
        mx.eval(y)
        y = next_y
    mx.eval(y)
    wall = (time.perf_counter() - t_start) / steps
    return y, [(host / steps, wall - host / steps)] * steps


def time_interleaved(model, states, steps, rounds, overlapped=True):
    """Per-step (host, device) times, the methods taking turns so that drift hits them alike;
    overlapped (as generate_step runs) or each step timed to completion."""
    times = {name: [] for name in states}
    for _ in range(rounds):
        for name, (cache, y) in states.items():
            if overlapped:
                y, t = overlapped_steps(model, cache, y, steps)
                times[name] += t
            else:
                for _ in range(steps):
                    y, t = step(model, cache, y)
                    times[name].append(t)
            states[name] = (cache, y)
    return times


def summary(figures, times, batch=1):
    """Median host, device and step seconds; tokens a second over the batch's sequences."""
    host = statistics.median(t[0] for t in times)
    device = statistics.median(t[1] for t in times)
    total = statistics.median(t[0] + t[1] for t in times)
    return {**figures, "host_s": host, "device_s": device, "step_s": total, "decode_tokens_per_s": batch / total}


def table(results) -> list[str]:
    rows = ["| context | cache | KV bytes | KV vs fp16 | peak MiB | peak vs fp16 | prefill s (first) "
            "| prefill s (warm) | prefill vs fp16 | decode tok/s | decode vs fp16 "
            "| host ms a step | host vs fp16 | device ms a step |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.get("error"):
            what = r["error"] if r["error"].startswith("skipped") else f"failed: {r['error'][:90]}"
            rows.append(f"| {r['context']} | {r['method']} | {what} |||||||||||")
            continue
        base = next(b for b in results if b["context"] == r["context"] and b["method"] == BASELINE)
        rows.append(
            f"| {r['context']} | {r['method']} | {r['kv_bytes']:,} | {r['kv_bytes'] / base['kv_bytes']:.3f} "
            f"| {r['peak_bytes'] / 2**20:.1f} | {r['peak_bytes'] / base['peak_bytes']:.2f} "
            f"| {r['prefill_first_s']:.3f} | {r['prefill_warm_s']:.3f} "
            f"| {r['prefill_warm_s'] / base['prefill_warm_s']:.2f}x | {r['decode_tokens_per_s']:.1f} "
            f"| {r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x | {r['host_s'] * 1e3:.2f} "
            f"| {r['host_s'] / base['host_s']:.2f}x | {r['device_s'] * 1e3:.2f} |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=list(PRESETS))
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--steps", type=int, default=8, help="decode steps per method per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of interleaved timing")
    ap.add_argument("--warmup-rounds", type=int, default=1,
                    help="untimed interleaved rounds before the timed ones (a round's steps share "
                         "one overlapped figure, so a slow first round moves the median); at least "
                         f"enough for {WARMUP_STEPS} steps")
    ap.add_argument("--prefill-repeats", type=int, default=2,
                    help="warm prefills per method after its first (the median is reported)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS),
                    help=f"'all' (every implemented method at its defaults, beside these rows), any method key (at its defaults), or from: {', '.join(METHODS)}")
    ap.add_argument("--timing", default="overlapped", choices=["overlapped", "completed"],
                    help="overlapped: steps run as mlx-lm's generate_step runs them (default); "
                         "completed: each step timed to completion (host and device apart)")
    ap.add_argument("--out", default=None, help="write every figure as JSON here")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds after which no further method starts its prefill: the ones "
                         "prefilled by then are timed and tabled, the rest are rows marked skipped "
                         "(a run under a time limit still ends with its table)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"],
                    help="auto: float32 on the CPU (MLX's fast CPU path), float16 on a GPU")
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences decoded together: that many prompts of each context, prefilled as "
                         "one batch into one cache per method; tokens a second count every sequence's")
    ap.add_argument("--isolate", action="store_true",
                    help="each method in a process of its own, beside its own baseline: many "
                         "caches taking turns in one process slow every method unequally "
                         "(benchmarks/notes/decode_host_bound.md)")
    args = ap.parse_args()
    if args.batch < 1:
        ap.error(f"--batch {args.batch}: the sequences decoded together must be 1 or more")
    args.methods = resolve_methods(args.methods, ap, every_row=True)
    if args.isolate:
        return run_isolated(args)

    on_cpu = mx.default_device() == mx.cpu
    dtype = (mx.float32 if on_cpu else mx.float16) if args.dtype == "auto" else getattr(mx, args.dtype)
    model = build_model(args.preset, dtype)
    results = []
    started = time.perf_counter()
    for context in args.contexts:
        names = [BASELINE, *[m for m in args.methods if m != BASELINE]]
        states, figures = {}, {}
        for name in names:
            if (args.budget_s is not None and name != BASELINE
                    and time.perf_counter() - started > args.budget_s):
                results.append({"method": name, "context": context, "batch": args.batch,
                                "error": f"skipped: --budget-s {args.budget_s:g} spent before its prefill"})
                print(f"  {name:30s} {context:7d}: skipped (--budget-s spent)", flush=True)
                continue
            try:
                cache, y, figures[name] = start(model, METHODS[name], context, args.prefill_repeats, args.batch)
                states[name] = (cache, y)
                print(f"  {name:30s} {context:7d}: prefilled in {figures[name]['prefill_first_s']:.2f} s "
                      f"(first)", flush=True)
            except Exception as exc:  # noqa: BLE001 - a failing peer is a row, not a crash
                results.append({"method": name, "context": context, "batch": args.batch,
                                "error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc(limit=4)})
                print(f"  {name:30s} {context:7d}: failed: {exc}", flush=True)
        warmup_rounds = max(args.warmup_rounds, -(-WARMUP_STEPS // args.steps))
        time_interleaved(model, states, args.steps, warmup_rounds, args.timing == "overlapped")
        times = time_interleaved(model, states, args.steps, args.rounds, args.timing == "overlapped")
        for name in states:
            r = {"method": name, "context": context, "batch": args.batch,
                 **summary(figures[name], times[name], args.batch)}
            results.append(r)
            print(f"  {name:30s} {context:7d}: prefill {r['prefill_first_s']:.3f} s first, "
                  f"{r['prefill_warm_s']:.3f} s warm, peak {r['peak_bytes'] / 2**20:.1f} MiB, "
                  f"{r['decode_tokens_per_s']:8.2f} tok/s, host {r['host_s'] * 1e3:.2f} ms, "
                  f"device {r['device_s'] * 1e3:.2f} ms", flush=True)
        del states
    results.sort(key=lambda r: (r["context"], names.index(r["method"])))
    env = {"mlx": mx.__version__, "device": str(mx.default_device()), "machine": platform.machine(),
           "preset": args.preset, "dtype": str(dtype), "batch": args.batch, "steps": args.steps,
           "rounds": args.rounds, "warmup_rounds": args.warmup_rounds, "timing": args.timing,
           "prefill_repeats": args.prefill_repeats}
    print("\n" + "\n".join(table(results)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": env, "results": results}, f, indent=2)


def run_isolated(args) -> None:
    """Each method in a child process beside its own baseline (``--methods BASELINE m``);
    the table holds each method's rows with ratios to the baseline of its own process."""
    passed = ["--preset", args.preset, "--contexts", *map(str, args.contexts), "--batch", str(args.batch),
              "--steps", str(args.steps),
              "--rounds", str(args.rounds), "--warmup-rounds", str(args.warmup_rounds),
              "--prefill-repeats", str(args.prefill_repeats), "--timing", args.timing, "--dtype", args.dtype]
    names = [m for m in dict.fromkeys(args.methods) if m != BASELINE]
    runs, lines, started = {}, [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            out = Path(tmp) / f"{i}.json"
            if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                runs[name] = _failed(name, args.contexts, f"skipped: --budget-s {args.budget_s:g} spent "
                                                           "before its process started")
            else:
                print(f"[{i + 1}/{len(names)}] {name}", flush=True)
                done = subprocess.run([sys.executable, __file__, *passed, "--methods", BASELINE, name,
                                       "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
                if done.returncode == 0 and out.exists():
                    runs[name] = json.loads(out.read_text())["results"]
                else:
                    tail = " ".join(done.stdout.strip().splitlines()[-2:])[-160:]
                    runs[name] = _failed(name, args.contexts, f"process exited {done.returncode}: {tail}")
            mine = _method_rows(name, runs[name])
            lines += mine
            print("\n".join(mine), flush=True)
    print("\n" + "\n".join([*table([])[:2], *lines]))
    if args.out:
        env = {"mlx": mx.__version__, "device": str(mx.default_device()), "preset": args.preset,
               "batch": args.batch, "steps": args.steps, "rounds": args.rounds, "warmup_rounds": args.warmup_rounds,
               "timing": args.timing, "prefill_repeats": args.prefill_repeats, "isolated": True}
        with open(args.out, "w") as f:
            json.dump({"environment": env, "runs": runs}, f, indent=2)


def _failed(name, contexts, why) -> list[dict]:
    return [{"method": name, "context": c, "error": why} for c in contexts]


def _method_rows(name, results) -> list[str]:
    """The table rows of ``name`` from one process's results (its baseline's where it failed)."""
    bases = {r["context"] for r in results if r["method"] == BASELINE and not r.get("error")}
    shown = [r for r in results if r["method"] == name and (r["context"] in bases or r.get("error"))]
    shown += [{**r, "method": name, "error": f"baseline {r['error']}"} for r in results
              if r["method"] == BASELINE and r.get("error")]
    return [line for r in shown for line in table([r, *[b for b in results if b["method"] == BASELINE]])[2:3]]


if __name__ == "__main__":
    main()
