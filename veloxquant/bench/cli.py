"""``veloxquant bench``: memory, quality and speed of every method on one harness."""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone
from pathlib import Path

from .._generated.deprecations import CONFIG_FIELD_USERS
from ..cache.config import fields_read_by
from ..cli_common import CLIError, DTYPE_HELP, DTYPES, build_config, check_method, parse_assignments
from ..registry import METHODS, implemented_methods
from .tasks import TASKS

DEFAULT_CONTEXT = 4096
# --quick: a median of 6 CPU-seconds a method (reference model, float32; 38 methods and
# the baseline took 223 s on 2 cores, benchmarks/results/bench-quick.md). 1,024 tokens is the shortest context at which
# the eviction methods' default budgets (512) still evict half of it.
QUICK = {
    "context": 1024,
    "tasks": ("niah_single", "niah_multikey", "kv_lookup"),
    "depths": (0.5,),
    "examples_per_depth": 1,
    "continuation": 32,
    "synthetic_decode": 8,
}

DESCRIPTION = """\
Memory, quality and speed of every implemented method (or --methods) on one harness,
each against the full cache in the same run: KV bytes per token (the caches' nbytes),
peak memory, greedy accuracy on long-context retrieval tasks (needle, multi-key needle,
key-value lookup, variable tracking), perplexity, KL divergence and top-1 agreement on
held-out text, and prefill/decode speed as ratios. Writes results.json, table.md and
pareto.png to --out. Default model: the embedded reference model ('reference').
--synthetic needs no model: it measures each method's attention error on synthetic
K/V/Q."""


class BenchError(CLIError):
    """A user error of ``veloxquant bench``: one line, exit status 2."""


