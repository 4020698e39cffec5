"""Batched generation over our caches: mlx-lm's batch protocol (``BatchKVCache``'s).

mlx-lm batches by building one cache per sequence, joining each layer's caches with
``caches[0][i].merge([...])`` and driving the result with ``prepare`` (right padding of
a prompt chunk), ``finalize``, ``filter`` (sequences that leave), ``extend`` (sequences
that join), ``extract`` (one sequence back as a single-sequence cache), ``make_mask``,
``trim``, ``size``, ``state`` and ``nbytes``, reading ``offset`` (one position per
sequence, an ``mx.array``) for RoPE. ``merge`` on one of our classes returns a
``BatchCache`` of that class, which works in one of two layouts:

- per sequence: the batch holds one single-sequence cache of the method's own class per
  sequence and gives each its own rows of every update (the padding of a right-padded
  prompt chunk never reaches it) and its own queries; the model's projections and MLPs
  run batched, attention runs once per sequence. Every decision a cache makes is the
  one it makes alone, so its state is exactly that of the sequence run alone. Prompt
  chunks always go this way (they differ in length, and prompt-time scoring needs each
  sequence's own queries); so does every update of a method without a packed layout.
- packed: decode steps of sequences past their prompt go through one array per kept
  quantity, (B, H, slots, ...), for the whole batch: a sequence's slots start at slot 0,
  the slots after its own are padding (never attended: a mask by slot for the dense
  cache, position -1 for the eviction base, which its attention and score helpers
  already ignore). One attention call per layer for the batch; eviction decisions stay
  per sequence (each sequence's budget, its scores over its own slots, its free slot).
  The dense cache (``FullPacked`` here) and the eviction base (``evict/batch.py``) have
  one. Padding sits after a sequence's slots, so attention over a padded row adds exact
  zeros after the real terms: on the CPU back-end the outputs were bit-identical to the
  sequence run alone in every check we ran (tests/test_conformance.py).

Batching is opt-in per method class, never inherited: a class sets ``batchable = True``
in its own body (packed where its base has a packed layout and the class changes none of
the base's decode steps, per sequence otherwise) or ``batchable = "per_sequence"``;
classes whose modules are not ours to edit are listed in ``BATCHABLE`` below. Other
classes have no ``merge`` (``CompressedKVCache.merge`` raises AttributeError for them),
so mlx-lm refuses to batch them; our integration replaces mlx-lm's generic message with
one that names the method and the methods that batch. Nothing ever falls back to an
uncompressed cache.
"""

from __future__ import annotations

import copy
import sys
import weakref
from typing import Any

import mlx.core as mx

from .base import _PACKAGE_DIR, AttentionHookMissing, causal_mask
from .buffers import GrowingArray

PACKED, PER_SEQUENCE = "packed", "per_sequence"

# Classes that batch, by "module:qualname", for classes whose modules are not edited here;
# each one passes the batch conformance tests (tests/test_conformance.py). True: packed
# decode where the base has it and the class changes none of its decode steps (else per
# sequence); PER_SEQUENCE: per sequence, for a class whose decode code reads the cache's
# offset as a number (Keyformer's noise keys: packed, ``offset`` is one per sequence).
BATCHABLE: dict[str, bool | str] = {
    # the eviction base
    "veloxquant_mlx.methods.snapkv:SnapKVCache": True,
    "veloxquant_mlx.methods.knorm:L2NormCache": True,
    "veloxquant_mlx.methods.tova:TOVACache": True,
    "veloxquant_mlx.methods.h2o:H2OCache": True,
    "veloxquant_mlx.methods.pyramidkv:PyramidKVCache": True,
    "veloxquant_mlx.methods.squeeze:SqueezeAttentionCache": True,
    "veloxquant_mlx.methods.curdkv:CurDKVCache": True,
    # the eviction base, decode steps of their own: per sequence
    "veloxquant_mlx.methods.chunkkv:ChunkKVCache": True,
    "veloxquant_mlx.methods.cam:CaMCache": True,
    "veloxquant_mlx.methods.qfilters:QFiltersCache": True,
    "veloxquant_mlx.methods.morphkv:MorphKVCache": True,
    "veloxquant_mlx.methods.nestedkv:NestedKVCache": True,
    "veloxquant_mlx.methods.rocketkv:RocketKVCache": True,
    "veloxquant_mlx.methods.keyformer:KeyformerCache": PER_SEQUENCE,
    # no packed layout: per sequence
    "veloxquant_mlx.methods.streaming_llm:StreamingLLMCache": PER_SEQUENCE,
    "veloxquant_mlx.methods.kivi:KIVICache": PER_SEQUENCE,
    "veloxquant_mlx.methods.kitty:KittyCache": PER_SEQUENCE,
    "veloxquant_mlx.methods.adakv:AdaKVCache": PER_SEQUENCE,
    "veloxquant_mlx.methods.age_tiered:AgeTieredKVCache": PER_SEQUENCE,
    "veloxquant_mlx.methods.skvq:SKVQCache": PER_SEQUENCE,
    "veloxquant_mlx.methods.kvquant:KVQuantCache": PER_SEQUENCE,
    "veloxquant_mlx.methods.gear:GEARCache": PER_SEQUENCE,
    "veloxquant_mlx.methods.zipcache:ZipCacheKVCache": PER_SEQUENCE,
}
# Packed decode can be turned off (every decode step then runs per sequence, bit-identical
# to each sequence alone; packed it is one attention call per layer for the batch).
PACK_DECODE = True


