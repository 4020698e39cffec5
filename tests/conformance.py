"""What the conformance suite knows about each method: the one place it reads.

A method joins the suite by being implemented. Methods on the eviction base need no
entry: their settings come from their ``roles`` (a small budget to compress, a budget
beyond the context to keep everything). Any other method gives its settings here, and
a method that cannot meet a check says why here (``exempt``), never by skipping quietly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx._generated.deprecations import CONFIG_FIELDS
from veloxquant_mlx.cache.buffers import GrowingArray
from veloxquant_mlx.evict.base import ScoredEvictionCache
from veloxquant_mlx.registry import METHODS

PROMPT = 200  # tokens of the test prompts
BUDGET = 48  # what a compressing setting keeps (or its equivalent)
LOSSLESS = 4096  # a budget beyond every test context


@dataclass
class Profile:
    compressing: dict[str, Any]  # settings under which the test prompt is compressed
    lossless: dict[str, Any] | None  # settings that keep everything (None: there are none)
    lossless_tolerance: float = 0.0  # 0: bit-identical to mlx-lm's KVCache
    evicts: bool = False  # attention sees a subset of the tokens, in full precision
    bound_after_decode: bool = True  # stored_length <= budget holds at decode too
    exempt: dict[str, str] = field(default_factory=dict)  # check -> why it cannot be met


PROFILES: dict[str, Profile] = {
    "full": Profile(compressing={}, lossless={}),
    "streaming_llm": Profile(
        compressing={"stream_n_sink": 4, "stream_window_size": BUDGET - 4},
        lossless={"stream_window_size": LOSSLESS},
        evicts=True,
        exempt={
            "per_layer_budgets": "one window for every layer (its own test sets them per layer)",
        },
    ),
    "kivi": Profile(
        compressing={"kv_bits": 4, "residual_window": 32},
        # A window beyond the context keeps every token in full precision; decode attends
        # through the pure-MLX path (not SDPA), so equal to float rounding, not bitwise.
        lossless={"residual_window": LOSSLESS},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, quantized"},
    ),
}


def profile(method: str) -> Profile:
    if method in PROFILES:
        return PROFILES[method]
    cls = METHODS[method].load_implementation()
    if issubclass(cls, ScoredEvictionCache):
        return Profile(
            compressing={cls.roles.budget: BUDGET},
            lossless={cls.roles.budget: LOSSLESS},
            evicts=True,
            bound_after_decode=bool(cls.schedule.decode_every),
        )
    raise AssertionError(
        f"method {method!r} is implemented but tests/conformance.py has no profile for it: "
        "give its compressing and lossless settings there"
    )


def config(method: str, settings: dict[str, Any]) -> KVCacheConfig:
    own = {k: v for k, v in settings.items() if k in CONFIG_FIELDS}
    options = {k: v for k, v in settings.items() if k not in CONFIG_FIELDS}
    return KVCacheConfig.from_dict({"method": method, "options": options, **own})


def arrays_held(obj, seen=None) -> int:
    """Bytes of every MLX array reachable from a cache's attributes (not its config or
    context): an independent count to hold ``nbytes`` against."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        return obj.nbytes
    if isinstance(obj, GrowingArray):
        return 0 if obj.buffer is None else arrays_held(obj.buffer, seen)
    if isinstance(obj, dict):
        return sum(arrays_held(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(arrays_held(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, (type, KVCacheConfig)):
        return sum(arrays_held(v, seen) for k, v in vars(obj).items() if k not in ("context", "config"))
    return 0


def edit_saved_layer(path, layer, edit):
    """Change one layer's saved state: ``edit(meta: dict[str, str|int], arrays: dict)``."""
    arrays, metadata = mx.load(str(path), return_metadata=True)
    prefix = f"{layer}."
    meta = {}
    for key, value in arrays.items():
        if key.startswith(prefix + "meta."):
            meta[key[len(prefix + "meta."):]] = value
    decoded = {k: ("".join(chr(int(c)) for c in v.tolist()) if v.ndim == 1 and v.size > 1 else v.item())
               for k, v in meta.items() if v.size}
    own = {k[len(prefix + "arrays."):]: v for k, v in arrays.items() if k.startswith(prefix + "arrays.")}
    edit(decoded, own)
    for k, v in decoded.items():
        arrays[prefix + "meta." + k] = mx.array([ord(c) for c in v]) if isinstance(v, str) else mx.array(v)
    for k, v in own.items():
        arrays[prefix + "arrays." + k] = v
    mx.save_safetensors(str(path), arrays, metadata)
