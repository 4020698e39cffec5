"""The stacked batch layout: sequences in the same state share one cache, batch first.

A method whose cache computes each row of a batch as that row alone (every array it keeps
has the batch first; no fit, codebook or threshold pools rows) can serve a batch with its
own single cache class, fed B rows. Sequences whose caches hold the same structure (the
same host counters, segment boundaries, fitted ranks; arrays of the same shapes past the
batch axis) are joined into one such cache: every kept array is the members' arrays
concatenated along axis 0. A decode step then runs the method's own ``update_and_fetch``
and ``attend`` once for the group, so every part of the store (windows, segments,
codebooks, latents, their flushes and refits) runs batched without a packed reader of its
own. Requests of one length that arrive together form one group; a batch of mixed lengths
runs one group per distinct state, and groups whose states meet (a sequence joining one
already there) are joined again.

What a class must give to use it (``batchable = "stacked"`` in its body, which the batch
conformance tests then hold to each sequence alone): rows that do not mix, and no
hidden-state observer. A cache whose structure is still to be fitted over the rows it holds
(a rank chosen by an energy rule, the largest over its rows; a prompt-end SVD) says so with
``stack_ready`` False: fitted in a group, one member's rank would serve all. Such a cache
is a group of its own until it has fitted, then joins the groups in its state at the next
step. Cross-layer groups are planned once for every layer, so a cross-layer batch packs
once every member is ready (its prompts' ends come at the first decode step, taken per
sequence).

Cross-layer methods (``cache/cross_layer.py``) read their neighbour layers through the
sequence's model context. Their groups are planned once for every layer, when the first
layer packs: sequences whose every compressed layer holds the same structure share a
group at every layer, each group's caches linked by a context of their own (a copy of the
first member's, whose ``layers`` are the group's caches), so that a layer reads its
neighbours' rows for the same sequences.

Arrays without the batch first (a table shared by the sequences, read from the config) are
kept once when the members' copies are equal, and a group with unequal ones is split into
its sequences. A sequence's cache is given back (``extract``, ``unpack``) with its rows of
every batched array, its own context, config and layer: byte for byte the cache it would
hold alone, since the group's buffers grew exactly as each member's would have.
"""

from __future__ import annotations

import copy
import json
import types
import weakref
from typing import Any

import mlx.core as mx

from .batch import PackedLayout
from .buffers import GrowingArray
from .cross_layer import CrossLayer

# A sequence's own attributes: never joined, each member keeps its own.
_OWN = ("config", "context", "layer")
# What a sequence's emptied cache keeps besides them: mlx-lm reads a later layer's offset
# (RoPE) before that layer packs, when a cross-layer plan has already emptied it.
_SHELL = (*_OWN, "offset")


class _Mismatch(Exception):
    """Two members' arrays that are not batched differ: they cannot share one cache."""


def _descend(x: Any) -> bool:
    """Whether the walk looks inside ``x``'s attributes (our objects and buffers)."""
    return hasattr(x, "__dict__") and type(x).__module__.startswith("veloxquant_mlx") and not isinstance(x, type)


def _batched(x: mx.array, batch: int, path: tuple, shared: frozenset) -> bool:
    return x.ndim > 0 and x.shape[0] == batch and path not in shared


def _signature(x: Any, batch: int, shared: frozenset, path: tuple = ()) -> Any:
    """What must be equal for two caches (or groups) to be joined: every attribute's value,
    and every array's dtype and shape past the batch axis (the whole shape where the array
    is not batched)."""
    if isinstance(x, mx.array):
        if _batched(x, batch, path, shared):
            return ("batched", x.shape[1:], str(x.dtype))
        return ("shared", x.shape, str(x.dtype))
    if isinstance(x, dict):
        return ("dict", tuple((repr(k), _signature(v, batch, shared, path + (k,))) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_signature(v, batch, shared, path + (i,)) for i, v in enumerate(x)))
    if _descend(x):
        items = []
        for k, v in vars(x).items():
            if k in _OWN:
                continue
            if k == "kv_shape" and v is not None:
                v = tuple(v[1:])
            items.append((k, _signature(v, batch, shared, path + (k,))))
        return (type(x).__qualname__, tuple(items))
    if x is None or isinstance(x, (bool, int, float, str, bytes)):
        return x
    if isinstance(x, mx.Dtype):
        return str(x)
    return ("object", type(x).__qualname__)  # compiled functions, plans: the first member's


