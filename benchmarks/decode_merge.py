"""One table of every method's decode figures from several ``benchmarks/decode.py`` runs.

Each run has its own mlx-lm ``KVCache`` baseline, and runs on a lent GPU differ in speed
(host time a step varied 2.3x between two runs of one day), so only ratios to the baseline
of the same run are put side by side; times are not. A method measured in several runs
takes its latest (the files' order on the command line, later files winning); the
``run`` column names the file each row comes from. Rows are sorted by decode ratio.

    python benchmarks/decode_merge.py benchmarks/results/decode_overlapped_4k_s10_b.json \
        benchmarks/results/decode_overlapped_4k_s10_c.json benchmarks/results/decode_overlapped_4k_s44_a.json \
        benchmarks/results/decode_overlapped_4k_s44_b.json benchmarks/results/decode_overlapped_4k_s44_c.json \
        --out benchmarks/results/decode_4k_every_method.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BASELINE = "mlx-lm KVCache"


def rows_of(path: Path) -> dict[tuple[str, int], dict]:
    """(method, context) -> the row's ratios to its run's baseline (failed rows skipped)."""
    data = json.loads(path.read_text())
    if "runs" in data:  # decode.py --isolate: each method beside its own process's baseline
        return {key: row for results in data["runs"].values() for key, row in _rows(path, results).items()}
    return _rows(path, data["results"])


def _rows(path: Path, results: list[dict]) -> dict[tuple[str, int], dict]:
    base = {r["context"]: r for r in results if r["method"] == BASELINE and not r.get("error")}
    out = {}
    for r in results:
        b = base.get(r["context"])
        if r.get("error") or b is None or r["method"] == BASELINE:
            continue
        out[(r["method"], r["context"])] = {
            "run": path.stem, "kv": r["kv_bytes"] / b["kv_bytes"], "peak": r["peak_bytes"] / b["peak_bytes"],
            "prefill": r["prefill_warm_s"] / b["prefill_warm_s"],
            "decode": r["decode_tokens_per_s"] / b["decode_tokens_per_s"], "host": r["host_s"] / b["host_s"]}
    return out


def table(rows: dict[tuple[str, int], dict]) -> list[str]:
    lines = ["| context | method | KV vs fp16 | peak vs fp16 | warm prefill vs fp16 | decode vs fp16 "
             "| host a step vs fp16 | run |", "|---:|---|---:|---:|---:|---:|---:|---|"]
    for (method, context), r in sorted(rows.items(), key=lambda kv: (kv[0][1], -kv[1]["decode"])):
        lines.append(f"| {context} | {method} | {r['kv']:.3f} | {r['peak']:.2f} | {r['prefill']:.2f}x "
                     f"| {r['decode']:.2f}x | {r['host']:.2f}x | {r['run']} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+", help="decode.py --out JSON files, oldest first")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = ap.parse_args()
    rows: dict[tuple[str, int], dict] = {}
    for path in args.runs:
        rows.update(rows_of(path))
    text = "\n".join(table(rows)) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
