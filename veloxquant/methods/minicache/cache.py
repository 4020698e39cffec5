"""MiniCache: adjacent layers' keys and values merged in depth (arXiv 2405.14366).

From layer ``floor(minicache_start_frac * n_layers)`` on, the compressed layers pair up
in order, (S, S+1), (S+2, S+3), ... (``minicache_group_size``: 2, the only size SLERP
defines); an odd last layer and the layers below S stay exact. For each token and KV
head, keys and values separately, the pair's rows become one unit direction by SLERP at
``minicache_slerp_t`` and each layer keeps its own magnitude (``methods/minicache/slerp.py``); a
pair whose cosine is below ``minicache_retention_threshold`` is retained, both
originals kept (the first layer's as its direction slot, the second's as a difference,
with its index). What is kept:

- the pair's second (deeper) layer, the owner (as in the paper's Fig. 3, the merged cache
  is stored at layer l): the merged directions of the pair (shared: counted and saved
  once, with it), its magnitudes, its retained differences and their indices;
- the first layer: its magnitudes;
- each layer of the pair: its decode rows since the last flush, exact (``held_*``, up to
  ``FLUSH`` - 1 of them between two forward passes).

When: mlx-lm runs layer l-1 before layer l in every forward pass. A decode token's row
joins its layer's held rows, and each layer attends over the merged history plus its own
held rows; when ``FLUSH`` (32) rows are held, layer l merges the pair's 32 tokens after
its attention, in one batched, compiled step (the SLERP, the retained pairs' decisions and
table writes, keys and values: ``decode_step.merge_decode``), reading layer l-1's rows
(``take_unmerged``), and both layers' held rows are let go. A prompt chunk is exact in
both layers (prefill attention is exact in the paper): layer l merges the rows held
before it (as decode tokens: the same pass) and then the chunk, in order. Merging is per
token: merging a run of decode tokens at once leaves the state merging them one at a time
leaves, bit for bit, and merging step by step equals merging the whole run at once.

Adapted: up to 31 of the newest decode tokens (their count since the last prompt chunk,
mod 32) are read exact, not merged, until their flush (as KIVI's full-precision residual):
a steady decode step writes one row and attends.

Attention reads the merged rows in place (``MergedRows``: ``m_t (q·e_t)`` plus the
retained differences) at a decode step; a prompt chunk attends over the rebuilt history.

Adapted: a cosine threshold replaces the paper's min-max-normalised angular gamma rule;
merged states are not quantized (the paper's 5.02x adds 4-bit quantization).
``minicache_max_ctx`` bounds a pair's merged tokens: a paired layer refuses to grow past
it, naming the field.

Retained pairs, and host reads: a prompt chunk's retained pairs are read on the host (the
table grows by their number, once a chunk). A decode step reads nothing: the table holds
rows reserved ahead, ``RESERVE_TOKENS`` decode tokens at a time, at the rate the prompt
retained plus a margin (``min(1, 2 f + 1/16)`` of the pairs, f the prompt's fraction; all
of them before any prompt was merged; ``RESERVE_TOKENS`` is a multiple of ``FLUSH``, so a
reservation falls at a flush's first token), and a flush writes its tokens' retained pairs,
token after token, into the rows after the ``used`` ones on the device
(``decode_step.merge_decode``, as ``slerp.write_retained``); pairs past the reserved rows
are merged after all and counted (``ret_*_dropped``): an adaptation, where the paper keeps
every retained pair.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from ...cache.base import CompressedKVCache, causal_mask
from ...cache.buffers import GrowingArray, arrays_written
from ...cache.cross_layer import CrossLayer, CrossLayerError, consecutive_groups, rows
from . import decode_step
from .slerp import MergedRows, norms, retained_entries, slerp_merge

_TENSORS = ("k", "v")
# Decode rows each layer of a pair holds exactly; when FLUSH are held, the second layer
# merges the pair's rows in one batched step (as the quantized stores and the eviction base
# work every 32 steps), so a steady decode step writes one row and attends.
FLUSH = 32
# Decode tokens whose retained pairs a reservation of table rows covers: a multiple of
# FLUSH, so that a reservation falls at a flush's first token (one bound for the whole run).
RESERVE_TOKENS = 64


@functools.lru_cache(maxsize=256)
def _pair_groups(compressed: tuple[int, ...], n_layers: int, start_frac: float, size: int):
    start = math.floor(start_frac * n_layers)
    return tuple(g for g in consecutive_groups(compressed, size, start) if len(g) == size)


class MiniCacheCache(CrossLayer, CompressedKVCache):
    batchable = "per_sequence"  # its merged layer keeps a data-dependent number of retained tokens: two sequences' shapes differ, so no two share a stacked cache (cache/stacked.py)
    requires_attention_hook = True
    owner_position = -1  # the deeper layer merges and keeps the merged directions

    def layer_groups(self, compressed, n_layers):
        # asked at every layer's step (``role``, ``owner``): the flat fields, the groups kept
        # (``config.options`` builds and validates an options object at each read)
        return _pair_groups(tuple(compressed), n_layers, self.config.minicache_start_frac,
                            self.config.minicache_group_size)

    @property
    def role(self) -> str:
        group = self.layer_group
        return "alone" if len(group) == 1 else "first" if group[0] == self.layer else "second"

    def _init_storage(self) -> None:
        self._init_cross_layer()
        # every buffer here is read through its rows held (``view`` or ``[:count]``), so each
        # grows with what it holds (geometric): a short prompt pays no 256-row step
        grown = functools.partial(GrowingArray, geometric=True)
        self.keys, self.values = grown(), grown()  # layers left alone: exact
        # a paired layer's decode rows, exact until the pair's next flush: FLUSH rows of room,
        # made by the first row after a flush (a flush lets the buffer go)
        self.held_k, self.held_v = GrowingArray(step=FLUSH), GrowingArray(step=FLUSH)
        self.pending_k = self.pending_v = None  # a first layer's prompt chunk (after its held rows), until merged
        self.m_k, self.m_v = grown(), grown()  # own magnitudes of the merged tokens
        for x in _TENSORS:  # a second layer's retained pairs: (b*H + h, token), x - m e
            setattr(self, f"ret_{x}_where", grown(axis=0))
            setattr(self, f"ret_{x}_delta", grown(axis=0))
            setattr(self, f"ret_{x}_used", None)  # () int32: rows holding pairs (the rest reserved)
            setattr(self, f"ret_{x}_dropped", None)  # () int32: decode pairs past the reserved rows
        self.retained_rate = 1.0  # of a decode token's pairs, rows reserved ahead
        for x in _TENSORS:  # a second layer's (the owner's) merged directions of the pair
            self.shared[f"e_{x}"] = grown()
        self._new = None
        self._decode_merges = 0  # decode tokens merged since the last prompt chunk: the reservation's schedule

    # -- the protocol ---------------------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        self._expect_attend()
        self._check_shape(keys, values)
        n, role = keys.shape[2], self.role
        limit = self.config.minicache_max_ctx
        if role != "alone" and self.offset + n > limit:
            raise ValueError(
                f"minicache_max_ctx={limit}: layer {self.layer}'s pair would merge "
                f"{self.offset + n} tokens; allowed: at most minicache_max_ctx (raise it)")
        self._note_update(n)
        if role == "alone":
            self.keys.append(keys)
            self.values.append(values)
        elif n == 1:
            self.held_k.append(keys)
            self.held_v.append(values)
        elif role == "first":  # the rows held and the chunk leave at the second layer's merge, this pass
            self.pending_k, self.pending_v = self._after_held(keys, values)
            self.held_k.reset(None)
            self.held_v.reset(None)
        else:
            self._new = (keys, values)
        self.offset += n
        return keys, values

    def _after_held(self, keys, values):
        if not self.held_k.length:
            return keys, values
        return (mx.concatenate([self.held_k.view(), keys], axis=2),
                mx.concatenate([self.held_v.view(), values], axis=2))

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        self._own_attention_begins(sinks)
        role, decode = self.role, queries.shape[2] == 1
        paired_history = role != "alone" and self.merged_rows
        if decode and paired_history:
            out = self._decode_attention(queries, scale)
        else:
            if role == "alone":
                k, v = self.keys.view(), self.values.view()
            elif decode:
                k, v = self.held_k.view(), self.held_v.view()
            else:
                k, v = (self.pending_k, self.pending_v) if role == "first" else self._after_held(*self._new)
            if paired_history:
                k = mx.concatenate([self.merged("k").dense(k.dtype), k], axis=2)
                v = mx.concatenate([self.merged("v").dense(v.dtype), v], axis=2)
            if isinstance(mask, mx.array):
                mask = causal_mask(queries.shape[2], k.shape[2])
            out = mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
        if role == "second" and self._merge_due(decode):
            # the dropped count is read by no attention: it rides on the output (one node),
            # or its lazy sum would chain from flush to flush
            out = mx.depends(out, [self.ret_k_dropped, self.ret_v_dropped])
        if not decode:  # a prompt chunk is stored with its layer (``buffers.arrays_written``),
            # the first layer's magnitudes too where this layer merged the pair
            kept = self._arrays()
            if role == "second":
                first = self.member(self.layer_group[0])
                kept = {**kept, "first_m_k": first.m_k, "first_m_v": first.m_v}
            out = mx.depends(out, arrays_written(kept))
        return out

    # -- the pair -----------------------------------------------------------------------------------
    @property
    def merged_rows(self) -> int:
        """Tokens whose pairs are merged (the rest held exactly)."""
        return self.group_shared["e_k"].length

    @property
    def n_merged(self) -> int:
        """Tokens the pair has taken in: merged, or held exactly until the next flush."""
        return self.merged_rows + self.owner.held_k.length

    def merged(self, x: str) -> MergedRows | None:
        """This layer's merged history of keys (``x="k"``) or values, read in place."""
        count = self.merged_rows
        if not count:
            return None
        m = getattr(self, f"m_{x}").buffer
        if self.role == "first":
            return MergedRows(self.group_shared[f"e_{x}"].buffer, m, count)
        where, delta = getattr(self, f"ret_{x}_where"), getattr(self, f"ret_{x}_delta")
        return MergedRows(self.shared[f"e_{x}"].buffer, m, count, where.view(), delta.view())

    def _decode_attention(self, queries, scale):
        """What ``decode_attention`` computes over ``merged`` and the rows held, as one
        compiled pass over the buffers' room (``decode_step.py``)."""
        parts = []
        for x in _TENSORS:
            e = (self.group_shared if self.role == "first" else self.shared)[f"e_{x}"].buffer
            part = [e, getattr(self, f"m_{x}").buffer]
            if self.role == "second":
                where = getattr(self, f"ret_{x}_where")
                part += [where.buffer, getattr(self, f"ret_{x}_delta").buffer, where.length] if where.length else []
            parts.append(part)
        (ek, mk, *tk), (ev, mv, *tv) = parts
        return decode_step.decode_attention(queries, ek, mk, ev, mv, self.merged_rows, self.held_k.buffer,
                                            self.held_v.buffer, self.held_k.length, tk, tv, scale=scale)

    def take_unmerged(self, start: int, n: int):
        """The first layer's rows of tokens [start, start + n), all it holds unmerged, which
        leave it (merged)."""
        k, v = (self.pending_k, self.pending_v) if self.pending_k is not None else (self.held_k.view(), self.held_v.view())
        held = rows(k)
        if self.offset - held != start or held != n:
            raise CrossLayerError(
                f"layer {self.layer} holds unmerged rows of tokens [{self.offset - held}, "
                f"{self.offset}), its pair's next layer merges [{start}, {start + n}): layers "
                "must be updated in order, each once per forward pass")
        self.pending_k = self.pending_v = None
        self.held_k.reset(None)
        self.held_v.reset(None)
        return k, v

    def _merge_due(self, decode: bool) -> bool:
        """The second layer's merges after its attention: FLUSH held decode rows, or a prompt
        chunk, after the rows held before it (merged as decode tokens, as they came).
        Returns whether decode rows were merged."""
        held = self.held_k.length
        if decode and held < FLUSH:  # a Python schedule
            return False
        start, prompt = self.merged_rows, None if decode else self._new
        self._new = None
        theirs = self.member(self.layer_group[0]).take_unmerged(start, held + (0 if decode else prompt[0].shape[2]))
        if held:
            own = self.held_k.view(), self.held_v.view()
            self.held_k.reset(None)
            self.held_v.reset(None)
            self._merge_decode([x[:, :, :held] for x in theirs] if prompt else theirs, own, start)
        if prompt:
            self._merge_prompt([x[:, :, held:] for x in theirs] if held else theirs, prompt, start + held)
        return bool(held)

    def _merge_prompt(self, theirs, own, start: int) -> None:
        o = self.config.options
        first = self.member(self.layer_group[0])
        found = total = 0
        for x, x1, x2 in zip(_TENSORS, theirs, own):
            e, m, retained, delta = slerp_merge(x1, x2, o.minicache_slerp_t, o.minicache_retention_threshold)
            self.shared[f"e_{x}"].append(e)
            getattr(self, f"m_{x}").append(m)
            getattr(first, f"m_{x}").append(norms(x1))
            where, rows_kept = retained_entries(retained, delta, start)
            table = getattr(self, f"ret_{x}_where")
            if where is not None:
                table.append(where)
                getattr(self, f"ret_{x}_delta").append(rows_kept)
                found += where.shape[0]
            total += retained.size
            setattr(self, f"ret_{x}_used", mx.array(table.length, mx.int32))  # rows reserved before: left zero
        self.retained_rate = min(1.0, 2 * found / total + 1 / 16)
        self._decode_merges = 0  # a new reservation at the next decode token

    def _merge_decode(self, theirs, own, start: int) -> None:
        """Decode tokens' pairs merged and their retained pairs written into the reserved
        rows, keys and values in one compiled pass (``decode_step.merge_decode``): the state
        merging them one at a time leaves, bit for bit."""
        o = self.config  # the flat fields (no options object built a merge)
        n = own[0].shape[2]
        # one bound on the table's rows for the whole run: no reservation falls inside it
        assert (self._decode_merges + n - 1) // RESERVE_TOKENS == self._decode_merges // RESERVE_TOKENS
        per_tensor = []
        for x, x1, x2 in zip(_TENSORS, theirs, own):
            where, table = getattr(self, f"ret_{x}_where"), getattr(self, f"ret_{x}_delta")
            used = getattr(self, f"ret_{x}_used")
            if used is None or self._decode_merges % RESERVE_TOKENS == 0:  # a Python schedule
                b, h = x2.shape[:2]
                rows_reserved = math.ceil(self.retained_rate * b * h * RESERVE_TOKENS)
                if used is None:
                    used = mx.array(where.length, mx.int32)
                where.append(mx.zeros((rows_reserved, 2), mx.int32))
                table.append(mx.zeros((rows_reserved, x2.shape[-1]), x2.dtype))
            per_tensor.append((x1, x2, where.buffer, table.buffer, used, where.length,
                               getattr(self, f"ret_{x}_dropped")))
        results = decode_step.merge_decode(o.minicache_slerp_t, o.minicache_retention_threshold, start,
                                           per_tensor)
        first = self.member(self.layer_group[0])
        for x, (e, m1, m2, where, table, used, dropped) in zip(_TENSORS, results):
            self.shared[f"e_{x}"].append(e)
            getattr(first, f"m_{x}").append(m1)
            getattr(self, f"m_{x}").append(m2)
            getattr(self, f"ret_{x}_where").buffer = where
            getattr(self, f"ret_{x}_delta").buffer = table
            setattr(self, f"ret_{x}_used", used)
            setattr(self, f"ret_{x}_dropped", dropped)
        self._decode_merges += n

    # -- what is kept ----------------------------------------------------------------------------------
    @property
    def stored_length(self) -> int:
        if self.role == "alone":
            return self.keys.length
        return self.m_k.length + self.held_k.length + rows(self.pending_k)

    def _arrays(self):
        out = {"keys": self.keys, "values": self.values, "held_k": self.held_k, "held_v": self.held_v,
               "pending_k": self.pending_k, "pending_v": self.pending_v, "m_k": self.m_k, "m_v": self.m_v}
        for x in _TENSORS:
            out[f"ret_{x}_where"] = getattr(self, f"ret_{x}_where")
            out[f"ret_{x}_delta"] = getattr(self, f"ret_{x}_delta")
            out[f"ret_{x}_used"] = getattr(self, f"ret_{x}_used")
            out[f"ret_{x}_dropped"] = getattr(self, f"ret_{x}_dropped")
        return {**out, **self.shared.arrays()}

    def _restore_arrays(self, arrays) -> None:
        super()._restore_arrays(self.shared.restore(arrays))

    def _state_problems(self):
        role = self.role
        held = self.held_k.length
        if role != "alone" and (self.held_v.length != held or held >= FLUSH):
            yield "held exact rows (keys, values)", (held, self.held_v.length), f"equal, fewer than {FLUSH}"
        elif self.stored_length != self.offset or (role == "alone" and self.values.length != self.offset):
            yield "tokens stored", self.stored_length, f"the offset {self.offset}"
        elif role == "second":  # restored after the first layer of its pair
            first = self.member(self.layer_group[0])
            if self.merged_rows != self.m_k.length:
                yield "merged tokens", self.merged_rows, f"the {self.m_k.length} magnitudes kept"
            elif (first.m_k.length, first.held_k.length, first.offset) != (self.merged_rows, held, self.offset):
                yield ("merged and held rows of the layer before", (first.m_k.length, first.held_k.length),
                       f"{(self.merged_rows, held)}")