def _rebound(x: Any, memo: dict) -> Any:
    """A bound method of an object the walk rebuilt, bound to the rebuilt one (a store's
    callback into its cache)."""
    owner = getattr(x, "__self__", None)
    if isinstance(x, types.MethodType) and id(owner) in memo:
        return types.MethodType(x.__func__, memo[id(owner)])
    return x


def _rebuilt(values: list, array, n: int, memo: dict, path: tuple = ()) -> Any:
    """``values`` (one object of the same structure per member) rebuilt as one: new objects,
    lists and dicts, every array ``array(members' arrays, path)``, ``kv_shape`` for ``n``
    rows, a member's own attributes (``_OWN``) the first's. ``memo`` maps an object's id to
    what it is rebuilt as (given for the root: an existing object is filled)."""
    first = values[0]
    if isinstance(first, mx.array):
        return array(values, path)
    if isinstance(first, dict):
        return {k: _rebuilt([v[k] for v in values], array, n, memo, path + (k,)) for k in first}
    if isinstance(first, (list, tuple)):
        items = [_rebuilt([v[i] for v in values], array, n, memo, path + (i,)) for i in range(len(first))]
        return items if isinstance(first, list) else type(first)(items)
    if _descend(first):
        if path and id(first) in memo:
            return memo[id(first)]
        obj = memo.get(id(first))
        if obj is None:
            obj = memo[id(first)] = type(first).__new__(type(first))
        for k, v in vars(first).items():
            if k in _OWN:
                obj.__dict__.setdefault(k, v)
            elif k == "kv_shape" and v is not None:
                obj.__dict__[k] = (n, *v[1:])
            else:
                obj.__dict__[k] = _rebuilt([vars(m)[k] for m in values], array, n, memo, path + (k,))
        return obj
    return _rebound(first, memo)


def _join(caches: list, batches: list[int], shared: frozenset) -> Any:
    """Caches of equal signatures (holding ``batches`` rows each) as one: batched arrays
    concatenated, the others kept once (``_Mismatch`` where they differ)."""

    def array(values, path):
        first = values[0]
        if _batched(first, batches[0], path, shared):
            return mx.concatenate(values, axis=0)
        if any(v is not first and not mx.array_equal(v, first).item() for v in values[1:]):
            raise _Mismatch(path)
        return first

    return _rebuilt(caches, array, sum(batches), {})


def _rows(x: Any, batch: int, take, n: int, shared: frozenset, memo: dict) -> Any:
    """``x`` (holding ``batch`` rows) rebuilt with its batched arrays cut to the rows
    ``take`` (a slice or an index array; None: all ``n``); ``memo`` as ``_rebuilt``'s."""

    def array(values, path):
        x = values[0]
        return x[take] if take is not None and _batched(x, batch, path, shared) else x

    return _rebuilt([x], array, n, memo)


def _shared_paths(x: Any, batch: int, path: tuple = (), every: bool = False) -> set:
    """Paths of the arrays in ``x`` without the batch first (kept once). A buffer that grows
    along axis 0 holds rows there, not sequences, whatever its length (gear's chunk ends: one
    chunk looks like a batch of one), and an object whose class says ``stack_shared`` holds
    tables that are not a row a sequence, whatever their shapes (kvtc's codec: its field
    layout is shaped (1, 1, k) to broadcast)."""
    if isinstance(x, mx.array):
        return set() if x.ndim > 0 and x.shape[0] == batch and not every else {path}
    if isinstance(x, GrowingArray) and (every or x.axis == 0):
        return {path + ("buffer",)}  # empty or not: the paths are fixed when a group forms
    every = every or getattr(type(x), "stack_shared", False)
    if isinstance(x, dict):
        items = ((k, v) for k, v in x.items())
    elif isinstance(x, (list, tuple)):
        items = enumerate(x)
    elif _descend(x):
        items = ((k, v) for k, v in vars(x).items() if k not in _OWN)
    else:
        return set()
    out = set()
    for k, v in items:
        out |= _shared_paths(v, batch, path + (k,), every)
    return out


