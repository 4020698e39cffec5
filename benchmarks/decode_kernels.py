"""Where a decode step's device time goes: the kernels of steady-state decode steps, per
method, measured by NVIDIA Nsight Compute (``ncu``) on a CUDA machine.

A random-weight model of the chosen preset's layer shape (fewer layers: every layer does
the same work), a prompt prefilled as mlx-lm does it, ``--warm`` decode steps, then
``--steps`` captured steps (between ``cudaProfilerStart`` and ``cudaProfilerStop``). ncu
times each kernel alone (serialised), so the figures are device time per kernel without the
gaps between launches; the count of launches shows what the gaps would cost. Per method:
launches and device microseconds a layer and step, and the kernels that take the most.
Each kernel's thread-block cluster is recorded too: MLX re-instantiates, at every commit, a
CUDA graph that holds a kernel whose cluster is taller than 1 in y or z (it cannot update
such a graph in place; benchmarks/notes/cuda_graphs.md), and the last column names them.

    # on the device, one process per method under ncu, then the table
    python benchmarks/decode_kernels.py --out-dir $OUT/kernels --methods "mlx-lm KVCache" kivi-4bit kvquant
    python benchmarks/decode_kernels.py --report $OUT/kernels > kernels.md
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import glob
import io
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _cudart():
    for pattern in ("/tmp/site/nvidia/cuda_runtime/lib/libcudart.so*", "/usr/local/cuda/lib64/libcudart.so*",
                    "/tmp/site/**/libcudart.so*"):
        for path in sorted(glob.glob(pattern, recursive=True)):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    raise SystemExit("libcudart not found: cudaProfilerStart is needed to capture the steady-state steps")


BATCH_LAYOUTS = (", per sequence", ", stacked")  # a method's batch forced to that layout


def capture(method: str, preset: str, layers: int, context: int, warm: int, steps: int, batch: int = 1) -> None:
    """Run one method: prefill, ``warm`` steps, then ``steps`` steps inside the profiler's range.
    ``batch`` > 1: that many copies of the prefilled sequence merged into one batch (as
    ``serve_capacity.py`` merges them); ``method`` may end in ``, per sequence`` or
    ``, stacked`` to force that batch layout."""
    sys.path.insert(0, str(HERE))
    import decode as bench  # noqa: E402  (imports veloxquant_mlx before mlx)

    import mlx.core as mx

    layout = next((s for s in BATCH_LAYOUTS if method.endswith(s)), None)
    method = method[: -len(layout)] if layout else method
    bench.PRESETS[preset] = {**bench.PRESETS[preset], "num_hidden_layers": layers}
    model = bench.build_model(preset, mx.float16)
    config = bench.METHODS[method] if method in bench.METHODS else bench.KVCacheConfig(method=method)
    cache, y, _ = bench.start(model, config, context, prefill_repeats=1)
    if batch > 1:
        import serve_capacity as sc  # noqa: E402
        from veloxquant_mlx.cache import batch as batch_module
        from veloxquant_mlx.registry import METHODS as REGISTRY

        if layout == ", per sequence":
            batch_module.packer_for = lambda cls: None
        elif layout == ", stacked":
            REGISTRY[method].load_implementation().batchable = "stacked"
        cache, y = sc.batched([cache], batch), mx.repeat(y.reshape(-1), batch)
    for _ in range(warm):
        y, _ = bench.step(model, cache, y)
    mx.synchronize()
    cudart = _cudart()
    cudart.cudaProfilerStart()
    for _ in range(steps):
        y, _ = bench.step(model, cache, y)
    mx.synchronize()
    cudart.cudaProfilerStop()


def run_all(args) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for method in args.methods:
        name = method.replace(" ", "_").replace("+", "plus")
        one = [sys.executable, __file__, "--one", method, "--preset", args.preset, "--layers", str(args.layers),
               "--context", str(args.context), "--warm", str(args.warm), "--steps", str(args.steps),
               "--batch", str(args.batch)]
        if args.prewarm:  # the first run of a fresh machine compiles; MLX keeps the kernels on disk
            warm = _run(one, args.timeout)
            print(f"{method}: prewarm rc {warm.returncode}", flush=True)
        done = _run(["ncu", "--profile-from-start", "off", "--metrics", ",".join(METRICS), "--csv", *one],
                    args.timeout)
        (out / f"{name}.csv").write_text(done.stdout)
        (out / f"{name}.err").write_text(done.stderr)
        (out / f"{name}.json").write_text(json.dumps({
            "method": method, "rc": done.returncode, "layers": args.layers, "steps": args.steps,
            "context": args.context, "preset": args.preset, "batch": args.batch}))
        print(f"{method}: rc {done.returncode}", flush=True)


def _run(cmd, timeout: float) -> subprocess.CompletedProcess:
    """``cmd``'s run, or past ``timeout`` seconds one with return code "timeout" and what it
    had printed: the next method still runs."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(cmd, "timeout", _text(e.stdout), _text(e.stderr))