def class_key(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def batch_mode(cls: type) -> str | None:
    """PACKED, PER_SEQUENCE, or None (the class does not batch). Never inherited."""
    value = cls.__dict__.get("batchable")
    if value is None:
        value = BATCHABLE.get(class_key(cls))
    if not value:
        return None
    if value == PER_SEQUENCE:
        return PER_SEQUENCE
    return PACKED if packer_for(cls) is not None else PER_SEQUENCE


def packer_for(cls: type):
    """The packed layout of ``cls``'s base, when ``cls`` changes none of its decode steps."""
    from ..evict.base import ScoredEvictionCache
    from ..methods.full import FullCache

    if cls is FullCache:
        return FullPacked
    if issubclass(cls, ScoredEvictionCache):
        from ..evict.batch import EvictionPacked

        return EvictionPacked if EvictionPacked.accepts(cls) else None
    return None


def batchable_methods() -> list[str]:
    """Method keys whose implementation batches (for messages and tests)."""
    from ..registry import METHODS

    out = []
    for key, info in METHODS.items():
        if not info.implemented:
            continue
        try:
            cls = info.load_implementation()
        except Exception:  # a module another engineer is still writing
            continue
        if batch_mode(cls) is not None:
            out.append(key)
    return out


def refusal(cache: Any) -> str:
    """Why ``cache``'s method does not batch, naming it and the methods that do."""
    method = cache.config.method
    return (
        f"method {method!r} ({type(cache).__name__}) does not support batched generation "
        "(mlx-lm's batch_generate, BatchGenerator, the server's continuous batching): its "
        "algorithm is not checked to batch on VeloxQuant's batch caches, and VeloxQuant never "
        "falls back to an uncompressed cache. Generate one sequence at a time "
        "(mlx_lm.generate / stream_generate), or use a method that batches: "
        + ", ".join(batchable_methods())
    )


# -- copies that keep one context per sequence ------------------------------------------
# A sequence's layers share one ModelContext. mlx-lm merges and extracts layer by layer
# (layer 0 first), so a copy made for the first compressed layer is reused by the others.
_STASHES: dict[str, dict[int, tuple[Any, Any]]] = {"merge": {}, "extract": {}}


def _context_copy(context: Any, layer: int, purpose: str) -> Any:
    if context is None:
        return None
    stash = _STASHES[purpose]
    entry = stash.get(id(context))
    first = not context.compressed_layers or layer == context.compressed_layers[0]
    if entry is None or first or entry[0]() is not context:
        for key in [k for k, (ref, _) in stash.items() if ref() is None]:
            del stash[key]
        entry = (weakref.ref(context), copy.deepcopy(context))
        stash[id(context)] = entry
    return entry[1]


def copy_single(cache: Any, purpose: str) -> Any:
    """An independent copy of a single-sequence cache; its layers keep sharing one context."""
    context = getattr(cache, "context", None)
    memo = {} if context is None else {id(context): _context_copy(context, cache.layer, purpose)}
    return copy.deepcopy(cache, memo)


def merge(cls: type, caches: list) -> "BatchCache":
    """``caches[0][i].merge([c[i] for c in caches])``: one batch cache for layer i.

    The caches are copied (a user's prompt caches, which mlx-lm promises not to change);
    each sequence's layers keep sharing one (copied) model context.
    """
    if batch_mode(cls) is None:
        raise ValueError(refusal(caches[0]))
    for c in caches:
        if type(c) is not cls:
            raise ValueError(
                f"cannot batch a {type(c).__name__} with a {cls.__name__}: every sequence of a "
                "batch must use the same method"
            )
    singles = [copy_single(c, "merge") for c in caches]
    return batch_class(cls)(singles)


_BATCH_CLASSES: dict[type, type] = {}


def batch_class(cls: type) -> type:
    """The batch class of a method class (it observes hidden states if the method does)."""
    if cls not in _BATCH_CLASSES:
        body = {"cache_class": cls, "__module__": __name__}
        if hasattr(cls, "observe_hidden"):
            body["observe_hidden"] = BatchCache._observe_hidden
            body["observes_hidden_states"] = getattr(cls, "observes_hidden_states", False)
        _BATCH_CLASSES[cls] = type(f"Batch{cls.__name__}", (BatchCache,), body)
    return _BATCH_CLASSES[cls]


def _share_dtypes_deepcopy(obj, memo):
    clone = type(obj).__new__(type(obj))
    memo[id(obj)] = clone
    for name, value in obj.__dict__.items():
        clone.__dict__[name] = value if isinstance(value, mx.Dtype) else copy.deepcopy(value, memo)
    return clone


class BatchCache:
    """One layer's caches of a batch of sequences (see the module docstring)."""

    cache_class: type
    requires_attention_hook = True  # attention must come here (per sequence, or packed)

    def __init__(self, singles: list):
        self.config = singles[0].config
        self.layer = singles[0].layer
        self.seqs: list | None = list(singles)  # per-sequence layout
        self.packed = None  # packed layout (FullPacked, EvictionPacked), or None
        self._lead: list[int] | None = None  # left padding of the next update
        self._todo: list[int] | None = None  # real tokens still to come (right padding after)
        self._right: list[int] | None = None  # right padding of the next update (no lengths)
        self._spans: list[tuple[int, int]] = []  # (first row, real rows) per sequence, last update
        self._fetched: list = []
        self._awaiting_attend = False

    @property
    def batch_size(self) -> int:
        return len(self.seqs) if self.packed is None else self.packed.batch_size

    @property
    def mode(self) -> str:
        return PER_SEQUENCE if self.packed is None else PACKED

    # -- positions: what the model feeds RoPE with -------------------------------------------
    @property
    def offset(self) -> mx.array:
        """(B,) int32: the position of each sequence's next token (minus pending left padding)."""
        if self.packed is not None:
            return self.packed.offset_array
        lead = self._lead or [0] * len(self.seqs)
        return mx.array([s.offset - p for s, p in zip(self.seqs, lead)], mx.int32)

    @property
    def offsets(self) -> list[int]:
        """Tokens each sequence has seen (host ints)."""
        return list(self.packed.offsets) if self.packed is not None else [s.offset for s in self.seqs]

    # -- padding of prompt chunks ----------------------------------------------------------------
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        self._unpack()
        if left_padding is not None:
            if any(s.offset for s in self.seqs):
                raise ValueError("Left padding can only be added to an empty batch cache")
            self._lead = [int(p) for p in left_padding]
        if lengths is not None:
            self._todo = [int(n) for n in lengths]
        elif right_padding is not None and max(right_padding) > 0:
            self._right = [int(p) for p in right_padding]

    def finalize(self):
        """Nothing to roll: padding rows were never stored."""
        self._todo = self._right = None

    def _take_spans(self, n: int) -> list[tuple[int, int]]:
        spans = []
        for b in range(len(self.seqs)):
            lead = self._lead[b] if self._lead else 0
            real = n - lead
            if self._todo is not None:
                real = max(0, min(self._todo[b], real))
                self._todo[b] -= real
            elif self._right is not None:
                real -= self._right[b]
            spans.append((lead, real))
        self._lead = self._right = None
        return spans

    # -- the protocol ----------------------------------------------------------------------
    def _expect_attend(self) -> None:
        """Attention must come to ``attend`` (as for caches that own attention)."""
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
            frame = frame.f_back
        if frame is not None:
            from ..integrations.mlx_lm import hook_caller_module

            hook_caller_module(frame.f_globals, self)
        if self._awaiting_attend:
            raise AttentionHookMissing(
                f"a batch of {self.cache_class.__name__} (method {self.config.method!r}) "
                "computes attention itself, but the model's attention did not go through the "
                "VeloxQuant hook"
            )
        self._awaiting_attend = True

    def update_and_fetch(self, keys, values):
        self._expect_attend()
        n = keys.shape[2]
        padded = self._lead is not None or self._todo is not None or self._right is not None
        if n == 1 and not padded:
            self._pack()
            if self.packed is not None:
                return self.packed.update_and_fetch(keys, values)
        self._unpack()
        self._spans = self._take_spans(n)
        self._fetched = []
        for b, (s, (lead, real)) in enumerate(zip(self.seqs, self._spans)):
            if real <= 0:
                self._fetched.append(None)
                continue
            rows = slice(lead, lead + real)
            self._fetched.append(s.update_and_fetch(keys[b : b + 1, :, rows], values[b : b + 1, :, rows]))
        return keys, values  # attention is computed per sequence in ``attend``

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        self._awaiting_attend = False
        if self.packed is not None:
            return self.packed.attend(queries, keys, values, scale=scale, sinks=sinks)
        n = queries.shape[2]
        outs = []
        for b, (s, (lead, real), fetched) in enumerate(zip(self.seqs, self._spans, self._fetched)):
            if fetched is None:
                outs.append(mx.zeros((1, queries.shape[1], n, values.shape[3]), queries.dtype))
                continue
            k, v = fetched
            own = None if real == 1 else causal_mask(real, k.shape[2]) if isinstance(mask, mx.array) else "causal"
            out = s.attend(queries[b : b + 1, :, lead : lead + real], k, v, scale=scale, mask=own, sinks=sinks)
            if real < n:
                out = mx.pad(out, [(0, 0), (0, 0), (lead, n - lead - real), (0, 0)])
            outs.append(out)
        self._fetched = []
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

    def _observe_hidden(self, before, attention):
        """Each sequence's cache observes its own rows (methods that observe hidden states)."""
        if self.packed is not None:
            spans = [(0, 1)] * self.packed.batch_size
            seqs = self.packed.shells
        else:
            spans, seqs = self._spans, self.seqs
        for b, (s, (lead, real)) in enumerate(zip(seqs, spans)):
            if real > 0:
                rows = slice(lead, lead + real)
                s.observe_hidden(before[b : b + 1, rows], attention[b : b + 1, rows])

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise ValueError(
                f"method {self.config.method!r} does not support sliding-window attention "
                f"layers (window_size={window_size})"
            )
        if self.packed is not None:
            return self.packed.make_mask(N, return_array)
        # Per sequence, each cache builds its own mask in ``attend``; this one is a stand-in
        # of the batch's shape for models that look at it.
        if N == 1 and not return_array:
            return None
        if not return_array:
            return "causal"
        return causal_mask(N, max(s._rows_returned(N) for s in self.seqs))

    # -- layouts -----------------------------------------------------------------------------
    def _pack(self) -> None:
        if self.packed is not None or not PACK_DECODE or batch_mode(self.cache_class) != PACKED:
            return
        packer = packer_for(self.cache_class)
        if all(packer.can_pack(s) for s in self.seqs):
            self.packed = packer.pack(self.seqs)
            self.seqs = None

    def _unpack(self) -> None:
        if self.packed is not None:
            self.seqs = self.packed.unpack()
            self.packed = None

    # -- what mlx-lm's BatchGenerator calls --------------------------------------------------
    def filter(self, batch_indices) -> None:
        keep = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices)]
        if self.packed is not None:
            self.packed.filter(keep)
        else:
            self.seqs = [self.seqs[i] for i in keep]

    def extend(self, other: "BatchCache") -> None:
        if type(other) is not type(self):
            raise ValueError(f"cannot extend a {type(self).__name__} with a {type(other).__name__}")
        if self.packed is not None and other.packed is None:
            other._pack()
        if self.packed is not None and other.packed is not None:
            self.packed.extend(other.packed)
        else:
            self._unpack()
            other._unpack()
            self.seqs.extend(other.seqs)

    def extract(self, idx: int):
        """Sequence ``idx`` as a single-sequence cache of the method's class, independent of
        the batch: the state it would have run alone."""
        if self.packed is not None:
            return self.packed.extract(idx)
        return copy_single(self.seqs[idx], "extract")

    def size(self) -> int:
        if self.packed is not None:
            return self.packed.size()
        return max((s.size() for s in self.seqs), default=0)

    def empty(self) -> bool:
        return self.packed is None and all(s.empty() for s in self.seqs)

    @property
    def nbytes(self) -> int:
        """Bytes of every array the batch holds: each sequence's, padding slots included."""
        if self.packed is not None:
            return self.packed.nbytes
        return sum(s.nbytes for s in self.seqs)

    @property
    def state(self):
        """The arrays held (mlx-lm evaluates them after each prompt chunk)."""
        if self.packed is not None:
            return self.packed.state
        return [s.state["arrays"] for s in self.seqs]

    @state.setter
    def state(self, value):
        raise ValueError("batch caches are not saved: extract each sequence and save that")

    def is_trimmable(self) -> bool:
        if self.packed is not None:
            return self.packed.is_trimmable()
        return all(s.is_trimmable() for s in self.seqs)

    def trim(self, n: int) -> int:
        """The same ``n`` tokens off every sequence, exactly (each cache trims itself)."""
        if not self.is_trimmable():
            return 0
        self._unpack()
        n = min([n] + [s.offset for s in self.seqs])
        trimmed = [s.trim(n) for s in self.seqs]
        return trimmed[0] if trimmed else 0

    def __deepcopy__(self, memo):
        return _share_dtypes_deepcopy(self, memo)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(layer={self.layer}, sequences={self.batch_size}, "
                f"layout={self.mode}, offsets={self.offsets}, nbytes={self.nbytes})")


