"""mlx-lm integration: build our caches for a model and route attention to them.

- ``make_prompt_cache(model, config)``: one cache per full-attention layer (layers the
  model gives its own special cache, e.g. sliding-window or state-space layers, keep it),
  plus one ``ModelContext`` shared by the layers of that prompt cache.
- ``patch_model_kv_cache(model, config)``: sets ``model.make_cache`` so that
  ``mlx_lm.generate``, ``stream_generate`` and the server build our caches, fresh for
  every generation, and installs the attention hook; ``unpatch_model_kv_cache`` (or the
  ``patched_kv_cache`` context manager) restores the model exactly.
- ``prefill_with_reconstruction(model, tokenizer, context, cache)``: prefill a context and
  compress it by the method's extra forward passes (KVzip's repeat-the-context probe),
  which mlx-lm's generate cannot run; then generate from the cache as usual.

The attention hook replaces the ``scaled_dot_product_attention`` name that each model
module imported from ``mlx_lm.models.base``. It hands attention to a layer's cache when
that cache has ``attend`` and calls mlx-lm's own function otherwise, so models whose
caches are not ours behave exactly as before.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Any, Callable

import importlib

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..cache.attention_hook import HOOKS, ORIGINAL_SDPA, Hook, hooked_sdpa
from ..cache.base import ends_pipeline_stage
from ..cache.config import KVCacheConfig, head_dim_problem
from ..cache.context import ModelContext, ShardLayout
from ..registry import METHODS


def attention_modules(model: nn.Module) -> list[Any]:
    """The model modules whose attention calls mlx-lm's shared function by name."""
    found = {}
    for _, module in model.named_modules():
        name = type(module).__module__
        mod = sys.modules.get(name)
        if mod is not None and name not in found:
            fn = getattr(mod, "scaled_dot_product_attention", None)
            if fn is ORIGINAL_SDPA or fn is hooked_sdpa:
                found[name] = mod
    return list(found.values())


def _architecture(model: nn.Module) -> str:
    return getattr(model, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1]


def _install_hooks(model: nn.Module, sticky: bool) -> None:
    for mod in attention_modules(model):
        hook = HOOKS.setdefault(mod.__name__, Hook(mod))
        mod.scaled_dot_product_attention = hooked_sdpa
        if sticky:
            hook.sticky = True
        else:
            hook.patched_models += 1


def _release_hooks(model: nn.Module) -> None:
    for mod in attention_modules(model):
        hook = HOOKS.get(mod.__name__)
        if hook is None:
            continue
        hook.patched_models = max(0, hook.patched_models - 1)
        if hook.patched_models == 0 and not hook.sticky:
            mod.scaled_dot_product_attention = ORIGINAL_SDPA
            del HOOKS[mod.__name__]


# -- residual-stream observation (SqueezeAttention) -------------------------------------
# A cache class with ``observes_hidden_states = True`` needs each layer's residual stream
# before the attention block (the decoder block's input, before its input norm) and after
# the attention output is added to it. While such a method is in use, every decoder block
# of ``model.layers`` and its ``self_attn`` get an observing subclass of their own class
# (same name and module; nothing is added to the model or its parameters): the block's
# ``__call__`` notes its input, the attention's ``__call__`` then calls
# ``cache.observe_hidden(block_input, attention_output)`` (after = their sum). A cache
# without ``observe_hidden`` passes straight through. Unpatching gives the original classes back
# when the patch put them in; a direct ``make_prompt_cache`` call leaves them (sticky, as
# the attention hook is).

_OBSERVING: dict[type, type] = {}  # original class -> its observing subclass
_BLOCK_INPUTS: dict[int, tuple] = {}  # id(attention module) -> (block input, cache), in a call


def _block_call(original):
    def __call__(self, x, *args, **kwargs):
        cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
        if not hasattr(cache, "observe_hidden"):
            return original(self, x, *args, **kwargs)
        _BLOCK_INPUTS[id(self.self_attn)] = (x, cache)
        try:
            return original(self, x, *args, **kwargs)
        finally:
            _BLOCK_INPUTS.pop(id(self.self_attn), None)

    return __call__


