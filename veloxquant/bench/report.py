"""Bench output: a terminal table, a JSON file with every figure, a Pareto plot (PNG)."""

from __future__ import annotations

import json
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from .metrics import pareto_front

BASELINE = "full"
LEGEND = (
    "bytes/tok: KV bytes kept per token after decoding (all layers); vs full, peak:\n"
    "ratios to the full cache in this run (peak: memory above what was in use before\n"
    "the run); prefill, decode: speed as a ratio to the full cache's, the median over\n"
    "rounds that each time the full cache then the method on the same text (wall\n"
    "clock; decode: the median step), with the lowest and highest round in brackets;\n"
    "retrieval: accuracy on the long-context tasks; ppl, KL (nats), top-1: over\n"
    "held-out text, against the full cache's next-token distributions; settings: the\n"
    "effective value of every field the method reads."
)
SYNTHETIC_LEGEND = (
    "bytes/token: KV bytes kept per token (all layers); attn rel. error: mean and max\n"
    "relative error of the decode steps' attention output against exact attention;\n"
    "settings: the effective value of every field the method reads."
)


def title(model: str | None, context: int, date: str, synthetic: bool) -> str:
    """``veloxquant bench: <model>, context <n> tokens, <date>``."""
    if synthetic:
        what = "synthetic K/V/Q"
    else:
        from ..reference import REFERENCE_MODEL

        what = "reference model" if model == str(REFERENCE_MODEL) else Path(model).name or model
        if "/" in model and not Path(model).exists():
            what = model  # a hub id
    return f"veloxquant bench: {what}, context {context:,} tokens, {date}"


def environment(seed: int, model: str | None) -> dict[str, Any]:
    import mlx.core as mx

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {
        "veloxquant-mlx": version("veloxquant-mlx"),
        "mlx": mx.__version__,
        "mlx-lm": version("mlx-lm"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "backend": str(mx.default_device()),
        "metal": bool(mx.metal.is_available()),
        "seed": seed,
        "model": model,
    }


def _baseline(results: list[dict]) -> dict | None:
    return next((r for r in results if r["label"] == BASELINE and r["status"] == "ok"), None)


def add_ratios(results: list[dict], synthetic: bool) -> None:
    """Ratios of every figure to the full cache's, measured in the same run."""
    base = _baseline(results)
    if base is None:
        return
    for r in results:
        if r["status"] != "ok":
            continue
        if synthetic:
            r["ratios"] = {"bytes_per_token": r["bytes_per_token"] / base["bytes_per_token"]}
            continue
        m, b = r["memory_speed"], base["memory_speed"]
        r["ratios"] = {
            "bytes_per_token_prefill": m["bytes_per_token_prefill"] / b["bytes_per_token_prefill"],
            "bytes_per_token_decode": m["bytes_per_token_decode"] / b["bytes_per_token_decode"],
            "peak_memory": m["peak_bytes"] / b["peak_bytes"] if b["peak_bytes"] > 0 else None,
        }
        # speed only from rounds timed alternately with the full cache (harness.
        # interleaved_speed): single passes minutes apart did not reproduce under load
        if r is base:
            r["ratios"].update(prefill_speed=1.0, decode_speed=1.0)
        elif "speed_rounds" in r:
            rounds = r["speed_rounds"]
            r["ratios"].update(
                {k: rounds[k] for k in ("prefill_speed", "prefill_speed_range",
                                        "decode_speed", "decode_speed_range")})


def table_rows(results: list[dict], synthetic: bool) -> tuple[list[str], list[list[str]]]:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    if synthetic:
        head = ["method", "settings", "bytes/token", "vs full", "attn rel. error", "max", "status"]
        rows = []
        for r in results:
            if r["status"] != "ok":
                rows.append([r["method"], _settings(r), "-", "-", "-", "-", "FAILED: " + r["error"]])
                continue
            rows.append([r["method"], _settings(r), f(r["bytes_per_token"], ".1f"),
                         f(r.get("ratios", {}).get("bytes_per_token"), ".3f"),
                         f(r["relative_error_mean"], ".4f"), f(r["relative_error_max"], ".4f"), "ok"])
        return head, rows
    head = ["method", "settings", "bytes/tok", "vs full", "peak", "retrieval", "ppl", "KL",
            "top-1", "prefill", "decode", "status"]
    rows = []
    for r in results:
        if r["status"] != "ok":
            rows.append([r["method"], _settings(r)] + ["-"] * 9 + ["FAILED: " + r["error"]])
            continue
        ratios, q = r.get("ratios", {}), r["continuation"]
        rows.append([
            r["method"], _settings(r),
            f(r["memory_speed"]["bytes_per_token_decode"], ",.0f"),
            f(ratios.get("bytes_per_token_decode"), ".3f"),
            f(ratios.get("peak_memory"), ".2f"),
            f(r["retrieval"]["accuracy"], ".3f"),
            f(q["perplexity"], ".3f"),
            f(q.get("kl_mean"), ".4f"),
            f(q.get("top1_agreement"), ".3f"),
            _speed(ratios, "prefill_speed"),
            _speed(ratios, "decode_speed"),
            "ok",
        ])
    return head, rows


def _speed(ratios: dict, key: str) -> str:
    """``0.93x (0.88-1.02)``: the median ratio and the range of the rounds."""
    if ratios.get(key) is None:
        return "-"
    spread = ratios.get(key + "_range")
    return f"{ratios[key]:.2f}x" + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else "")


