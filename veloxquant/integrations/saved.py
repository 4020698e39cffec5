"""Saved prompt caches, checked: ``save_prompt_cache(path, cache, model)`` and
``load_prompt_cache(path, model)``.

mlx-lm's own ``load_prompt_cache`` already restores our caches (``cache_classes.py``
binds their names) and each cache refuses a state that contradicts its config or itself
(``CompressedKVCache.from_state``). It cannot know the model the file will be used with;
this loader does: it names the file in every error, checks the layer count and each
layer's KV heads and head_dim against the model, and gives the layers one shared model
context again, as ``make_prompt_cache`` does (its ``layers`` list is how cross-layer
caches, ``cache/cross_layer.py``, reach each other; mlx-lm's loader already gives them
back linked, their shared arrays once, in their owner's state).

A file written by ``save_prompt_cache`` here is an ordinary mlx-lm prompt-cache file
(mlx-lm's loader reads it) whose metadata also holds a checksum of every array and a
fingerprint of the model (its config and a hash of a few weight slices): a same-shaped
model with other weights, or a file edited or damaged after saving, is refused by name.
Entropy-coded caches are written in their coded form (``save_prompt_cache`` below).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_lm_cache

from ..cache.base import CacheStateError, CompressedKVCache
from ..quant.coded_cache import coded_states

CHECKSUM_KEY = "veloxquant_arrays_sha256"
FINGERPRINT_KEY = "veloxquant_model_fingerprint"
MODEL_KEY = "veloxquant_model"
# Parameters whose leading elements enter the fingerprint: enough to tell fine-tunes and
# other checkpoints of one architecture apart, few enough to hash in microseconds.
_SLICED_PARAMETERS = 4
_SLICE = 256


def _model_kv_shape(model) -> tuple[int, int] | None:
    args = getattr(model, "args", None)
    if args is None:
        return None
    from .mlx_lm import model_head_dim  # mlx-lm is loaded by now: a model was given

    kv_heads = getattr(args, "num_key_value_heads", None) or getattr(args, "num_attention_heads", None)
    head_dim = model_head_dim(model)
    return (kv_heads, head_dim) if kv_heads and head_dim else None


def _bytes(array: mx.array) -> bytes:
    flat = mx.contiguous(array.reshape(-1))
    return bytes(memoryview(flat.view(mx.uint8))) if flat.size else b""


def arrays_checksum(arrays: dict[str, mx.array]) -> str:
    """sha256 over every array's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = arrays[name]
        digest.update(f"{name}|{array.dtype}|{tuple(array.shape)}|".encode())
        digest.update(_bytes(array))
    return digest.hexdigest()


def _model_args(model) -> dict[str, Any]:
    args = getattr(model, "args", None)
    if args is None:
        return {}
    return dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(vars(args))


def describe_model(model) -> str:
    """A short human name for a model: its type, layers and hidden size."""
    args = _model_args(model)
    return (f"{args.get('model_type', type(model).__module__.rsplit('.', 1)[-1])}, "
            f"{len(getattr(model, 'layers', []))} layers, hidden {args.get('hidden_size', '?')}")


def model_fingerprint(model) -> str:
    """sha256 (16 hex digits) of the model's config and the first values of a few of its
    weights, spread over the model (first, last and evenly between)."""
    digest = hashlib.sha256(json.dumps(_model_args(model), sort_keys=True, default=str).encode())
    parameters = sorted(tree_flatten(model.parameters()), key=lambda item: item[0])
    if parameters:
        n = len(parameters)
        picks = sorted({round(i * (n - 1) / (_SLICED_PARAMETERS - 1)) for i in range(_SLICED_PARAMETERS)})
        for i in picks:
            name, weight = parameters[i]
            digest.update(name.encode())
            digest.update(_bytes(weight.reshape(-1)[:_SLICE]))
    return digest.hexdigest()[:16]


def save_prompt_cache(path: str, cache: list, model: Any = None, metadata: dict[str, str] | None = None):
    """mlx-lm's ``save_prompt_cache``, with a checksum of the arrays and, given ``model``,
    its fingerprint in the file's metadata (``load_prompt_cache`` here checks both).

    Entropy-coded caches (cachegen, kvtc: ``quant/coded_cache.py``) are written in their
    coded form here: their ``state`` gives it only while this save reads it. mlx-lm's own
    ``save_prompt_cache`` is not patched: a file it writes holds their resident form (the
    fixed-length codes: larger, and loaded by either loader just the same)."""
    metadata = dict(metadata or {})
    if model is not None:
        metadata[FINGERPRINT_KEY] = model_fingerprint(model)
        metadata[MODEL_KEY] = describe_model(model)
    with coded_states():
        mlx_lm_cache.save_prompt_cache(str(path), cache, metadata)
    arrays, file_metadata = mx.load(str(path), return_metadata=True)
    file_metadata = {**file_metadata, f"0.{CHECKSUM_KEY}": arrays_checksum(arrays)}
    mx.save_safetensors(str(path), arrays, file_metadata)