def _attention_call(original):
    def __call__(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        noted = _BLOCK_INPUTS.pop(id(self), None)
        if noted is not None:
            x, cache = noted
            cache.observe_hidden(x, out)
        return out

    return __call__


def _observed_modules(model: nn.Module) -> list[tuple[Any, Any]]:
    """(module, wrapper) for each decoder block of ``model.layers`` with a ``self_attn``, and for it."""
    found = []
    for block in getattr(model, "layers", None) or []:
        attn = block.get("self_attn") if isinstance(block, dict) else None
        if isinstance(attn, nn.Module):
            found += [(block, _block_call), (attn, _attention_call)]
    return found


def _observing_hidden_states(model: nn.Module) -> bool:
    return any(hasattr(type(m), "_veloxquant_original") for m, _ in _observed_modules(model))


def _observe_hidden_states(model: nn.Module, on: bool) -> None:
    """Give the model's blocks and attention modules their observing classes, or take them back."""
    for module, wrapper in _observed_modules(model):
        cls = type(module)
        original = cls.__dict__.get("_veloxquant_original")
        if on and original is None:
            if cls not in _OBSERVING:
                _OBSERVING[cls] = type(cls.__name__, (cls,), {
                    "__call__": wrapper(cls.__call__), "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__, "_veloxquant_original": cls,
                })
            module.__class__ = _OBSERVING[cls]
        elif not on and original is not None:
            module.__class__ = original


def _observers_for(model: nn.Module, cache_class: type, config: KVCacheConfig, sticky: bool) -> None:
    """Install the observation a cache class asks for; a patch records that it did."""
    if not getattr(cache_class, "observes_hidden_states", False):
        return
    if not _observed_modules(model):
        raise ValueError(
            f"method {config.method!r} measures each layer's residual stream around "
            f"its attention, but the {_architecture(model)!r} model has no decoder blocks "
            "with a self_attn module in model.layers"
        )
    owned = not sticky and not _observing_hidden_states(model)
    _observe_hidden_states(model, True)
    if owned:
        object.__setattr__(model, "_veloxquant_observers", True)
    elif sticky:  # a direct call: the observation stays, whatever a patch did
        model.__dict__.pop("_veloxquant_observers", None)


def _native_caches(model: nn.Module) -> list[Any]:
    """What mlx-lm would build for this model, ignoring our own patch."""
    native = model.__dict__.get("_veloxquant_native_make_cache")
    if native is not None:
        return native()
    if hasattr(model, "make_cache") and "_veloxquant_config" not in model.__dict__:
        return model.make_cache()
    return [KVCache() for _ in model.layers]


def model_head_dim(model: nn.Module) -> int | None:
    """The model's attention head_dim from its args, when they say."""
    args = getattr(model, "args", None)
    head_dim = getattr(args, "head_dim", None)
    if not isinstance(head_dim, int):
        hidden, heads = getattr(args, "hidden_size", None), getattr(args, "num_attention_heads", None)
        head_dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
    return head_dim


def head_dim_problem_for(config: KVCacheConfig, model: nn.Module) -> str | None:
    """A field of ``config`` that must divide the model's head_dim and does not, or None."""
    head_dim = model_head_dim(model)
    return head_dim_problem(config, head_dim) if head_dim else None


def _check_supported(model: nn.Module, cache_class: type, config: KVCacheConfig) -> None:
    problem = head_dim_problem_for(config, model)
    if problem:
        raise ValueError(f"method {config.method!r}: {problem}")
    if cache_class.requires_attention_hook and not attention_modules(model):
        raise ValueError(
            f"method {config.method!r} computes attention itself, but the "
            f"{_architecture(model)!r} architecture does not call mlx-lm's "
            "scaled_dot_product_attention (it computes attention inline), so the method "
            "cannot be hooked in; methods that work here: "
            + ", ".join(
                k for k, m in METHODS.items()
                if m.implemented and not m.load_implementation().requires_attention_hook
            )
        )


def make_prompt_cache(model: nn.Module, config: KVCacheConfig | None = None, **_ignored) -> list[Any]:
    """One cache per layer for ``config.method``; the model's special layers keep theirs.

    Extra keyword arguments (mlx-lm's ``max_kv_size``) are accepted and ignored: the
    method's own options bound the cache.
    """
    return _make_prompt_cache(model, config or KVCacheConfig(), sticky=True)


def _make_prompt_cache(model: nn.Module, config: KVCacheConfig, sticky: bool) -> list[Any]:
    cache_class = METHODS[config.method].load_implementation()
    _check_supported(model, cache_class, config)
    native = _native_caches(model)
    layers = tuple(i for i, c in enumerate(native) if type(c) is KVCache)
    if not layers:
        raise ValueError(
            f"the {_architecture(model)!r} model has no full-attention KV cache layer "
            f"to compress (its caches: {sorted({type(c).__name__ for c in native})})"
        )
    shard = shard_layout(model, len(native))
    first = shard.first_layer
    n_layers, layers = _global_layers(shard, len(native), tuple(first + i for i in layers))
    context = ModelContext(config, n_layers, layers, model_args=getattr(model, "args", None),
                           shard=shard)
    if sticky:  # a patched model's hooks are installed (and counted) by the patch
        _install_hooks(model, sticky=True)
    _observers_for(model, cache_class, config, sticky)
    local = [cache_class(config, context, first + i) if first + i in layers else c
             for i, c in enumerate(native)]
    context.layers = [None] * first + local + [None] * (n_layers - first - len(local))
    if shard.pipelined:
        ends_pipeline_stage(local[-1])
    for c in local:
        check = getattr(c, "check_layout", None)
        if check is not None:
            check()
    return local


def shard_layout(model: nn.Module, n_local: int) -> ShardLayout:
    """How mlx-lm sharded ``model`` across processes (see cache/context.py)."""
    body = getattr(model, "model", None)
    size = getattr(body, "pipeline_size", 1)
    tensor_group = next((getattr(getattr(m, "k_proj", None), "group", None)
                         for m in (getattr(b, "self_attn", None) for b in model.layers)), None)
    if size <= 1:
        return ShardLayout(stages=((0, n_local),), tensor_group=tensor_group)
    group = mx.distributed.init()
    rank = body.pipeline_rank
    if group.size() != size or group.rank() != rank:
        raise ValueError(
            f"the model is pipelined over {size} ranks (this is rank {rank}), but "
            f"mx.distributed.init() gives a group of {group.size()} (rank {group.rank()}); "
            "allowed: a pipeline over the whole distributed group (VeloxQuant combines "
            "per-layer quantities across it)")
    settle_generation()
    bounds = mx.zeros((size, 2), mx.int32)
    bounds[rank] = mx.array([body.start_idx, body.start_idx + n_local])
    # Cache construction, not a decode step: each rank learns the others' layers once.
    bounds = mx.distributed.all_sum(bounds, group=group).tolist()
    return ShardLayout(stages=tuple((s, e) for s, e in bounds), pipeline_rank=rank,
                       pipeline_group=group, tensor_group=tensor_group)


def settle_generation() -> None:
    """Wait for the step mlx-lm's generate_step computes ahead on its own stream: on a
    sharded model it holds collectives, and collectives of two streams at once crash the
    ring back-end (segfault, measured with mlx 0.32.4)."""
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)


