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
  The dense cache (``FullPacked`` here), the eviction base (``evict/batch.py``),
  StreamingLLM's sinks and ring (``methods/streaming_llm.py``; the dense ones attend through
  ``kernels/decode.py``'s ``RowsByLength``) and the quantized store
  (``quant/batch.py``) have one. Padding sits after a sequence's slots,
  so attention over a padded row adds exact zeros after the real terms; MLX's fused attention still sums a longer row in other
  blocks, so a sequence followed by padding may round differently from alone (by float
  rounding). The batch conformance tests hold packed runs to float
  rounding with the same tokens and kept positions, per-sequence runs to bit identity.

Batching is opt-in per method class, never inherited (a subclass may change what the
batch layouts rely on): a class says in its own body ``batchable = True`` (packed where
its base has a packed layout that accepts it, per sequence otherwise) or ``batchable =
"per_sequence"``. A class without it has no ``merge`` (``CompressedKVCache.merge`` raises
AttributeError), so mlx-lm does not batch it, and our integration replaces mlx-lm's
generic refusal with one naming the method, why it does not batch (``why_not_batchable``:
a class that cannot batch says why in its body, ``batchable = False`` with
``batch_refusal = "..."``) and the methods that batch. Nothing ever falls back to an
uncompressed cache.

Cross-layer methods (xkv, xquant, minicache) read their neighbours through the sequence's
model context; each sequence's copies share one copied context whose ``layers`` are those
copies (see "copies" below). Per sequence, each reads its own; stacked (xquant, xkv), a
group's caches at every layer share a context of the group's own (``cache/stacked.py``).

The quantized stores (``quant/store.py`` and the stores built on it) attend over parts
(sinks, segments, codebook codes, low-rank factors) whose boundaries move at each
sequence's own steps. The plain ``QuantizedKVStore`` of a class that keeps
``QuantizedCache``'s decode steps (KIVI) has a packed layout (``quant/batch.py``: one launch
of the fused frag kernel with each sequence's counts on CUDA in float16, else per-sequence
lengths and masks in the pure-MLX attention; flushes at each sequence's own steps); where a
fused kernel reads one KIVI sequence but none reads a packed batch (the other GPU shapes),
KIVI batches per sequence. A class whose rows never mix may say ``batchable = "stacked"``
instead: sequences in the same state (the same boundaries) share one cache of its own
class, fed their rows together (``cache/stacked.py``); twenty stores do. The others batch
per sequence: each store's decode runs unchanged (bit-identical to alone) and the model's
projections and MLPs still run batched.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import mlx.core as mx

from .base import CompressedKVCache, causal_mask
from .buffers import GrowingArray, added_room

PACKED, PER_SEQUENCE, STACKED = "packed", "per_sequence", "stacked"

def batch_mode(cls: type) -> str | None:
    """PACKED, PER_SEQUENCE, or None (the class does not batch): ``cls``'s own
    ``batchable``, never an inherited one."""
    value = cls.__dict__.get("batchable")
    if value is None or value is False:
        return None
    if value == PER_SEQUENCE:
        return PER_SEQUENCE
    if value == STACKED:
        return PACKED
    if value is not True:
        raise TypeError(
            f"{cls.__qualname__}.batchable={value!r}: allowed are True (packed where the base "
            f"has a packed layout for it), {STACKED!r} (the method's own cache fed a batch, "
            f"cache/stacked.py), {PER_SEQUENCE!r} or False"
        )
    return PACKED if packer_for(cls) is not None else PER_SEQUENCE


def packer_for(cls: type):
    """The packed layout of ``cls``'s base, when ``cls`` changes none of its decode steps
    (the class's ``packed_layout()``, which the bases with a packed layout define), or the
    stacked layout for a class that declares it."""
    if cls.__dict__.get("batchable") == STACKED:
        from .stacked import StackedLayout

        return StackedLayout
    layout = getattr(cls, "packed_layout", None)
    return layout() if layout is not None else None


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


