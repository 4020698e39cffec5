"""The state one prompt cache's layers share (built by the cache factory, one per prompt)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import KVCacheConfig


@dataclass
class ModelContext:
    """State shared by the layers of one prompt cache (one per ``make_prompt_cache``).

    Methods that coordinate across layers (per-layer budgets, layers sharing or merging
    their caches) keep that state here, never in globals.
    """

    config: KVCacheConfig
    n_layers: int
    compressed_layers: tuple[int, ...]
    shared: dict[str, Any] = field(default_factory=dict)
    layer_budgets: dict[int, int] = field(default_factory=dict)  # per-layer token budgets
    model_args: Any = None  # the model's ModelArgs (rope_theta, head counts, ...) when known
    # The prompt cache's layers, by layer index (the model's own caches included): how a
    # layer reaches its neighbours' caches (cross-layer methods, cache/cross_layer.py).
    layers: list = field(default_factory=list)
