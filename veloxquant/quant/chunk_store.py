"""A store that compresses whole chunks: a full-precision buffer flushed a chunk at a time.

New tokens wait in a full-precision buffer (keys and values together). A prompt chunk
(more than one token) flushes the buffer and itself at once, as one chunk of the whole
groups they hold (a per-channel codec needs whole groups of ``group`` tokens; the rest,
fewer than ``group``, stays in the buffer); a decode step appends its token in place and
flushes the buffer as one chunk once it holds ``block`` tokens (GEAR's streaming buffer
n_b). The codecs compress each chunk on its own (``error_feedback.ErrorFeedbackTokens``:
factors and outliers per chunk; anything with the ``PackedTokens`` interface works).

With ``quantize_values=False`` values are never compressed: every value stays in full
precision (``v_buf`` holds them all) and ``values`` is an empty ``PackedTokens`` whose
layout says so, so that a plain group-affine key layout still goes to the fused kernel.

A prompt chunk attends over the decoded history plus itself (``PackedStore``); a decode
step over one part: the packed chunks, then the buffer's full-precision rows.
"""

from __future__ import annotations

import mlx.core as mx

from ..cache.buffers import GrowingArray, RecentRows
from ..kernels.decode import DecodePart
from .packed import GROWTH_TOKENS
from .store import WINDOW_STEP, PackedStore


def _cat(kept: GrowingArray, new: mx.array) -> mx.array:
    old = kept.view()
    return new if old is None else mx.concatenate([old, new], axis=2)


class ChunkedStore(PackedStore):
    def __init__(self, keys, values, *, block: int, group: int, quantize_values: bool = True,
                 step_tokens: int = GROWTH_TOKENS):
        if block % group:
            raise ValueError(f"block={block} must be a multiple of group={group}")
        self.keys, self.values = keys, values
        self.block, self.group, self.quantize_values = block, group, quantize_values
        # a block's room, kept across flushes (steps launch the same kernels: MLX's CUDA graphs recur)
        self.k_buf = RecentRows(step=WINDOW_STEP, limit=block, geometric=True)
        self.v_buf = RecentRows(step=WINDOW_STEP, limit=block, geometric=True) if quantize_values else GrowingArray(step=step_tokens)

    @property
    def length(self) -> int:
        return self.keys.count + self.k_buf.length

    def _flush(self, keys: mx.array, values: mx.array, decoding: bool = False) -> None:
        self.keys.append(keys, decoding=decoding)
        if self.quantize_values:
            self.values.append(values, decoding=decoding)

    def commit(self, keys: mx.array, values: mx.array) -> None:
        if not self.quantize_values:
            self.v_buf.append(values)
        if keys.shape[2] == 1:  # a decode step: written in place, a chunk once the buffer is full
            self.k_buf.append(keys)
            if self.quantize_values:
                self.v_buf.append(values)
            if self.k_buf.length == self.block:
                self._flush(self.k_buf.view(), self.v_buf.view() if self.quantize_values else None, decoding=True)
                self.k_buf.truncate(0)
                if self.quantize_values:
                    self.v_buf.truncate(0)
            return
        k = _cat(self.k_buf, keys)
        v = _cat(self.v_buf, values) if self.quantize_values else None
        n = k.shape[2] // self.group * self.group
        if n:
            self._flush(k[:, :, :n], v[:, :, :n] if v is not None else None)
        self.k_buf.reset(mx.contiguous(k[:, :, n:]) if k.shape[2] > n else None)
        if self.quantize_values:
            self.v_buf.reset(mx.contiguous(v[:, :, n:]) if v.shape[2] > n else None)

    def history(self, dtype):
        """Every stored token in ``dtype``, in order (transient: prefill chunks and tests)."""
        if not self.length:
            return None, None
        ks = [x for x in (self.keys.decode(dtype), self.k_buf.view()) if x is not None]
        vs = [self.v_buf.view()] if not self.quantize_values else [
            x for x in (self.values.decode(dtype), self.v_buf.view()) if x is not None]
        cat = lambda xs: mx.concatenate([x.astype(dtype) for x in xs], axis=2)  # noqa: E731
        return cat(ks), cat(vs)

    def decode_parts(self, empty: mx.array) -> list[DecodePart]:
        return [DecodePart(self.keys.layout(empty), self.k_buf.view(),
                           self.values.layout(empty), self.v_buf.view())]

    def layout_problems(self, head_dims: tuple[int, int]):
        """(field, found, expected) for arrays whose shapes contradict their codecs."""
        for packed, name, dim in ((self.keys, "key", head_dims[0]), (self.values, "value", head_dims[1])):
            base = getattr(packed, "base", packed)
            if base.codes.buffer is not None:
                found = tuple(base.codes.view().shape[2:]), tuple(base.scales.view().shape[2:])
                if found != packed.expected_shapes(dim):
                    c = base.codec
                    yield (f"{name} codes and scales", found,
                           f"{packed.expected_shapes(dim)} ({c.bits}-bit codes, groups of {c.group})")
            yield from (("{} {}".format(name, f), x, e) for f, x, e in getattr(packed, "problems", lambda d: ())(dim))
        for rows, name, dim in ((self.k_buf, "buffered keys", head_dims[0]), (self.v_buf, "buffered values", head_dims[1])):
            if rows.buffer is not None and rows.buffer.shape[3] != dim:
                yield f"{name} head_dim", rows.buffer.shape[3], dim

    def problems(self, offset: int):
        """(field, found, expected) for each way the stored tokens contradict the policy."""
        n_k, n_buf = self.keys.count, self.k_buf.length
        if n_k % self.group:
            yield "compressed keys", n_k, f"a multiple of the group {self.group}"
        if n_buf >= self.block:
            yield "buffered keys", n_buf, f"fewer than the block {self.block}"
        if n_k + n_buf != offset:
            yield "tokens stored", n_k + n_buf, f"the offset {offset}"
        values = (self.values.count, self.v_buf.length)
        expected = (n_k, n_buf) if self.quantize_values else (0, offset)
        if values != expected:
            yield "values (compressed, full precision)", values, expected

    def arrays(self):
        return {**self.keys.arrays("k"), **self.values.arrays("v"), "k_buf": self.k_buf, "v_buf": self.v_buf}