def why_not_batchable(cache: Any) -> str:
    """Why ``cache`` does not batch: the class's own ``batch_refusal`` (a method that cannot
    batch says why in its body, next to ``batchable = False``), a composed cache (a storage
    under an eviction method), or a class that has not opted in."""
    cls = type(cache)
    reason = cls.__dict__.get("batch_refusal")
    if reason:
        return reason
    storage = getattr(getattr(cache, "config", None), "storage", None)
    if batch_mode(cls) is not None and storage is not None:
        return (f"it is a composed cache (storage={type(storage).__name__}(...) under an eviction "
                "method): no batch layout holds its quantized slots")
    return ("its class has not opted in (no `batchable`: it is not checked to give each "
            "sequence of a batch what it gives alone)")


def refusal(cache: Any) -> str:
    """Why ``cache``'s method does not batch, naming it, the reason and the methods that do."""
    method = cache.config.method
    return (
        f"method {method!r} ({type(cache).__name__}) does not support batched generation "
        f"(mlx-lm's batch_generate, BatchGenerator, the server's continuous batching): "
        f"{why_not_batchable(cache)}; VeloxQuant never falls back to an uncompressed cache. "
        "Generate one sequence at a time (mlx_lm.generate / stream_generate), or use a method "
        "that batches: " + ", ".join(batchable_methods())
    )


# -- copies: one model context per sequence ----------------------------------------------
# A sequence's layers share one ModelContext (per-layer budgets, what one layer leaves for
# the next) whose ``layers`` list is the sequence's prompt cache: cross-layer methods reach
# a neighbour through it (cache/cross_layer.py). mlx-lm merges and extracts layer by layer,
# layer 0 first, with nothing run in between; the context is deep-copied once, at the
# sequence's first compressed layer, which copies its compressed layers with it, each
# linked to the copied context, and every layer's copy is the one in the copied context's
# ``layers`` (a copy made apart from it would read its neighbours' stale copies). The
# model's own caches in ``layers`` (layers the method does not compress: mlx-lm batches
# them itself) are not copied: the copied context holds None for them. The copy is kept
# here, by the original's id, until the sequence's last compressed layer has taken its
# copy. Merges and extracts keep separate tables, so that neither picks up a copy the
# other made.
_CONTEXT_COPIES: dict[str, dict[int, tuple[weakref.ref, Any]]] = {"merge": {}, "extract": {}}


def _context_copy(context: Any, layer: int, purpose: str) -> Any:
    if context is None:
        return None
    copies = _CONTEXT_COPIES[purpose]
    entry = copies.get(id(context))
    held = context.local_compressed_layers  # a pipeline rank's first layer may be any
    first_layer = not held or layer == held[0]
    if entry is None or first_layer or entry[0]() is not context:
        for key in [k for k, (ref, _) in copies.items() if ref() is None]:
            del copies[key]
        memo = {id(c): None for c in (context.layers or ())
                if c is not None and not isinstance(c, CompressedKVCache)}
        entry = (weakref.ref(context), copy.deepcopy(context, memo))
        copies[id(context)] = entry
    if held and layer == held[-1]:  # every compressed layer of the sequence has its copy
        copies.pop(id(context), None)
    return entry[1]


def copy_single(cache: Any, purpose: str) -> Any:
    """An independent copy of a single-sequence cache (``purpose``: "merge" or "extract");
    the copies of one sequence's layers share one copied context, whose ``layers`` are
    those copies."""
    context = getattr(cache, "context", None)
    if context is None:
        return copy.deepcopy(cache)
    copied = _context_copy(context, cache.layer, purpose)
    layers = context.layers or []
    if cache.layer < len(layers) and layers[cache.layer] is cache:
        return copied.layers[cache.layer]
    return copy.deepcopy(cache, {id(context): copied})