def _global_layers(shard: ShardLayout, n_local: int, local_compressed: tuple[int, ...]):
    """The model's layer count and its compressed layers, over every pipeline rank."""
    if not shard.pipelined:
        return n_local, local_compressed
    n_layers = max(e for _, e in shard.stages)
    flags = mx.zeros((n_layers,), mx.int32)
    if local_compressed:
        flags[mx.array(local_compressed)] = 1
    flags = mx.distributed.all_sum(flags, group=shard.pipeline_group).tolist()
    return n_layers, tuple(i for i, f in enumerate(flags) if f)


def patch_model_kv_cache(model: nn.Module, config: KVCacheConfig) -> nn.Module:
    """Make every mlx-lm generation with ``model`` use ``config``'s caches.

    Sets ``model.make_cache`` (mlx-lm's ``make_prompt_cache`` calls it for generate,
    stream_generate and the server) and installs the attention hook for the model's
    architecture. Patching again replaces the config. Returns the model.
    """
    if not isinstance(config, KVCacheConfig):
        raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
    cache_class = METHODS[config.method].load_implementation()
    _check_supported(model, cache_class, config)
    if "_veloxquant_config" not in model.__dict__:
        previous = model.__dict__.get("make_cache")
        native = model.make_cache if hasattr(model, "make_cache") else None
        object.__setattr__(model, "_veloxquant_previous_make_cache", previous)
        object.__setattr__(model, "_veloxquant_native_make_cache", native)
        _install_hooks(model, sticky=False)
    object.__setattr__(model, "_veloxquant_config", config)
    object.__setattr__(
        model, "make_cache", lambda: _make_prompt_cache(model, model._veloxquant_config, False)
    )
    return model