def _scalar(array: mx.array, kind: str):
    if kind == "scalar":
        return array.item()
    if kind == "string":
        return "".join(chr(i) for i in array.tolist())
    if kind == "none":
        return None
    raise ValueError(f"scalar kind is {kind!r}, expected 'scalar', 'string' or 'none'")


def _read(path: str, model: Any):
    """The file's caches and user metadata; every problem is named with the file."""
    try:
        arrays, file_metadata = mx.load(str(path), return_metadata=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise CacheStateError(f"{path}: not a readable prompt-cache file: {exc}") from None
    try:
        metadata, classes, scalars = tree_unflatten(list(file_metadata.items()))
        classes = list(classes)
    except (ValueError, TypeError) as exc:
        raise CacheStateError(f"{path}: metadata is not mlx-lm's prompt-cache layout "
                              f"(user metadata, class names, scalars): {exc}") from None
    metadata = dict(metadata) if isinstance(metadata, dict) else {}
    saved_checksum = metadata.pop(CHECKSUM_KEY, None)
    if saved_checksum is not None:
        found = arrays_checksum(arrays)
        if found != saved_checksum:
            raise CacheStateError(
                f"{path}: arrays checksum is {found[:16]}, expected the saved {saved_checksum[:16]}: "
                "the file was changed or damaged after it was saved")
    saved_fingerprint = metadata.get(FINGERPRINT_KEY)
    if model is not None and saved_fingerprint is not None:
        fingerprint = model_fingerprint(model)
        if fingerprint != saved_fingerprint:
            raise CacheStateError(
                f"{path}: model fingerprint is {saved_fingerprint} "
                f"({metadata.get(MODEL_KEY, 'unknown model')}), expected this model's {fingerprint} "
                f"({describe_model(model)}): the cache was saved from another model")
    for entry in list(scalars)[1:]:
        try:
            name, kind = entry
            arrays[name] = _scalar(arrays[name], kind)
        except (KeyError, ValueError, TypeError) as exc:
            raise CacheStateError(f"{path}: scalar entry {entry!r} is unusable: {exc}") from None
    states = tree_unflatten(list(arrays.items())) if arrays else []
    if not isinstance(states, list) or len(states) != len(classes):
        found = len(states) if isinstance(states, list) else "not a list"
        raise CacheStateError(f"{path}: layers with a state is {found}, expected one per class "
                              f"name ({len(classes)})")
    cache = []
    for layer, (name, state) in enumerate(zip(classes, states)):
        cls = getattr(mlx_lm_cache, name, None)
        if not isinstance(cls, type) or not hasattr(cls, "from_state"):
            raise CacheStateError(f"{path}: layer {layer} cache class is {name!r}, expected a class "
                                  "of mlx_lm.models.cache or of VeloxQuant")
        meta = state.get("meta") if isinstance(state, dict) else None
        if issubclass(cls, CompressedKVCache) and isinstance(meta, dict) and "layer" in meta \
                and meta["layer"] != layer:
            raise CacheStateError(f"{path}: layer {layer} ({name}) meta.layer is {meta['layer']!r}, "
                                  f"expected {layer} (its position in the file)")
        try:
            cache.append(cls.from_state(state))
        except CacheStateError as exc:
            raise CacheStateError(f"{path}: {exc}") from None
        except (KeyError, IndexError, ValueError, TypeError, AttributeError) as exc:
            raise CacheStateError(
                f"{path}: layer {layer} ({name}) state does not restore: "
                f"{type(exc).__name__}: {exc}") from None
    return cache, metadata


def load_prompt_cache(path: str, model: Any = None, return_metadata: bool = False):
    """Load a saved prompt cache; with ``model``, refuse one made for another model."""
    from ..cache.context import ModelContext

    cache, metadata = _read(path, model)
    ours = [i for i, c in enumerate(cache) if isinstance(c, CompressedKVCache)]
    if model is not None:
        if len(cache) != len(model.layers):
            raise CacheStateError(
                f"{path}: layers is {len(cache)}, expected the model's {len(model.layers)}"
            )
        expected = _model_kv_shape(model)
        for i in ours:
            shape = cache[i].kv_shape
            if expected and shape and (shape[1], shape[2]) != expected:
                raise CacheStateError(
                    f"{path}: layer {i} kv heads x head_dim is {shape[1]} x {shape[2]}, "
                    f"expected the model's {expected[0]} x {expected[1]}"
                )
        limit = getattr(getattr(model, "args", None), "max_position_embeddings", None)
        for i, layer_cache in enumerate(cache):
            offset = getattr(layer_cache, "offset", 0)
            if limit and isinstance(offset, int) and offset > limit:
                raise CacheStateError(
                    f"{path}: layer {i} offset is {offset}, expected at most the model's "
                    f"{limit} positions (max_position_embeddings)")
    if ours:
        config = cache[ours[0]].config
        for i in ours:
            if cache[i].config != config:
                raise CacheStateError(
                    f"{path}: layer {i} config is {cache[i].config.to_dict()}, expected "
                    f"layer {ours[0]}'s {config.to_dict()}"
                )
        context = ModelContext(config, len(cache), tuple(ours),
                               model_args=getattr(model, "args", None), layers=list(cache))
        for i in ours:
            cache[i].context = context
    return (cache, metadata) if return_metadata else cache