def add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="memory, quality and speed of every method against the full cache",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", default=None, metavar="PATH|HUB_ID",
        help="a local mlx-lm model folder (config.json + *.safetensors) or a Hugging Face "
             "hub id; default: 'reference', the embedded reference model",
    )
    p.add_argument("--methods", default="all",
                   help="'all' (default: every implemented method) or a comma-separated list "
                        "(m1,m2); the full cache always runs first, as the baseline")
    p.add_argument("--context", type=int, default=None,
                   help=f"prompt length in tokens (default: {DEFAULT_CONTEXT}, with "
                        f"--quick {QUICK['context']}); the full run also uses half of it")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="an options field (applied to the method that has it) or a config "
                        "field (applied to the benchmarked methods that read it); "
                        "repeatable")
    p.add_argument("--sweep", action="store_true",
                   help="run each method at every setting its spec lists under sweep: "
                        "(one field at a time); a method without one runs at its defaults")
    p.add_argument(
        "--quick", action="store_true",
        help=f"a bounded workload, one setting per method, a few seconds a method on 2 "
             f"CPU cores: context {QUICK['context']} tokens, one example each of "
             f"{', '.join(QUICK['tasks'])} (needle at depth {QUICK['depths'][0]}), "
             f"{QUICK['continuation']} held-out tokens for perplexity, KL and top-1",
    )
    p.add_argument("--synthetic", action="store_true",
                   help="no model: each method's attention error on synthetic K/V/Q "
                        "against exact attention")
    p.add_argument("--out", default="bench-out", metavar="DIR",
                   help="folder for results.json, table.md and pareto.png "
                        "(default: bench-out)")
    p.add_argument("--seed", type=int, default=0,
                   help="picks the held-out text window and the task examples, and seeds "
                        "the synthetic tensors (default: 0)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    p.set_defaults(func=cmd_bench)


def select_methods(spec: str) -> list[str]:
    if spec == "all":
        return implemented_methods()
    chosen = [m.strip() for m in spec.split(",") if m.strip()]
    for m in chosen:
        try:
            check_method(m)
        except CLIError as exc:
            raise BenchError(f"--methods: {exc}") from None
    return chosen


def settings_of(config) -> dict:
    """The effective value of every field the config's method reads."""
    return {name: getattr(config, name) for name in fields_read_by(config.method)}


def method_runs(methods: list[str], assignments: list[str] | None, sweep: bool):
    """The runs: the full baseline first, then each method at its defaults (or --set), or
    at each value of its spec's sweeps."""
    from .harness import MethodRun

    own, per_field = parse_assignments(assignments)
    runs_methods = ["full"] + [m for m in methods if m != "full"]
    owners = {f: k for k, m in METHODS.items() for f in m.fields}
    for name in per_field:
        if name not in owners:
            raise BenchError(f"--set {name}: not a field of any method or of the config")
        if owners[name] not in runs_methods:
            raise BenchError(f"--set {name}: a field of {owners[name]}, which is not benchmarked")
    for name in own:
        if not any(m in CONFIG_FIELD_USERS[name] for m in runs_methods):
            readers = ", ".join(CONFIG_FIELD_USERS[name]) or "no method"
            raise BenchError(f"--set {name}: none of the benchmarked methods reads it "
                             f"(read by: {readers})")
    runs = []
    for method in runs_methods:
        base_own = {f: v for f, v in own.items() if method in CONFIG_FIELD_USERS[f]}
        base_options = {f: v for f, v in per_field.items() if owners[f] == method}
        variants = [{f: v} for f, values in METHODS[method].sweeps for v in values] if sweep else []
        for variant in variants or [{}]:
            top = {**base_own, **{k: v for k, v in variant.items() if k in CONFIG_FIELD_USERS}}
            options = {**base_options, **{k: v for k, v in variant.items() if k not in top}}
            try:
                config = build_config(method, top, options)
            except CLIError as exc:
                raise BenchError(str(exc)) from None
            chosen = {**base_own, **base_options, **variant}
            label = method + "".join(f" {k}={v}" for k, v in chosen.items())
            runs.append(MethodRun(label, config, settings=settings_of(config)))
    return runs


def workload_settings(args) -> dict:
    if args.quick:  # variable_tracking is left out: the reference model never learned it
        return {"contexts": [args.context], **{k: v for k, v in QUICK.items() if k != "context"}}
    return {"contexts": sorted({args.context // 2, args.context}), "examples_per_depth": 2,
            "depths": (0.1, 0.3, 0.5, 0.7, 0.9), "tasks": TASKS, "continuation": 256,
            "synthetic_decode": 32}


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..cli_common import resolve_model
    from . import report

    if args.quick and args.sweep:
        raise BenchError("--quick runs one setting per method; drop --sweep or --quick")
    if args.context is None:
        args.context = QUICK["context"] if args.quick else DEFAULT_CONTEXT
    if args.context < 64:
        raise BenchError(f"--context must be at least 64 tokens, got {args.context}")
    methods = select_methods(args.methods)
    runs = method_runs(methods, args.set, args.sweep)
    model_name = None if args.synthetic else resolve_model(args.model)
    console = Console(stderr=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = workload_settings(args)
    started = time.perf_counter()
    if args.synthetic:
        results = run_synthetic(runs, args, settings, console)
    else:
        results = run_model(runs, args, settings, console, model_name)
    report.add_ratios(results, args.synthetic)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    title = report.title(model_name, args.context, date, args.synthetic)
    report.plot(out / "pareto.png", results, args.synthetic, title)
    payload = {
        "environment": report.environment(args.seed, model_name),
        "date": date,
        "arguments": {k: v for k, v in vars(args).items() if k != "func"},
        "workload": {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()},
        "elapsed_s": time.perf_counter() - started,
        "results": results,
    }
    report.write_json(out / "results.json", payload)
    (out / "table.md").write_text(report.markdown_report(results, args.synthetic, title))
    report.print_table(results, args.synthetic, title=title)
    print(f"wrote {out / 'results.json'}, {out / 'table.md'} and {out / 'pareto.png'} "
          f"({payload['elapsed_s']:.0f} s)")
    return 0 if all(r["status"] == "ok" for r in results) else 1


def run_synthetic(runs, args, settings, console) -> list[dict]:
    from .synthetic import SyntheticSpec, attention_error, make_tensors

    spec = SyntheticSpec(context=args.context, decode=settings["synthetic_decode"], seed=args.seed)
    tensors = make_tensors(spec)
    results = []
    for run in _progress(console, runs, "synthetic"):
        started = time.perf_counter()
        row = {"label": run.label, "method": run.config.method, "settings": run.settings,
               "config": report_config(run.config)}
        try:
            row.update(attention_error(run.config, spec, tensors), status="ok")
        except Exception as exc:  # noqa: BLE001 - recorded in the table, the run goes on
            row.update(status="failed", error=f"{type(exc).__name__}: {exc}")
        row["elapsed_s"] = time.perf_counter() - started
        results.append(row)
    return results


def report_config(config) -> dict:
    """The config as results.json records it: only the fields its method reads."""
    data = config.to_dict()
    return {k: v for k, v in data.items()
            if k in ("method", "options") or config.method in CONFIG_FIELD_USERS.get(k, ())}


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


def run_model(runs, args, settings, console, model_name) -> list[dict]:
    from rich.progress import Progress

    from ..cli_common import compute_dtype, load_model
    from .harness import evaluate

    model, tokenizer, _ = load_model(args.model)
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
            started, cpu = time.perf_counter(), time.process_time()
            result, logprobs = evaluate(model, tokenizer, run, work, reference,
                                        tick=lambda: progress.advance(bar))
            result["config"] = report_config(run.config)
            # Wall time, and CPU time of all threads: on a shared machine the second
            # tells what the run costs.
            result["elapsed_s"] = time.perf_counter() - started
            result["cpu_s"] = time.process_time() - cpu
            if run.label == "full" and result["status"] == "ok":
                reference = logprobs
            progress.update(bar, completed=done + per_method)
            results.append(result)
    return results

