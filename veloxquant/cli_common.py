"""What the ``veloxquant`` commands share: model loading, dtypes, ``--method``/``--set``
parsing into a validated config, and the one-line user error (``cli.py``, ``bench/cli.py``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from ._generated.deprecations import CONFIG_FIELD_USERS, CONFIG_FIELDS
from .cache.config import KVCacheConfig, describe_fields_read
from .reference import EMBEDDED_MODELS, REFERENCE_MODEL
from .registry import METHODS, implemented_methods

MODEL_HELP = (
    "a model is a local folder holding config.json and weights (*.safetensors), or a "
    "Hugging Face hub id such as mlx-community/Qwen3-0.6B-4bit; 'reference' (the default) "
    "is the embedded byte-level reference model, 'reference-subword' the embedded one with "
    "subword tokens"
)
DTYPES = ["auto", "float16", "bfloat16", "float32"]
DTYPE_HELP = (
    "compute dtype of the model and its KV cache; auto (default): float32 on the CPU "
    "(MLX's fast CPU path), the model's own dtype on a GPU"
)


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


def parse_value(text: str):
    """``--set`` values: Python literals (``4``, ``0.5``, ``True``, ``(8, 4)``, ``None``)
    where they parse, the raw string otherwise (``--set snap_backend=auto``)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_assignments(assignments: list[str] | None) -> tuple[dict, dict]:
    """``--set F=V ...`` -> (config fields, options fields), values parsed."""
    own, options = {}, {}
    for item in assignments or []:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise CLIError(f"--set expects FIELD=VALUE, got {item!r}")
        (own if name in CONFIG_FIELDS else options)[name] = parse_value(text)
    return own, options


def method_key(name: str) -> str:
    """The method key ``name`` spells in any letter case (``KIVI`` -> ``kivi``); other names
    unchanged, for check_method to refuse with its did-you-mean."""
    if name in METHODS:
        return name
    return next((key for key in METHODS if key.lower() == name.strip().lower()), name)


def check_method(method: str) -> None:
    """A known method with an implementation, or a one-line CLIError."""
    if method not in METHODS:
        try:
            KVCacheConfig(method=method)  # its message has the did-you-mean
        except ValueError as exc:
            raise CLIError(str(exc)) from None
    if not METHODS[method].implemented:
        raise CLIError(
            f"method {method!r} has no implementation yet; implemented: "
            + ", ".join(implemented_methods())
        )


def build_config(method: str, own: dict, options: dict) -> KVCacheConfig:
    """A validated config for ``method``; a config field it does not read is an error."""
    for name in own:
        if method not in CONFIG_FIELD_USERS[name]:
            raise CLIError(
                f"--set {name}: {method} does not read {name}; {describe_fields_read(method)}"
            )
    try:
        return KVCacheConfig.from_dict({"method": method, "options": options, **own})
    except (ValueError, TypeError) as exc:
        raise CLIError(str(exc)) from None


def config_from_args(method: str, assignments: list[str] | None) -> KVCacheConfig:
    """``--method M --set FIELD=VALUE ...`` -> a validated KVCacheConfig."""
    check_method(method)
    return build_config(method, *parse_assignments(assignments))


def resolve_model(path_or_id: str | None) -> str:
    """A local model folder (checked) or a hub id; CLIError saying what a model needs."""
    if path_or_id is None:
        return str(REFERENCE_MODEL)
    if path_or_id in EMBEDDED_MODELS:
        return str(EMBEDDED_MODELS[path_or_id])
    path = Path(path_or_id).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CLIError(f"--model {path_or_id}: not a folder; {MODEL_HELP}")
        if not (path / "config.json").is_file():
            raise CLIError(f"--model {path_or_id}: the folder has no config.json; {MODEL_HELP}")
        if not any(path.glob("*.safetensors")):
            raise CLIError(
                f"--model {path_or_id}: the folder has no weights (*.safetensors); {MODEL_HELP}"
            )
        return str(path)
    # A hub id is "owner/name"; anything else that does not exist is a missing folder.
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", path_or_id):
        return path_or_id
    raise CLIError(f"--model {path_or_id}: model not found (no such folder); {MODEL_HELP}")


def load_model(path_or_id: str | None):
    """(model, tokenizer, config dict) through mlx-lm; any failure is one line."""
    import mlx_lm

    resolved = resolve_model(path_or_id)
    try:
        return mlx_lm.load(resolved, return_config=True)
    except Exception as exc:  # noqa: BLE001 - hub, network and file errors alike
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CLIError(
            f"--model {path_or_id}: could not load it ({type(exc).__name__}: {first}); "
            f"{MODEL_HELP}"
        ) from None


def compute_dtype(name: str):
    import mlx.core as mx

    if name == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else None
    return getattr(mx, name)