# -- shared by packed layouts ------------------------------------------------------------------
def grown_capacity(capacity: int, length: int, n: int, step: int, limit: int | None) -> int:
    """The capacity ``GrowingArray.append`` leaves after appending ``n`` rows."""
    if length + n <= capacity:
        return capacity
    room = (n + step - 1) // step * step
    if limit is not None and length + n <= limit:
        room = min(room, limit - length)
    return length + room


def pad_rows(x: mx.array, rows: int, value=0) -> mx.array:
    """``x`` (1, H, n, ...) with rows appended along axis 2 up to ``rows``."""
    extra = rows - x.shape[2]
    if extra <= 0:
        return x
    return mx.pad(x, [(0, 0), (0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 3), constant_values=value)


def single_buffer(block: mx.array, capacity: int, step: int, limit: int | None) -> GrowingArray:
    """A GrowingArray holding ``block`` (1, H, n, ...) with ``capacity`` rows of room."""
    grown = GrowingArray(axis=2, step=step, limit=limit)
    grown.buffer = mx.contiguous(pad_rows(block, capacity))
    grown.length = block.shape[2]
    return grown


class FullPacked:
    """The dense cache's packed decode layout: keys and values (B, H, rows, D), each
    sequence's tokens in slots 0 .. n_b - 1, the rest padding (masked by slot)."""

    batch_size = property(lambda self: len(self.shells))

    @staticmethod
    def can_pack(single) -> bool:
        return single.keys.buffer is not None

    @classmethod
    def pack(cls, singles) -> "FullPacked":
        self = cls.__new__(cls)
        self.shells = singles
        self.lengths = [s.keys.length for s in singles]
        self.capacities = [s.keys.capacity for s in singles]
        self.offsets = [s.offset for s in singles]
        room = max(self.capacities)
        step = singles[0].keys.step
        self.keys, self.values = GrowingArray(step=step), GrowingArray(step=step)
        self.keys.buffer = mx.concatenate([pad_rows(s.keys.view(), room) for s in singles])
        self.values.buffer = mx.concatenate([pad_rows(s.values.view(), room) for s in singles])
        self.keys.length = self.values.length = max(self.lengths)
        for s in singles:  # the shells keep their config, context and layer; not their rows
            s.keys, s.values = GrowingArray(), GrowingArray()
        self._sync()
        return self

    def _sync(self) -> None:
        self.offset_array = mx.array(self.offsets, mx.int32)
        self.length_array = mx.array(self.lengths, mx.int32)
        self.padded = len(set(self.lengths)) > 1

    def update_and_fetch(self, keys, values):
        shape = self.shells[0].kv_shape
        if (keys.shape[1], keys.shape[3], values.shape[3]) != (shape[1], shape[2], shape[3]):
            self.shells[0]._check_shape(keys[:1], values[:1])
        if not self.padded:
            self.keys.append(keys)
            self.values.append(values)
        else:
            if max(self.lengths) == self.keys.length:
                self.keys.append(mx.zeros_like(keys))
                self.values.append(mx.zeros_like(values))
            slot = self.length_array.reshape(-1, 1, 1, 1)
            for grown, rows in ((self.keys, keys), (self.values, values)):
                index = mx.broadcast_to(slot, (*rows.shape[:3], 1))
                grown.buffer = mx.put_along_axis(grown.buffer, index, rows, axis=2)
        step = self.keys.step
        self.capacities = [grown_capacity(c, n, 1, step, None) for c, n in zip(self.capacities, self.lengths)]
        self.lengths = [n + 1 for n in self.lengths]
        self.offsets = [o + 1 for o in self.offsets]
        self.offset_array = self.offset_array + 1
        self.length_array = self.length_array + 1
        return self.keys.view(), self.values.view()

    def _visible(self, rows: int) -> mx.array | None:
        if not self.padded:
            return None
        return (mx.arange(rows)[None] < self.length_array[:, None])[:, None, None, :]

    def attend(self, queries, keys, values, *, scale, sinks=None):
        mask = self._visible(keys.shape[2])
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def make_mask(self, N, return_array):
        if N == 1 and not (return_array or self.padded):
            return None
        rows = self.keys.length + N
        visible = mx.arange(rows)[None] < (self.length_array + N)[:, None]
        return visible[:, None, None, :] & causal_mask(N, rows)[None, None]

    def filter(self, keep: list[int]) -> None:
        index = mx.array(keep, mx.int32)
        self.shells = [self.shells[i] for i in keep]
        for name in ("lengths", "capacities", "offsets"):
            setattr(self, name, [getattr(self, name)[i] for i in keep])
        for grown in (self.keys, self.values):
            grown.buffer = grown.buffer[index]
            grown.length = max(self.lengths)
        self._sync()

    def extend(self, other: "FullPacked") -> None:
        rows = max(self.keys.capacity, other.keys.capacity)
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            mine.buffer = mx.concatenate([pad_rows(mine.buffer, rows), pad_rows(theirs.buffer, rows)])
            mine.length = max(mine.length, theirs.length)
        self.shells += other.shells
        self.lengths += other.lengths
        self.capacities += other.capacities
        self.offsets += other.offsets
        self._sync()

    def _single(self, b: int, shell):
        n, cap = self.lengths[b], self.capacities[b]
        shell.keys = single_buffer(self.keys.buffer[b : b + 1, :, :n], cap, self.keys.step, None)
        shell.values = single_buffer(self.values.buffer[b : b + 1, :, :n], cap, self.keys.step, None)
        shell.offset = self.offsets[b]
        return shell

    def extract(self, b: int):
        return self._single(b, copy_single(self.shells[b], "extract"))

    def unpack(self) -> list:
        return [self._single(b, s) for b, s in enumerate(self.shells)]

    def is_trimmable(self) -> bool:
        return True

    def size(self) -> int:
        return max(self.lengths)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.offset_array.nbytes + self.length_array.nbytes

    @property
    def state(self):
        return [self.keys.view(), self.values.view()]

    def __deepcopy__(self, memo):
        return _share_dtypes_deepcopy(self, memo)


__all__ = ["BATCHABLE", "BatchCache", "FullPacked", "batch_mode", "batchable_methods", "merge",
           "refusal"]