class _Group:
    """One cache of the method's class holding ``len(rows)`` sequences batched (``rows``:
    their places in the batch)."""

    def __init__(self, cache, rows: list[int], shared: frozenset):
        self.cache, self.rows, self.shared = cache, rows, shared

    @classmethod
    def of(cls, single, row: int) -> "_Group":
        """A group of one: new objects holding the arrays ``single`` holds (``single`` is
        emptied once its group is made: ``_empty``)."""
        shared = frozenset(_shared_paths(single, 1))
        return cls(_rows(single, 1, None, 1, shared, {}), [row], shared)

    @property
    def signature(self):
        if not _ready(self.cache):
            return ("fit to come", id(self))  # joins no other group
        config = json.dumps(self.cache.config.to_dict(), sort_keys=True)
        return config, self.cache.layer, self.cache.offset, _signature(self.cache, len(self.rows), self.shared)

    @staticmethod
    def join(groups: list["_Group"]) -> list["_Group"]:
        """``groups`` (of equal signatures) as one group, or as they were where an array they
        keep once differs between them."""
        if len(groups) == 1:
            return groups
        try:
            cache = _join([g.cache for g in groups], [len(g.rows) for g in groups], groups[0].shared)
        except _Mismatch:
            return groups
        return [_Group(cache, [r for g in groups for r in g.rows], groups[0].shared)]

    def take(self, local: list[int], rows: list[int]) -> "_Group":
        """The group of its members ``local`` (indices into ``self.rows``), now at ``rows``."""
        if local == list(range(len(self.rows))):
            return _Group(self.cache, rows, self.shared)
        take = slice(local[0], local[0] + 1) if len(local) == 1 else mx.array(local, mx.int32)
        cache = _rows(self.cache, len(self.rows), take, len(local), self.shared, {})
        return _Group(cache, rows, self.shared)


def _ready(cache) -> bool:
    return getattr(cache, "stack_ready", True)


def _empty(singles: list) -> None:
    """The sequences' own caches, emptied of what their groups now hold (the objects stay:
    the contexts' ``layers`` name them)."""
    for s in singles:
        for k in [k for k in vars(s) if k not in _SHELL]:
            del s.__dict__[k]


def _grouped(groups: list[_Group]) -> list[_Group]:
    """Groups of equal signatures joined (in order of their first row)."""
    by_signature: dict[Any, list[_Group]] = {}
    for g in groups:
        by_signature.setdefault(g.signature, []).append(g)
    out = [j for same in by_signature.values() for j in _Group.join(same)]
    return sorted(out, key=lambda g: g.rows[0])


# -- cross-layer methods: one plan for every layer, a context per group ---------------------
# Contexts of groups, by their members' contexts (the same for a group's caches at every
# layer); weakly held: an entry goes with the last cache that uses it.
_GROUP_CONTEXTS: "weakref.WeakValueDictionary[tuple, Any]" = weakref.WeakValueDictionary()
# Plans made when a batch's first layer packs, by the batch's contexts in row order: for
# each layer not yet packed, its sequences' caches (ids) and their groups.
_PLANS: dict[tuple, dict[int, tuple[list[int], list[_Group]]]] = {}


