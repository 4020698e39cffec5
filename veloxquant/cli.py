"""The ``veloxquant`` command line: methods, generate, serve, calibrate, bench (see bench/cli.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .cache.config import KVCacheConfig
from .cli_common import (
    DTYPE_HELP,
    DTYPES,
    CLIError,
    build_config,
    check_method,
    compute_dtype,
    method_key,
    config_from_args,
    load_model,
    parse_assignments,
    resolve_model,
)
from .reference import REFERENCE_MODEL
from .registry import METHODS

# A status note that starts so says the method saves no memory (or none over a simpler
# method) at its defaults; `veloxquant methods` lists those notes under the table.
NO_SAVING_NOTE = "Saves no"


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
    caveats = [(key, info.status_note) for key, info in METHODS.items()
               if (info.status_note or "").startswith(NO_SAVING_NOTE)]
    if caveats:
        print("\nNo memory saved at the defaults, or none over a simpler method (status notes):")
        for key, note in caveats:
            print(f"  {key}: {note.split('; ')[0].split('. ')[0]}")
    return 0


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise CLIError(f"{name} must be at least 1, got {value}")


def full_cache_bytes(model, caches: list, tokens: int) -> tuple[int, int, str]:
    """What mlx-lm's own caches would keep for ``tokens`` tokens: (bytes, bytes per token,
    the K/V dtype).

    One token through the model's native caches gives each KVCache layer's row size (K
    and V: kv heads x head_dim x dtype size); a KVCache holding ``tokens`` rows keeps
    exactly ``tokens`` of them (its 256-row allocation steps are left out: kept rows
    against kept rows). A layer the method leaves to its native cache (sliding window,
    state space) counts that cache's own bytes on both sides.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    probe = make_prompt_cache(model)
    model(mx.array([[0]]), cache=probe)
    per_token, total, dtype = 0, 0, "?"
    for native, ours in zip(probe, caches):
        if type(native) is KVCache:
            row = native.keys[..., :1, :].nbytes + native.values[..., :1, :].nbytes
            per_token += row
            total += row * tokens
            dtype = str(native.keys.dtype).removeprefix("mlx.core.")
        else:
            total += ours.nbytes
    return total, per_token, dtype


def more_than_full_note(method: str, kept: int, baseline: int, tokens: int) -> str | None:
    """One line when ``method`` holds more bytes than the full cache's rows (None otherwise,
    and for ``full`` itself, the baseline)."""
    if method == "full" or kept <= baseline:
        return None
    note = METHODS[method].status_note or ""
    why = (note.split("; ")[0].split(". ")[0] if note.startswith(NO_SAVING_NOTE) else
           f"at {tokens} tokens its fixed costs (full-precision rows, room for the next rows, "
           f"per-token side tables) outweigh what it compresses; it saves memory on longer contexts")
    return (f"[kv cache] note: {method} holds MORE than the full cache here "
            f"({kept / max(1, baseline):.2f}x its bytes): {why}")


