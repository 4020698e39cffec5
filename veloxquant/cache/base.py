"""The cache protocol every VeloxQuant method implements.

mlx-lm calls ``cache.update_and_fetch(keys, values)`` per layer with post-RoPE keys of
shape ``(B, n_kv_heads, L, head_dim)``, reading ``cache.offset`` first for RoPE, and then
attention. Our caches keep the logical ``offset`` (it never shrinks when tokens are
evicted) separate from ``stored_length``, report ``nbytes`` from the arrays they really
keep, round-trip through ``save_prompt_cache``/``load_prompt_cache`` via ``state``, and may
own attention through ``attend``: the integration routes each layer's attention there.

Names mlx-lm duck-types are avoided on purpose: no ``bits`` (it would route attention to
mlx-lm's quantized path), no ``to_quantized`` (``kv_bits`` would silently replace us).
``merge`` (mlx-lm's batching and the server's continuous batching look for it) exists only
on classes that opted into batching (``batchable``, see ``cache/batch.py``): it returns
our own batch cache, never a stock ``BatchKVCache``; on every other class it raises
AttributeError, so ``hasattr(cache, "merge")`` is False and mlx-lm does not batch it.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sys
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from .attention_hook import hook_caller_module, hooked_sdpa
from .buffers import GrowingArray
from .config import KVCacheConfig

# Every cache class registers here and, by bare name, in mlx_lm.models.cache, where
# load_prompt_cache looks classes up.
CACHE_CLASSES: dict[str, type] = {}
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def causal_mask(n_queries: int, n_keys: int) -> mx.array:
    """Lower-right aligned causal mask: query i sees keys [0, n_keys - n_queries + i]."""
    q = mx.arange(n_keys - n_queries, n_keys)[:, None]
    return q >= mx.arange(n_keys)[None]


class CacheStateError(ValueError):
    """A cache's state contradicts its config, itself, or the model it is used with."""


class AttentionHookMissing(RuntimeError):
    """A cache that owns attention was updated twice without being asked to attend."""


def _method_mismatch(cls: type, method: str) -> str | None:
    """The methods ``cls`` implements, when ``method`` is not one of them."""
    from ..registry import METHODS

    info = METHODS[method]
    if info.implemented and issubclass(cls, info.load_implementation()):
        return None
    owners = [k for k, m in METHODS.items() if (m.implementation or "").endswith(":" + cls.__name__)]
    return " or ".join(map(repr, owners)) or "none"


class _BatchMerge:
    """``cache.merge(caches)`` for classes that batch (``cache/batch.py``); AttributeError,
    naming the method, for the others (so that ``hasattr(cache, "merge")`` is False)."""

    def __get__(self, obj, owner):
        from .batch import batch_mode, merge

        config = getattr(obj, "config", None)
        stored = getattr(config, "storage", None) is not None  # no packed batch of quantized slots
        if batch_mode(owner) is None or stored:
            method = getattr(config, "method", None)
            raise AttributeError(
                f"{owner.__name__}" + (f" (method {method!r})" if method else "")
                + (" with a storage" if stored else "") + " does not batch: it has no merge"
            )
        return functools.partial(merge, owner)


_frame = sys._getframe
_MODEL_CODE = "mlx_lm.models."  # the modules whose pipeline code sets ``cache.keys``


class _PipelineKeys:
    """``cache.keys`` as mlx-lm's pipeline-sharded models use it.

    Every rank but the last stage ends its forward with
    ``cache[-1].keys = mx.depends(cache[-1].keys, h)``: the send of ``h`` to the next stage
    must run whenever the cache is evaluated (mlx-lm evaluates only ``c.state`` after each
    prompt chunk, and the next stage waits for that send). Our caches keep no ``keys``
    array of that meaning, so model code reads a token and the value it sets is held in
    ``_after_send``: ``state`` carries its dependency until the next update, whose incoming
    keys then carry it into everything the cache computes and stores. A method that keeps
    its own storage under the name ``keys`` (xkv, minicache) still reads and writes that
    storage: only model code sees the token.
    """

    def __get__(self, obj, owner):
        if obj is None:
            return self
        d = obj.__dict__
        own = d.get("keys", _NO_KEYS)
        # xkv and minicache read their own ``keys`` at every decode step: a frame costs ~1 us,
        # so it is looked at only on the one cache a pipeline stage's code touches
        if own is not _NO_KEYS and ("_ends_stage" not in d or not _frame(1).f_globals.get(
                "__name__", "").startswith(_MODEL_CODE)):
            return own
        pending = obj.__dict__.get("_after_send")
        return mx.array(0, dtype=mx.int32) if pending is None else pending

    def __set__(self, obj, value):
        if isinstance(value, mx.array) and _frame(1).f_globals.get("__name__", "").startswith(_MODEL_CODE):
            obj.__dict__["_after_send"] = value
        else:
            obj.__dict__["keys"] = value