def merge(cls: type, caches: list) -> "BatchCache":
    """``caches[0][i].merge([c[i] for c in caches])``: one batch cache for layer i.

    The caches are copied (they are a caller's prompt caches, which mlx-lm leaves as they
    were).
    """
    if batch_mode(cls) is None:
        raise ValueError(refusal(caches[0]))
    for c in caches:
        if type(c) is not cls:
            raise ValueError(
                f"cannot batch a {type(c).__name__} with a {cls.__name__}: every sequence of a "
                "batch must use the same method"
            )
    return batch_class(cls)([copy_single(c, "merge") for c in caches])


_BATCH_CLASSES: dict[type, type] = {}


def batch_class(cls: type) -> type:
    """The batch class of a method class: ``BatchCache`` plus, for a method that observes
    hidden states, ``observe_hidden`` (the integration looks for it by name)."""
    if cls not in _BATCH_CLASSES:
        body = {"cache_class": cls, "__module__": __name__}
        if hasattr(cls, "observe_hidden"):
            body["observe_hidden"] = BatchCache._observe_hidden
            body["observes_hidden_states"] = getattr(cls, "observes_hidden_states", False)
        _BATCH_CLASSES[cls] = type(f"Batch{cls.__name__}", (BatchCache,), body)
    return _BATCH_CLASSES[cls]


