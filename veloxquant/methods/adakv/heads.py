"""Per-head mixed precision: a quantized store whose parts hold subsets of the KV heads.

A head allocation gives each KV head of a layer a bit width. ``HeadWiseStore`` keeps a
layer's history as a sequence of **epochs**, each a run of tokens stored under one
allocation: per width, the heads at that width hold their keys and values in one
``PackedTokens`` pair (keys per channel, values per token, group-affine: KIVI's layout,
``AffineCodecs``) and are attended as one ``DecodePart`` with ``heads=`` (``heads=None``
when every head shares the width). New tokens wait in full precision in a window written
in place: the newest ``window`` tokens always stay there, and when ``block`` more have
come the oldest ``block`` flush, keys and values together, under the allocation current
at that flush (so a token's key and value share its head's width and every part covers
the same tokens for its keys and its values); the rows left move to the front of the
window's buffer (one copy of ``window`` rows every ``block`` steps). A flush under the
allocation of the newest epoch extends that epoch's buffers in place; a different one
opens a new epoch. Stored tokens are never re-quantized: they keep their widths.

Decode: one part per (epoch, width), plus the window (the tail of the newest epoch's part
when that epoch holds every head at one width, else a part of its own), merged by
log-sum-exp in ``kernels/decode.py``. Parts at 2, 4 and 8 bits (groups of 32, 64, 128)
are ``AffineLayout``s the fused kernel serves on a GPU, each launch over its own heads;
parts at other widths (3, 5, 6 bits) take the pure-MLX path, on a GPU too; on the CPU
every part does.

``RecentNorms`` keeps per-head statistics of the newest keys that an allocation may read:
a ring of the L2 norms of the last ``window`` keys of each head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Callable

import mlx.core as mx

from ...cache.buffers import GrowingArray
from ...kernels.decode import DecodePart
from ...quant.packed import GROWTH_TOKENS, GroupAffine, PackedTokens
from ...quant.store import PackedStore

KERNEL_BITS = (2, 4, 8)  # widths the fused decode kernels read


@dataclass(frozen=True)
class AffineCodecs:
    """Codecs at ``bits``: keys per channel in groups of ``group`` tokens, values per token
    in groups of ``group`` channels."""

    group: int

    def __call__(self, bits: int) -> tuple[GroupAffine, GroupAffine]:
        return GroupAffine(bits, self.group, "channel"), GroupAffine(bits, self.group, "token")


class WidthGroup:
    """The heads of one epoch stored at one width: one part of the decode."""

    def __init__(self, bits: int, heads: tuple[int, ...], n_heads: int, codecs, step_tokens: int):
        self.bits, self.head_list = bits, heads
        self.heads = None if len(heads) == n_heads else mx.array(heads, dtype=mx.int32)
        key_codec, value_codec = codecs(bits)
        self.keys = PackedTokens(key_codec, step_tokens)
        self.values = PackedTokens(value_codec, step_tokens)

    def append(self, keys: mx.array, values: mx.array) -> None:
        if self.heads is not None:
            keys, values = keys[:, self.heads], values[:, self.heads]
        self.keys.append(keys)
        self.values.append(values)

    def part(self, empty: mx.array) -> DecodePart:
        return DecodePart(self.keys.layout(empty), None, self.values.layout(empty), None, heads=self.heads)


class HeadEpoch:
    """A run of tokens stored under one allocation ``widths`` (one bit width per KV head)."""

    def __init__(self, widths: tuple[int, ...], codecs, step_tokens: int):
        self.widths = tuple(widths)
        n = len(widths)
        self.groups = [WidthGroup(b, tuple(h for h in range(n) if widths[h] == b), n, codecs, step_tokens)
                       for b in sorted(set(widths))]

    @property
    def count(self) -> int:
        return self.groups[0].keys.count

    def append(self, keys: mx.array, values: mx.array) -> None:
        for g in self.groups:
            g.append(keys, values)

    def decode(self, dtype) -> tuple[mx.array, mx.array]:
        """Keys and values of every head, in head order (transient: prefill and tests)."""
        k = [g.keys.decode(dtype) for g in self.groups]
        v = [g.values.decode(dtype) for g in self.groups]
        if len(self.groups) == 1:
            return k[0], v[0]
        order = [h for g in self.groups for h in g.head_list]
        inverse = mx.array(sorted(range(len(order)), key=order.__getitem__))
        return mx.concatenate(k, axis=1)[:, inverse], mx.concatenate(v, axis=1)[:, inverse]

    def arrays(self, prefix: str) -> dict[str, Any]:
        out = {}
        for g in self.groups:
            name = f"{prefix}_b{g.bits}"
            out.update(g.keys.arrays(f"{name}_k"))
            out.update(g.values.arrays(f"{name}_v"))
            out[f"{name}_heads"] = g.heads
        return out


class HeadWiseStore(PackedStore):
    """Epochs of per-head-width storage behind a full-precision window of the newest
    ``window`` to ``window + block - 1`` tokens (fewer before that many came).

    ``codecs(bits) -> (key codec, value codec)``; keys per channel need ``block`` to be a
    multiple of their group. ``widths()``: the allocation a flush stores under (asked only
    when a block flushes). ``tail_bits``: the width the window-only part announces (no
    codes; a width the kernel reads lets it serve the window).
    """

    def __init__(self, codecs: Callable[[int], tuple[GroupAffine, GroupAffine]], block: int,
                 widths: Callable[[], tuple[int, ...]], window: int = 0,
                 step_tokens: int = GROWTH_TOKENS, tail_bits: int = 4):
        self.codecs, self.block, self.window, self.step_tokens = codecs, block, window, step_tokens
        self.widths = widths
        self.epochs: list[HeadEpoch] = []
        cap = window + block
        room = min(cap, GROWTH_TOKENS)  # the window grows with what it holds, up to cap rows
        self.k_win = GrowingArray(axis=2, step=room, limit=cap)
        self.v_win = GrowingArray(axis=2, step=room, limit=cap)
        tail_k, tail_v = codecs(tail_bits)
        self._tail = PackedTokens(tail_k), PackedTokens(tail_v)  # never filled: layouts only

    @property
    def length(self) -> int:
        return sum(e.count for e in self.epochs) + self.k_win.length

    # -- writing -------------------------------------------------------------------------
    def commit(self, keys: mx.array, values: mx.array) -> None:
        """Take new tokens in; flush whole blocks under ``widths()`` (asked only then)."""
        widths = self.widths
        n, cap = keys.shape[2], self.window + self.block
        if self.k_win.length + n <= cap:  # a decode step: rows written in place
            self.k_win.append(keys)
            self.v_win.append(values)
            if self.k_win.length == cap:
                b = self.block
                self._flush(self.k_win.buffer[:, :, :b], self.v_win.buffer[:, :, :b], widths())
                for win in (self.k_win, self.v_win):  # the rest to the front, in place
                    if self.window:
                        win.buffer[:, :, : self.window] = win.buffer[:, :, b:]
                    win.truncate(self.window)
            return
        k, v = self._window()
        k = keys if k is None else mx.concatenate([k, keys], axis=2)
        v = values if v is None else mx.concatenate([v, values], axis=2)
        n_flush = max(0, k.shape[2] - self.window) // self.block * self.block
        if n_flush:
            self._flush(k[:, :, :n_flush], v[:, :, :n_flush], widths())
        rest = k.shape[2] > n_flush
        self.k_win.reset(mx.contiguous(k[:, :, n_flush:]) if rest else None)  # no view pinning k
        self.v_win.reset(mx.contiguous(v[:, :, n_flush:]) if rest else None)

    def _flush(self, keys: mx.array, values: mx.array, widths: tuple[int, ...]) -> None:
        widths = tuple(int(b) for b in widths)
        if len(widths) != keys.shape[1]:
            raise ValueError(f"an allocation of {len(widths)} widths for {keys.shape[1]} KV heads")
        if not self.epochs or self.epochs[-1].widths != widths:
            self.epochs.append(HeadEpoch(widths, self.codecs, self.step_tokens))
        self.epochs[-1].append(keys, values)

    # -- reading --------------------------------------------------------------------------
    def _window(self) -> tuple[mx.array | None, mx.array | None]:
        if not self.k_win.length:
            return None, None
        return self.k_win.view(), self.v_win.view()

    def history(self, dtype) -> tuple[mx.array | None, mx.array | None]:
        """Every stored token in ``dtype``, in order (transient: prefill chunks and tests)."""
        decoded = [e.decode(dtype) for e in self.epochs]
        k, v = self._window()
        if k is not None:
            decoded.append((k.astype(dtype), v.astype(dtype)))
        if not decoded:
            return None, None
        if len(decoded) == 1:
            return decoded[0]
        return (mx.concatenate([d[0] for d in decoded], axis=2),
                mx.concatenate([d[1] for d in decoded], axis=2))

    def decode_parts(self, empty: mx.array) -> list[DecodePart]:
        parts = [g.part(empty) for e in self.epochs for g in e.groups]
        k, v = self._window()
        if k is None:
            return parts
        if parts and parts[-1].heads is None:  # the newest epoch holds every head: the window rides
            parts[-1] = replace(parts[-1], key_tail=k, value_tail=v)
        else:
            parts.append(DecodePart(self._tail[0].layout(empty), k, self._tail[1].layout(empty), v))
        return parts

    # -- what is kept ------------------------------------------------------------------------
    def arrays(self) -> dict[str, Any]:
        out = {"k_win": self.k_win, "v_win": self.v_win}
        for i, e in enumerate(self.epochs):
            out.update(e.arrays(f"e{i}"))
        return out

    def meta(self) -> dict[str, str]:
        return {"epochs": json.dumps([list(e.widths) for e in self.epochs])}

    def restore(self, meta: dict[str, Any], arrays: dict[str, Any]) -> None:
        """Rebuild the epochs ``meta`` names, then put the saved arrays back."""
        self.epochs = [HeadEpoch(tuple(w), self.codecs, self.step_tokens)
                       for w in json.loads(meta.get("epochs", "[]"))]
        kept = self.arrays()
        for name, value in arrays.items():
            if isinstance(kept.get(name), GrowingArray):
                kept[name].reset(value)

    def layout_problems(self, head_dims: tuple[int, int]):
        return iter(())

    def problems(self, offset: int, n_heads: int | None = None):
        """(field, found, expected) for each way the stored tokens contradict the policy."""
        for i, e in enumerate(self.epochs):
            if n_heads is not None and len(e.widths) != n_heads:
                yield f"epoch {i} widths", len(e.widths), f"one per KV head ({n_heads})"
            for g in e.groups:
                counts = g.keys.count, g.values.count
                if counts != (e.count, e.count) or e.count % self.block:
                    yield (f"epoch {i} {g.bits}-bit tokens", f"{counts[0]} keys / {counts[1]} values",
                           f"equal, a multiple of the block {self.block}")
                stored = g.keys.codes.buffer
                if stored is not None and stored.shape[1] != len(g.head_list):
                    yield f"epoch {i} {g.bits}-bit heads", stored.shape[1], len(g.head_list)
        held, cap = self.k_win.length, self.window + self.block
        if not min(offset, self.window) <= held < cap or self.v_win.length != held:
            yield ("full-precision window", f"{held} keys / {self.v_win.length} values",
                   f"equal, from min(offset {offset}, window {self.window}) to below {cap}")
        if self.length != offset:
            yield "tokens stored", self.length, f"the offset {offset}"


class RecentNorms:
    """The L2 norms of the newest ``window`` keys of each KV head, in a ring written in place."""

    def __init__(self, window: int):
        self.window = window
        self.norms: mx.array | None = None  # (B, H, window) float32
        self.pos = self.filled = 0

    def observe(self, keys: mx.array) -> None:
        n = keys.shape[2]
        newest = keys if n <= self.window else keys[:, :, -self.window:]
        norms = mx.linalg.norm(newest.astype(mx.float32), axis=-1)  # (B, H, m)
        m = norms.shape[2]
        if self.norms is None:
            self.norms = mx.zeros((*norms.shape[:2], self.window), mx.float32)
        first = min(m, self.window - self.pos)
        self.norms[:, :, self.pos: self.pos + first] = norms[:, :, :first]
        if m > first:  # wraps around
            self.norms[:, :, : m - first] = norms[:, :, first:]
        self.pos = (self.pos + m) % self.window
        self.filled = min(self.window, self.filled + n)

    def variance(self) -> mx.array | None:
        """Per KV head (H,), the variance of the held norms, averaged over the batch; 0 with
        fewer than 2 keys seen, NaN (an overflowed key) read as 0."""
        if self.norms is None:
            return None
        if self.filled < 2:
            return mx.zeros((self.norms.shape[1],), mx.float32)
        held = self.norms if self.filled == self.window else self.norms[:, :, : self.filled]
        return mx.nan_to_num(mx.var(held, axis=-1).mean(axis=0), nan=0.0, posinf=0.0)

    def meta(self) -> dict[str, int]:
        return {"norms_pos": self.pos, "norms_filled": self.filled}

    def restore(self, meta: dict[str, Any], norms: mx.array | None) -> None:
        self.norms, self.pos, self.filled = norms, int(meta.get("norms_pos", 0)), int(meta.get("norms_filled", 0))