def unpatch_model_kv_cache(model: nn.Module) -> nn.Module:
    """Undo ``patch_model_kv_cache``: the model and mlx-lm behave exactly as before."""
    if "_veloxquant_config" not in model.__dict__:
        return model
    previous = model.__dict__["_veloxquant_previous_make_cache"]
    if model.__dict__.get("_veloxquant_observers"):
        _observe_hidden_states(model, False)
    for name in ("_veloxquant_config", "_veloxquant_previous_make_cache",
                 "_veloxquant_native_make_cache", "_veloxquant_observers", "make_cache"):
        model.__dict__.pop(name, None)
    if previous is not None:
        object.__setattr__(model, "make_cache", previous)
    _release_hooks(model)
    return model


@contextlib.contextmanager
def patched_kv_cache(model: nn.Module, config: KVCacheConfig):
    """``with patched_kv_cache(model, config): mlx_lm.generate(model, ...)``."""
    patch_model_kv_cache(model, config)
    try:
        yield model
    finally:
        unpatch_model_kv_cache(model)


# -- batched generation ------------------------------------------------------------------
# mlx-lm's BatchGenerator joins each layer's caches with ``_merge_caches``, which raises a
# generic "<class> does not yet support batching with history" for a cache without
# ``merge``. For our caches the error names the method and the methods that batch.
mlx_lm_generate = importlib.import_module("mlx_lm.generate")  # the module (mlx_lm.generate is a function)
_ORIGINAL_MERGE_CACHES = getattr(mlx_lm_generate, "_merge_caches", None)


def _merge_caches(caches):
    from ..cache.base import CompressedKVCache
    from ..cache.batch import refusal

    for cache in caches[0] if caches else ():
        if isinstance(cache, CompressedKVCache) and not hasattr(cache, "merge"):
            raise ValueError(refusal(cache))
    return _ORIGINAL_MERGE_CACHES(caches)


if _ORIGINAL_MERGE_CACHES is not None and getattr(_ORIGINAL_MERGE_CACHES, "__module__", "") != __name__:
    mlx_lm_generate._merge_caches = _merge_caches


def batch_refusal(model: nn.Module) -> str | None:
    """Why ``model``'s caches cannot be batched by mlx-lm (None: they can)."""
    from mlx_lm.models.cache import make_prompt_cache as mlx_lm_make_prompt_cache

    from ..cache.base import CompressedKVCache
    from ..cache.batch import refusal

    for cache in mlx_lm_make_prompt_cache(model):
        if not hasattr(cache, "merge"):
            if isinstance(cache, CompressedKVCache):
                return refusal(cache)
            return f"{type(cache).__name__} layers of this model do not batch in mlx-lm"
    return None


# -- admission by KV memory (issue 32) ------------------------------------------------------
PROBE_TOKENS = 512  # tokens of the probe whose cache is measured: a multiple of growth steps


def measured_kv_bytes_per_token(model: nn.Module, tokens: int = PROBE_TOKENS) -> float:
    """Bytes one token of a sequence holds in ``model``'s (patched) caches: every layer's
    ``nbytes`` (spare room included) after a probe of ``tokens`` tokens, over ``tokens``."""
    import mlx.core as mx

    cache = model.make_cache()
    probe = mx.arange(tokens, dtype=mx.int32) % 7 + 1  # any tokens: the cache's size is the same
    for start in range(0, tokens, 256):
        model(probe[start:start + 256][None], cache=cache)
        mx.eval([c.state for c in cache])
    return sum(c.nbytes for c in cache) / tokens