_NO_KEYS = object()


def ends_pipeline_stage(cache) -> None:
    """Mark the last cache of a pipeline stage (``cache[-1]``, which mlx-lm's pipeline code
    gives the send dependency): only there does ``keys`` look at who asks."""
    if isinstance(cache, CompressedKVCache):
        cache.__dict__["_ends_stage"] = True


def _carry_pipeline_dependency(update):
    """``update_and_fetch`` whose incoming keys depend on what the pipeline set (see
    ``_PipelineKeys``), so the previous stage's send is ordered before this update."""

    @functools.wraps(update)
    def update_and_fetch(self, keys, values):
        after_send = self.__dict__.pop("_after_send", None)
        if after_send is not None:
            keys = mx.depends(keys, after_send)
        return update(self, keys, values)

    update_and_fetch._carries_pipeline_dependency = True
    return update_and_fetch


class CompressedKVCache:
    """Base class: shared bookkeeping, masks, state, and plain attention.

    Subclasses implement ``update_and_fetch``, ``stored_length``, ``_arrays`` (what is
    kept) and, when they store more than arrays, ``_meta``/``_restore_meta``. A subclass
    that can only be correct when it computes attention itself sets
    ``requires_attention_hook = True`` and overrides ``attend``.
    """

    requires_attention_hook = False
    # Whether tokens leave the cache (eviction): a cache that keeps every token must hold
    # exactly ``offset`` of them, which is how a saved state's offset is checked.
    evicts_tokens = False
    # Whether the class holds its kept tokens in ``config.storage`` (eviction + quantization)
    takes_storage = False
    # Batched generation is opt-in per class, never inherited: a class sets ``batchable``
    # (True or "per_sequence") in its own body; ``cache.batch.batch_mode(cls)`` says how it
    # batches (None: it does not).
    merge = _BatchMerge()
    keys = _PipelineKeys()

    def __init__(self, config: KVCacheConfig, context: Any = None, layer: int = 0):
        self.config = config
        self.context = context
        self.layer = layer
        self.offset = 0
        self.kv_shape: tuple[int, ...] | None = None  # (B, H, D_k, D_v), from the first update
        self._awaiting_attend = False
        if getattr(config, "storage", None) is not None and not self.takes_storage:
            raise ValueError(
                f"storage={type(config.storage).__name__}(...) with method={config.method!r}: "
                f"{type(self).__name__} keeps its tokens in buffers of its own; storage is "
                "taken by the eviction methods built on the scorer base (evict/base.py)")
        self._init_storage()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        CACHE_CLASSES[cls.__name__] = cls
        update = cls.__dict__.get("update_and_fetch")
        if update is not None and not getattr(update, "_carries_pipeline_dependency", False):
            cls.update_and_fetch = _carry_pipeline_dependency(update)
        import mlx_lm.models.cache as mlx_lm_cache

        setattr(mlx_lm_cache, cls.__name__, cls)

    # -- what subclasses provide -------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        raise NotImplementedError

    @property
    def stored_length(self) -> int:
        """Tokens whose keys and values the cache keeps (any precision)."""
        raise NotImplementedError

    def _arrays(self) -> dict[str, Any]:
        """What the cache keeps, by attribute name: arrays, ``GrowingArray``s or None."""
        raise NotImplementedError

    def _meta(self) -> dict[str, Any]:
        return {}

    def _layout_problems(self):
        """(field, found, expected) for each array whose shape contradicts the config."""
        return iter(())

    def _state_problems(self):
        """(field, found, expected) for each way the state contradicts its config or itself."""
        return iter(())

    def _check_shape(self, keys: mx.array, values: mx.array) -> None:
        """Every update must bring keys and values of the shape the cache holds."""
        (b, h, _, d_k), d_v = keys.shape, values.shape[3]
        shape = (b, h, d_k, d_v)
        if self.kv_shape is None:
            self.kv_shape = shape
        elif shape != self.kv_shape:
            raise CacheStateError(
                f"layer {self.layer} ({type(self).__name__}, method {self.config.method!r}) "
                f"holds batch x kv heads x key/value head_dim {self.kv_shape}, but the model "
                f"gives {shape}: this cache was made for another model"
            )

    def _restore_meta(self, meta: dict[str, Any]) -> None:
        pass

    def _rows_returned(self, n_new: int) -> int:
        """How many key rows the next update of ``n_new`` tokens will attend over."""
        return self.stored_length + n_new

    # -- attention ---------------------------------------------------------------
    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        """Attention over what ``update_and_fetch`` returned, with this layer's mask.

        mlx-lm builds one mask from the first layer's cache and shares it; an array mask
        is rebuilt here from this layer's own rows, so layers may differ in length.
        """
        self._awaiting_attend = False
        if isinstance(mask, mx.array):
            mask = causal_mask(queries.shape[2], keys.shape[2])
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks
        )

    def _own_attention_begins(self, sinks) -> None:
        """For a cache that computes attention itself: the hook's call has come, and the
        model's learned sink logits are refused (that attention has no term for them)."""
        self._awaiting_attend = False
        if sinks is not None:
            raise NotImplementedError(
                f"method {self.config.method!r} does not support attention sinks (the model's "
                "learned sink logits) yet")

    def _stash_chunk(self, keys: mx.array, values: mx.array):
        """The end of ``update_and_fetch`` for a cache that stores a chunk only once it has
        attended: the chunk waits for ``attend`` (``_take_chunk``)."""
        self._pending = (keys, values)
        self.offset += keys.shape[2]
        return keys, values

    def _take_chunk(self, sinks) -> tuple[mx.array, mx.array]:
        """The chunk ``_stash_chunk`` kept, as the cache's own attention begins."""
        self._own_attention_begins(sinks)
        chunk, self._pending = self._pending, None
        return chunk

    def _expect_attend(self) -> None:
        """Called by hook-dependent caches at each update: attention must come to us.

        The model module that called ``update_and_fetch`` gets the attention hook if it
        lacks it (a cache loaded from a file, used with an unpatched model), before any
        token is computed; a model module that computes attention inline is refused.
        The second check catches callers that are not mlx-lm model modules.
        """
        frame = _frame(1)
        while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
            frame = frame.f_back
        # a module already routed to the hook is the common case: nothing to look up
        if frame is not None and frame.f_globals.get("scaled_dot_product_attention") is not hooked_sdpa:
            hook_caller_module(frame.f_globals, self)
        if self._awaiting_attend:
            raise AttentionHookMissing(
                f"{type(self).__name__} (method {self.config.method!r}) computes attention "
                "itself, but the model's attention did not go through the VeloxQuant hook. "
                "Build the cache with veloxquant_mlx.make_prompt_cache(model, config) or "
                "patch_model_kv_cache(model, config); architectures that do not call "
                "mlx-lm's scaled_dot_product_attention cannot use this method."
            )
        self._awaiting_attend = True

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise ValueError(
                f"method {self.config.method!r} does not support sliding-window attention "
                f"layers (window_size={window_size}); VeloxQuant only replaces full-attention "
                "layers and leaves the model's own sliding-window caches in place"
            )
        if not return_array:
            return None if N == 1 else "causal"
        if N == 1:
            return None
        return causal_mask(N, self._rows_returned(N))

    # -- copies: mlx-lm's server deep-copies prompt caches to reuse them -------------
    def __deepcopy__(self, memo):
        """Arrays and state are copied; dtypes (which cannot be copied) are shared."""
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            clone.__dict__[name] = value if isinstance(value, mx.Dtype) else copy.deepcopy(value, memo)
        return clone

    # -- bookkeeping ---------------------------------------------------------------
    def size(self) -> int:
        return self.stored_length

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        """Bytes of every array the cache keeps, spare room included (not a formula)."""
        return sum(
            a.nbytes
            for _, a in tree_flatten(self._arrays())
            if isinstance(a, (mx.array, GrowingArray))
        )

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    # -- state: what save_prompt_cache writes and load_prompt_cache restores -------
    @property
    def state(self) -> dict[str, Any]:
        meta = {
            "offset": self.offset,
            "layer": self.layer,
            "config": json.dumps(self.config.to_dict(), sort_keys=True),
            "kv_shape": json.dumps(self.kv_shape),
            **self._meta(),
        }
        rooms = {name: kept.capacity for name, kept in self._growing_arrays().items()
                 if kept.buffer is not None and kept.capacity > kept.length}
        if rooms:  # absent otherwise: a state with no spare room serialises as before
            meta["buffer_rooms"] = json.dumps(rooms)
        arrays = {
            name: kept.view() if isinstance(kept, GrowingArray) else kept
            for name, kept in self._arrays().items()
        }
        after_send = self.__dict__.get("_after_send")
        if after_send is not None:  # mlx-lm evaluates the state: the pipeline's send with it
            name = next((n for n, a in arrays.items() if isinstance(a, mx.array)), None)
            if name is not None:
                arrays[name] = mx.depends(arrays[name], after_send)
        return {"arrays": arrays, "meta": meta}

    @state.setter
    def state(self, state: dict[str, Any]) -> None:
        meta = dict(state["meta"])
        if not hasattr(self, "config"):  # restored by from_state: rebuild from the file
            try:
                config = KVCacheConfig.from_dict(json.loads(meta["config"]))
            except (TypeError, ValueError) as exc:
                raise CacheStateError(
                    f"saved cache, layer {meta.get('layer')} ({type(self).__name__}): its config "
                    f"does not parse: {exc}"
                ) from None
            mismatch = _method_mismatch(type(self), config.method)
            if mismatch:
                raise CacheStateError(
                    f"saved cache, layer {meta.get('layer')} ({type(self).__name__}): config "
                    f"method is {config.method!r}, expected {mismatch}"
                )
            CompressedKVCache.__init__(self, config, None, int(meta["layer"]))
        self.offset = int(meta["offset"])
        shape = json.loads(meta.get("kv_shape", "null"))
        self.kv_shape = None if shape is None else tuple(shape)
        try:
            self._restore_arrays(state.get("arrays") or {})
            self._restore_meta(meta)
        except KeyError as exc:  # a file with an array or a meta field cut out
            raise CacheStateError(
                f"saved cache, layer {self.layer} ({type(self).__name__}, method "
                f"{self.config.method!r}): {exc.args[0]!r} is missing, expected in the file"
            ) from None
        # Each buffer gets back the room it had: a reader over whole buffers (capacity-fixed
        # shapes) then sums over the shapes it summed over before the save, so the loaded
        # cache continues bit for bit (GrowingArray.restore_room ignores a room growth never
        # leaves).
        try:
            rooms = json.loads(meta.get("buffer_rooms") or "{}")
            rooms = {name: int(rooms[name]) for name in rooms}
        except (TypeError, ValueError):
            raise CacheStateError(
                f"saved cache, layer {self.layer} ({type(self).__name__}, method {self.config.method!r}): "
                f"buffer_rooms is {meta.get('buffer_rooms')!r}, expected a JSON object of buffer names "
                f"to row counts") from None
        for name, kept in self._growing_arrays().items():
            kept.restore_room(rooms.get(name))

    def _growing_arrays(self) -> dict[str, GrowingArray]:
        """The kept ``GrowingArray``s by their flattened names in ``_arrays``."""
        return {name: kept for name, kept in tree_flatten(self._arrays()) if isinstance(kept, GrowingArray)}

    def _restore_arrays(self, arrays: dict[str, Any]) -> None:
        """Put saved arrays back where ``_arrays`` found them (by attribute name)."""
        for name, value in arrays.items():
            kept = getattr(self, name, None)
            if isinstance(kept, GrowingArray):
                kept.reset(value)
            else:
                setattr(self, name, value)

    def _init_storage(self) -> None:
        """Set up empty storage from ``self.config`` (by ``__init__`` and ``from_state``)."""

    @classmethod
    def from_state(cls, state: dict[str, Any]):
        """Restore a saved cache; refuse (CacheStateError) a state that contradicts its
        config or itself, naming the field and both values."""
        obj = cls.__new__(cls)
        obj.state = state
        problems = [*obj._layout_problems(), *obj._offset_problems(), *obj._state_problems(),
                    *obj._unevicted_offset_problems()]
        if problems:
            field, found, expected = problems[0]
            raise CacheStateError(
                f"saved cache, layer {obj.layer} ({cls.__name__}, method "
                f"{obj.config.method!r}): {field} is {found}, expected {expected}"
            )
        return obj

    def _offset_problems(self):
        if self.offset < 0:
            yield "offset", self.offset, "a token count >= 0"
        elif self.stored_length > self.offset:
            yield "offset", self.offset, f">= the {self.stored_length} tokens stored"

    def _unevicted_offset_problems(self):
        if not self.evicts_tokens and 0 <= self.stored_length != self.offset:
            yield "offset", self.offset, f"the {self.stored_length} tokens stored (this method keeps every token)"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(layer={self.layer}, offset={self.offset}, "
            f"stored={self.stored_length}, nbytes={self.nbytes})"
        )
