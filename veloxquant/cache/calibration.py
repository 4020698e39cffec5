"""Calibration files: what a method fits offline on a model's keys and values, in safetensors.

``veloxquant calibrate`` runs a model over a text (``collect_kv``: mlx-lm's own caches,
so the keys are post-RoPE, as our caches receive them; ``integrations/query_capture``
also, for a class whose ``calibration_queries`` is true, the queries each layer attends
with, handed to its ``calibrate`` as ``queries``), lets the method fit its arrays
per layer (a cache class with ``calibrate``, ``calibration_fields`` and, where its arrays
depend on more than those, ``calibration_metadata``), and writes them with
``write_calibration``. A config points at the file (``calibration_file``); each layer's
cache reads its arrays through ``layer_calibration``, which refuses a file made for
another method, other settings or another model, naming the file, the field and both
values. Files are read once per file version and process, whatever the number of layers
and caches reading them.

File layout: arrays ``layer{i}.{name}`` for each calibrated layer i; string metadata
(JSON values): ``format`` (``veloxquant-calibration``), ``version``, ``method``, the
method's ``calibration_fields`` (e.g. vecinfer's sub-vector widths and codebook bits,
kvtc's bit budget), what its ``calibration_metadata`` adds, ``layers`` (calibrated layer
indices), the model's identity (``model``: its folder name or hub id; ``model_type``,
``num_hidden_layers``, ``hidden_size``, ``num_key_value_heads``, ``head_dim``,
``vocab_size``, ``rope_theta``, from its config), and how the fit was made (``tokens``,
``text``, ``iterations``, ``seed``).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Callable

import mlx.core as mx

FORMAT = "veloxquant-calibration"
VERSION = 1
IDENTITY = ("model_type", "num_hidden_layers", "hidden_size", "num_key_value_heads", "head_dim",
            "vocab_size", "rope_theta")


class CalibrationError(ValueError):
    """A calibration file that is missing, unreadable or made for something else."""


def model_identity(args: Any) -> dict[str, Any]:
    """The identity fields of mlx-lm ``ModelArgs`` (those it has)."""
    if args is None:
        return {}
    heads = getattr(args, "num_attention_heads", None)
    hidden = getattr(args, "hidden_size", None)
    found = {name: getattr(args, name, None) for name in IDENTITY}
    found["num_key_value_heads"] = found["num_key_value_heads"] or heads
    if found["head_dim"] is None and heads and hidden:
        found["head_dim"] = hidden // heads
    if found["rope_theta"] is not None:
        found["rope_theta"] = float(found["rope_theta"])
    return {k: v for k, v in found.items() if v is not None}


def collect_kv(model, tokens: mx.array, chunk: int = 512,
               progress: Callable[[int, int], None] | None = None) -> dict[int, tuple[mx.array, mx.array]]:
    """Run ``model`` over ``tokens`` (T,) with mlx-lm's own caches: each full-attention
    layer's keys and values (1, H, T, D), post-RoPE, as a cache receives them."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    n = tokens.shape[0]
    for start in range(0, n, chunk):
        model(tokens[start : start + chunk][None], cache=cache)
        mx.eval([c.state for c in cache])
        if progress:
            progress(min(start + chunk, n), n)
    return {i: (c.keys[:, :, : c.offset], c.values[:, :, : c.offset])
            for i, c in enumerate(cache) if type(c) is KVCache}


def calibration_header(cls, config, model_args: Any, model: str) -> dict[str, Any]:
    """What a calibration file of ``cls``'s arrays says it was made for (``layer_calibration``
    checks it): the method, the fields its arrays depend on, what the cache computes from its
    model (``calibration_metadata``), the model's name and identity."""
    identity = model_identity(model_args)
    return {"method": config.method, **{f: getattr(config, f) for f in cls.calibration_fields},
            **(cls.calibration_metadata(model_args) if hasattr(cls, "calibration_metadata") else {}),
            "model": model, **{k: identity[k] for k in IDENTITY if k in identity}}


