"""Every method's prefill at long contexts, each one able to fail alone (issue 31: no method
fails on CUDA at 4k, 32k and 128k).

A random-weight llama of a ``decode.py`` preset's shape, with ``--layers`` of them (each
layer's shapes, and so its kernels and index ranges, are the preset's; depth only scales
time and memory). Per method and context: a fresh cache is prefilled the way mlx-lm does
(``bench/runner.prefill``: chunks, then the last token), then two decode steps run; the
figures are the first prefill's seconds (run-time compilation included: each method's first
context is its first use in the process), the KV bytes held, the peak memory above what was
held before and the phase it came in (a chunk, the prompt's last token, the decode steps),
each chunk's seconds and peak, and the error where there is one.

Methods run one after another in a child process, which prints a JSON line when it starts a
method and one per finished context. A CUDA error can leave a process unable to go on, and a
fit can run for minutes at 128k: the parent records the method in flight as failed when the
child dies or passes ``--method-timeout-s``, and starts a new child at the next method.

    python benchmarks/long_prefill.py --preset llama3-8b --layers 4 --contexts 32768 131072 \
        --methods all --method-timeout-s 60 --out long_prefill.json          # the H200
    MLX_DEFAULT_DEVICE=cpu python benchmarks/long_prefill.py --preset tiny --contexts 512 \
        --methods full h2o kivi                                             # a CPU check
"""

from __future__ import annotations

import argparse
import gc
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import veloxquant_mlx  # noqa: E402,F401  first: it may load OpenBLAS

import mlx.core as mx  # noqa: E402

from decode import BASELINE, METHODS, PRESETS, build_model, make_cache, resolve_methods, step  # noqa: E402
from veloxquant_mlx.bench.runner import prefill  # noqa: E402


class Phases:
    """Seconds and peak memory (above ``base``) of each prefill chunk, then of named phases:
    where a method's peak or time goes (a fit at the first chunk, growth with the history,
    the step at the prompt's end)."""

    def __init__(self, base: int):
        self.base, self.chunks, self.named = base, [], {}
        self._restart()

    def _restart(self) -> None:
        mx.reset_peak_memory()
        self._t0 = time.perf_counter()

    def _read(self) -> tuple[float, int]:
        return time.perf_counter() - self._t0, mx.get_peak_memory() - self.base

    def after_chunk(self, n: int) -> None:
        self.chunks.append(self._read())
        self._restart()

    def end(self, name: str) -> None:
        self.named[name] = self._read()
        self._restart()

    def peak(self) -> tuple[int, str]:
        """The largest peak of all phases, and the first phase that reached it."""
        at = [(peak, f"chunk {i + 1}/{len(self.chunks)}") for i, (_, peak) in enumerate(self.chunks)]
        return max(at + [(peak, name) for name, (_, peak) in self.named.items()], key=lambda a: a[0])


def run_one(model, config, context: int) -> dict:
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    tokens = mx.random.randint(0, model.args.vocab_size, (context,), key=mx.random.key(context))
    cache = make_cache(model, config)
    phases = Phases(base)
    t0 = time.perf_counter()
    logits = prefill(model, cache, tokens, after_chunk=phases.after_chunk)
    seconds = time.perf_counter() - t0
    phases.end("last token")
    y = mx.argmax(logits)[None]
    t0 = time.perf_counter()
    for _ in range(2):
        y, _ = step(model, cache, y)
    steps_s = (time.perf_counter() - t0) / 2
    phases.end("decode")
    finite = bool(mx.all(mx.isfinite(logits)).item())
    peak, where = phases.peak()
    return {"prefill_s": seconds, "step_s": steps_s, "kv_bytes": sum(c.nbytes for c in cache),
            "peak_bytes": peak, "peak_in": where, "finite_logits": finite,
            "chunk_s": [round(t, 4) for t, _ in phases.chunks],
            "chunk_peak_bytes": [peak for _, peak in phases.chunks],
            "last_token": phases.named["last token"], "decode": phases.named["decode"]}


def child(args) -> None:
    model = build_model(args.preset, getattr(mx, args.dtype), layers=args.layers)
    for name in args.methods:
        print(json.dumps({"method": name, "started": time.time()}), flush=True)
        for context in args.contexts:
            row = {"method": name, "context": context}
            try:
                row.update(run_one(model, METHODS[name], context))
            except Exception as exc:  # noqa: BLE001 - a failing method is a row
                row["error"] = f"{type(exc).__name__}: {exc}"
                row["traceback"] = traceback.format_exc(limit=6)
            print(json.dumps(row), flush=True)
            if "error" in row:
                break  # a longer context would fail the same way, and cost time


