"""Cross-layer state: what the layers of a model need from each other's caches.

Methods whose layers share or merge what they keep (xkv, xquant, minicache) build on
``CrossLayer``, a mixin for a ``CompressedKVCache``. The one object shared by the layers
of a prompt cache is its ``ModelContext`` (``cache/context.py``); its ``layers`` list
is the prompt cache itself. What the mixin gives a layer:

- **Groups.** The method says how its layers group (``layer_groups``: disjoint runs of
  the compressed layers, in layer order). A layer reaches its group's caches through the
  context (``members``, ``member``), never through an attribute of its own, so a layer's
  ``nbytes`` and saved state hold exactly what that layer keeps. Without a context (a
  cache built alone) a layer is a group of one.
- **Events.** mlx-lm calls layers 0..L-1 in order for each prompt chunk, then for each
  decode step, and says nothing else: a layer's prompt is done at its first single-token
  update after multi-token ones. The layer then hears ``on_prefill_done``; the member
  that completes its group's prompt (the last in layer order) hears
  ``on_group_prefill_done`` and the layer that completes every compressed layer's hears
  ``on_model_prefill_done``, each before its own attention of that step. The flags that
  say so are each layer's own (saved with it), so events survive save/load.
- **Shared arrays.** What a group shares (a basis, a latent, merged directions) is kept by
  one member, the group's ``owner`` (first member by default): ``SharedArrays`` in its
  ``shared`` attribute, counted in its ``nbytes`` and written with its state only. The
  others read it through ``group_shared`` (the owner's, looked up through the context).
- **Saving.** mlx-lm saves each layer's ``state`` on its own and ``load_prompt_cache``
  restores them in layer order with ``from_state``, each knowing nothing of the others.
  Each layer's meta therefore carries a link (an id of its prompt cache, the model's
  layer count, the compressed layers); layers restored with the same id are collected
  into one new context (``_assemble``: a table of contexts being assembled, weakly held,
  an entry dropped as soon as its last compressed layer arrives, so loading a file twice
  gives two independent caches). So mlx-lm's plain ``load_prompt_cache`` already gives
  back layers that find each other, the shared arrays once, in their owner;
  ``veloxquant_mlx.load_prompt_cache(path, model)`` checks the file against the model and
  swaps in a context that knows it. A member whose group was not restored with it
  (``from_state`` called on one layer) raises ``CrossLayerError`` naming the layer it
  misses, as soon as it needs it (its restore checks, or its first update).

Sharded models (``cache/context.py``): layer indices are global, so groups are formed as
in one process; a pipeline layout that would put one group's members on different ranks
is refused when the cache is built (``check_layout``, naming the layers and the split),
so every read of a neighbour stays in one process and nothing is sent between ranks.
Tensor sharding needs nothing here: each rank's members hold the same heads. The events
are per process: ``on_model_prefill_done`` fires when every compressed layer this rank
holds has ended its prompt, and a saved link names the layers its rank held, which are
the ones a load waits for.
"""

from __future__ import annotations

import functools

import json
import uuid
import weakref
from typing import Any

import mlx.core as mx

from .buffers import GrowingArray

LINK_KEY = "cross_layer_link"  # the context's id in ``ModelContext.shared``
_ASSEMBLING: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


def consecutive_groups(layers, size: int, start: int = 0) -> tuple[tuple[int, ...], ...]:
    """``layers`` (increasing) from index ``start`` on, cut into runs of ``size``; the last
    run may be shorter. Kept per arguments: a decode step asks for its layer's group."""
    return _consecutive_groups(tuple(layers), size, start)


@functools.lru_cache(maxsize=256)
def _consecutive_groups(layers: tuple[int, ...], size: int, start: int) -> tuple[tuple[int, ...], ...]:
    kept = [i for i in layers if i >= start]
    return tuple(tuple(kept[i : i + size]) for i in range(0, len(kept), size))


class SharedArrays:
    """Arrays a group shares, kept (counted, saved) by the group's owner only.

    ``items`` maps a name to an ``mx.array``, a ``GrowingArray`` or None; saved as
    ``shared_<name>`` in the owner's state."""

    PREFIX = "shared_"

    def __init__(self):
        self.items: dict[str, Any] = {}

    def __getitem__(self, name):
        return self.items.get(name)

    def __setitem__(self, name, value):
        self.items[name] = value

    def arrays(self) -> dict[str, Any]:
        """What is held (empty entries, which a layer that owns nothing has, are left out)."""
        return {self.PREFIX + k: v for k, v in self.items.items()
                if v is not None and not (isinstance(v, GrowingArray) and v.buffer is None)}

    def restore(self, arrays: dict[str, Any]) -> dict[str, Any]:
        """Take back the shared arrays of a saved state; returns the other arrays."""
        rest = {}
        for name, value in arrays.items():
            if not name.startswith(self.PREFIX):
                rest[name] = value
                continue
            key = name[len(self.PREFIX):]
            kept = self.items.get(key)
            if isinstance(kept, GrowingArray):
                kept.reset(value)
            else:
                self.items[key] = value
        return rest


class CrossLayerError(RuntimeError):
    """A layer cannot reach the neighbour its method needs."""