def _settings(r: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in r.get("settings", {}).items()) or "-"


def print_table(results: list[dict], synthetic: bool, console=None, title: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    head, rows = table_rows(results, synthetic)
    title = title or "veloxquant bench" + (" (synthetic)" if synthetic else "")
    if console is None:  # piped output: wide enough that no column is cut
        console = Console(width=None if sys.stdout.isatty() else 170)
    for columns in _column_groups(head, rows, console.width):
        table = Table(title=title)
        title = None
        for i in columns:
            text = head[i] in _TEXT_COLUMNS
            table.add_column(head[i], justify="left" if i == 0 or text else "right",
                             no_wrap=not text, overflow="fold",
                             min_width=None if text else _width(head, rows, i))
        for row in rows:
            table.add_row(*(row[i] for i in columns))
        console.print(table)
    print(SYNTHETIC_LEGEND if synthetic else LEGEND)


_TEXT_COLUMNS = ("settings", "status")
_TEXT_MIN_WIDTH = 30


def _width(head, rows, i) -> int:
    return max(len(head[i]), *(len(row[i]) for row in rows)) if rows else len(head[i])


def _column_groups(head, rows, width: int) -> list[list[int]]:
    """The columns of each table to print: all in one where they fit in ``width``; else
    the numbers in tables that fit, each led by the method, then the method with its
    settings and status, which wrap: no number is cut and no column dropped."""
    cost = lambda i: _width(head, rows, i) + 3  # noqa: E731 - padding and a border
    # the text columns wrap: in one table, they need room for a few words a line
    wrapped = sum(min(cost(i), _TEXT_MIN_WIDTH) for i in range(len(head)) if head[i] in _TEXT_COLUMNS)
    if 1 + wrapped + sum(cost(i) for i in range(len(head)) if head[i] not in _TEXT_COLUMNS) <= width:
        return [list(range(len(head)))]
    numbers = [i for i in range(1, len(head)) if head[i] not in _TEXT_COLUMNS]
    groups, current = [], [0]
    for i in numbers:
        if len(current) > 1 and 1 + sum(cost(j) for j in current + [i]) > width:
            groups.append(current)
            current = [0]
        current.append(i)
    groups.append(current)
    return groups + [[0] + [i for i in range(1, len(head)) if head[i] in _TEXT_COLUMNS]]


def markdown_table(results: list[dict], synthetic: bool) -> str:
    head, rows = table_rows(results, synthetic)
    cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_report(results: list[dict], synthetic: bool, title: str) -> str:
    """table.md: the title, the table, what each column means."""
    legend = (SYNTHETIC_LEGEND if synthetic else LEGEND).replace("\n", " ")
    return f"# {title}\n\n{markdown_table(results, synthetic)}\n\n{legend}\n"


def write_json(path: Path, payload: dict) -> None:
    """Written whole or not at all: an interrupt during the write leaves the last file."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")
    partial.replace(path)


def _byte_ticks(low: float, high: float) -> list[float]:
    """At least 4 round byte counts in [low, high]: 1, 2, 5 x 10^k, finer when few fit."""
    import math

    for mantissas in ((1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9)):
        ticks = [m * 10**e for e in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
                 for m in mantissas]
        ticks = [t for t in ticks if low <= t <= high]
        if len(ticks) >= 4:
            return ticks
    return ticks


def _labels(ax, results, xs, ys, fontsize: float = 8) -> None:
    """Each point's label to its upper right, moved up past labels it would overlap; the
    y axis grows until the highest label fits under its top."""
    points_to_px = ax.figure.dpi / 72
    line, char = 1.25 * fontsize * points_to_px, 0.6 * fontsize * points_to_px
    points = sorted(zip(results, xs, ys), key=lambda t: (t[2], t[1]))  # bottom up
    for _ in range(4):
        placed: list[tuple[float, float, float]] = []  # (left, bottom, right) in pixels
        for r, x, y in points:
            px, py = ax.transData.transform((x, y))
            left, bottom = px + 5 * points_to_px, py + 4 * points_to_px
            right = left + char * len(r["label"])
            while any(abs(bottom - b) < line and left < r2 and l2 < right for l2, b, r2 in placed):
                bottom += line
            placed.append((left, bottom, right))
        top = max((b + line for _, b, _ in placed), default=0)
        axes_top = ax.get_window_extent().y1
        if top <= axes_top:
            break
        _, y_top = ax.transData.inverted().transform((0, top + 2 * line))
        ax.set_ylim(top=y_top)
    for (r, x, y), (left, bottom, _) in zip(points, placed):
        px, py = ax.transData.transform((x, y))
        moved = bottom - py > line  # a label pushed up keeps a thin line to its point
        ax.annotate(r["label"], (x, y), textcoords="offset points", fontsize=fontsize,
                    xytext=((left - px) / points_to_px, (bottom - py) / points_to_px),
                    arrowprops=dict(arrowstyle="-", color="0.6", lw=0.5, shrinkA=0, shrinkB=3)
                    if moved else None)


def plot_points(results: list[dict], synthetic: bool) -> list[tuple[dict, float, float]]:
    """(result, KV bytes per token, error) of each run the plot shows, lower error better:
    the mean KL divergence of the continuation from the full cache's (the full cache
    itself: 0), or with ``synthetic`` the attention's relative error. Runs that failed or
    have no such figure are left out."""
    out = []
    for r in results:
        if r["status"] != "ok":
            continue
        if synthetic:
            x, error = r["bytes_per_token"], r["relative_error_mean"]
        else:
            x = r["memory_speed"]["bytes_per_token_decode"]
            error = r.get("continuation", {}).get("kl_mean")
            if error is None and r["label"] == BASELINE:
                error = 0.0  # the reference the KL is taken against
        if x is not None and error is not None:
            out.append((r, float(x), float(error)))
    return out


def quality_front(points: list[tuple[dict, float, float]]) -> list[int]:
    """Indices (into ``points``) of the runs no other run beats on both plotted axes: no
    fewer bytes per token with no more error. Only the plotted quality counts."""
    return pareto_front([(x, -error) for _, x, error in points])


def plot(path: Path, results: list[dict], synthetic: bool, title: str | None = None) -> None:
    """Error (KL divergence from the full cache, log scale; lower is better) against KV
    bytes per token. Points are numbered by bytes per token; the table beside the plot
    names each number, its bytes and error, and marks the Pareto-optimal runs (on those
    two axes), which the plot rings and joins. Sets ``pareto`` on every ok result."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    points = sorted(plot_points(results, synthetic), key=lambda p: (p[1], p[2]))
    front = quality_front(points)
    xs = [x for _, x, _ in points]
    positive = [e for _, _, e in points if e > 0]
    floor = min(positive, default=1e-3) / 4  # an error of 0 is drawn here (a log axis has no 0)
    ys = [e if e > 0 else floor for _, _, e in points]
    measure = "attention relative error vs exact" if synthetic else "KL divergence from the full cache"
    rows = len(points)
    fig, (ax, side) = plt.subplots(1, 2, figsize=(12, max(5.5, 1.6 + 0.17 * rows)), dpi=110,
                                   gridspec_kw={"width_ratios": [3, 2]})
    exact = [i for i, (_, _, e) in enumerate(points) if e == 0]
    inexact = [i for i in range(rows) if i not in exact]
    ax.scatter([xs[i] for i in inexact], [ys[i] for i in inexact], color="tab:blue", s=18, zorder=3)
    if exact:
        ax.scatter([xs[i] for i in exact], [ys[i] for i in exact], color="tab:green", marker="v",
                   s=40, zorder=3, label=f"error 0 (drawn at {floor:.1e})")
    if len(front) >= 2:
        ax.plot([xs[i] for i in front], [ys[i] for i in front], "--", color="tab:red",
                label="Pareto frontier", zorder=2)
    if front:
        ax.scatter([xs[i] for i in front], [ys[i] for i in front], s=110, facecolors="none",
                   edgecolors="tab:red", zorder=4, label="Pareto-optimal")
    if points:
        ax.legend(loc="lower left", fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    if xs:
        low, high = min(xs) / 1.3, max(xs) * 1.3
        ax.set_xlim(low, high)
        ax.xaxis.set_major_locator(FixedLocator(_byte_ticks(low, high)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_ylim(floor / 2, max(ys) * 3)
    if title:
        ax.set_title(title, fontsize=10)
    ax.set_xlabel("KV bytes per token (measured nbytes, all layers)")
    ax.set_ylabel(f"{measure}\n(log scale; lower is better)")
    ax.grid(True, which="both", alpha=0.25)
    side.axis("off")
    lines = [f"{'#':>3}  {'run':<34} {'bytes/tok':>9} {'error' if synthetic else 'KL':>8}  front",
             f"{'':->3}  {'':-<34} {'':->9} {'':->8}  -----"]
    on_front = set(front)
    for n, (r, x, e) in enumerate(points, 1):
        label = r["label"] if len(r["label"]) <= 34 else r["label"][:33] + "~"
        lines.append(f"{n:>3}  {label:<34} {x:>9,.0f} {e:>8.2g}  {'*' if n - 1 in on_front else ''}")
    left_out = [r["label"] for r in results if r["status"] == "ok" and r not in [p[0] for p in points]]
    if left_out:
        lines.append(f"not plotted (no {'error' if synthetic else 'KL'}): {', '.join(left_out)}")
    side.text(0, 1, "\n".join(lines), transform=side.transAxes, va="top", ha="left",
              family="monospace", fontsize=7)
    fig.tight_layout()
    _labels(ax, [{"label": str(n)} for n in range(1, rows + 1)], xs, ys, fontsize=7)
    fig.savefig(path)
    plt.close(fig)
    for r in results:
        if r["status"] == "ok":
            r["pareto"] = False
    for i in front:
        points[i][0]["pareto"] = True
