"""Saved prompt caches, checked: ``load_prompt_cache(path, model)``.

mlx-lm's own ``load_prompt_cache`` already restores our caches (``cache_classes.py``
binds their names) and each cache refuses a state that contradicts its config or itself
(``CompressedKVCache.from_state``). It cannot know the model the file will be used with;
this loader does: it names the file in every error, checks the layer count and each
layer's KV heads and head_dim against the model, and gives the layers one shared model
context again, as ``make_prompt_cache`` does (its ``layers`` list is how cross-layer
caches, ``cache/cross_layer.py``, reach each other; mlx-lm's loader already gives them
back linked, their shared arrays once, in their owner's state).
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import load_prompt_cache as _mlx_lm_load

from ..cache.base import CacheStateError, CompressedKVCache


def _model_kv_shape(model) -> tuple[int, int] | None:
    args = getattr(model, "args", None)
    if args is None:
        return None
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or (args.hidden_size // heads if heads else None)
    return (kv_heads, head_dim) if kv_heads and head_dim else None


def load_prompt_cache(path: str, model: Any = None, return_metadata: bool = False):
    """Load a saved prompt cache; with ``model``, refuse one made for another model."""
    from ..cache.context import ModelContext

    try:
        cache, metadata = _mlx_lm_load(str(path), return_metadata=True)
    except CacheStateError as exc:
        raise CacheStateError(f"{path}: {exc}") from None
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
