"""Build the natural-text corpus for the VeloxQuant reference model.

Source: the King James Version of the Bible (1611), public domain, read from
Debian's ``bible-kjv-text`` package through its ``bible`` reader program
(package ``bible-kjv``)::

    apt-get update && apt-get install -y bible-kjv bible-kjv-text
    python training/build_corpus.py --out training/data

The text is normalised to plain prose: one paragraph per chapter, preceded by
a heading line ("Genesis 1"), verse numbers dropped, wrapped lines joined.

Outputs (in --out):
  train.txt    every book except the held-out ones (about 4 MB; not committed)
  heldout.txt  the held-out books (the Acts of the Apostles), also shipped as
               veloxquant/assets/reference_model/heldout_kjv_acts.txt; the
               script checks that the shipped copy is byte-identical (or writes
               it with --write-asset).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSET = REPO / "veloxquant" / "assets" / "reference_model" / "heldout_kjv_acts.txt"
HELDOUT_BOOKS = ("Acts",)


def dump_kjv() -> str:
    try:
        out = subprocess.run(
            ["bible", "-m", "8192", "gen1:1-rev22:21"],
            check=True,
            capture_output=True,
            text=True,
            env={"COLUMNS": "80", "PATH": "/usr/bin:/bin:/usr/games"},
        ).stdout
    except FileNotFoundError:
        sys.exit(
            "the 'bible' program is missing: apt-get install -y bible-kjv bible-kjv-text"
        )
    return out


HEADING = re.compile(r"^([1-3]?\s?[A-Z][A-Za-z ]+?) (\d+)$")
VERSE = re.compile(r"^\s+(\d+) (.*)$")


def parse(raw: str) -> list[tuple[str, int, str]]:
    """Return (book, chapter, prose) for every chapter, in canonical order."""
    chapters: list[tuple[str, int, list[str]]] = []
    for line in raw.splitlines():
        if not line.strip():
            continue
        m = HEADING.match(line)
        if m and not line.startswith(" "):
            chapters.append((m.group(1), int(m.group(2)), []))
            continue
        v = VERSE.match(line)
        if v:
            chapters[-1][2].append(v.group(2).strip())
        else:  # continuation of a wrapped verse
            chapters[-1][2][-1] += " " + line.strip()
    result = []
    for book, chap, verses in chapters:
        prose = " ".join(verses)
        prose = re.sub(r"\s+", " ", prose).strip()
        result.append((book, chap, prose))
    return result


def render(chapters) -> str:
    return "".join(f"{book} {chap}\n{prose}\n\n" for book, chap, prose in chapters)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=str(REPO / "training" / "data"))
    ap.add_argument(
        "--write-asset", action="store_true", help="(re)write the shipped held-out file"
    )
    args = ap.parse_args()

    chapters = parse(dump_kjv())
    books = []
    for b, _, _ in chapters:
        if not books or books[-1] != b:
            books.append(b)
    assert len(books) == 66, f"expected 66 books, got {len(books)}"
    assert len(chapters) == 1189, f"expected 1189 chapters, got {len(chapters)}"
    train = render([c for c in chapters if c[0] not in HELDOUT_BOOKS])
    held = render([c for c in chapters if c[0] in HELDOUT_BOOKS])
    for t in (train, held):
        assert t.isascii(), "KJV text is expected to be ASCII"

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.txt").write_text(train, encoding="utf-8")
    (out / "heldout.txt").write_text(held, encoding="utf-8")
    if args.write_asset:
        ASSET.parent.mkdir(parents=True, exist_ok=True)
        ASSET.write_text(held, encoding="utf-8")
    elif ASSET.exists() and ASSET.read_text(encoding="utf-8") != held:
        sys.exit(f"held-out text differs from the shipped {ASSET}")
    for name, t in (("train.txt", train), ("heldout.txt", held)):
        print(
            f"{name}: {len(t):,} bytes sha256={hashlib.sha256(t.encode()).hexdigest()[:16]}"
        )


if __name__ == "__main__":
    main()