def write_calibration(path: str, layers: dict[int, dict[str, mx.array]], metadata: dict[str, Any]) -> None:
    arrays = {f"layer{i}.{name}": a for i, named in layers.items() for name, a in named.items()
              if a is not None}
    meta = {"format": FORMAT, "version": VERSION, **metadata, "layers": sorted(layers)}
    mx.save_safetensors(path, arrays, {k: json.dumps(v) for k, v in meta.items()})


@functools.lru_cache(maxsize=8)
def _read(path: str, mtime_ns: int, size: int):
    arrays, raw = mx.load(path, return_metadata=True)
    meta = {}
    for key, text in raw.items():
        try:
            meta[key] = json.loads(text)
        except ValueError:
            meta[key] = text
    return arrays, meta


def read_calibration(path: str) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """The file's arrays and metadata (read once per file version)."""
    if not os.path.isfile(path):
        raise CalibrationError(f"calibration_file={path!r}: no such file (write one with "
                               f"`veloxquant calibrate --model PATH --method METHOD --out FILE`)")
    stat = os.stat(path)
    try:
        arrays, meta = _read(os.path.realpath(path), stat.st_mtime_ns, stat.st_size)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one error
        raise CalibrationError(f"calibration_file={path!r}: not a safetensors file ({exc})") from None
    if meta.get("format") != FORMAT:
        raise CalibrationError(f"calibration_file={path!r}: format is {meta.get('format')!r}, "
                               f"expected {FORMAT!r} (a file written by `veloxquant calibrate`)")
    return arrays, meta


def _refuse(path, meta, field, in_file, other, where):
    made_for = f" (made for {meta['model']!r})" if meta.get("model") else ""
    raise CalibrationError(f"calibration_file={path!r}: {field} is {in_file!r} in the file"
                           f"{made_for}, but {other!r} in the {where}")


def _as_stored(value: Any) -> Any:
    """``value`` as the file's JSON metadata gives it back (a tuple as a list)."""
    return json.loads(json.dumps(value))


def batch_rows(x: mx.array, batch: int) -> mx.array:
    """A calibration file's array ``x`` (1, ...) as ``batch`` rows of their own, every row
    the same (the file is one; a cache's rows keep per-row arrays)."""
    return x if batch == x.shape[0] else mx.contiguous(mx.broadcast_to(x, (batch, *x.shape[1:])))


def layer_calibration(config, fields: tuple[str, ...], names: tuple[str, ...], layer: int, *,
                      model_args: Any = None, kv_shape: tuple[int, int] | None = None,
                      cache_metadata: dict[str, Any] | None = None) -> dict[str, mx.array]:
    """Layer ``layer``'s arrays ``names`` from ``config.calibration_file``, after checking
    the file against the config's method and ``fields``, the model's identity (when its
    ``model_args`` are known), the layer's (kv heads, head_dim) (when known) and what the
    cache computes from its model as ``calibration_metadata`` does (``cache_metadata``)."""
    path = config.calibration_file
    arrays, meta = read_calibration(path)
    if meta.get("method") != config.method:
        _refuse(path, meta, "method", meta.get("method"), config.method, "config")
    for name in fields:
        if meta.get(name) != _as_stored(getattr(config, name)):
            _refuse(path, meta, name, meta.get(name), getattr(config, name), "config")
    for name, value in model_identity(model_args).items():
        if name in meta and meta[name] != value:
            _refuse(path, meta, name, meta[name], value, "model")
    if kv_shape is not None:
        for name, value in zip(("num_key_value_heads", "head_dim"), kv_shape):
            if meta.get(name) != value:
                _refuse(path, meta, name, meta.get(name), value, f"keys of layer {layer}")
    for name, value in (cache_metadata or {}).items():
        if meta.get(name) != _as_stored(value):
            _refuse(path, meta, name, meta.get(name), value, f"cache of layer {layer}")
    if layer not in meta.get("layers", []):
        raise CalibrationError(f"calibration_file={path!r}: layer {layer} is not in the file "
                               f"(its layers: {meta.get('layers')})")
    missing = [n for n in names if f"layer{layer}.{n}" not in arrays]
    if missing:
        raise CalibrationError(f"calibration_file={path!r}: layer {layer} has no {missing[0]!r} array")
    return {n: arrays[f"layer{layer}.{n}"] for n in names}
