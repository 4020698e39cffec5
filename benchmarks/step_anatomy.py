"""Where a decode step's wall time goes on the host: building its graph, submitting it
(``mx.async_eval`` encodes every node's kernels on the calling thread), and waiting; and
whether building it waits for the device (a hidden sync).

``benchmarks/decode.py`` reports a step's host time (building the graph) and the rest of
its wall time. Under mlx-lm's overlapped loop the rest is not device time alone: the
submission of the next step runs on the same thread, and a cache whose graph building
waits for the device (an array read on the host, an op that synchronises) serialises the
pipeline. Per method, after ``--warm`` steps:

- idle: ``--steps`` steps each built, submitted and waited for in turn, so the three
  parts are apart (medians); and the operations of one step's graph, counted, so that the
  submission's cost per operation shows;
- busy: ``--probes`` steps each built as the overlapped loop builds them, the previous
  step submitted and a chain of matrix products of about ``--busy-ms`` queued behind it;
  a build that takes about that long waited for the device. The innermost lines of this
  checkout's code that took more than ``--block-ms`` during one more such build are listed
  (``sys.settrace``): they name the call that synced.

    python benchmarks/step_anatomy.py --preset llama3-8b --contexts 4096 --methods full h2o kivi-4bit
    python benchmarks/step_anatomy.py --preset tiny --contexts 256 --methods full h2o   # a CPU check
"""

from __future__ import annotations

import argparse
import json
import linecache
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode as bench  # noqa: E402  (imports veloxquant_mlx before mlx)
from submit_cost import build_submit_wait, medians  # noqa: E402

import mlx.core as mx  # noqa: E402

ROOT = str(Path(__file__).resolve().parents[1])


def busy_chain(ms: float, calibrated: dict) -> mx.array:
    """Queue about ``ms`` of device work (a chain of square products: 4096 in float16 on a
    GPU, 512 in float32 on the CPU) and return it."""
    if "per_product_ms" not in calibrated:
        n, dtype = (512, mx.float32) if mx.default_device() == mx.cpu else (4096, mx.float16)
        a = mx.random.normal((n, n)).astype(dtype) * (1 / n**0.5)
        mx.eval(a)
        z = a
        for _ in range(4):
            z = z @ a
        mx.eval(z)
        t0 = time.perf_counter()
        z = a
        for _ in range(40):
            z = z @ a
        mx.eval(z)
        calibrated["per_product_ms"] = (time.perf_counter() - t0) * 1e3 / 40
        calibrated["a"] = a
    a = calibrated["a"]
    z = a
    for _ in range(max(1, round(ms / calibrated["per_product_ms"]))):
        z = z @ a
    return z


def build(model, cache, y):
    return mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)


def idle_anatomy(model, cache, y, steps):
    parts = []
    for _ in range(steps):
        y, part = build_submit_wait(lambda: build(model, cache, y))
        parts.append(part)
    return y, medians(parts, 1e3)


def step_nodes(model, cache, y):
    """One step built, its graph's operations counted (``mx.export_to_dot``: evaluated arrays
    are leaves), then evaluated: (next token, operations). Their count against ``submit``
    gives what one operation costs to submit on this device."""
    next_y = build(model, cache, y)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.dot"
        mx.export_to_dot(str(path), next_y)
        nodes = sum("shape=rectangle" in line for line in path.read_text().splitlines())
    mx.eval(next_y)
    return next_y, nodes


def overlapped_ms(model, cache, y, steps):
    y, times = bench.overlapped_steps(model, cache, y, steps)
    return y, (times[0][0] + times[0][1]) * 1e3


def blocking_calls(model, cache, y, block_ms):
    """Build one step under a line tracer: the innermost lines of this checkout's code that
    took over ``block_ms`` ((code, file:line, ms); MLX's methods are not Python functions,
    so the line that called the one that blocked is what can be named)."""
    slow, started = [], {}

    def depth(frame):
        n = 0
        while frame is not None:
            n, frame = n + 1, frame.f_back
        return n

    def local(frame, event, arg):
        now = time.perf_counter()
        begun = started.pop(id(frame), None)
        if begun is not None and (now - begun[1]) * 1e3 > block_ms:
            line = linecache.getline(frame.f_code.co_filename, begun[0]).strip()
            where = f"{Path(frame.f_code.co_filename).relative_to(ROOT)}:{begun[0]}"
            slow.append((depth(frame), begun[1], now, line, where))
        if event == "line":
            started[id(frame)] = (frame.f_lineno, time.perf_counter())
        return local

    def tracer(frame, event, arg):  # this checkout's code, not its venv's packages nor this script
        name = frame.f_code.co_filename
        return local if name.startswith(ROOT) and "site-packages" not in name and name != __file__ else None

    sys.settrace(tracer)
    try:
        next_y = build(model, cache, y)
    finally:
        sys.settrace(None)
    innermost = [s for s in slow if not any(o[0] > s[0] and s[1] <= o[1] and o[2] <= s[2] for o in slow)]
    return next_y, [(line, where, (t1 - t0) * 1e3) for _, t0, t1, line, where in innermost]