class BatchCache:
    """One layer's caches of a batch of sequences (see the module docstring)."""

    cache_class: type
    requires_attention_hook = True  # attention must come here (per sequence, or packed)

    def __init__(self, singles: list):
        self.config = singles[0].config
        self.layer = singles[0].layer
        self.seqs: list | None = list(singles)  # per-sequence layout: one cache per sequence
        self.packed = None  # packed layout (FullPacked, EvictionPacked); then seqs is None
        # Padding of the update to come, from ``prepare``: per sequence, padding rows before
        # its tokens, real tokens still to come in this and later chunks (the rest of each
        # chunk is padding after them), or padding rows after its tokens.
        self._left_padding: list[int] | None = None
        self._tokens_to_come: list[int] | None = None
        self._right_padding: list[int] | None = None
        # Per sequence, of the last update: (first real row, real rows), and what its cache
        # returned (None: no real rows), for ``attend``.
        self._real_rows: list[tuple[int, int]] = []
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
        """(B,) int32: each sequence's next position, less pending left padding (so that its
        first real token gets its own position, as mlx-lm's BatchKVCache does)."""
        if self.packed is not None:
            return self.packed.offset_array
        lead = self._left_padding or [0] * len(self.seqs)
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
            self._left_padding = [int(p) for p in left_padding]
        if lengths is not None:
            self._tokens_to_come = [int(n) for n in lengths]
        elif right_padding is not None and max(right_padding) > 0:
            self._right_padding = [int(p) for p in right_padding]

    def finalize(self):
        """Nothing to roll (BatchKVCache moves right padding to the left here): padding rows
        were never stored."""
        self._tokens_to_come = self._right_padding = None

    def _split_rows(self, n: int) -> list[tuple[int, int]]:
        """(first real row, real rows) of each sequence in an update of ``n`` rows; uses up
        the left and right padding and counts down the tokens to come."""
        out = []
        for b in range(len(self.seqs)):
            lead = self._left_padding[b] if self._left_padding else 0
            real = n - lead
            if self._tokens_to_come is not None:
                real = max(0, min(self._tokens_to_come[b], real))
                self._tokens_to_come[b] -= real
            elif self._right_padding is not None:
                real -= self._right_padding[b]
            out.append((lead, real))
        self._left_padding = self._right_padding = None
        return out

    # -- an update, then attention ---------------------------------------------------------
    # Borrowed, not inherited: a batch cache is no CompressedKVCache (it is never saved,
    # registered with mlx-lm or merged again). The hook check routes the calling model
    # module's attention to ``attend``; copies share dtypes, which cannot be copied.
    _expect_attend = CompressedKVCache._expect_attend
    __deepcopy__ = CompressedKVCache.__deepcopy__

    @property
    def _padding_pending(self) -> bool:
        return not (self._left_padding is None and self._tokens_to_come is None and self._right_padding is None)

    def update_and_fetch(self, keys, values):
        """A decode step without padding goes to the packed layout when the class has one
        and every sequence can join it; any other update (a prompt chunk, padded or not)
        goes to each sequence's cache, its real rows only."""
        self._expect_attend()
        n = keys.shape[2]
        if n == 1 and not self._padding_pending:
            self._pack()
            if self.packed is not None:
                return self.packed.update_and_fetch(keys, values)
        self._unpack()
        self._real_rows = self._split_rows(n)
        self._fetched = []
        for b, (s, (first, real)) in enumerate(zip(self.seqs, self._real_rows)):
            if real <= 0:
                self._fetched.append(None)
                continue
            rows = slice(first, first + real)
            self._fetched.append(s.update_and_fetch(keys[b : b + 1, :, rows], values[b : b + 1, :, rows]))
        return keys, values  # not attended: ``attend`` takes each sequence's own rows

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        """Packed: one call for the batch. Per sequence: each cache attends with its own
        queries, over what it returned, with its own causal mask; padding rows get zeros
        (mlx-lm discards their outputs)."""
        self._awaiting_attend = False
        if self.packed is not None:
            out = self.packed.attend(queries, keys, values, scale=scale, sinks=sinks)
            # mlx-lm's batch loop evaluates the tokens only: a write the attention did not
            # read would stay lazy and chain onto the next step's (tests/test_batch_lazy_state.py)
            writes = self.packed.step_writes()
            return mx.depends(out, writes) if writes else out
        n = queries.shape[2]
        outs = []
        for b, (s, (first, real), fetched) in enumerate(zip(self.seqs, self._real_rows, self._fetched)):
            if fetched is None:
                outs.append(mx.zeros((1, queries.shape[1], n, values.shape[3]), queries.dtype))
                continue
            k, v = fetched
            own_mask = None if real == 1 else causal_mask(real, k.shape[2]) if isinstance(mask, mx.array) else "causal"
            out = s.attend(queries[b : b + 1, :, first : first + real], k, v, scale=scale, mask=own_mask, sinks=sinks)
            if real < n:
                out = mx.pad(out, [(0, 0), (0, 0), (first, n - first - real), (0, 0)])
            outs.append(out)
        self._fetched = []
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

    def _observe_hidden(self, before, attention):
        """Each sequence's cache observes its own rows (methods that observe hidden states)."""
        if self.packed is not None:  # a decode step: one row each; the shells keep the method's state
            real_rows, seqs = [(0, 1)] * self.packed.batch_size, self.packed.shells
        else:
            real_rows, seqs = self._real_rows, self.seqs
        for b, (s, (first, real)) in enumerate(zip(seqs, real_rows)):
            if real > 0:
                rows = slice(first, first + real)
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
        """Per sequence -> packed, when the class has a packed layout and every sequence is
        past its prompt (``can_pack``); otherwise the batch stays per sequence."""
        if self.packed is not None or batch_mode(self.cache_class) != PACKED:
            return
        packer = packer_for(self.cache_class)
        if packer is not None and all(packer.can_pack(s) for s in self.seqs):
            self.packed = packer.pack(self.seqs)
            self.seqs = None

    def _unpack(self) -> None:
        """Packed -> per sequence: each sequence's cache gets back its rows, exactly as it
        would hold them alone (a prompt chunk, ``prepare``, ``trim`` run per sequence)."""
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
        """Sequences join: packed if both batches can be, per sequence otherwise."""
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
        """Bytes of every array the batch holds: each sequence's, padding slots included; an
        array several sequences keep (a calibration file's tables, read once) counted once."""
        if self.packed is not None:
            return self.packed.nbytes
        return sum(s.nbytes for s in self.seqs) - _kept_again(self.seqs)

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

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(layer={self.layer}, sequences={self.batch_size}, "
                f"layout={self.mode}, offsets={self.offsets}, nbytes={self.nbytes})")