class KVAdmission:
    """Admits requests while their caches fit ``budget`` bytes, first come first served.

    A request's need is ``bytes_per_token * (prompt + max_tokens)``; one that can never fit
    is refused (``refusal``); one that does not fit now waits (``admitted``) until requests
    before it have finished, so that the caches held never exceed the budget.
    """

    def __init__(self, budget: int, bytes_per_token: float, method: str):
        import collections
        import threading

        self.budget, self.bytes_per_token, self.method = budget, bytes_per_token, method
        self.in_use = 0
        self._waiting: collections.deque = collections.deque()
        self._changed = threading.Condition()

    def need(self, tokens: int) -> int:
        return math.ceil(self.bytes_per_token * tokens)

    def refusal(self, prompt_tokens: int, max_tokens: int) -> str | None:
        need = self.need(prompt_tokens + max_tokens)
        if need <= self.budget:
            return None
        most = int(self.budget // self.bytes_per_token)
        return (f"prompt of {prompt_tokens} tokens + max_tokens={max_tokens}: its KV cache needs "
                f"{need} bytes ({self.bytes_per_token:.1f} bytes a token, measured for method "
                f"{self.method!r}), over the server's --kv-memory budget of {self.budget} bytes; "
                f"allowed: prompt + max_tokens of at most {most} tokens")

    @contextlib.contextmanager
    def admitted(self, need: int):
        ticket = object()
        with self._changed:
            self._waiting.append(ticket)
            if self._waiting[0] is not ticket or self.in_use + need > self.budget:
                print(f"veloxquant: request queued: it needs {need} bytes of KV cache, {self.in_use} "
                      f"of the {self.budget} bytes budgeted are held", file=sys.stderr, flush=True)
            while self._waiting[0] is not ticket or self.in_use + need > self.budget:
                self._changed.wait()
            self._waiting.popleft()
            self.in_use += need
            self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                self.in_use -= need
                self._changed.notify_all()


def patch_server(server_module: Any, config: KVCacheConfig, batching: bool = True,
                 kv_memory: int | None = None) -> None:
    """Make ``mlx_lm.server`` patch every model it loads with ``config``.

    ``kv_memory``: bytes of KV cache the requests being answered may hold together; each
    loaded model's bytes per token is measured once (``measured_kv_bytes_per_token``) and
    requests are admitted, queued or refused by ``KVAdmission``.

    When the method batches (``cache/batch.py``) the server batches continuously as it does
    with mlx-lm's own caches: requests join the batch while others decode and leave when
    they finish; its LRU prompt cache keeps each finished sequence's (extracted) cache.
    Otherwise, or with ``batching=False``, it serves requests one at a time through
    ``stream_generate`` (its LRU prompt cache copies and trims ours).
    """
    provider = server_module.ModelProvider
    original = provider.__dict__.get("_veloxquant_original_load", provider._load)

    def _load(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        patch_model_kv_cache(self.model, config)
        why = batch_refusal(self.model) if batching else "batching turned off"
        if self.draft_model is not None:
            why = why or "speculative decoding (a draft model) is served one request at a time"
        if getattr(getattr(self, "cli_args", None), "kv_bits", None) is not None:
            why = why or "mlx-lm's --kv-bits serves one request at a time"
        self.is_batchable = why is None
        if kv_memory is not None:
            per_token = measured_kv_bytes_per_token(self.model)
            self._veloxquant_admission = KVAdmission(kv_memory, per_token, config.method)
            print(f"veloxquant: KV budget {kv_memory} bytes, {per_token:.1f} bytes a token "
                  f"(measured on a {PROBE_TOKENS}-token probe): about {int(kv_memory // per_token)} "
                  "tokens held at once", file=sys.stderr, flush=True)
        how = ("continuous batching (a request with a seed is served on its own, as mlx-lm does)"
               if why is None else f"one request at a time ({why.split(':')[0]})")
        print(
            f"veloxquant: serving {self.model_key[0]} with KV cache method {config.method!r}, {how}",
            file=sys.stderr,
            flush=True,
        )
        return result

    provider._veloxquant_original_load = original
    provider._load = _load
    server_module._veloxquant_kv_memory = kv_memory
    _tolerate_missing_hub_cache(server_module)
    _note_http_served(server_module)
    _bound_requests(server_module)


# Set on the server module once its HTTP server has run in this process (``veloxquant
# serve`` then leaves without Python's finalization: see cli.cmd_serve).
SERVED_FLAG = "_veloxquant_http_served"


def _note_http_served(server_module: Any) -> None:
    run_http = getattr(server_module, "_run_http_server", None)
    if run_http is None or getattr(run_http, "_veloxquant_noting", False):
        return

    def _run_http_server(*args, **kwargs):
        setattr(server_module, SERVED_FLAG, True)
        return run_http(*args, **kwargs)

    _run_http_server._veloxquant_noting = True
    server_module._run_http_server = _run_http_server


def context_limits(model: nn.Module) -> list[tuple[str, int, str]]:
    """The limits a sequence of a patched ``model`` must keep: (what, tokens, "prompt" or
    "sequence"): the model's positions, and each ``*_max_ctx`` field of the method's options
    (a cache class says ``max_ctx_covers = "prompt"`` when its field bounds the first prompt
    only, as xkv's does)."""
    import dataclasses

    limits = []
    args = getattr(model, "args", None)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(args, key, None)
        if isinstance(value, int) and value > 0:
            limits.append((f"the model's {key}={value}", value, "sequence"))
            break
    config = model.__dict__.get("_veloxquant_config")
    options = getattr(config, "options", None)
    if options is not None and dataclasses.is_dataclass(options):
        covers = getattr(METHODS[config.method].load_implementation(), "max_ctx_covers", "sequence")
        for field in dataclasses.fields(options):
            value = getattr(options, field.name)
            if field.name.endswith("_max_ctx") and isinstance(value, int):
                limits.append((f"{field.name}={value} (method {config.method!r})", value, covers))
    return limits


def request_bounds(model: nn.Module, prompt_tokens: int, max_tokens: int) -> tuple[str | None, int]:
    """(why the request is refused, or None; the max_tokens to generate: ``max_tokens``
    capped so that the prompt and the generated tokens stay within every sequence limit)."""
    cap = max_tokens
    for what, limit, covers in context_limits(model):
        if prompt_tokens > limit or (covers == "sequence" and prompt_tokens >= limit):
            bounds = "the prompt" if covers == "prompt" else "the prompt and the generated tokens"
            return (f"prompt of {prompt_tokens} tokens: over {what}, which bounds {bounds}; "
                    f"allowed: a prompt of at most {limit - (covers == 'sequence')} tokens"), 0
        if covers == "sequence":
            cap = min(cap, limit - prompt_tokens)
    return None, cap


class _ClientGone(Exception):
    """The client of a non-streaming request closed its connection while it generated."""


def _peer_closed(sock) -> bool:
    """Whether the other end of a connected socket has closed it (without reading from it)."""
    import select
    import socket

    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):
        return True


def _bound_requests(server_module: Any) -> None:
    """Bound what one request can make the server do.

    - Before a completion request is queued, its prompt is tokenized and checked against
      ``context_limits``: over a limit, HTTP 400 at once, naming it (it used to prefill for
      minutes behind other requests and fail without a response); ``max_tokens`` is capped
      so that prompt + generated tokens stay within the model's positions and the method's
      limits (``max_tokens=10**30`` generated unbounded).
    - A non-streaming request whose client closed its connection stops generating at the
      next token (it kept the one-at-a-time server busy, and later requests waited).
    - When the server stops (Ctrl-C), every request still generating stops at its next token,
      so that mlx-lm's join of its generation thread returns.
    """
    import json
    import logging
    import threading
    import time
    import weakref
    from types import SimpleNamespace

    handler_class = getattr(server_module, "APIHandler", None)
    generator_class = getattr(server_module, "ResponseGenerator", None)
    if handler_class is None or generator_class is None or getattr(handler_class, "_veloxquant_bounded", False):
        return
    local = threading.local()
    live = weakref.WeakValueDictionary()  # id -> the context of a request being answered
    handle_completion = handler_class.handle_completion
    generate = generator_class.generate
    stop_and_join = generator_class.stop_and_join

    def refusal(handler, request) -> str | None:
        provider = handler.response_generator.model_provider
        model, tokenizer = getattr(provider, "model", None), getattr(provider, "tokenizer", None)
        key = getattr(provider, "model_key", None) or (None,)
        if model is None or tokenizer is None or "_veloxquant_config" not in model.__dict__:
            return None  # not loaded yet: the generation thread's own errors apply
        if getattr(handler, "requested_model", "default_model") not in (
                "default_model", key[0], getattr(provider.cli_args, "model", None)):
            return None  # another model: it is loaded (and checked) by the generation thread
        image_parts = getattr(server_module, "_image_parts", None)
        if image_parts is not None and request.request_type == "chat" and any(image_parts(request.messages)):
            return None  # images are decoded once, by the generation thread
        try:
            prompt = handler.response_generator._tokenize(
                tokenizer, request, SimpleNamespace(chat_template_kwargs=handler.chat_template_kwargs))[0]
        except Exception:
            return None  # the server's own path reports what it cannot tokenize
        why, cap = request_bounds(model, len(prompt), handler.max_tokens)
        if why is None and cap < handler.max_tokens:
            logging.info(f"veloxquant: max_tokens {handler.max_tokens} capped at {cap} "
                         f"(a prompt of {len(prompt)} tokens and the limits {context_limits(model)})")
            handler.max_tokens = cap
        admission = getattr(provider, "_veloxquant_admission", None)
        if why is None and admission is not None:
            why = admission.refusal(len(prompt), handler.max_tokens)
            handler._veloxquant_need = admission.need(len(prompt) + handler.max_tokens)
        return why

    def bounded_handle_completion(self, request, stop_words):
        why = refusal(self, request)
        if why is not None:
            body = json.dumps({"error": why}).encode()
            self._set_completion_headers(400)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        local.connection = None if self.stream else self.connection
        provider = self.response_generator.model_provider
        admission = getattr(provider, "_veloxquant_admission", None)
        need = self.__dict__.pop("_veloxquant_need", None)
        if admission is None and getattr(server_module, "_veloxquant_kv_memory", None) is not None:
            # the model is still loading (its bytes per token not yet measured): nothing is
            # admitted unmeasured, so wait for it, then check this request like any other
            while getattr(provider, "_veloxquant_admission", None) is None and \
                    self.response_generator.generation_available():
                time.sleep(0.1)
            return bounded_handle_completion(self, request, stop_words)
        held = admission.admitted(need) if admission is not None and need is not None else contextlib.nullcontext()
        try:
            with held:
                return handle_completion(self, request, stop_words)
        except (_ClientGone, BrokenPipeError, ConnectionResetError):  # streaming: a write failed
            logging.info("veloxquant: the client closed its connection; its request stopped generating")
        finally:
            local.connection = None

    def watched_generate(self, *args, **kwargs):
        ctx, responses = generate(self, *args, **kwargs)
        live[id(ctx)] = ctx
        connection = getattr(local, "connection", None)
        if connection is None:
            return ctx, responses

        def watched():
            checked = time.monotonic()
            for response in responses:
                yield response
                if time.monotonic() - checked > 0.2:
                    checked = time.monotonic()
                    if _peer_closed(connection):
                        ctx.stop()
                        raise _ClientGone()

        return ctx, watched()

    def stopping_stop_and_join(self):
        for ctx in list(live.values()):
            ctx.stop()
        return stop_and_join(self)

    handler_class.handle_completion = bounded_handle_completion
    generator_class.generate = watched_generate
    generator_class.stop_and_join = stopping_stop_and_join
    handler_class._veloxquant_bounded = True


def _tolerate_missing_hub_cache(server_module: Any) -> None:
    """``GET /v1/models`` lists the models in the Hugging Face cache; where there is no such
    cache (a machine that never downloaded one) mlx-lm's scan raised and the server logged
    a traceback for each request. No cache lists no downloaded models."""
    scan = getattr(server_module, "scan_cache_dir", None)
    if scan is None or getattr(scan, "_veloxquant_tolerant", False):
        return
    from types import SimpleNamespace

    from huggingface_hub.errors import CacheNotFound

    def scan_cache_dir(*args, **kwargs):
        try:
            return scan(*args, **kwargs)
        except CacheNotFound:
            return SimpleNamespace(repos=frozenset(), size_on_disk=0, warnings=[])

    scan_cache_dir._veloxquant_tolerant = True
    server_module.scan_cache_dir = scan_cache_dir


# -- scoring passes: extra forward passes a method scores with (KVzip) ------------------------
# mlx-lm's generate_step prefills the prompt itself and calls the model nothing else, so a
# method whose scores come from the model re-reading something (KVzip's "repeat the
# previous context" probe) is driven from here: prefill the context, run the probes through
# the same caches (each layer scores them and drops their KV again), rank every layer at
# once, then hand the cache to generate/stream_generate for the question or the last
# prompt token. A cache layer takes part when its class sets ``scores_by_reconstruction``.


def reconstruction_layers(cache: list) -> list:
    """The layers of a prompt cache that score by a reconstruction pass (empty: none)."""
    return [c for c in cache if getattr(c, "scores_by_reconstruction", False)]


def _other_layers_saved(cache: list, layers: list) -> list:
    """The model's own layer caches (sliding window, ...), to put back after a probe."""
    ours = {id(c) for c in layers}
    return [(c, c.state, getattr(c, "meta_state", None)) for c in cache if id(c) not in ours]


def run_reconstruction_pass(model: nn.Module, tokenizer, context_ids: list[int], cache: list,
                            progress: Callable[[int, int], None] | None = None) -> None:
    """Run the method's probes over a prefilled context: each layer keeps its scores in
    ``reliance`` (B, Hkv, T); the cache holds exactly the context again afterwards.

    ``progress(done, total)`` is called with ``done=0`` before the first probe chunk, then
    after each chunk is evaluated; an exception it raises (KeyboardInterrupt) stops the pass
    there, the cache restored to the context."""
    import mlx.core as mx

    layers = reconstruction_layers(cache)
    body = getattr(model, "model", model)  # hidden states only: the probes need no logits
    chunks = list(type(layers[0]).probe_chunks_for(tokenizer, context_ids))
    if progress is not None:
        progress(0, len(chunks))
    for done, (start, end, probe) in enumerate(chunks, 1):
        others = _other_layers_saved(cache, layers)
        for c in layers:
            c.begin_probe(start, end)
        try:
            mx.eval(body(mx.array(probe)[None], cache=cache), [c.reliance for c in layers])
        finally:
            for c in layers:
                c.end_probe()
            for c, state, meta in others:
                c.state = state
                if meta is not None:
                    c.meta_state = meta
        if progress is not None:
            progress(done, len(chunks))


def prefill_with_reconstruction(model: nn.Module, tokenizer, context, cache: list,
                                prefill_step_size: int = 2048,
                                progress: Callable[[int, int], None] | None = None) -> dict:
    """Prefill ``context`` (text, or token ids) into a fresh ``cache`` and compress it by
    the method's reconstruction pass; returns the seconds each part took.

    ``progress(done, total)``: called before (``done=0``) and after each chunk of the reconstruction pass (a
    KeyboardInterrupt raised there, or arriving during a chunk, stops the pass after that
    chunk; the selection does not run).

    Then continue as usual: ``mlx_lm.stream_generate(model, tokenizer, question,
    prompt_cache=cache)`` (a deep copy of the cache answers each of several questions).
    KVzip needs this step; without it a prompt that ends over the budget is compressed
    by its documented fall-back (which warns). Batch size 1: run it on each sequence's
    cache, then batch them (``batch_generate(..., prompt_caches=...)``): each sequence
    keeps the choice its own pass made.
    """
    import time

    import mlx.core as mx

    from ..cache.batch import BatchCache

    if any(isinstance(c, BatchCache) for c in cache):
        raise ValueError(
            "prefill_with_reconstruction: this is a batch's cache (merged by mlx-lm's batching); "
            "the pass probes one sequence's context: run it on each sequence's own cache "
            "(make_prompt_cache), then batch the questions with batch_generate(..., "
            "prompt_caches=[...]) or BatchGenerator.insert(..., caches=[...])")
    layers = reconstruction_layers(cache)
    if not layers:
        methods = sorted({getattr(getattr(c, "config", None), "method", type(c).__name__) for c in cache})
        raise ValueError(f"prefill_with_reconstruction: no layer of this cache scores by a "
                         f"reconstruction pass (its methods: {methods}); only kvzip does")
    ids = list(tokenizer.encode(context)) if isinstance(context, str) else [int(t) for t in context]
    if not ids:
        raise ValueError("prefill_with_reconstruction: the context is empty")
    for c in layers:
        c.begin_reconstruction()
    settle_generation()
    start = time.perf_counter()
    for i in range(0, len(ids), prefill_step_size):
        model(mx.array(ids[i : i + prefill_step_size])[None], cache=cache)
        mx.eval([c.state for c in cache])
    prefilled = time.perf_counter()
    run_reconstruction_pass(model, tokenizer, ids, cache, progress)
    type(layers[0]).select_globally(layers)
    mx.eval([c.state for c in cache])
    done = time.perf_counter()
    return {"prefill_s": prefilled - start, "reconstruction_s": done - prefilled}