def busy_anatomy(model, cache, y, probes, busy_ms, block_ms, calibrated):
    """Steps built as the overlapped loop builds them (the previous step submitted, not
    finished), with ``busy_ms`` of work queued behind it: (next token, median build ms,
    the innermost lines that blocked during one more such build, traced)."""
    builds, slow = [], Counter()
    for probe in range(probes + 1):
        next_y = build(model, cache, y)
        mx.async_eval(next_y)
        z = busy_chain(busy_ms, calibrated)
        mx.async_eval(z)
        t0 = time.perf_counter()
        if probe < probes:
            y = build(model, cache, next_y)
            builds.append((time.perf_counter() - t0) * 1e3)
        else:
            y, calls = blocking_calls(model, cache, next_y, block_ms)
            for name, where, ms in calls:
                slow[(name, where)] += ms
        mx.eval(y, z)
    return y, statistics.median(builds), slow


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=list(bench.PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="layers of the preset's shape (default: the preset's)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096])
    ap.add_argument("--methods", nargs="+", default=["mlx-lm KVCache", "full", "h2o", "kivi-4bit"])
    ap.add_argument("--warm", type=int, default=12)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--probes", type=int, default=3, help="steps built while the device is busy (at least 1)")
    ap.add_argument("--busy-ms", type=float, default=40.0)
    ap.add_argument("--block-ms", type=float, default=None,
                    help="a traced line that took longer blocked (default: a quarter of --busy-ms)")
    ap.add_argument("--out", help="JSON of every row, rewritten after each method (a run cut short keeps its rows)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds after which no further method starts: the rest are rows marked skipped")
    args = ap.parse_args()
    if args.probes < 1:
        ap.error(f"--probes {args.probes}: at least 1 (the busy build's median needs one)")
    args.block_ms = args.busy_ms / 4 if args.block_ms is None else args.block_ms
    if "all" in args.methods:  # every implemented method at its defaults, after the named rows
        named = [m for m in args.methods if m != "all"]
        args.methods = named + [k for k in bench.implemented_methods() if k not in named]
    for key in set(args.methods) & set(bench.implemented_methods()):
        bench.METHODS.setdefault(key, bench.KVCacheConfig(method=key))
    unknown = [m for m in args.methods if m not in bench.METHODS]
    if unknown:
        ap.error(f"unknown method(s) {unknown}; choose from {list(bench.METHODS)} or all")
    if args.layers:
        bench.PRESETS[args.preset] = {**bench.PRESETS[args.preset], "num_hidden_layers": args.layers}
    on_cpu = mx.default_device() == mx.cpu
    model = bench.build_model(args.preset, mx.float32 if on_cpu else mx.float16)
    calibrated, rows = {}, []
    started = time.perf_counter()

    def write_rows() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps({"mlx": mx.__version__, "device": str(mx.default_device()),
                                                  "busy_ms": args.busy_ms, "rows": rows}, indent=2))

    for context in args.contexts:
        for name in args.methods:
            if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                rows.append({"method": name, "context": context, "error": f"skipped: past --budget-s {args.budget_s:g}"})
                continue
            try:
                cache, y, fig = bench.start(model, bench.METHODS[name], context, prefill_repeats=1)
                for _ in range(args.warm):
                    y, _ = bench.step(model, cache, y)
                y, (host, submit, wait) = idle_anatomy(model, cache, y, args.steps)
                y, nodes = step_nodes(model, cache, y)
                y, wall = overlapped_ms(model, cache, y, args.steps)
                y, busy_build, slow = busy_anatomy(model, cache, y, args.probes, args.busy_ms,
                                                   args.block_ms, calibrated)
            except Exception as exc:  # noqa: BLE001 - a failing method is a row
                rows.append({"method": name, "context": context, "error": f"{type(exc).__name__}: {exc}"})
                print(f"{name}: failed: {exc}", flush=True)
                write_rows()
                continue
            top = [{"code": c, "where": w, "ms": round(ms, 2)} for (c, w), ms in slow.most_common(6)]
            rows.append({"method": name, "context": context, "build_ms": host, "submit_ms": submit,
                         "wait_ms": wait, "nodes": nodes, "overlapped_ms": wall, "busy_build_ms": busy_build,
                         "blocking": top, "first_prefill_s": fig["prefill_first_s"]})
            print(f"{name:24s} {context}: build {host:.2f} submit {submit:.2f} wait {wait:.2f} | {nodes} ops | "
                  f"overlapped {wall:.2f} ms/token | build while busy {busy_build:.2f} ms | "
                  f"blocked: {top[:3]}", flush=True)
            write_rows()
    print(f"\nbusy chain: {args.busy_ms:g} ms queued before each probe build\n")
    print("| context | method | build ms | submit ms | wait ms | ops a step | submit us an op "
          "| overlapped ms a token | build ms while the device is busy | lines that blocked (ms) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['context']} | {r['method']} | {r['error'][:80]} ||||||||")
            continue
        blocked = "; ".join(f"{b['code']} at {b['where']} {b['ms']:.1f}" for b in r["blocking"][:3]) or "-"
        print(f"| {r['context']} | {r['method']} | {r['build_ms']:.2f} | {r['submit_ms']:.2f} | "
              f"{r['wait_ms']:.2f} | {r['nodes']} | {r['submit_ms'] * 1e3 / r['nodes']:.2f} | "
              f"{r['overlapped_ms']:.2f} | {r['busy_build_ms']:.2f} | {blocked} |")
    write_rows()


if __name__ == "__main__":
    main()