def _text(out) -> str:
    """What a timed-out run had printed (bytes, text or None) as text."""
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


TIME = "gpu__time_duration.sum"
CLUSTER = ("launch__cluster_dim_y", "launch__cluster_dim_z")
METRICS = (TIME, *CLUSTER)


def parse(csv_text: str) -> list[tuple[str, float]]:
    """(kernel name, microseconds) per launch from ncu's CSV."""
    return [(name, us) for name, us, _ in parse_launches(csv_text)]


def parse_launches(csv_text: str) -> list[tuple[str, float, bool]]:
    """(kernel name, microseconds, whether its cluster is taller than 1 in y or z) per launch
    from ncu's CSV (one row a launch and metric; a capture without the cluster metrics, or
    a kernel launched without a cluster, counts as flat)."""
    start = csv_text.find('"ID"')
    if start < 0:
        return []
    launches: dict[str, list] = {}
    for row in csv.DictReader(io.StringIO(csv_text[start:])):
        entry = launches.setdefault(row["ID"], [row["Kernel Name"], None, False])
        value = row["Metric Value"].replace(",", "")
        if row.get("Metric Name") == TIME:
            unit = row.get("Metric Unit", "nsecond")
            scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}.get(unit, 1e-3)
            entry[1] = float(value) * scale
        elif row.get("Metric Name") in CLUSTER:
            entry[2] = entry[2] or (value.replace(".", "", 1).isdigit() and float(value) > 1)
    return [tuple(e) for e in launches.values() if e[1] is not None]


def short(name: str, width: int = 48) -> str:
    name = name.split("(")[0]
    return name if len(name) <= width else name[: width - 3] + "..."


def report(directory: str, top: int) -> None:
    lines = ["| method | launches a layer and step | device us a layer and step | vs fp16 | top kernels (us a layer and step) | kernels with clusters taller than 1 in y or z (launches) |",
             "|---|---:|---:|---:|---|---|"]
    metas = sorted(Path(directory).glob("*.json"))
    base_us = None
    results = []
    for meta_path in metas:
        meta = json.loads(meta_path.read_text())
        found = parse_launches(meta_path.with_suffix(".csv").read_text())
        launches = [(name, us) for name, us, _ in found]
        tall = defaultdict(int)
        for name, _, clustered in found:
            if clustered:
                tall[short(name)] += 1
        per = meta["layers"] * meta["steps"]
        if not launches:
            results.append((meta["method"], None, None, f"no kernels captured (rc {meta['rc']})", ""))
            continue
        by_name = defaultdict(float)
        for name, us in launches:
            by_name[short(name)] += us
        total = sum(us for _, us in launches) / per
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
        tops = "; ".join(f"{n} {us / per:.1f}" for n, us in ranked)
        results.append((meta["method"], len(launches) / per, total, tops,
                        "; ".join(f"{n} ({c})" for n, c in sorted(tall.items())) or "-"))
        if meta["method"] == "mlx-lm KVCache":
            base_us = total
    for method, n, us, tops, tall in results:
        if n is None:
            lines.append(f"| {method} | | | | {tops} | |")
            continue
        ratio = f"{us / base_us:.2f}x" if base_us else ""
        lines.append(f"| {method} | {n:.1f} | {us:.1f} | {ratio} | {tops} | {tall} |")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--methods", nargs="+", default=["mlx-lm KVCache", "full", "kivi-4bit"])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=2, help="layers of the preset's shape (default 2)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--warm", type=int, default=40, help="decode steps before the captured ones")
    ap.add_argument("--steps", type=int, default=4, help="captured decode steps")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a method's ncu run may take")
    ap.add_argument("--prewarm", action="store_true",
                    help="run each method once without ncu first (on a fresh machine its first run compiles)")
    ap.add_argument("--out-dir")
    ap.add_argument("--report", metavar="DIR", help="print the table of a finished --out-dir")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (copies of the prompt)")
    args = ap.parse_args()
    if args.one:
        capture(args.one, args.preset, args.layers, args.context, args.warm, args.steps, args.batch)
    elif args.report:
        report(args.report, args.top)
    elif args.out_dir:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        run_all(args)
    else:
        ap.error("--out-dir (run under ncu) or --report DIR")


if __name__ == "__main__":
    main()
