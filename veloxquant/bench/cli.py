"""``veloxquant bench``: memory, quality and speed of every method on one harness."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .._generated.deprecations import CONFIG_FIELD_USERS, CONFIG_FIELDS
from .._generated.validators import validate_field
from ..cache.config import KVCacheConfig
from ..registry import METHODS, implemented_methods
from .tasks import TASKS

# --sweep: the settings each method is run at (besides its defaults).
SWEEPS: dict[str, list[dict]] = {
    "full": [{}],
    "streaming_llm": [{"stream_window_size": w} for w in (124, 252, 508, 1020)],
    "snapkv": [{"snap_budget": b} for b in (128, 256, 512, 1024)],
    "kivi": [{"kv_bits": b} for b in (2, 4, 8)],
}


class BenchError(Exception):
    pass


def add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="memory, quality and speed of every method",
        description=__doc__ + " Default model: the embedded reference model.",
    )
    p.add_argument("--model", default=None, help="mlx-lm model path or hub id (default: the embedded reference model)")
    p.add_argument("--methods", default="all", help="'all' (every implemented method) or m1,m2,...")
    p.add_argument("--context", type=int, default=4096, help="prompt length in tokens (default 4096)")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="an options field (applied to its method) or a config field (applied to all)")
    p.add_argument("--sweep", action="store_true", help="run each method at several settings")
    p.add_argument("--quick", action="store_true", help="a smaller workload (about 3 minutes on 2 CPU cores)")
    p.add_argument("--synthetic", action="store_true", help="no model: attention error on synthetic K/V/Q")
    p.add_argument("--out", default="bench-out", help="folder for results.json and pareto.png")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"],
        help="compute dtype of the model and its KV cache; auto: float32 on the CPU "
             "(MLX's fast CPU path), the model's own dtype on a GPU",
    )
    p.set_defaults(func=cmd_bench)


def select_methods(spec: str) -> list[str]:
    if spec == "all":
        return implemented_methods()
    chosen = [m.strip() for m in spec.split(",") if m.strip()]
    for m in chosen:
        if m not in METHODS:
            import difflib

            close = difflib.get_close_matches(m, METHODS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise BenchError(f"--methods: unknown method {m!r}{hint}")
        if not METHODS[m].implemented:
            raise BenchError(f"--methods: {m!r} has no implementation yet; implemented: "
                             + ", ".join(implemented_methods()))
    return chosen


def method_runs(methods: list[str], assignments: list[str] | None, sweep: bool):
    """The (label, config, settings) to run: the full baseline first, then each method."""
    from ..cli import parse_value
    from .harness import MethodRun

    own, per_field = {}, {}
    for item in assignments or []:
        name, sep, text = item.partition("=")
        if not sep:
            raise BenchError(f"--set expects FIELD=VALUE, got {item!r}")
        (own if name in CONFIG_FIELDS else per_field)[name.strip()] = parse_value(text)
    for name, value in own.items():
        try:
            validate_field(name, value)
        except ValueError as exc:
            raise BenchError(f"--set {exc}") from None
    owners = {f: k for k, m in METHODS.items() for f in m.fields}
    for name in per_field:
        if name not in owners:
            raise BenchError(f"--set: {name!r} is not a field of any method or of the config")
        if owners[name] not in methods:
            raise BenchError(f"--set {name}: it belongs to {owners[name]!r}, which is not benchmarked")
    runs = []
    for method in ["full"] + [m for m in methods if m != "full"]:
        base = {f: v for f, v in per_field.items() if owners[f] == method}
        variants = SWEEPS.get(method, [{}]) if sweep else [{}]
        for variant in variants:
            options = {**base, **{k: v for k, v in variant.items() if k not in CONFIG_FIELDS}}
            top = {**own, **{k: v for k, v in variant.items() if k in CONFIG_FIELDS}}
            try:
                config = KVCacheConfig.from_dict({"method": method, "options": options, **top})
            except (TypeError, ValueError) as exc:
                raise BenchError(f"{method}: {exc}") from None
            used = {**options, **{k: v for k, v in top.items() if method in CONFIG_FIELD_USERS[k]}}
            label = method if not used else method + " " + ",".join(f"{k}={v}" for k, v in used.items())
            runs.append(MethodRun(label if method != "full" else "full", config, settings=used))
    return runs


def workload_settings(args) -> dict:
    if args.quick:  # variable_tracking is left out: the reference model never learned it
        return {"contexts": [min(args.context, 2048)], "examples_per_depth": 1, "depths": (0.25, 0.75),
                "tasks": ("niah_single", "niah_multikey", "kv_lookup"), "continuation": 64,
                "synthetic_decode": 8}
    return {"contexts": sorted({args.context // 2, args.context}), "examples_per_depth": 2,
            "depths": (0.1, 0.3, 0.5, 0.7, 0.9), "tasks": TASKS, "continuation": 256,
            "synthetic_decode": 32}


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from . import report

    console = Console(stderr=True)
    try:
        methods = select_methods(args.methods)
        runs = method_runs(methods, args.set, args.sweep)
    except BenchError as exc:
        console.print(f"veloxquant bench: error: {exc}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = workload_settings(args)
    started = time.perf_counter()
    if args.synthetic:
        results = run_synthetic(runs, args, settings, console)
    else:
        results = run_model(runs, args, settings, console)
    report.add_ratios(results, args.synthetic)
    report.plot(out / "pareto.png", results, args.synthetic)
    payload = {
        "environment": report.environment(args.seed, None if args.synthetic else _model_name(args)),
        "arguments": {k: v for k, v in vars(args).items() if k != "func"},
        "workload": {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()},
        "elapsed_s": time.perf_counter() - started,
        "results": results,
    }
    report.write_json(out / "results.json", payload)
    report.print_table(results, args.synthetic)
    print(f"wrote {out / 'results.json'} and {out / 'pareto.png'} "
          f"({payload['elapsed_s']:.0f} s)")
    return 0 if all(r["status"] == "ok" for r in results) else 1


def _model_name(args) -> str:
    from ..cli import resolve_model

    return resolve_model(args.model)


def run_synthetic(runs, args, settings, console) -> list[dict]:
    from .synthetic import SyntheticSpec, attention_error, make_tensors

    spec = SyntheticSpec(context=args.context if not args.quick else min(args.context, 2048),
                         decode=settings["synthetic_decode"], seed=args.seed)
    tensors = make_tensors(spec)
    results = []
    for run in _progress(console, runs, "synthetic"):
        row = {"label": run.label, "method": run.config.method, "settings": run.settings,
               "config": run.config.to_dict()}
        try:
            row.update(attention_error(run.config, spec, tensors), status="ok")
        except Exception as exc:  # noqa: BLE001 - recorded in the table, the run goes on
            row.update(status="failed", error=f"{type(exc).__name__}: {exc}")
        results.append(row)
    return results


def _progress(console, items, what):
    from rich.progress import Progress

    with Progress(console=console, transient=False) as progress:
        task = progress.add_task(what, total=len(items))
        for item in items:
            progress.update(task, description=f"{what}: {getattr(item, 'label', item)}")
            yield item
            progress.advance(task)


def build_workload(tokenizer, settings: dict, seed: int):
    from .harness import Workload
    from .tasks import load_default_filler, make_examples

    count = lambda s: len(tokenizer.encode(s))  # noqa: E731
    examples = []
    for context in settings["contexts"]:
        for task in settings["tasks"]:
            examples += make_examples(task, settings["examples_per_depth"] * len(settings["depths"]),
                                      context, seed=1234 + seed, depths=settings["depths"],
                                      count_tokens=count)
    text = tokenizer.encode(load_default_filler())
    context = max(settings["contexts"])
    n_cont = settings["continuation"]
    start = (seed * 7919) % max(1, len(text) - context - n_cont)
    window = text[start : start + context + n_cont]
    return Workload(
        retrieval=examples,
        prefix=window[: context - n_cont],
        continuation=window[context - n_cont : context],
    )


def compute_dtype(name: str):
    import mlx.core as mx

    if name == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else None
    return getattr(mx, name)


def run_model(runs, args, settings, console) -> list[dict]:
    import mlx_lm
    from rich.progress import Progress

    from .harness import evaluate

    model, tokenizer = mlx_lm.load(_model_name(args))
    dtype = compute_dtype(args.dtype)
    if dtype is not None:
        model.set_dtype(dtype)
    work = build_workload(tokenizer, settings, args.seed)
    per_method = 1 + len(work.retrieval)
    results, reference = [], None
    with Progress(console=console) as progress:
        bar = progress.add_task("bench", total=per_method * len(runs))
        for run in runs:
            progress.update(bar, description=f"bench: {run.label}")
            done = progress.tasks[0].completed
            result, logprobs = evaluate(model, tokenizer, run, work, reference,
                                        tick=lambda: progress.advance(bar))
            if run.label == "full" and result["status"] == "ok":
                reference = logprobs
            progress.update(bar, completed=done + per_method)
            results.append(result)
    return results
