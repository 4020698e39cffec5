"""The ``veloxquant`` command line: methods, generate, serve, bench (see bench/cli.py)."""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from ._generated.deprecations import CONFIG_FIELDS
from .cache.config import KVCacheConfig
from .registry import METHODS

REFERENCE_MODEL = Path(__file__).resolve().parent / "assets" / "reference_model"


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


def parse_value(text: str):
    """``--set`` values: Python literals (``4``, ``0.5``, ``True``, ``(8, 4)``, ``None``)
    where they parse, the raw string otherwise (``--set snap_backend=auto``)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def config_from_args(method: str, assignments: list[str] | None) -> KVCacheConfig:
    """``--method M --set FIELD=VALUE ...`` -> a validated KVCacheConfig."""
    own, options = {}, {}
    for item in assignments or []:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise CLIError(f"--set expects FIELD=VALUE, got {item!r}")
        (own if name in CONFIG_FIELDS else options)[name] = parse_value(text)
    try:
        return KVCacheConfig.from_dict({"method": method, "options": options, **own})
    except (ValueError, TypeError) as exc:
        raise CLIError(str(exc)) from None


def resolve_model(path_or_id: str | None) -> str:
    return str(REFERENCE_MODEL) if path_or_id in (None, "reference") else path_or_id


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


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate text with a compressed KV cache and report the bytes it kept."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import KVCache

    from .integrations.mlx_lm import make_prompt_cache

    config = config_from_args(args.method, args.set)
    model, tokenizer = mlx_lm.load(resolve_model(args.model))
    cache = make_prompt_cache(model, config)
    prompt = tokenizer.encode(args.prompt)
    completion, generated = "", []
    for response in mlx_lm.stream_generate(
        model, tokenizer, prompt, max_tokens=args.max_tokens, prompt_cache=cache
    ):
        completion += response.text
        generated.append(response.token)
    print(completion)

    # The baseline, measured the same way: the full cache over the same tokens.
    full = [KVCache() for _ in model.layers]
    tokens = mx.array(prompt + generated[:-1])
    for start in range(0, tokens.shape[0], 2048):
        model(tokens[start : start + 2048][None], cache=full)
        mx.eval([c.state for c in full])
    kept = sum(c.nbytes for c in cache)
    baseline = sum(c.nbytes for c in full)
    stored = max(getattr(c, "stored_length", c.offset) for c in cache)
    print(
        f"[kv cache] method={config.method}: {kept:,} bytes kept for {cache[0].offset} tokens "
        f"({stored} stored rows/layer) vs {baseline:,} bytes for the full cache "
        f"({kept / baseline:.3f}x)",
        file=sys.stderr,
    )
    return 0


def cmd_serve(args: argparse.Namespace, server_args: list[str]) -> int:
    """Run mlx-lm's server with every loaded model patched to use the method."""
    import mlx_lm.server as server

    from .integrations.mlx_lm import patch_server

    patch_server(server, config_from_args(args.method, args.set))
    sys.argv = ["veloxquant serve", *server_args]
    server.main()
    return 0


def _add_method_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="full", help="method key (see `veloxquant methods`)")
    p.add_argument(
        "--set", action="append", metavar="FIELD=VALUE",
        help="an options field of the method or a config field (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="veloxquant", description="KV-cache compression for MLX / mlx-lm models."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("methods", help=cmd_methods.__doc__)
    p.set_defaults(func=cmd_methods)

    p = sub.add_parser("generate", help=cmd_generate.__doc__)
    p.add_argument("--model", default=None, help="mlx-lm model path or hub id (default: the embedded reference model)")
    _add_method_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "serve", help=cmd_serve.__doc__,
        description=cmd_serve.__doc__ + " Arguments after -- go to mlx_lm.server.",
    )
    _add_method_args(p)
    p.set_defaults(func=cmd_serve)

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


if __name__ == "__main__":
    sys.exit(main())