def _link(group: _Group, shells: list) -> None:
    """Give a cross-layer group's cache the context its group's caches share at every layer."""
    contexts = [shells[r].context for r in group.rows]
    key = tuple(id(c) for c in contexts)
    joint = _GROUP_CONTEXTS.get(key)
    if joint is None:
        joint = copy.copy(contexts[0])
        joint.layers = [None] * len(contexts[0].layers)
        joint.shared = dict(contexts[0].shared)
        _GROUP_CONTEXTS[key] = joint
    joint.layers[group.cache.layer] = group.cache
    group.cache.context = joint


def _cross_layer_plan(singles: list) -> dict[int, tuple[list[int], list[_Group]]]:
    """Every compressed layer's groups for the batch ``singles`` (one layer's caches, in row
    order): sequences join where all their layers' signatures are equal and every layer's
    join succeeds, else each is a group of its own at every layer."""
    layers = singles[0].context.local_compressed_layers
    caches = [[s.context.layers[j] for j in layers] for s in singles]
    alone = [[_Group.of(c, i) for c in row] for i, row in enumerate(caches)]
    parts: dict[Any, list[int]] = {}
    for i, row in enumerate(alone):
        parts.setdefault(tuple(g.signature for g in row), []).append(i)
    plan: dict[int, list[_Group]] = {j: [] for j in layers}
    for rows in parts.values():
        joined = [_Group.join([alone[i][k] for i in rows]) for k in range(len(layers))]
        if any(len(g) > 1 for g in joined):
            joined = [[alone[i][k] for i in rows] for k in range(len(layers))]
        for j, groups in zip(layers, joined):
            plan[j] += groups
    return {j: ([id(row[k]) for row in caches], sorted(plan[j], key=lambda g: g.rows[0]))
            for k, j in enumerate(layers)}


