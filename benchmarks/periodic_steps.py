"""Which decode steps are slow, and whether they stay slow the second time round.

``step_anatomy.py`` found methods whose overlapped time a token exceeds what a steady step
costs (build + submit) by 5-19 ms on the H200: periodic work (a flush into a quantized
segment, an eviction, a refit) that falls in some steps. On the CPU such steps build
graphs only 2-4x a steady step's, which does not explain it. So this times each token as
mlx-lm's ``generate_step`` sees it (the next step built and submitted before the host
waits for this one), twice over the same prompt with a fresh cache each time: the second
run meets the same shapes again, so a cost that is paid once per new shape (compiling a
fused kernel, capturing a CUDA graph) shows in the first run only. Per method and run: the
median interval between tokens, the steps over ``--spike`` times it (step: ms), and their
excess over the median in all; and the graph size (nodes) of a steady step after them.

    python benchmarks/periodic_steps.py --preset llama3-8b --contexts 4096 --steps 96 --methods kivi cachegen
    python benchmarks/periodic_steps.py --preset tiny --contexts 256 --steps 70 --methods kivi   # a CPU check
    python benchmarks/periodic_steps.py --preset llama3-8b --methods svdq --cache-limit-gb 64 --no-gc   # spikes' causes
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode as bench  # noqa: E402  (imports veloxquant_mlx before mlx)
from step_anatomy import step_nodes  # noqa: E402

import mlx.core as mx  # noqa: E402


def token_intervals(model, cache, y, steps):
    """``steps`` tokens as generate_step runs them: ms between consecutive tokens ready."""
    mx.async_eval(y)
    ready = []
    for _ in range(steps):
        next_y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.async_eval(next_y)
        y.item()
        ready.append(time.perf_counter())
        y = next_y
    y.item()
    ready.append(time.perf_counter())
    return y, [(b - a) * 1e3 for a, b in zip(ready, ready[1:])]


def summary(intervals, spike):
    med = statistics.median(intervals)
    spikes = [(i, round(ms, 1)) for i, ms in enumerate(intervals) if ms > spike * med]
    return {"median_ms": med, "spikes": spikes, "excess_ms": sum(ms - med for _, ms in spikes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=list(bench.PRESETS))
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096])
    ap.add_argument("--methods", nargs="+", default=["mlx-lm KVCache", "kivi"])
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--runs", type=int, default=2, help="runs over the same prompt, a fresh cache each")
    ap.add_argument("--spike", type=float, default=1.5, help="a step over this times the median spikes")
    ap.add_argument("--out")
    ap.add_argument("--cache-limit-gb", type=float,
                    help="MLX's cache of freed buffers (mx.set_cache_limit): past it, freed buffers go back "
                         "to the device, which a CUDA free may wait for")
    ap.add_argument("--no-gc", action="store_true", help="Python's garbage collector off while steps run")
    args = ap.parse_args()
    if args.runs < 1 or args.steps < 2:
        ap.error(f"--runs {args.runs} and --steps {args.steps}: at least 1 run of 2 steps")
    for key in set(args.methods) & set(bench.implemented_methods()):
        bench.METHODS.setdefault(key, bench.KVCacheConfig(method=key))
    unknown = [m for m in args.methods if m not in bench.METHODS]
    if unknown:
        ap.error(f"unknown method(s) {unknown}; choose from {list(bench.METHODS)}")
    if args.cache_limit_gb is not None:
        mx.set_cache_limit(int(args.cache_limit_gb * 2**30))
    if args.no_gc:
        gc.collect()
        gc.disable()
    on_cpu = mx.default_device() == mx.cpu
    model = bench.build_model(args.preset, mx.float32 if on_cpu else mx.float16)
    rows = []
    for context in args.contexts:
        for name in args.methods:
            runs = []
            try:
                for _ in range(args.runs):
                    cache, y, _ = bench.start(model, bench.METHODS[name], context, prefill_repeats=1)
                    y, intervals = token_intervals(model, cache, y, args.steps)
                    runs.append({**summary(intervals, args.spike), "intervals_ms": intervals})
                    mx.eval(y)
                y, nodes = step_nodes(model, cache, y)
            except Exception as exc:  # noqa: BLE001 - a failing method is a row
                rows.append({"method": name, "context": context, "error": f"{type(exc).__name__}: {exc}"})
                print(f"{name}: failed: {exc}", flush=True)
                continue
            rows.append({"method": name, "context": context, "steady_nodes": nodes, "runs": runs})
            for i, r in enumerate(runs):
                print(f"{name:16s} {context} run {i + 1}: median {r['median_ms']:.2f} ms, "
                      f"{len(r['spikes'])} spikes, excess {r['excess_ms']:.0f} ms: {r['spikes'][:10]}", flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps({"mlx": mx.__version__, "device": str(mx.default_device()),
                                                      "steps": args.steps, "spike": args.spike, "rows": rows}))
    print(f"\n| context | method | run | median ms a token | spikes | excess ms over {args.steps} steps "
          f"| excess ms a token | steps that spiked (ms) |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['context']} | {r['method']} | | {r['error'][:80]} ||||")
            continue
        for i, run in enumerate(r["runs"]):
            where = ", ".join(f"{s}: {ms}" for s, ms in run["spikes"][:8])
            print(f"| {r['context']} | {r['method']} | {i + 1} | {run['median_ms']:.2f} | {len(run['spikes'])} | "
                  f"{run['excess_ms']:.0f} | {run['excess_ms'] / args.steps:.2f} | {where} |")


if __name__ == "__main__":
    main()
