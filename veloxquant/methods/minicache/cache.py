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
- the first layer: its magnitudes, and its new rows until the second layer merges them.

When: mlx-lm runs layer l-1 before layer l in every forward pass. Layer l-1 attends over
the merged history plus its own exact new rows and holds them; layer l attends over the
merged history plus its exact new rows, then merges the pair's new rows (reading layer
l-1's, ``take_pending``). So a prompt chunk's and a decode token's own step are exact
in both layers (prefill attention is exact in the paper) and later steps read the merged
form. Merging is per token: merging step by step equals merging the whole run at once.

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
of them before any prompt was merged), and a step writes its retained pairs into the rows
after the ``used`` ones on the device (``decode_step.merge_decode``, as ``slerp.write_retained``); pairs past the reserved
rows are merged after all and counted (``ret_*_dropped``): an adaptation, where the paper
keeps every retained pair.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from ...cache.base import CompressedKVCache, causal_mask
from ...cache.buffers import GrowingArray
from ...cache.cross_layer import CrossLayer, CrossLayerError, consecutive_groups
from . import decode_step
from .slerp import MergedRows, norms, retained_entries, slerp_merge

_TENSORS = ("k", "v")
RESERVE_TOKENS = 64  # decode tokens whose retained pairs a reservation of table rows covers


def _cat(a, b):
    return b if a is None else mx.concatenate([a, b], axis=2)