class StackedLayout(PackedLayout):
    """Decode steps of a batch through the method's own cache, one per group of sequences in
    the same state (see the module docstring)."""

    @staticmethod
    def accepts(cls: type) -> bool:
        return cls.__dict__.get("batchable") == "stacked"

    @classmethod
    def can_pack(cls, single) -> bool:
        return (single.offset > 0 and getattr(single, "_pending", None) is None and not hasattr(single, "observe_hidden")
                and (_ready(single) or not isinstance(single, CrossLayer)))

    @classmethod
    def pack(cls, singles) -> "StackedLayout":
        self = cls.__new__(cls)
        self.offsets = [s.offset for s in singles]
        self.shells = list(singles)
        if isinstance(singles[0], CrossLayer) and singles[0].context is not None:
            key = tuple(id(s.context) for s in singles)
            planned = _PLANS.get(key, {}).get(singles[0].layer)
            if planned is None or planned[0] != [id(s) for s in singles]:  # none, or a stale one
                # every layer's groups now, linked at once: a layer may read a later one's
                # (a group's owner) before that layer packs
                _PLANS[key] = _cross_layer_plan(singles)
                for j, (_, groups) in _PLANS[key].items():
                    for g in groups:
                        _link(g, self.shells)
                    _empty([s.context.layers[j] for s in singles])
                    mx.eval([g.cache.state["arrays"] for g in groups])  # as _sync, a layer at a time
            plan = _PLANS[key]
            self.groups = plan.pop(singles[0].layer)[1]
            if not plan:
                del _PLANS[key]
        else:
            self.groups = _grouped([_Group.of(s, i) for i, s in enumerate(singles)])
            _empty(singles)
        self._sync()
        return self

    def _sync(self) -> None:
        # Joined arrays are made now, layer by layer, so that a layer's members' own arrays
        # are freed before the next layer joins (left to the step's evaluation, every
        # layer's members and joined copies are alive together). Only when the batch's
        # sequences change or a group's fit is done, never in a steady decode step.
        mx.eval([g.cache.state["arrays"] for g in self.groups])
        # groups whose fit is to come, to be regrouped once it is done (cross-layer batches
        # keep their groups: see the module docstring)
        self._fitting = [] if not self.groups or self._cross_layer else [g for g in self.groups if not _ready(g.cache)]
        self.offset_array = mx.array(self.offsets, mx.int32)
        order = [r for g in self.groups for r in g.rows]
        self._index = [mx.array(g.rows, mx.int32) for g in self.groups] if len(self.groups) > 1 else None
        self._restore = None if order == sorted(order) else mx.argsort(mx.array(order, mx.int32))
        self._fetched = None

    @property
    def group_sizes(self) -> list[int]:
        return [len(g.rows) for g in self.groups]

    # -- a decode step ---------------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        if self._fitting and any(_ready(g.cache) for g in self._fitting):
            for g in self._fitting:  # what a fit made is kept as its group's other arrays are
                g.shared = frozenset(_shared_paths(g.cache, len(g.rows)))
            self.groups = _grouped(self.groups)  # a fit done alone: its group may join others
            self._sync()
        self.offsets = [o + 1 for o in self.offsets]
        self.offset_array = self.offset_array + 1
        if self._index is None:
            self._fetched = [self.groups[0].cache.update_and_fetch(keys, values)]
        else:
            self._fetched = [g.cache.update_and_fetch(keys[i], values[i]) for g, i in zip(self.groups, self._index)]
        return keys, values

    def attend(self, queries, keys, values, *, scale, sinks=None):
        fetched, self._fetched = self._fetched, None
        if self._index is None:
            k, v = fetched[0]
            return self.groups[0].cache.attend(queries, k, v, scale=scale, mask=None, sinks=sinks)
        outs = [g.cache.attend(queries[i], k, v, scale=scale, mask=None, sinks=sinks)
                for g, i, (k, v) in zip(self.groups, self._index, fetched)]
        out = mx.concatenate(outs, axis=0)
        return out if self._restore is None else out[self._restore]

    def make_mask(self, N, return_array):
        return self.groups[0].cache.make_mask(N, return_array)

    # -- what BatchGenerator calls ---------------------------------------------------------
    def filter(self, keep: list[int]) -> None:
        place = {old: new for new, old in enumerate(keep)}
        groups = []
        for g in self.groups:
            local = [j for j, r in enumerate(g.rows) if r in place]
            if local:
                groups.append(g.take(local, [place[g.rows[j]] for j in local]))
        self.groups = sorted(groups, key=lambda g: g.rows[0])
        self.shells = [self.shells[i] for i in keep]
        self.offsets = [self.offsets[i] for i in keep]
        self._relink()
        self._sync()

    def extend(self, other: "StackedLayout") -> None:
        n = len(self.shells)
        moved = [_Group(g.cache, [r + n for r in g.rows], g.shared) for g in other.groups]
        # a cross-layer batch keeps its groups (joining them at one layer would have to be
        # planned for every layer)
        cross = self._cross_layer
        self.groups = self.groups + moved if cross else _grouped(self.groups + moved)
        self.shells += other.shells
        self.offsets += other.offsets
        self._relink()
        self._sync()

    @property
    def _cross_layer(self) -> bool:
        return isinstance(self.groups[0].cache, CrossLayer) and self.groups[0].cache.context is not None

    def _relink(self) -> None:
        if self.groups and self._cross_layer:
            for g in self.groups:
                _link(g, self.shells)

    def _single(self, b: int, shell):
        g = next(g for g in self.groups if b in g.rows)
        j = g.rows.index(b)
        return _rows(g.cache, len(g.rows), slice(j, j + 1), 1, g.shared, {id(g.cache): shell})

    def is_trimmable(self) -> bool:
        return all(g.cache.is_trimmable() for g in self.groups)

    def size(self) -> int:
        return max(self.offsets)

    @property
    def nbytes(self) -> int:
        index = [] if self._index is None else self._index
        restore = [] if self._restore is None else [self._restore]
        return sum(g.cache.nbytes for g in self.groups) + sum(a.nbytes for a in [self.offset_array, *index, *restore])

    @property
    def state(self):
        return [g.cache.state["arrays"] for g in self.groups]


__all__ = ["StackedLayout"]
