"""The ``veloxquant`` command line."""

from __future__ import annotations

import argparse
import sys

from .registry import METHODS


def cmd_methods(args: argparse.Namespace) -> int:
    """List every method with its family, status and whether it is implemented."""
    rows = [("method", "options class", "family", "status", "implemented")]
    for key, info in METHODS.items():
        rows.append(
            (key, info.options_class_name or "-", info.family, info.status,
             "yes" if info.implemented else "not yet")
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    done = sum(info.implemented for info in METHODS.values())
    print(f"\n{len(METHODS)} methods, {done} implemented")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="veloxquant", description="KV-cache compression for MLX / mlx-lm models."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("methods", help=cmd_methods.__doc__)
    p.set_defaults(func=cmd_methods)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
