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
            "peak_memory": m["peak_bytes"] / b["peak_bytes"],
            "prefill_speed": m["prefill_tokens_per_s"] / b["prefill_tokens_per_s"],
            "decode_speed": m["decode_tokens_per_s"] / b["decode_tokens_per_s"],
        }


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
            f(ratios.get("prefill_speed"), ".2f") + "x",
            f(ratios.get("decode_speed"), ".2f") + "x",
            "ok",
        ])
    return head, rows


def _settings(r: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in r.get("settings", {}).items()) or "defaults"


def print_table(results: list[dict], synthetic: bool, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    head, rows = table_rows(results, synthetic)
    table = Table(title="veloxquant bench" + (" (synthetic)" if synthetic else ""))
    for i, h in enumerate(head):
        table.add_column(h, justify="left" if i < 2 or h == "status" else "right", no_wrap=i < 2)
    for row in rows:
        table.add_row(*row)
    if console is None:  # piped output: wide enough that no column is cut
        console = Console(width=None if sys.stdout.isatty() else 170)
    console.print(table)
    if not synthetic:
        print(
            "bytes/tok: KV bytes kept per token after decoding (all layers); vs full, peak,\n"
            "prefill, decode: ratios to the full cache in this run; retrieval: accuracy on\n"
            "the long-context tasks; ppl, KL (nats), top-1: over held-out text, against\n"
            "the full cache's next-token distributions."
        )


def markdown_table(results: list[dict], synthetic: bool) -> str:
    head, rows = table_rows(results, synthetic)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")


def plot(path: Path, results: list[dict], synthetic: bool) -> None:
    """Quality against bytes per token; the Pareto frontier drawn and its points ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r["status"] == "ok"]
    if synthetic:  # lower error is better: the frontier is taken on -error
        xs = [r["bytes_per_token"] for r in ok]
        ys = [r["relative_error_mean"] for r in ok]
        quality = [-y for y in ys]
        ylabel = "attention relative error vs exact (lower is better)"
    else:
        xs = [r["memory_speed"]["bytes_per_token_decode"] for r in ok]
        ys = quality = [r["retrieval"]["accuracy"] for r in ok]
        ylabel = "retrieval accuracy (higher is better)"
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    ax.scatter(xs, ys, color="tab:blue", zorder=3)
    for r, x, y in zip(ok, xs, ys):
        ax.annotate(r["label"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    front = pareto_front(list(zip(xs, quality)))
    if front:
        ax.plot([xs[i] for i in front], [ys[i] for i in front], "--", color="tab:red",
                label="Pareto frontier", zorder=2)
        ax.scatter([xs[i] for i in front], [ys[i] for i in front], s=120,
                   facecolors="none", edgecolors="tab:red", zorder=4)
        ax.legend()
    ax.set_xscale("log")
    if synthetic:
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_ylim(bottom=0)
    ax.set_xlabel("KV bytes per token (measured nbytes, all layers)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    for r in ok:
        r["pareto"] = False
    for i in front:
        ok[i]["pareto"] = True
