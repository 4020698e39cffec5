"""Merge leaderboards that ran apart on the same prompts (``leaderboard.json`` of each) into
one table, JSON and plot: a method whose part died in one run and was run again later, say.
``bench.leaderboard.merge`` checks that the runs share their prompts, tasks and full cache
(a ValueError names the one that does not). The first leaderboard's method order is kept,
and the other runs' methods take their place in it. A method's rows come from the last run
that scored it. A merge is partial while a method of the first run's command has no row.

    python benchmarks/merge_leaderboards.py --out benchmarks/results/leaderboard_subword_4k_s70 \\
        benchmarks/results/leaderboard_subword_4k_s70/leaderboard.json \\
        benchmarks/results/h200_s71/run28_out/lb_kvtc/leaderboard.json
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from veloxquant_mlx.bench import leaderboard


def methods_of(command: str) -> list[str]:
    """The ``--methods`` of a leaderboard's command, in order."""
    words = shlex.split(command)
    return words[words.index("--methods") + 1].split(",") if "--methods" in words else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for the merged leaderboard")
    ap.add_argument("runs", nargs="+", type=Path, help="leaderboard.json files, the first giving the order")
    args = ap.parse_args()
    parts = [json.loads(p.read_text()) for p in args.runs]
    for part in parts:  # written before --question-after existed: the whole-prompt protocol
        if part.get("question_after") is None:
            part["question_after"] = False
    order = methods_of(parts[0].get("command", ""))
    for i, part in enumerate(parts[1:], 1):  # a later run's methods replace the earlier runs' rows
        again = {r["method"] for r in part["rows"] if r["method"] != "full"}
        for earlier in parts[:i]:
            earlier["rows"] = [r for r in earlier["rows"] if r["method"] not in again]
        order += [m for m in methods_of(part.get("command", "")) if m not in order]
    payload, rows = leaderboard.merge(parts)
    rank = {m: i for i, m in enumerate(order)}
    rows = [rows[0]] + sorted(rows[1:], key=lambda r: (rank.get(r.method, len(rank)), r.target or -1))
    scored = {r.method for r in rows if r.status == "ok"}
    payload["partial"] = any(m not in scored for m in order)
    command = " && ".join(p["command"] for p in parts)
    payload.update(command=command, merged_from=[str(p) for p in args.runs])
    title = payload.get("title", "leaderboard") + (" (PARTIAL)" if payload["partial"] else "")
    args.out.mkdir(parents=True, exist_ok=True)
    leaderboard.write(args.out, payload, rows, payload["tasks"], title, command)
    leaderboard.plot(args.out / "leaderboard.png", rows, title)
    missing = [m for m in order if m not in scored]
    print(f"wrote {args.out / 'leaderboard.md'} from {len(parts)} runs"
          + (f"; no row for {', '.join(missing)}" if missing else ""))


if __name__ == "__main__":
    main()