def _forward_lines(stream, lines: queue.Queue) -> None:
    """The child's lines into ``lines``, then None at its end (the parent waits on the
    queue with a timeout, so that a silent child can be timed out)."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def parent(args) -> list[dict]:
    names = list(dict.fromkeys([BASELINE, *args.methods]))
    rows: list[dict] = []
    while names:
        cmd = [sys.executable, __file__, "--child", "--preset", args.preset, "--dtype", args.dtype,
               "--contexts", *map(str, args.contexts), "--methods", *names]
        if args.layers:
            cmd += ["--layers", str(args.layers)]
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
            lines: queue.Queue = queue.Queue()
            threading.Thread(target=_forward_lines, args=(proc.stdout, lines), daemon=True).start()
            current, started, killed = None, time.time(), False
            while True:
                try:
                    line = lines.get(timeout=1.0)
                except queue.Empty:
                    line = ""
                if line is None:
                    break
                try:
                    msg = json.loads(line) if line else None
                except ValueError:
                    msg = None
                if msg and "started" in msg:
                    current, started = msg["method"], time.time()
                    print(f"[{names.index(current) + 1}/{len(names)}] {current}", flush=True)
                elif msg:
                    rows.append(msg)
                    print("  " + _line(msg), flush=True)
                if current and time.time() - started > args.method_timeout_s:
                    proc.kill()
                    killed = True
                    break
            proc.wait()
            err.seek(0)
            tail = " ".join(err.read().strip().splitlines()[-2:])[-300:]
        if proc.returncode == 0 and not killed:
            break
        if current is None:  # the child died before its first method
            rows += [{"method": n, "context": args.contexts[0], "error": f"process: {tail}"} for n in names]
            break
        mine = [r for r in rows if r["method"] == current]
        seen = {r["context"] for r in mine}
        if not any("error" in r for r in mine) and len(seen) < len(args.contexts):
            rows.append({"method": current, "context": next(c for c in args.contexts if c not in seen),
                         "error": f"over --method-timeout-s {args.method_timeout_s:g}" if killed
                         else f"process exited {proc.returncode}: {tail}"})
            print("  " + _line(rows[-1]), flush=True)
        names = names[names.index(current) + 1:]
    return rows


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['method']:28s} {r['context']:7d}: failed: {r['error'][:200]}"
    return (f"{r['method']:28s} {r['context']:7d}: prefill {r['prefill_s']:7.2f} s, step "
            f"{r['step_s'] * 1e3:7.1f} ms, KV {r['kv_bytes'] / 2**20:9.1f} MiB, peak "
            f"{r['peak_bytes'] / 2**20:9.1f} MiB in {r['peak_in']}; chunks {_spread(r['chunk_s'])} s"
            + ("" if r["finite_logits"] else ", NON-FINITE logits"))


def _spread(seconds: list[float]) -> str:
    """First, median of the rest, last: a slow first chunk is compilation or a fit; a rising
    median, work that grows with the history."""
    if not seconds:
        return "-"
    rest = sorted(seconds[1:]) or seconds
    return f"{seconds[0]:.2f}/{rest[len(rest) // 2]:.2f}/{seconds[-1]:.2f}"


def table(rows: list[dict]) -> list[str]:
    out = ["| context | method | prefill s (first) | vs fp16 | KV MiB | KV vs fp16 | peak MiB | peak vs fp16 "
           "| peak in | step ms | logits |", "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    base = {r["context"]: r for r in rows if r["method"] == BASELINE and "error" not in r}
    for r in sorted(rows, key=lambda r: r["context"]):
        if "error" in r:
            out.append(f"| {r['context']} | {r['method']} | failed: {r['error'][:160]} ||||||||||")
            continue
        b = base.get(r["context"])
        ratio = (lambda k: f"{r[k] / b[k]:.2f}") if b else (lambda k: "-")
        out.append(f"| {r['context']} | {r['method']} | {r['prefill_s']:.2f} | {ratio('prefill_s')}x "
                   f"| {r['kv_bytes'] / 2**20:.1f} | {ratio('kv_bytes')} | {r['peak_bytes'] / 2**20:.1f} "
                   f"| {ratio('peak_bytes')} | {r['peak_in']} | {r['step_s'] * 1e3:.1f} | "
                   f"{'finite' if r['finite_logits'] else 'NON-FINITE'} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-8b", choices=list(PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="layers of the preset's shape (default: its own)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--methods", nargs="+", default=["all"],
                    help="'all' (every implemented method at its defaults) or keys/rows of decode.py")
    ap.add_argument("--dtype", default=None, choices=("float16", "bfloat16", "float32"),
                    help="default: float32 on the CPU, float16 on a GPU")
    ap.add_argument("--method-timeout-s", type=float, default=120.0)
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dtype is None:
        args.dtype = "float32" if mx.default_device() == mx.cpu else "float16"
    args.methods = resolve_methods(args.methods, ap, every_row=False)
    if args.child:
        return child(args)
    rows = parent(args)
    print("\n" + "\n".join(table(rows)))
    if args.out:
        env = {"mlx": mx.__version__, "device": str(mx.default_device()), "preset": args.preset,
               "layers": args.layers or PRESETS[args.preset]["num_hidden_layers"], "dtype": args.dtype}
        Path(args.out).write_text(json.dumps({"environment": env, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