def _max_positions(model_config: dict) -> tuple[str, int] | None:
    """(config key, positions) the model was built for, when its config says."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        if isinstance(model_config.get(key), int):
            return key, model_config[key]
    return None


# kvzip's prefill in steps this small: Ctrl-C acts between them (a step of the pass itself
# is one probe chunk of the method's, evaluated whole)
RECONSTRUCTION_PREFILL_STEP = 512


def _reconstruction_progress(method: str, tokens: int):
    """A progress callback for ``prefill_with_reconstruction``: one stderr line a chunk (the
    first line says what is coming), so a long prompt is not silent before its first token."""
    import time

    print(f"[kv cache] {method}: prefilling the {tokens}-token prompt, then its reconstruction pass",
          file=sys.stderr, flush=True)
    start = time.perf_counter()

    def progress(done: int, total: int) -> None:
        nonlocal start
        if done == 0:
            start = time.perf_counter()
            print(f"[kv cache] {method}: reconstruction pass in {total} chunk(s), each one forward "
                  f"pass (Ctrl-C stops it after the current chunk)", file=sys.stderr, flush=True)
            return
        spent = time.perf_counter() - start
        left = spent / done * (total - done)
        print(f"[kv cache] {method}: reconstruction chunk {done}/{total} done, {spent:.1f} s"
              + (f", about {left:.0f} s left" if done < total else ""), file=sys.stderr, flush=True)

    return progress


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate a completion with a compressed KV cache, streamed to stdout as it comes;
    then, on stderr, the bytes the method's cache holds against what the full cache
    would hold for the same tokens. Ctrl-C stops it, keeping what was generated."""
    _positive("--max-tokens", args.max_tokens)
    config = config_from_args(args.method, args.set)
    resolve_model(args.model)  # a missing model fails before anything is loaded

    import mlx_lm

    from .integrations.mlx_lm import make_prompt_cache, prefill_with_reconstruction, reconstruction_layers
    from .cache.calibration import CalibrationError

    model, tokenizer, model_config = load_model(args.model)
    dtype = compute_dtype(args.dtype)
    if dtype is not None:
        model.set_dtype(dtype)
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # undecodable argv bytes arrive as lone surrogates
        bad = args.prompt[exc.start].encode("utf-8", "surrogateescape")
        raise CLIError(f"--prompt is not UTF-8 text: byte 0x{bad.hex()} at character {exc.start}") from None
    prompt = tokenizer.encode(args.prompt)
    positions = _max_positions(model_config)
    if positions is not None and len(prompt) + args.max_tokens > positions[1]:
        print(
            f"veloxquant generate: warning: the prompt ({len(prompt)} tokens) plus "
            f"--max-tokens {args.max_tokens} passes the model's {positions[1]} positions "
            f"({positions[0]}); tokens beyond them are at positions it never saw",
            file=sys.stderr, flush=True,
        )
    check_config_for_model(config, model)
    interrupted = False
    try:  # a config the model cannot take, or a context past a method's limit, fails in here
        cache = make_prompt_cache(model, config)
        if reconstruction_layers(cache) and len(prompt) > 1:  # kvzip: compress the prompt by its pass
            cost = prefill_with_reconstruction(model, tokenizer, prompt[:-1], cache,
                                               prefill_step_size=RECONSTRUCTION_PREFILL_STEP,
                                               progress=_reconstruction_progress(config.method, len(prompt) - 1))
            print(f"[kv cache] {config.method}: prefill {cost['prefill_s']:.2f} s, reconstruction "
                  f"pass {cost['reconstruction_s']:.2f} s", file=sys.stderr, flush=True)
            prompt = prompt[-1:]
        for response in mlx_lm.stream_generate(
            model, tokenizer, prompt, max_tokens=args.max_tokens, prompt_cache=cache
        ):
            sys.stdout.write(response.text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        interrupted = True
    except CalibrationError as exc:  # a calibration file checked against the model and keys
        print(flush=True)
        raise CLIError(str(exc)) from None
    except (ValueError, NotImplementedError) as exc:
        raise CLIError(f"method {config.method!r}: {exc}".replace("\n", " ")) from None
    print(flush=True)

    tokens = max(c.offset for c in cache)
    kept = sum(c.nbytes for c in cache)
    baseline, per_token, dtype_name = full_cache_bytes(model, cache, tokens)
    stored = max(getattr(c, "stored_length", c.offset) for c in cache)
    note = more_than_full_note(config.method, kept, baseline, tokens)
    if note:
        print(note, file=sys.stderr)
    print(
        ("[interrupted] " if interrupted else "")
        + f"[kv cache] method={config.method} dtype={dtype_name} tokens={tokens}: "
        f"kept {kept:,} bytes (every array the method holds; {stored} rows/layer) vs "
        f"{baseline:,} bytes for the full cache (the same {tokens} rows at {per_token:,} "
        f"bytes/token, from the shapes; mlx-lm's KVCache allocates 256-row steps beyond "
        f"them) = {kept / max(1, baseline):.3f}x",
        file=sys.stderr,
    )
    return 130 if interrupted else 0


def check_config_for_model(config: KVCacheConfig, model) -> None:
    """What only the model's shapes can refuse, refused before any work: every field the
    spec says must divide head_dim (group sizes, sub-vector widths)."""
    from .integrations.mlx_lm import head_dim_problem_for

    problem = head_dim_problem_for(config, model)
    if problem:
        raise CLIError(f"--set {problem}")


def _server_model_args(server_args: list[str]) -> list[str]:
    """mlx-lm's ``--model``: checked like ours, ``reference`` -> the embedded model; absent,
    the embedded model (mlx-lm's server would start without one and answer every request
    with a 404 about a None path)."""
    out = list(server_args)
    given = False
    for i, arg in enumerate(out):
        if arg == "--model" and i + 1 < len(out):
            out[i + 1] = resolve_model(out[i + 1])
            given = True
        elif arg.startswith("--model="):
            out[i] = "--model=" + resolve_model(arg.partition("=")[2])
            given = True
    return out if given else ["--model", resolve_model(None), *out]


# mlx_lm.server options that set up mlx-lm's own KV cache: our caches replace it (and keep
# no ``to_quantized``), so the server would ignore them silently, or serve one at a time.
CONFLICTING_SERVER_ARGS = {
    "--kv-bits": "mlx-lm's KV quantization",
    "--kv-group-size": "mlx-lm's KV quantization group size",
    "--quantized-kv-start": "where mlx-lm's KV quantization starts",
}


def _refuse_conflicting_server_args(server_args: list[str], method: str) -> None:
    """One line for an mlx_lm.server option the method's cache would ignore (argparse's
    unambiguous prefixes too: ``--kv-b 4``)."""
    for i, arg in enumerate(server_args):
        name = arg.partition("=")[0]
        if len(name) < 3 or not name.startswith("--"):
            continue
        for option, what in CONFLICTING_SERVER_ARGS.items():
            if option.startswith(name):
                given = arg if "=" in arg or i + 1 == len(server_args) else f"{arg} {server_args[i + 1]}"
                raise CLIError(
                    f"{given}: {what} conflicts with the KV cache of --method {method}, which "
                    f"replaces mlx-lm's cache; quantize with a method instead (veloxquant "
                    f"methods lists them; kivi: --set kv_bits=4)")


# Set (to anything but "" or "0"), `veloxquant serve` prints SERVE_STATS_PREFIX + one JSON
# line to stderr when it stops (Ctrl-C / SIGINT): the process's peak MLX memory
# (mx.get_peak_memory(): every array, weights and caches) and its peak resident set.
SERVE_STATS_ENV = "VELOXQUANT_SERVE_STATS"
SERVE_STATS_PREFIX = "veloxquant serve stats: "


def print_serve_stats() -> None:
    """The stats line of SERVE_STATS_ENV (benchmarks/serve_load.py reads it)."""
    import json
    import resource

    import mlx.core as mx

    stats = {"peak_memory_bytes": int(mx.get_peak_memory()),
             "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    print(SERVE_STATS_PREFIX + json.dumps(stats), file=sys.stderr, flush=True)


def _serve_stats_wanted() -> bool:
    import os

    return os.environ.get(SERVE_STATS_ENV, "") not in ("", "0")


def kv_memory_bytes(gigabytes: float | None) -> int | None:
    """``--kv-memory`` in bytes (GB: 10**9 bytes, as mlx-lm's --prompt-cache-bytes counts)."""
    if gigabytes is None:
        return None
    if not gigabytes > 0 or gigabytes == float("inf"):
        raise SystemExit(f"veloxquant serve: --kv-memory={gigabytes}: allowed is a finite number "
                         "of GB above 0 (e.g. --kv-memory 40)")
    return int(gigabytes * 10**9)


def cmd_serve(args: argparse.Namespace, server_args: list[str]) -> int:
    """Run mlx-lm's OpenAI-compatible server with every loaded model patched to use the
    method, batching requests continuously when the method batches (--no-batching: one
    request at a time)."""
    config = config_from_args(args.method, args.set)
    _refuse_conflicting_server_args(server_args, config.method)
    server_args = _server_model_args(server_args)

    import mlx_lm.server as server

    from .integrations.mlx_lm import SERVED_FLAG, patch_server

    budget = kv_memory_bytes(args.kv_memory)
    patch_server(server, config, batching=not args.no_batching,
                 **({} if budget is None else {"kv_memory": budget}))
    sys.argv = ["veloxquant serve", *server_args]
    code = 0
    try:
        server.main()  # Ctrl-C: mlx-lm stops its HTTP server and generation thread, returns
    except KeyboardInterrupt:  # a second Ctrl-C while it was stopping
        print("veloxquant serve: interrupted", file=sys.stderr)
        code = 130
    finally:
        if _serve_stats_wanted():
            print_serve_stats()
    if getattr(server, SERVED_FLAG, False):
        # The server ran in this process: leave without Python's finalization, where MLX's
        # worker threads, woken while the interpreter tore down, aborted the process (exit
        # -6, "terminate called without an active exception", 6 of 9 stops), and where a
        # generation thread still busy after a second Ctrl-C kept it alive.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


CALIBRATE_TOKENS = 2048
CALIBRATE_ITERS = 16
MIN_CALIBRATION_TOKENS = 16


def _calibration_text(path: str | None) -> tuple[str, str]:
    """(text, its name): ``--text FILE`` or the reference model's held-out book (whose end
    is used: the bench's default held-out window is its start)."""
    if path is None:
        return (REFERENCE_MODEL / "heldout_kjv_acts.txt").read_text(), "heldout_kjv_acts.txt"
    file = Path(path).expanduser()
    if not file.is_file():
        raise CLIError(f"--text {path}: no such file (a UTF-8 text file to collect keys and values from)")
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"--text {path}: cannot be read as UTF-8 text ({type(exc).__name__})") from None
    return text, file.name


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit a method's per-layer arrays offline (codebooks, bases, channel orders: what
    its paper calibrates): run the model over a text, collect each layer's keys and
    values, fit, and write a safetensors file that a config points to (calibration_file)."""
    _positive("--tokens", args.tokens)
    _positive("--iters", args.iters)
    check_method(args.method)
    cls = METHODS[args.method].load_implementation()
    if not hasattr(cls, "calibrate"):
        able = [k for k, m in METHODS.items() if m.implemented and hasattr(m.load_implementation(), "calibrate")]
        raise CLIError(f"--method {args.method}: has no calibration step; methods that have one: "
                       + ", ".join(able))
    own, options = parse_assignments(args.set)
    if "calibration_file" in own:
        raise CLIError("--set calibration_file: calibrate writes the file that --out names")
    config = build_config(args.method, own, options)
    text, text_name = _calibration_text(args.text)
    resolved = resolve_model(args.model)
    out = Path(args.out or f"{args.method}-{Path(resolved).name}.safetensors").expanduser()
    if out.suffix != ".safetensors":
        raise CLIError(f"--out {args.out}: the file name must end in .safetensors")
    if not out.parent.is_dir():
        raise CLIError(f"--out {args.out}: no such folder {str(out.parent)!r}")

    import mlx.core as mx
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .cache.calibration import calibration_header, collect_kv, write_calibration
    from .integrations.query_capture import collect_queries

    model, tokenizer, _ = load_model(args.model)
    model_args = getattr(model, "args", None)
    check_config_for_model(config, model)
    dtype = compute_dtype(args.dtype)
    if dtype is not None:
        model.set_dtype(dtype)
    tokens = tokenizer.encode(text)
    tokens = tokens[-args.tokens :] if args.text is None else tokens[: args.tokens]
    text_name += " (its end)" if args.text is None else ""
    if len(tokens) < MIN_CALIBRATION_TOKENS:
        raise CLIError(f"--text {args.text or text_name}: {len(tokens)} tokens; calibration needs "
                       f"at least {MIN_CALIBRATION_TOKENS}")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        queries = {}
        if getattr(cls, "calibration_queries", False):  # its paper calibrates on queries too
            task = bar.add_task(f"queries, keys and values of {len(tokens)} tokens", total=len(tokens))
            queries, kv = collect_queries(model, mx.array(tokens),
                                          progress=lambda done, n: bar.update(task, completed=done))
        else:
            task = bar.add_task(f"keys and values of {len(tokens)} tokens", total=len(tokens))
            kv = collect_kv(model, mx.array(tokens), progress=lambda done, n: bar.update(task, completed=done))
        layers = {}
        for i, (keys, values) in kv.items():
            task = bar.add_task(f"layer {i}", total=None)

            def report(name, done, total, task=task, i=i):
                bar.update(task, description=f"layer {i} {name}", completed=done, total=total)

            try:
                layers[i] = cls.calibrate(keys, values, config, iters=args.iters, seed=args.seed,
                                          progress=report, model_args=model_args,
                                          **({"queries": queries[i]} if queries else {}))
            except ValueError as exc:  # settings this text or model cannot be fitted with
                raise CLIError(f"--method {args.method}: {exc}") from None
            mx.eval(layers[i])
    metadata = {**calibration_header(cls, config, model_args, args.model or "reference"),
                "tokens": len(tokens), "text": text_name, "iterations": args.iters, "seed": args.seed}
    write_calibration(str(out), layers, metadata)
    print(f"wrote {out}: {args.method} calibration for {len(layers)} layers of {metadata['model']} "
          f"({len(tokens)} tokens of {text_name}); use it with "
          f"KVCacheConfig(method={args.method!r}, calibration_file={str(out)!r}) or "
          f"--set calibration_file={out}")
    return 0


def _add_method_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--method", default="full", type=method_key,
        help="method key (default: full, no compression); `veloxquant methods` lists them",
    )
    p.add_argument(
        "--set", action="append", metavar="FIELD=VALUE",
        help="a field the method reads: one of its options fields or a config field it "
             "uses (kivi: kv_bits, residual_window, fused_attention); values are Python "
             "literals (4, 0.5, True, (8, 4), None) or plain strings; repeatable",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="veloxquant", description="KV-cache compression for MLX / mlx-lm models."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("methods", help=cmd_methods.__doc__, description=cmd_methods.__doc__)
    p.set_defaults(func=cmd_methods)

    doc = " ".join(cmd_generate.__doc__.split())
    p = sub.add_parser("generate", help=doc.split(";")[0], description=doc)
    p.add_argument(
        "--model", default=None, metavar="PATH|HUB_ID",
        help="a local mlx-lm model folder (config.json + *.safetensors) or a Hugging Face "
             "hub id; default: 'reference', the embedded byte-level reference model; 'reference-subword', the embedded subword one",
    )
    _add_method_args(p)
    p.add_argument("--prompt", required=True, help="the prompt text (required)")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="most tokens to generate, at least 1 (default: 64)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    p.set_defaults(func=cmd_generate)

    doc = " ".join(cmd_serve.__doc__.split())
    p = sub.add_parser(
        "serve", help=doc,
        description=doc + " Arguments after -- go to mlx_lm.server (its --model may be a "
        "folder, a hub id, 'reference', the embedded byte-level model, which is the default, or 'reference-subword', the embedded subword one).",
        usage="veloxquant serve [--method M] [--set FIELD=VALUE ...] [--no-batching] "
              "[--kv-memory GB] -- "
              "[mlx_lm.server args]",
    )
    _add_method_args(p)
    p.add_argument("--no-batching", action="store_true",
                   help="serve one request at a time even when the method batches (requests "
                        "arriving meanwhile wait); default: continuous batching for the methods "
                        f"that batch. With {SERVE_STATS_ENV}=1 in the environment, the server "
                        "prints its peak memory when it stops")
    p.add_argument("--kv-memory", type=float, default=None, metavar="GB",
                   help="KV cache memory (GB, 10^9 bytes) the requests being answered may hold "
                        "together: the method's bytes per token are measured once on the model, a "
                        "request needing bytes/token x (prompt + max_tokens) is admitted when that "
                        "fits beside the others, queued otherwise, and refused (HTTP 400) when it "
                        "can never fit; mlx-lm's --prompt-cache-bytes bounds the finished caches it "
                        "keeps. Default: no budget")
    p.set_defaults(func=cmd_serve)

    doc = " ".join(cmd_calibrate.__doc__.split())
    p = sub.add_parser("calibrate", help=doc.split(":")[0], description=doc)
    p.add_argument(
        "--model", default=None, metavar="PATH|HUB_ID",
        help="the model to calibrate for: a local mlx-lm model folder or a Hugging Face hub "
             "id; default: 'reference', the embedded byte-level reference model; 'reference-subword', the embedded subword one",
    )
    p.add_argument("--method", required=True, type=method_key,
                   help="the method whose arrays to fit (required; vecinfer and kvtc have a "
                        "calibration step)")
    p.add_argument(
        "--set", action="append", metavar="FIELD=VALUE",
        help="a field of the method's options the fit depends on (vecinfer: "
             "key_sub_dim, value_sub_dim, key_codebook_bits, value_codebook_bits; kvtc: "
             "kvtc_bit_budget, kvtc_bit_choices, kvtc_beta); a config "
             "using the file must have the same values; repeatable",
    )
    p.add_argument("--out", default=None, metavar="FILE",
                   help="the safetensors file to write (default: "
                        "<method>-<model folder name>.safetensors in the current folder)")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="a UTF-8 text file whose keys and values are collected (default: the "
                        "reference model's held-out text, heldout_kjv_acts.txt, its end)")
    p.add_argument("--tokens", type=int, default=CALIBRATE_TOKENS,
                   help=f"tokens of the text used, at least 1: from the start of --text, from "
                        f"the end of the default text (the bench measures its start) (default: "
                        f"{CALIBRATE_TOKENS})")
    p.add_argument("--iters", type=int, default=CALIBRATE_ITERS,
                   help=f"most k-means iterations per codebook (vecinfer; kvtc's fit does not "
                        f"iterate), at least 1 (default: "
                        f"{CALIBRATE_ITERS})")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the k-means initialisation and sampling (vecinfer; kvtc's fit is "
                        "unseeded) (default: 0)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    p.set_defaults(func=cmd_calibrate)

    from .bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args = []
    if argv[:1] == ["serve"] and "--" in argv:
        cut = argv.index("--")
        argv, server_args = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return cmd_serve(args, server_args)
        return args.func(args)
    except CLIError as exc:
        print(f"veloxquant {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"veloxquant {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
