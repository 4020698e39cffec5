"""Where every method stands on a GPU: the latest stored figure of each method, from every
``benchmarks/decode.py`` JSON under ``benchmarks/results`` (issues 30 and 31's tables).

Each figure is a ratio to mlx-lm's KVCache measured in the same run (the same process, or
the method's own process beside its own KVCache with ``decode.py``'s isolated runs); runs on
different machines and days are not compared with each other. For each method and context
the newest file holding it wins (its last commit's time; a file git does not track: its
modification time). Decode counts only with ``decode.py``'s overlapped timing (mlx-lm's
``generate_step``), the issue's measure. A row whose newest run failed or was skipped shows
why. The card (H100 or H200) is in the source folder's README. A file whose environment
names a ``variant`` (an A/B's arm the tree does not ship, noted after the run) is left out.

    python benchmarks/standing.py --preset llama3-8b --context 4096 > benchmarks/notes/standing.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "mlx-lm KVCache"
TARGETS = {"decode": 0.9, "prefill": 1.5, "peak": 1.0}  # issue 30's 4k decode, issue 31's prefill and peak


@dataclass
class Figure:
    method: str
    context: int
    batch: int
    source: str
    when: float  # seconds since the epoch: the file's last commit
    kv: float | None = None
    decode: float | None = None
    host: float | None = None
    prefill: float | None = None
    prefill_first_s: float | None = None
    peak: float | None = None
    error: str | None = None
    newer_failure: "Figure | None" = None  # a newer run of the method that failed or was skipped


def file_time(path: Path) -> float:
    """The file's last commit time, or its modification time where git does not track it."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%ct", "--", str(path)], cwd=path.parent,
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return float(out) if out else path.stat().st_mtime


def _groups(data: dict) -> list[list[dict]]:
    """The rows of each process: ``results`` (one process) or ``runs`` (one a method)."""
    if isinstance(data.get("results"), list):
        return [data["results"]]
    if isinstance(data.get("runs"), dict):
        return [rows for rows in data["runs"].values() if isinstance(rows, list)]
    return []


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def figures_of(path: Path, preset: str) -> list[Figure]:
    """Every method's figures in one ``decode.py`` JSON on a GPU at ``preset``, as ratios to
    the KVCache of its own process ([] for any other file)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    env = data.get("environment") if isinstance(data, dict) else None
    if not isinstance(env, dict) or env.get("preset") != preset or "gpu" not in str(env.get("device", "")):
        return []
    if env.get("variant"):  # a run of a setting the tree does not ship (an A/B's other arm)
        return []
    overlapped = env.get("timing") == "overlapped"
    batch = int(env.get("batch", 1))
    when, source = file_time(path), str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    out = []
    for rows in _groups(data):
        rows = [r for r in rows if isinstance(r, dict) and "method" in r and "context" in r]
        base = {r["context"]: r for r in rows if r["method"] == BASELINE and not r.get("error")}
        for r in rows:
            if r["method"] == BASELINE:
                continue
            f = Figure(r["method"], r["context"], batch, source, when)
            b = base.get(r["context"])
            if r.get("error"):
                f.error = str(r["error"]).splitlines()[0][:120]
            elif b is None:
                f.error = "no KVCache figure in its process"
            else:
                f.kv = _ratio(r.get("kv_bytes"), b.get("kv_bytes"))
                if overlapped:
                    f.decode = _ratio(r.get("decode_tokens_per_s"), b.get("decode_tokens_per_s"))
                    f.host = _ratio(r.get("host_s"), b.get("host_s"))
                f.prefill = _ratio(r.get("prefill_warm_s"), b.get("prefill_warm_s"))
                f.prefill_first_s = r.get("prefill_first_s")
                f.peak = _ratio(r.get("peak_bytes"), b.get("peak_bytes"))
            out.append(f)
    return out


def latest(figures: list[Figure]) -> dict[tuple[str, int, int], Figure]:
    """The newest measured figure of each (method, context, batch) (ties: the later source
    path), with the newest failure after it, if any (``newer_failure``; a row skipped for a
    run's time budget says nothing of the method and is left out); a failure or skip where
    nothing was ever measured."""
    best: dict[tuple[str, int, int], Figure] = {}
    for f in sorted(figures, key=lambda f: (f.when, f.source)):
        key, held = (f.method, f.context, f.batch), best.get((f.method, f.context, f.batch))
        if f.error and held is not None and not held.error:
            if not f.error.startswith("skipped"):
                held.newer_failure = f
        else:
            best[key] = f
    return best


def _cell(x: float | None, target: float | None = None, above: bool = True) -> str:
    """``x`` to two places, bold where the shown value misses ``target`` (``above``: it must
    be at least the target, else at most)."""
    if x is None:
        return "-"
    text = f"{x:.2f}"
    shown = float(text)
    if target is not None and (shown < target if above else shown > target):
        return f"**{text}**"
    return text


def table(best: dict[tuple[str, int, int], Figure], context: int, batch: int, methods: list[str]) -> list[str]:
    """Markdown rows of one context and batch, every method in ``methods`` (``no figure`` where
    none is stored) and every other measured row;
    bold: short of the issues' bar (decode below 0.9x, warm prefill above 1.5x, peak above
    KVCache's)."""
    lines = ["| method | KV vs fp16 | decode vs KVCache | host vs KVCache | warm prefill vs KVCache | "
             "first prefill s | peak vs KVCache | from |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    names = list(dict.fromkeys([*methods, *sorted(m for m, c, b in best if (c, b) == (context, batch))]))
    for m in names:
        f = best.get((m, context, batch))
        if f is None:
            lines.append(f"| {m} | no figure | | | | | | |")
        elif f.error:
            lines.append(f"| {m} | failed or skipped: {f.error} | | | | | | `{f.source}` |")
        else:
            first = "-" if f.prefill_first_s is None else f"{f.prefill_first_s:.1f}"
            later = "" if f.newer_failure is None else (
                f" (later, `{f.newer_failure.source}`: {f.newer_failure.error})")
            lines.append(f"| {m} | {_cell(f.kv)} | {_cell(f.decode, TARGETS['decode'])} | {_cell(f.host)} | "
                         f"{_cell(f.prefill, TARGETS['prefill'], above=False)} | {first} | "
                         f"{_cell(f.peak, TARGETS['peak'], above=False)} | `{f.source}`{later} |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--context", type=int, nargs="+", default=[4096])
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--methods", nargs="*", default=None,
                        help="rows to show even without a figure (default: every implemented method)")
    args = parser.parse_args(argv)
    methods = args.methods
    if methods is None:
        from veloxquant_mlx.registry import implemented_methods

        methods = list(implemented_methods())
    figures = [f for path in sorted(args.results.rglob("*.json")) for f in figures_of(path, args.preset)]
    best = latest(figures)
    print(f"# Where each method stands on a GPU ({args.preset})\n")
    print("Command: `python benchmarks/standing.py --preset " + args.preset + " --context "
          + " ".join(map(str, args.context)) + "`\n")
    print("The newest stored figure of each method, each a ratio to mlx-lm's KVCache in its own run "
          "(runs differ in machine and day: the card is in the source folder's README). Bold: short "
          f"of the issues' bars (decode below {TARGETS['decode']}x at 4k, warm prefill above "
          f"{TARGETS['prefill']}x, peak above KVCache's).\n")
    for context in args.context:
        for batch in sorted({b for _, c, b in best if c == context} or {1}):
            print(f"## {context:,} tokens, batch {batch}\n")
            print("\n".join(table(best, context, batch, methods if batch == 1 else [])) + "\n")


if __name__ == "__main__":
    main()
