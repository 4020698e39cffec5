"""The attention hook: mlx-lm model modules call attention through it, so that a layer's
cache can own attention (``attend``).

Each mlx-lm model module imports ``scaled_dot_product_attention`` from
``mlx_lm.models.base`` by name; the hook replaces that name in the module. It hands
attention to the layer's cache when the cache has ``attend`` and calls mlx-lm's function
otherwise. The integration (``integrations/mlx_lm.py``) installs and releases hooks per
patched model; caches that own attention install one from ``update_and_fetch`` when they
were loaded from a file and used with a model nobody patched.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import mlx_lm.models.base as mlx_lm_base

ORIGINAL_SDPA = mlx_lm_base.scaled_dot_product_attention


def hooked_sdpa(queries, keys, values, cache=None, **kwargs):
    attend = getattr(cache, "attend", None)
    if attend is None:
        return ORIGINAL_SDPA(queries, keys, values, cache=cache, **kwargs)
    return attend(queries, keys, values, **kwargs)


@dataclass
class Hook:
    module: Any
    patched_models: int = 0
    sticky: bool = False  # installed by a direct make_prompt_cache call: stays


HOOKS: dict[str, Hook] = {}


def hook_caller_module(caller_globals: dict, cache: Any) -> None:
    """Route the attention of the model module that updated ``cache`` to the cache.

    Called by caches that own attention, from ``update_and_fetch``: a cache loaded with
    ``load_prompt_cache`` and used with a model nobody patched gets the hook here,
    before the model computes anything with it. An mlx-lm model module that does not
    call mlx-lm's shared attention function cannot use such a cache and is refused.
    """
    module_name = caller_globals.get("__name__", "")
    fn = caller_globals.get("scaled_dot_product_attention")
    if fn is hooked_sdpa:
        return
    if fn is ORIGINAL_SDPA:
        module = sys.modules[module_name]
        HOOKS.setdefault(module_name, Hook(module)).sticky = True
        module.scaled_dot_product_attention = hooked_sdpa
    elif module_name.startswith("mlx_lm.models."):
        from .base import AttentionHookMissing

        raise AttentionHookMissing(
            f"{type(cache).__name__} (method {cache.config.method!r}) computes attention "
            f"itself, but {module_name} computes attention inline instead of calling "
            "mlx-lm's scaled_dot_product_attention, so it cannot use this method"
        )