class MiniCacheCache(CrossLayer, CompressedKVCache):
    batchable = "per_sequence"  # its merged layer keeps a data-dependent number of retained tokens: two sequences' shapes differ, so no two share a stacked cache (cache/stacked.py)
    requires_attention_hook = True
    owner_position = -1  # the deeper layer merges and keeps the merged directions

    def layer_groups(self, compressed, n_layers):
        o = self.config.options
        start = math.floor(o.minicache_start_frac * n_layers)
        size = o.minicache_group_size
        return [g for g in consecutive_groups(compressed, size, start) if len(g) == size]

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
        self.pending_k = self.pending_v = None  # a first layer's rows not merged yet
        self.m_k, self.m_v = grown(), grown()  # own magnitudes
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
        limit = self.config.options.minicache_max_ctx
        if role != "alone" and self.offset + n > limit:
            raise ValueError(
                f"minicache_max_ctx={limit}: layer {self.layer}'s pair would merge "
                f"{self.offset + n} tokens; allowed: at most minicache_max_ctx (raise it)")
        self._note_update(n)
        if role == "alone":
            self.keys.append(keys)
            self.values.append(values)
        elif role == "first":
            self.m_k.append(norms(keys))
            self.m_v.append(norms(values))
            self.pending_k, self.pending_v = _cat(self.pending_k, keys), _cat(self.pending_v, values)
        else:
            self._new = (keys, values)
        self.offset += n
        return keys, values

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        self._own_attention_begins(sinks)
        role = self.role
        if role == "alone":
            tail_k, tail_v, merged = self.keys.view(), self.values.view(), (None, None)
        else:
            tail_k, tail_v = (self.pending_k, self.pending_v) if role == "first" else self._new
            merged = self.merged("k"), self.merged("v")
        if queries.shape[2] == 1 and merged[0] is not None:
            out = self._decode_attention(queries, tail_k, tail_v, scale)
        else:
            k, v = tail_k, tail_v
            if merged[0] is not None:
                k = mx.concatenate([merged[0].dense(k.dtype), k], axis=2)
                v = mx.concatenate([merged[1].dense(v.dtype), v], axis=2)
            if isinstance(mask, mx.array):
                mask = causal_mask(queries.shape[2], k.shape[2])
            out = mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
        if role == "second":
            self._merge(*self._new)
            self._new = None
            if queries.shape[2] == 1:
                # the dropped count is read by no attention: it rides on the output (one
                # node), or its lazy sum would chain from step to step
                out = mx.depends(out, [self.ret_k_dropped, self.ret_v_dropped])
        return out

    # -- the pair -----------------------------------------------------------------------------------
    @property
    def n_merged(self) -> int:
        return self.group_shared["e_k"].length

    def merged(self, x: str) -> MergedRows | None:
        """This layer's merged history of keys (``x="k"``) or values, read in place."""
        count = self.n_merged
        if not count:
            return None
        m = getattr(self, f"m_{x}").buffer
        if self.role == "first":
            return MergedRows(self.group_shared[f"e_{x}"].buffer, m, count)
        where, delta = getattr(self, f"ret_{x}_where"), getattr(self, f"ret_{x}_delta")
        return MergedRows(self.shared[f"e_{x}"].buffer, m, count, where.view(), delta.view())

    def _decode_attention(self, queries, tail_k, tail_v, scale):
        """What ``decode_attention`` computes over ``merged`` and the tail, as one compiled
        pass over the buffers' room (``decode_step.py``)."""
        n = self.n_merged
        parts = []
        for x in _TENSORS:
            e = (self.group_shared if self.role == "first" else self.shared)[f"e_{x}"].buffer
            part = [e, getattr(self, f"m_{x}").buffer]
            if self.role == "second":
                where = getattr(self, f"ret_{x}_where")
                part += [where.buffer, getattr(self, f"ret_{x}_delta").buffer, where.length] if where.length else []
            parts.append(part)
        (ek, mk, *tk), (ev, mv, *tv) = parts
        return decode_step.decode_attention(queries, ek, mk, ev, mv, n, tail_k, tail_v, tk, tv, scale=scale)

    def take_pending(self, start: int, n: int):
        """The first layer's rows of tokens [start, start + n), which leave it (merged)."""
        held = 0 if self.pending_k is None else self.pending_k.shape[2]
        if self.offset - held != start or held < n:
            raise CrossLayerError(
                f"layer {self.layer} holds unmerged rows of tokens [{self.offset - held}, "
                f"{self.offset}), its pair's next layer merges [{start}, {start + n}): layers "
                "must be updated in order, each once per forward pass")
        rest = held > n
        rows = (self.pending_k[:, :, :n], self.pending_v[:, :, :n]) if rest else (self.pending_k, self.pending_v)
        self.pending_k = mx.contiguous(self.pending_k[:, :, n:]) if rest else None
        self.pending_v = mx.contiguous(self.pending_v[:, :, n:]) if rest else None
        return rows

    def _merge(self, keys, values) -> None:
        o = self.config.options
        start, n = self.n_merged, keys.shape[2]
        first = self.member(self.layer_group[0])
        if n == 1:
            self._merge_decode(first.take_pending(start, n), (keys, values), start)
            return
        merged = []
        for x, own, theirs in zip(_TENSORS, (keys, values), first.take_pending(start, n)):
            e, m, retained, delta = slerp_merge(theirs, own, o.minicache_slerp_t,
                                                o.minicache_retention_threshold)
            self.shared[f"e_{x}"].append(e)
            getattr(self, f"m_{x}").append(m)
            merged.append((x, retained, delta))
        self._merge_prompt(merged, start)

    def _merge_prompt(self, merged, start: int) -> None:
        found = total = 0
        for x, retained, delta in merged:
            where, rows = retained_entries(retained, delta, start)
            table = getattr(self, f"ret_{x}_where")
            if where is not None:
                table.append(where)
                getattr(self, f"ret_{x}_delta").append(rows)
                found += where.shape[0]
            total += retained.size
            setattr(self, f"ret_{x}_used", mx.array(table.length, mx.int32))  # rows reserved before: left zero
        self.retained_rate = min(1.0, 2 * found / total + 1 / 16)
        self._decode_merges = 0  # a new reservation at the next decode token

    def _merge_decode(self, theirs, own, start: int) -> None:
        """A decode token's pair merged and its retained pairs written into the reserved
        rows, keys and values in one compiled pass (``decode_step.merge_decode``)."""
        o = self.config.options
        per_tensor = []
        for x, x1, x2 in zip(_TENSORS, theirs, own):
            where, table = getattr(self, f"ret_{x}_where"), getattr(self, f"ret_{x}_delta")
            used = getattr(self, f"ret_{x}_used")
            if used is None or self._decode_merges % RESERVE_TOKENS == 0:  # a Python schedule
                b, h = x2.shape[:2]
                rows = math.ceil(self.retained_rate * b * h * RESERVE_TOKENS)
                if used is None:
                    used = mx.array(where.length, mx.int32)
                where.append(mx.zeros((rows, 2), mx.int32))
                table.append(mx.zeros((rows, x2.shape[-1]), x2.dtype))
            per_tensor.append((x1, x2, where.buffer, table.buffer, used, where.length,
                               getattr(self, f"ret_{x}_dropped")))
        results = decode_step.merge_decode(o.minicache_slerp_t, o.minicache_retention_threshold, start,
                                           per_tensor)
        for x, (e, m, where, table, used, dropped) in zip(_TENSORS, results):
            self.shared[f"e_{x}"].append(e)
            getattr(self, f"m_{x}").append(m)
            getattr(self, f"ret_{x}_where").buffer = where
            getattr(self, f"ret_{x}_delta").buffer = table
            setattr(self, f"ret_{x}_used", used)
            setattr(self, f"ret_{x}_dropped", dropped)
        self._decode_merges += 1

    # -- what is kept ----------------------------------------------------------------------------------
    @property
    def stored_length(self) -> int:
        return self.keys.length if self.role == "alone" else self.m_k.length

    def _arrays(self):
        out = {"keys": self.keys, "values": self.values, "pending_k": self.pending_k,
               "pending_v": self.pending_v, "m_k": self.m_k, "m_v": self.m_v}
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
        stored = self.keys.length if role == "alone" else self.m_k.length
        if stored != self.offset or (role == "alone" and self.values.length != self.offset):
            yield "tokens stored", stored, f"the offset {self.offset}"
        if role == "second":  # restored after the first layer of its pair
            first = self.member(self.layer_group[0])
            held = 0 if first.pending_k is None else first.pending_k.shape[2]
            if self.n_merged != self.offset:
                yield "merged tokens", self.n_merged, f"the offset {self.offset}"
            elif first.offset - held != self.n_merged:
                yield "unmerged rows of the layer before", held, f"{first.offset - self.n_merged}"
