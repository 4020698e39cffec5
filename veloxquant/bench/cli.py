"""``veloxquant bench``: memory, quality and speed of every method on one harness."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from .._generated.deprecations import CONFIG_FIELD_USERS
from ..cache.config import KVCacheConfig, fields_read_by
from ..cli_common import (CLIError, DTYPE_HELP, DTYPES, build_config, check_method, method_key,
                          parse_assignments)
from ..registry import METHODS, implemented_methods
from .leaderboard import RATIOS as LEADERBOARD_RATIOS
from .ruler import RULER_TASKS
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

# --leaderboard: kvpress reports RULER at 4k; --quick is a short run of the same shape
LEADERBOARD = {"context": 4096, "examples": 10}
LEADERBOARD_QUICK = {"context": 1024, "examples": 2}

DESCRIPTION = """\
Memory, quality and speed of every implemented method (or --methods) on one harness,
each against the full cache in the same run: KV bytes per token (the caches' nbytes),
peak memory, greedy accuracy on long-context retrieval tasks (needle, multi-key needle,
key-value lookup), perplexity, KL divergence and top-1 agreement on held-out text, and
prefill/decode speed as ratios to the full cache's, timed in rounds that alternate the
two. Writes results.json and table.md to --out as each run finishes (marked partial
until the last) and pareto.png at the end; refuses a folder that holds a run's results
unless --force. Default model: the embedded reference model ('reference').
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
             "hub id; default: 'reference', the embedded byte-level reference model; 'reference-subword', the embedded subword one",
    )
    p.add_argument("--methods", default="all",
                   help="'all' (default: every implemented method) or a comma-separated list "
                        "(m1,m2); an eviction method composed with quantized storage is "
                        "METHOD+kiviBITS (snapkv+kivi4: snapkv's kept tokens held by KIVI's "
                        "quantizer at 4 bits); the full cache always runs first, as the "
                        "baseline")
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
    p.add_argument("--leaderboard", action="store_true",
                   help="RULER-style tasks (needles, multi-key, multi-value, variable "
                        "tracking, common words, QA) scored for each method at compression "
                        "ratios of KV bytes (--ratios), each method's main field set to the "
                        "value whose measured bytes come nearest; writes leaderboard.md, "
                        ".json and .png to --out")
    p.add_argument("--ratios", default=",".join(f"{r:g}" for r in LEADERBOARD_RATIOS),
                   help="with --leaderboard: compression ratios, the fraction of the full "
                        "cache's KV bytes removed (default: %(default)s)")
    p.add_argument("--tasks", default=",".join(RULER_TASKS),
                   help="with --leaderboard: comma-separated tasks (default: %(default)s)")
    p.add_argument("--examples", type=int, default=None,
                   help=f"with --leaderboard: examples per task (default: "
                        f"{LEADERBOARD['examples']}, with --quick "
                        f"{LEADERBOARD_QUICK['examples']})")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="with --leaderboard: run the methods in N processes at once, one "
                        "method a process, each into OUT/parts/METHOD, then merge them into "
                        "OUT; a part that finished in an earlier run is reused, so a "
                        "stopped run resumes (default: 1, one process)")
    p.add_argument("--question-after", action="store_true",
                   help="with --leaderboard: kvpress's protocol: each prompt's context is "
                        "prefilled and compressed alone, then eviction stops and the question "
                        "is read and answered (query-agnostic compression); by default the "
                        "whole prompt goes through the cache, as a generate call sends it")
    p.add_argument("--baseline-unscored", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="bench-out", metavar="DIR",
                   help="folder for results.json, table.md and pareto.png "
                        "(default: bench-out)")
    p.add_argument("--force", action="store_true",
                   help="overwrite the results of an earlier run in --out (default: refuse)")
    p.add_argument("--seed", type=int, default=0,
                   help="picks the held-out text window and the task examples, and seeds "
                        "the synthetic tensors (default: 0)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    p.set_defaults(func=cmd_bench)


STORAGE_BITS = (2, 4, 8)  # kv_bits' choices: what METHOD+kiviBITS may name


def composed(name: str) -> tuple[str, int | None]:
    """("snapkv", 4) for "snapkv+kivi4"; (name, None) for a plain method key."""
    if "+" not in name:
        return name, None
    base, _, storage = name.partition("+")
    bits = storage.removeprefix("kivi")
    if not storage.startswith("kivi") or not bits.isdigit() or int(bits) not in STORAGE_BITS:
        raise BenchError(f"--methods {name}: the storage after '+' is kivi<bits>; allowed bits: "
                         f"{', '.join(map(str, STORAGE_BITS))} (e.g. {base}+kivi4)")
    return base, int(bits)


def select_methods(spec: str) -> list[str]:
    if spec == "all":
        return implemented_methods()
    chosen = []
    for m in (m.strip() for m in spec.split(",") if m.strip()):
        base, bits = composed(m)
        base = method_key(base)
        try:
            check_method(base)
        except CLIError as exc:
            raise BenchError(f"--methods: {exc}") from None
        if bits is not None and METHODS[base].family != "eviction":
            raise BenchError(f"--methods {m}: storage holds an eviction method's kept tokens; "
                             f"{base} is a {METHODS[base].family} method")
        chosen.append(base if bits is None else f"{base}+kivi{bits}")
    return chosen


def settings_of(config) -> dict:
    """The effective value of every field the config's method (and its storage) reads."""
    settings = {name: getattr(config, name) for name in fields_read_by(config.method)}
    if config.storage is not None:
        settings.update(kv_bits=config.kv_bits, kivi_group_size=config.storage.kivi_group_size)
    return settings


def method_runs(methods: list[str], assignments: list[str] | None, sweep: bool):
    """The runs: the full baseline first, then each method at its defaults (or --set), or
    at each value of its spec's sweeps."""
    from .harness import MethodRun

    own, per_field = parse_assignments(assignments)
    runs_methods = ["full"] + [m for m in methods if m != "full"]
    bases = [composed(m)[0] for m in runs_methods]
    owners = {f: k for k, m in METHODS.items() for f in m.fields}
    for name in per_field:
        if name not in owners:
            raise BenchError(f"--set {name}: not a field of any method or of the config")
        if owners[name] not in bases:
            raise BenchError(f"--set {name}: a field of {owners[name]}, which is not benchmarked")
    for name in own:
        if not any(m in CONFIG_FIELD_USERS[name] for m in bases):
            readers = ", ".join(CONFIG_FIELD_USERS[name]) or "no method"
            raise BenchError(f"--set {name}: none of the benchmarked methods reads it "
                             f"(read by: {readers})")
    runs = []
    for key in runs_methods:
        method, bits = composed(key)
        base_own = {f: v for f, v in own.items() if method in CONFIG_FIELD_USERS[f]}
        base_options = {f: v for f, v in per_field.items() if owners[f] == method}
        variants = [{f: v} for f, values in METHODS[method].sweeps for v in values] if sweep else []
        for variant in variants or [{}]:
            top = {**base_own, **{k: v for k, v in variant.items() if k in CONFIG_FIELD_USERS}}
            options = {**base_options, **{k: v for k, v in variant.items() if k not in top}}
            try:
                config = build_config(method, top, options)
                if bits is not None:  # kv_bits is the storage's, not the method's
                    config = KVCacheConfig.from_dict({**config.to_dict(), "kv_bits": bits,
                                                      "storage": {"method": "kivi", "options": {}}})
            except (CLIError, ValueError, TypeError) as exc:
                raise BenchError(str(exc)) from None
            chosen = {**base_own, **base_options, **variant}
            label = key + "".join(f" {k}={v}" for k, v in chosen.items())
            runs.append(MethodRun(label, config, settings=settings_of(config)))
    return runs


#: the tasks of the default workload: variable_tracking is left out, as the reference
#: model never learned it (the full cache scores 0.750 on it, so it tells methods apart by
#: noise); make_examples still builds it for other models
DEFAULT_TASKS = tuple(t for t in TASKS if t != "variable_tracking")


def workload_settings(args) -> dict:
    if args.quick:
        return {"contexts": [args.context], **{k: v for k, v in QUICK.items() if k != "context"}}
    return {"contexts": sorted({args.context // 2, args.context}), "examples_per_depth": 2,
            "depths": (0.1, 0.3, 0.5, 0.7, 0.9), "tasks": DEFAULT_TASKS, "continuation": 256,
            "synthetic_decode": 32}


def output_folder(args) -> Path:
    """--out, created; refused where it holds an earlier run's results, unless --force."""
    out = Path(args.out)
    if (out / "results.json").exists() and not args.force:
        raise BenchError(f"--out {out}: already holds the results of a run "
                         f"({out / 'results.json'}); choose another folder or pass --force "
                         "to overwrite them")
    out.mkdir(parents=True, exist_ok=True)
    return out


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..cli_common import resolve_model
    from . import report

    if args.leaderboard:
        return cmd_leaderboard(args)
    if args.question_after:
        raise BenchError("--question-after is a protocol of --leaderboard; add --leaderboard or drop it")
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
    out = output_folder(args)
    settings = workload_settings(args)
    started = time.perf_counter()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    title = report.title(model_name, args.context, date, args.synthetic)
    results: list[dict] = []

    def save(partial: bool) -> dict:
        """results.json and table.md as they stand: written after every finished run, so
        that an interrupted bench keeps what it measured, marked partial."""
        report.add_ratios(results, args.synthetic)
        payload = {
            "environment": report.environment(args.seed, model_name),
            "date": date,
            "arguments": {k: v for k, v in vars(args).items() if k != "func"},
            "workload": {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()},
            "elapsed_s": time.perf_counter() - started,
            "partial": partial,
            "runs_finished": len(results),
            "runs_planned": len(runs),
            "results": results,
        }
        shown = title + (f" (PARTIAL: {len(results)} of {len(runs)} runs)" if partial else "")
        report.write_json(out / "results.json", payload)
        (out / "table.md").write_text(report.markdown_report(results, args.synthetic, shown))
        return payload

    def finished(result: dict) -> None:
        results.append(result)
        save(partial=True)

    save(partial=True)  # an earlier run's results never stand for this one's
    try:
        if args.synthetic:
            run_synthetic(runs, args, settings, console, finished)
        else:
            run_model(runs, args, settings, console, model_name, finished)
    except KeyboardInterrupt:
        print(f"veloxquant bench: interrupted after {len(results)} of {len(runs)} runs; "
              f"their results are in {out / 'results.json'} and {out / 'table.md'}, "
              "marked partial", file=sys.stderr)
        raise
    report.add_ratios(results, args.synthetic)
    report.plot(out / "pareto.png", results, args.synthetic, title)
    payload = save(partial=False)
    report.print_table(results, args.synthetic, title=title)
    print(f"wrote {out / 'results.json'}, {out / 'table.md'} and {out / 'pareto.png'} "
          f"({payload['elapsed_s']:.0f} s)")
    return 0 if all(r["status"] == "ok" for r in results) else 1


def _floats(text: str, what: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"{what} {text}: comma-separated numbers, e.g. 0.25,0.5") from None
    if not values or not all(0 <= v < 1 for v in values):
        raise BenchError(f"{what} {text}: each ratio is in [0, 1)")
    return values


def cmd_leaderboard(args: argparse.Namespace) -> int:
    import shlex

    from rich.console import Console

    from ..cli_common import compute_dtype, load_model, resolve_model
    from . import leaderboard, report

    for flag in ("synthetic", "sweep", "set"):
        if getattr(args, flag):
            raise BenchError(f"--leaderboard sets each method's main field itself; drop "
                             f"--{flag}")
    ratios = _floats(args.ratios, "--ratios")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in RULER_TASKS]
    if unknown or not tasks:
        raise BenchError(f"--tasks {args.tasks}: choose from {', '.join(RULER_TASKS)}")
    shape = LEADERBOARD_QUICK if args.quick else LEADERBOARD
    context = args.context or shape["context"]
    examples = args.examples or shape["examples"]
    if context < 256:
        raise BenchError(f"--leaderboard needs --context of at least 256 tokens, got {context}")
    methods = ["full"] + [m for m in select_methods(args.methods) if m != "full"]
    if args.jobs < 1:
        raise BenchError(f"--jobs {args.jobs}: at least 1 process")
    model_name = resolve_model(args.model)
    out = Path(args.out)
    if args.jobs > 1:
        return leaderboard_in_parts(args, methods, ratios, tasks, context, examples, out)
    if (out / "leaderboard.json").exists() and not args.force:
        raise BenchError(f"--out {out}: already holds a leaderboard ({out / 'leaderboard.json'});"
                         " choose another folder or pass --force to overwrite it")
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer, _ = load_model(args.model)
    dtype = compute_dtype(args.dtype)
    if dtype is not None:
        model.set_dtype(dtype)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    title = "leaderboard: " + report.title(model_name, context, date, False).removeprefix(
        "veloxquant bench: ") + f", {examples} examples a task" + (
        ", question after compression (kvpress's protocol)" if args.question_after else "")
    command = shlex.join(["veloxquant", "bench", "--leaderboard", "--methods",
                          ",".join(methods[1:]) or "full",
                          *leaderboard_settings(args, ratios, tasks, context, examples),
                          "--out", str(out)])
    started = time.perf_counter()
    payload = {"environment": report.environment(args.seed, model_name), "date": date,
               "context": context, "ratios": ratios, "tasks": tasks, "seed": args.seed,
               "title": title, "question_after": bool(args.question_after),
               "examples_per_task": examples, "command": command}

    def save(rows, partial: bool):
        leaderboard.write(out, {**payload, "partial": partial,
                                "elapsed_s": time.perf_counter() - started}, rows, tasks,
                          title + (" (PARTIAL)" if partial else ""), command)

    try:
        prompts = leaderboard.make_examples(tokenizer, tasks, examples, context, args.seed)
    except ValueError as exc:
        raise BenchError(f"--context {context}: {exc}") from None
    progress = RunProgress(Console(stderr=True), "leaderboard",
                           1 + (len(methods) - 1) * len(ratios),
                           ticks_per_run=examples * len(tasks))
    try:
        result = leaderboard.run_leaderboard(
            model, tokenizer, methods, ratios, tasks, prompts, context, args.seed,
            progress=progress, on_row=lambda rows: save(rows, partial=True),
            score_full=not args.baseline_unscored,
            on_full=lambda nbytes, tokens: payload.update(full_bytes=nbytes, probe_tokens=tokens),
            question_after=args.question_after)
    finally:
        progress.close()
    payload.update(full_bytes=result["full_bytes"], probe_tokens=result["probe_tokens"],
                   outputs=result["outputs"])
    save(result["rows"], partial=False)
    leaderboard.plot(out / "leaderboard.png", result["rows"], title)
    print((out / "leaderboard.md").read_text())
    print(f"wrote {out / 'leaderboard.md'}, {out / 'leaderboard.json'} and "
          f"{out / 'leaderboard.png'} ({time.perf_counter() - started:.0f} s)")
    return 0 if all(r.status in ("ok", "not scored") for r in result["rows"]) else 1


def leaderboard_settings(args, ratios, tasks, context: int, examples: int) -> list[str]:
    """A leaderboard's settings as arguments, in its recorded command's order: the line
    reruns it whatever the defaults become, and a ``--jobs`` part is reused only when its
    recorded command has them."""
    return (["--ratios", ",".join(f"{r:g}" for r in ratios), "--tasks", ",".join(tasks),
             "--context", str(context), "--examples", str(examples), "--seed", str(args.seed),
             "--dtype", args.dtype]
            + ([] if args.model in (None, "reference") else ["--model", args.model])
            + (["--question-after"] if args.question_after else []))


def leaderboard_in_parts(args, methods, ratios, tasks, context, examples, out: Path) -> int:
    """``--jobs N``: each method a ``veloxquant bench --leaderboard`` process of its own
    (the baseline's scores in one part, the others measure its bytes only), N at a time,
    then one table, plot and JSON merged from the parts."""
    import json
    import shlex
    import subprocess

    if (out / "leaderboard.json").exists() and not args.force:
        raise BenchError(f"--out {out}: already holds a leaderboard ({out / 'leaderboard.json'});"
                         " choose another folder or pass --force to overwrite it")
    parts_dir = out / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    shared = leaderboard_settings(args, ratios, tasks, context, examples)

    def finished(key: str) -> bool:
        """The part ran to its end with this run's settings (its command says which)."""
        folder = parts_dir / key
        own = shlex.join(["veloxquant", "bench", "--leaderboard", "--methods", key, *shared,
                          "--out", str(folder)])
        try:
            data = json.loads((folder / "leaderboard.json").read_text())
            return not data["partial"] and data["command"] == own
        except (OSError, ValueError, KeyError):
            return False

    waiting = [m for m in methods if not finished(m)]
    reused = [m for m in methods if m not in waiting]
    if reused:
        print(f"leaderboard: reusing the finished parts of {', '.join(reused)}", file=sys.stderr)
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    started, done, interrupted = time.perf_counter(), len(reused), False

    previous = signal.signal(signal.SIGTERM, stop_once)
    try:
        while waiting or running:
            while waiting and len(running) < args.jobs:
                key = waiting.pop(0)
                folder = parts_dir / key
                folder.mkdir(exist_ok=True)
                (folder / STOPPED).unlink(missing_ok=True)
                argv = (["bench", "--leaderboard", "--methods", key, *shared, "--out",
                         str(folder), "--force"]
                        + ([] if key == "full" else ["--baseline-unscored"]))
                with open(folder / "log.txt", "w") as log:
                    running[key] = (subprocess.Popen(
                        [sys.executable, "-c", "import sys; from veloxquant_mlx.cli import "
                         "main; sys.exit(main(sys.argv[1:]))", *argv],
                        stdout=log, stderr=subprocess.STDOUT), time.perf_counter())
            time.sleep(0.5)
            for key, (proc, t0) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[key]
                done += 1
                state = "done"
                if not finished(key):  # said in its log and, by _merged_parts, in the table
                    ended = process_end(proc.returncode)
                    (parts_dir / key / STOPPED).write_text(ended)
                    with open(parts_dir / key / "log.txt", "a") as log:
                        log.write(f"leaderboard: the process ended unfinished: {ended}\n")
                    state = f"stopped ({ended}; see {parts_dir / key / 'log.txt'})"
                print(f"leaderboard [{done}/{len(methods)}] {key}: {state} in "
                      f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print(f"leaderboard: interrupted; merging what the parts in {parts_dir} hold, "
              "marked partial (rerun the same command to resume)", file=sys.stderr)
    finally:
        for proc, _ in running.values():
            proc.terminate()
        for proc, _ in running.values():
            proc.wait()
    try:
        return _merged_parts(args, methods, ratios, tasks, context, out, parts_dir, shared, started,
                             interrupted)
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_once(signum, frame):
    """SIGTERM while ``--jobs`` parts run (``timeout``'s): stop as Ctrl-C does, once. Later
    TERMs are ignored until the merge is written: ``timeout`` signals the process and then
    its process group, and a second TERM inside the ``except`` cut the merge short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


STOPPED = "stopped.txt"  # a part's process ended before its part did: how (``process_end``)


def process_end(returncode: int) -> str:
    """How a process ended, in words: ``exit 1``, ``killed by SIGSEGV``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


def _stopped_rows(key: str, part: dict | None, ratios, ended: str, log: Path) -> list:
    """Failed rows for the targets a part whose process ended unfinished had not reached."""
    from .leaderboard import Row

    reached = {r["target"] for r in (part or {}).get("rows", []) if r["method"] == key}
    return [Row(method=key, target=t, ratio=float("nan"), field=None, value=None,
                bytes_per_token=float("nan"), status="failed",
                error=f"its process ended unfinished ({ended}; see {log})")
            for t in ratios if t not in reached]


def _merged_parts(args, methods, ratios, tasks, context, out, parts_dir, shared, started,
                  interrupted) -> int:
    """The parts' leaderboard, table and plot in ``out`` (``leaderboard_in_parts``); a part
    whose process ended unfinished gives failed rows for the ratios it had not reached."""
    import json
    import shlex

    from . import leaderboard

    parts, stopped = [], []
    for key in methods:
        part = None
        try:
            part = json.loads((parts_dir / key / "leaderboard.json").read_text())
            parts.append(part)
        except (OSError, ValueError):
            print(f"leaderboard: {key} left no results (see {parts_dir / key / 'log.txt'})",
                  file=sys.stderr)
        if key != "full" and (parts_dir / key / STOPPED).exists():
            ended = (parts_dir / key / STOPPED).read_text()
            stopped += _stopped_rows(key, part, ratios, ended, parts_dir / key / "log.txt")
    try:
        payload, rows = leaderboard.merge(parts)
    except ValueError as exc:
        raise BenchError(f"--jobs: the parts in {parts_dir} do not merge: {exc}") from None
    order = {m: i for i, m in enumerate(methods)}
    rows = [rows[0]] + sorted(rows[1:] + stopped, key=lambda r: (order.get(r.method, len(order)),
                                                                  r.target if r.target is not None else -1))
    command = shlex.join(["veloxquant", "bench", "--leaderboard", "--methods",
                          ",".join(methods[1:]) or "full", *shared, "--jobs", str(args.jobs),
                          "--out", str(out)])
    payload.update(command=command, elapsed_s=time.perf_counter() - started,
                   parts=[str(parts_dir / m) for m in methods])
    payload["partial"] = payload["partial"] or interrupted or len(parts) < len(methods)
    title = payload.get("title", f"leaderboard at {context} tokens") + (
        " (PARTIAL)" if payload["partial"] else "")
    leaderboard.write(out, payload, rows, tasks, title, command)
    leaderboard.plot(out / "leaderboard.png", rows, title)
    print((out / "leaderboard.md").read_text())
    print(f"wrote {out / 'leaderboard.md'}, {out / 'leaderboard.json'} and "
          f"{out / 'leaderboard.png'} from {len(parts)} parts "
          f"({time.perf_counter() - started:.0f} s)")
    if interrupted:
        return 130
    return 0 if len(parts) == len(methods) and all(r.status == "ok" for r in rows) else 1


def run_synthetic(runs, args, settings, console, finished) -> None:
    """Each run's row, handed to ``finished`` as it completes."""
    from .synthetic import SyntheticSpec, attention_error, make_tensors

    spec = SyntheticSpec(context=args.context, decode=settings["synthetic_decode"], seed=args.seed)
    tensors = make_tensors(spec)
    progress = RunProgress(console, "synthetic", len(runs), ticks_per_run=1)
    try:
        for run in runs:
            progress.start(run.label)
            started = time.perf_counter()
            row = {"label": run.label, "method": run.method, "settings": run.settings,
                   "config": report_config(run.config)}
            try:
                row.update(attention_error(run.config, spec, tensors), status="ok")
            except Exception as exc:  # noqa: BLE001 - recorded in the table, the run goes on
                row.update(status="failed", error=f"{type(exc).__name__}: {exc}")
            row["elapsed_s"] = time.perf_counter() - started
            progress.finish(row)
            finished(row)
    finally:
        progress.close()


def report_config(config) -> dict:
    """The config as results.json records it: only the fields its method reads."""
    data = config.to_dict()
    stored = ("storage", "kv_bits") if config.storage is not None else ()
    return {k: v for k, v in data.items()
            if k in ("method", "options", *stored) or config.method in CONFIG_FIELD_USERS.get(k, ())}


class RunProgress:
    """Progress over the runs: rich's bar on a terminal; elsewhere (a log, a pipe), where
    that bar shows nothing until the end, one plain line as each run starts and ends."""

    def __init__(self, console, what: str, runs: int, ticks_per_run: int):
        self.console, self.what, self.runs, self.per_run = console, what, runs, ticks_per_run
        self.index, self.started = 0, 0.0
        self.bar = None
        if console.is_terminal:
            from rich.progress import Progress

            self.bar = Progress(console=console, transient=False)
            self.bar.start()
            self.task = self.bar.add_task(what, total=runs * ticks_per_run)

    def start(self, label: str) -> None:
        self.index += 1
        self.started = time.perf_counter()
        if self.bar is not None:
            self.bar.update(self.task, description=f"{self.what}: {label}")
        else:
            print(f"{self.what} [{self.index}/{self.runs}] {label}: started", file=sys.stderr,
                  flush=True)

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.task)

    def finish(self, result: dict) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=self.index * self.per_run)
            return
        status = result["status"] + (f" ({result['error']})" if result.get("error") else "")
        print(f"{self.what} [{self.index}/{self.runs}] {result['label']}: {status} in "
              f"{time.perf_counter() - self.started:.1f} s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


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


def run_model(runs, args, settings, console, model_name, finished) -> None:
    """Each run's result, handed to ``finished`` as it completes; the full cache first."""
    from ..cli_common import compute_dtype, load_model
    from .harness import evaluate, interleaved_speed

    model, tokenizer, _ = load_model(args.model)
    dtype = compute_dtype(args.dtype)
    if dtype is not None:
        model.set_dtype(dtype)
    work = build_workload(tokenizer, settings, args.seed)
    progress = RunProgress(console, "bench", len(runs), ticks_per_run=1 + len(work.retrieval))
    reference, baseline = None, None
    try:
        for run in runs:
            progress.start(run.label)
            started, cpu = time.perf_counter(), time.process_time()
            result, logprobs = evaluate(model, tokenizer, run, work, reference,
                                        tick=progress.tick)
            result["config"] = report_config(run.config)
            if run.label == "full" and result["status"] == "ok":
                reference, baseline = logprobs, run
            elif baseline is not None and result["status"] == "ok":
                try:
                    result["speed_rounds"] = interleaved_speed(model, run, baseline, work,
                                                               tokenizer)
                except Exception as exc:  # noqa: BLE001 - the other figures stand
                    result["speed_error"] = f"{type(exc).__name__}: {exc}"
            # Wall time, and CPU time of all threads: on a shared machine the second
            # tells what the run costs.
            result["elapsed_s"] = time.perf_counter() - started
            result["cpu_s"] = time.process_time() - cpu
            progress.finish(result)
            finished(result)
    finally:
        progress.close()