class CrossLayer:
    """Mixin (before the cache base class) for caches whose layers cooperate."""

    owner_position = 0  # which member of a group keeps the shared arrays (-1: the last)

    # -- what a method provides ------------------------------------------------------------------
    def layer_groups(self, compressed: tuple[int, ...], n_layers: int) -> list[tuple[int, ...]]:
        """Disjoint runs of ``compressed`` that share state (default: none)."""
        return [(i,) for i in compressed]

    def on_prefill_done(self, end: int) -> None:
        """This layer's prompt ended at token ``end`` (its first single-token update)."""

    def on_group_prefill_done(self, members: list, end: int) -> None:
        """Every member of this layer's group has ended its prompt at ``end``."""

    def on_model_prefill_done(self, end: int) -> None:
        """Every compressed layer has ended its prompt at ``end``."""

    def _relinked(self) -> None:
        """A restored layer has its context again (before its arrays are put back)."""

    @property
    def stack_ready(self) -> bool:
        """No prompt waiting for its end (cache/stacked.py): the work a prompt's end brings
        (xKV's SVD, its rank the largest over the rows it is given) runs on each sequence
        alone."""
        return not self.__dict__.get("prompt_open", False)

    # -- groups ------------------------------------------------------------------------------------
    @property
    def layer_group(self) -> tuple[int, ...]:
        """The layer indices of this layer's group (itself alone without a context)."""
        ctx = self.context
        if ctx is None:
            return (self.layer,)
        for g in self.layer_groups(tuple(ctx.compressed_layers), ctx.n_layers):
            if self.layer in g:
                return g
        return (self.layer,)

    def member(self, layer: int):
        """The cache of ``layer`` (a neighbour in this layer's group), through the context."""
        if layer == self.layer:
            return self
        layers = getattr(self.context, "layers", None) or []
        cache = layers[layer] if layer < len(layers) else None
        if cache is None or not isinstance(cache, CrossLayer):
            raise CrossLayerError(
                f"layer {self.layer} (method {self.config.method!r}) shares its cache with layer "
                f"{layer}, which is not linked to it: build the caches with make_prompt_cache "
                "and load saved ones with load_prompt_cache (every layer of the file)"
            )
        return cache

    def check_layout(self) -> None:
        """Refuse a sharded layout that splits this layer's group (at cache construction)."""
        group = self.layer_group
        if self.context is not None and len(group) > 1:
            self.context.require_one_stage(group, "shares what it keeps across")

    def members(self) -> list:
        return [self.member(i) for i in self.layer_group]

    @property
    def owner(self):
        return self.member(self.layer_group[self.owner_position])

    @property
    def is_owner(self) -> bool:
        return self.layer_group[self.owner_position] == self.layer

    @property
    def group_shared(self) -> SharedArrays:
        """The group's shared arrays (kept by the owner)."""
        return self.owner.shared

    # -- events --------------------------------------------------------------------------------------
    def _init_cross_layer(self) -> None:
        self.shared = SharedArrays()
        self.prompt_open = False  # multi-token updates have come since the last single token
        self.prompts_done = 0
        self.prompt_end = 0  # the token at which the last finished prompt ended

    def _note_update(self, n_new: int) -> None:
        """Call at each update, before ``offset`` grows: fires the events it completes."""
        if n_new > 1:
            self.prompt_open = True
            return
        if not self.prompt_open:
            return
        self.prompt_open, self.prompts_done, self.prompt_end = False, self.prompts_done + 1, self.offset
        self.on_prefill_done(self.offset)
        members = self.members()
        if all(m.prompts_done >= self.prompts_done for m in members):
            self.on_group_prefill_done(members, self.offset)
        ctx = self.context
        layers = [ctx.layers[i] for i in ctx.local_compressed_layers] if ctx is not None and ctx.layers else [self]
        if all(isinstance(c, CrossLayer) and c.prompts_done >= self.prompts_done for c in layers):
            self.on_model_prefill_done(self.offset)

    # -- save / load -----------------------------------------------------------------------------------
    def _meta(self):
        ctx = self.context
        link = None
        if ctx is not None:
            link = {"id": ctx.shared.setdefault(LINK_KEY, uuid.uuid4().hex),
                    "n_layers": ctx.n_layers, "layers": list(ctx.compressed_layers)}
            if ctx.local_compressed_layers != ctx.compressed_layers:  # one pipeline rank's file
                link["held"] = list(ctx.local_compressed_layers)
        own = {"link": link, "prompt_open": self.prompt_open, "prompts_done": self.prompts_done,
               "prompt_end": self.prompt_end}
        return {**super()._meta(), "cross_layer": json.dumps(own, sort_keys=True)}

    def _restore_meta(self, meta) -> None:
        own = json.loads(meta.get("cross_layer", "{}"))
        self.prompt_open = bool(own.get("prompt_open", False))
        self.prompts_done = int(own.get("prompts_done", 0))
        self.prompt_end = int(own.get("prompt_end", 0))
        if self.context is None and own.get("link"):
            self.context = _assemble(self, own["link"])
        self._relinked()
        super()._restore_meta(meta)


def _assemble(cache, link: dict):
    """The context that the layers restored with ``link``'s id share (see the module doc)."""
    from .context import ModelContext

    ctx = _ASSEMBLING.get(link["id"])
    if ctx is None or ctx.layers[cache.layer] is not None or ctx.config != cache.config:
        ctx = ModelContext(cache.config, int(link["n_layers"]), tuple(link["layers"]))
        ctx.layers = [None] * ctx.n_layers
        ctx.shared[LINK_KEY] = link["id"]
        _ASSEMBLING[link["id"]] = ctx
    ctx.layers[cache.layer] = cache
    if all(ctx.layers[i] is not None for i in link.get("held", ctx.compressed_layers)):
        _ASSEMBLING.pop(link["id"], None)
    return ctx


def rows(x: mx.array | None) -> int:
    return 0 if x is None else x.shape[2]