def _kept_again(caches) -> int:
    """Bytes of the arrays that a cache keeps (``_arrays``) and an earlier one of ``caches``
    keeps too, the same array: counted in each one's ``nbytes``, held once."""
    seen, again = set(), 0
    for cache in caches:
        mine = {}
        for kept in cache._arrays().values():
            a = kept.buffer if isinstance(kept, GrowingArray) else kept
            if isinstance(a, mx.array):
                mine[id(a)] = a.nbytes
        again += sum(n for i, n in mine.items() if i in seen)
        seen.update(mine)
    return again


# -- packed layouts -----------------------------------------------------------------------
# A packed layout (``FullPacked`` below, ``evict/batch.py``'s ``EvictionPacked``) provides:
# ``can_pack(single)`` and ``pack(singles)`` (classmethods), ``unpack()`` (the single caches
# back, as they would be alone), ``update_and_fetch``, ``attend``, ``make_mask``, ``filter``,
# ``extend``, ``extract``, ``size``, ``is_trimmable``, ``nbytes``, ``state``, and reads
# ``batch_size``, ``offsets`` (host ints), ``offset_array`` ((B,) int32) and ``shells``: the
# sequences' own caches, emptied of rows, which keep their config, context and options
# (a method's per-sequence settings, what ``extract`` copies). Each layout tracks the
# capacity each sequence's own buffers would have grown to alone, so that unpacking or
# extracting gives back byte for byte the cache of the sequence run alone. ``PackedLayout``
# derives ``batch_size``, ``extract`` and ``unpack`` from ``shells`` and ``_single``, and
# gives ``step_writes`` (what a step writes but does not read: none unless a layout says).
def grown_capacity(capacity: int, length: int, n: int, step: int, limit: int | None,
                   geometric: bool = False) -> int:
    """The capacity ``GrowingArray.append`` leaves after appending ``n`` rows."""
    if length + n <= capacity:
        return capacity
    return length + added_room(length, n, step, limit, geometric)


def pad_rows(x: mx.array, rows: int, value=0) -> mx.array:
    """``x`` (1, H, n, ...) with rows appended along axis 2 up to ``rows``."""
    extra = rows - x.shape[2]
    if extra <= 0:
        return x
    return mx.pad(x, [(0, 0), (0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 3), constant_values=value)


def single_buffer(block: mx.array, capacity: int, step: int, limit: int | None,
                  geometric: bool = False) -> GrowingArray:
    """A GrowingArray holding ``block`` (1, H, n, ...) with ``capacity`` rows of room."""
    grown = GrowingArray(axis=2, step=step, limit=limit, geometric=geometric)
    grown.buffer = mx.contiguous(pad_rows(block, capacity))
    grown.length = block.shape[2]
    return grown


class PackedLayout:
    """What every packed layout derives from ``shells`` and ``_single(i, shell)`` (sequence
    i's rows put into ``shell``, returned): the batch size, ``extract`` and ``unpack``."""

    batch_size = property(lambda self: len(self.shells))

    def step_writes(self) -> list[mx.array]:
        """Arrays a decode step writes that its attention does not read (the batch's output
        then depends on them, so that they are evaluated with it)."""
        return []

    def extract(self, i: int):
        return self._single(i, copy_single(self.shells[i], "extract"))

    def unpack(self) -> list:
        return [self._single(i, s) for i, s in enumerate(self.shells)]


def check_step_rows(cache, keys, values) -> None:
    """A packed decode step's rows against ``cache``'s recorded shape (one of the batch's
    caches): its own ``_check_shape`` (the error naming what differs) only when the heads
    or the head dims differ, so a step pays a tuple comparison."""
    shape = cache.kv_shape
    if (keys.shape[1], keys.shape[3], values.shape[3]) != (shape[1], shape[2], shape[3]):
        cache._check_shape(keys[:1], values[:1])


__all__ = ["BatchCache", "PACKED", "PackedLayout", "PER_SEQUENCE", "check_step_rows", "batch_mode", "batchable_methods",
           "merge", "refusal", "why_not_batchable"]
