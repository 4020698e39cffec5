"""Replace the rows of some methods in a merged leaderboard by those of parts run later.

A method rerun after a fix (``bench --leaderboard --jobs`` leaves ``OUT/parts/METHOD``)
takes the place of its old rows; every other row, and the baseline, stay as they were.
The parts must share the leaderboard's prompts, seed and full-cache bytes
(``leaderboard.merge`` refuses them by name otherwise). The table, JSON and plot are
rewritten in place; the JSON's ``replaced`` lists each method taken from a part, with the
part's command and date.

    python benchmarks/leaderboard_replace_rows.py benchmarks/results/leaderboard_subword_4k_all \
        lb_rerun/parts/svdq lb_rerun/parts/a2ats
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from veloxquant_mlx.bench import leaderboard


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("board", type=Path, help="folder of the merged leaderboard.json")
    ap.add_argument("parts", type=Path, nargs="+", help="part folders, one method each")
    args = ap.parse_args()
    board = json.loads((args.board / "leaderboard.json").read_text())
    parts = [json.loads((p / "leaderboard.json").read_text()) for p in args.parts]
    methods = {r["method"] for part in parts for r in part["rows"] if r["method"] != "full"}
    kept = {**board, "rows": [r for r in board["rows"] if r["method"] not in methods],
            "outputs": {k: v for k, v in board["outputs"].items() if k.split("|")[0] not in methods}}
    for part in parts:  # the baseline comes from the board; a part's own is dropped
        part["rows"] = [r for r in part["rows"] if r["method"] != "full"]
    payload, rows = leaderboard.merge([kept, *parts])
    order = [r["method"] for r in board["rows"]]
    rows.sort(key=lambda r: order.index(r.method) if r.method in order else len(order))
    payload.update(command=board["command"], parts=board.get("parts"),
                   replaced=[*board.get("replaced", []),
                             *({"method": m, "command": part["command"], "date": part["date"]}
                               for part in parts for m in sorted({r["method"] for r in part["rows"]}))])
    title = board["title"]
    shown = board["command"] + "".join(f"\n# rows of {r['method']} replaced ({r['date']}) by: {r['command']}"
                                       for r in payload["replaced"])
    leaderboard.write(args.board, payload, rows, board["tasks"], title, shown)
    leaderboard.plot(args.board / "leaderboard.png", rows, title)
    print(f"{args.board}: rows of {', '.join(sorted(methods))} replaced")


if __name__ == "__main__":
    main()
