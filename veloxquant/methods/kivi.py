"""KIVI: keys quantized per channel, values per token, a full-precision recent window.

Storage (the layout the fused decode kernel reads, see ``kernels/kivi_decode.py``):

- keys: groups of ``kivi_group_size`` tokens of one channel, stored transposed
  (codes ``(B, H, D, T*bits/32)``), quantized a whole residual block at a time; the
  newest ``T mod R`` keys stay in full precision (``k_res``);
- values: groups of ``kivi_group_size`` channels of one token (codes
  ``(B, H, T, D*bits/32)``); the newest ``R`` values stay in full precision (``v_res``)
  and the window slides one token per step.

``R`` is the config's ``residual_window`` and the bit width its ``kv_bits`` (KIVIOptions
holds only the group size). The history is never kept in full precision: a prefill chunk
attends over the dequantized history plus its own full-precision tokens (as KIVI's own
prefill does), a decode step attends over the packed history through the fused kernel on
a GPU, or the faster pure-MLX path elsewhere.
"""

from __future__ import annotations

import mlx.core as mx

from ..cache.base import CompressedKVCache
from ..cache.buffers import GrowingArray
from ..kernels.kivi_decode import kivi_decode_attention
from ..quant.affine import (
    dequantize_per_channel,
    dequantize_per_token,
    packed_length,
    quantize_per_channel,
    quantize_per_token,
)

GROWTH_TOKENS = 256  # room added to the quantized history at a time


class KIVICache(CompressedKVCache):
    requires_attention_hook = True

    def _init_storage(self) -> None:
        c = self.config
        self.group = c.options.kivi_group_size
        self.code_bits, self.residual = c.kv_bits, c.residual_window  # config fields (see the spec)
        self.use_kernel = c.fused_attention
        # Keys flush in residual-sized blocks (whole groups when there is no residual).
        self.flush = self.residual or self.group
        step = max(GROWTH_TOKENS, self.flush)
        words = packed_length(step, self.code_bits)
        self.k_codes = GrowingArray(axis=-1, step=words)
        self.k_scales = GrowingArray(axis=-1, step=step // self.group)
        self.k_biases = GrowingArray(axis=-1, step=step // self.group)
        self.v_codes = GrowingArray(axis=2)
        self.v_scales = GrowingArray(axis=2)
        self.v_biases = GrowingArray(axis=2)
        self.k_res = None  # (B, H, < flush, D) full precision
        self.v_res = None  # (B, H, <= R, D) full precision
        self._pending = None

    # -- sizes ---------------------------------------------------------------------
    @property
    def n_quantized_keys(self) -> int:
        return self.k_scales.length * self.group

    @property
    def n_quantized_values(self) -> int:
        return self.v_codes.length

    @staticmethod
    def _rows(x) -> int:
        return 0 if x is None else x.shape[2]

    @property
    def stored_length(self) -> int:
        return self.n_quantized_keys + self._rows(self.k_res)

    def _arrays(self):
        return {
            "k_codes": self.k_codes,
            "k_scales": self.k_scales,
            "k_biases": self.k_biases,
            "v_codes": self.v_codes,
            "v_scales": self.v_scales,
            "v_biases": self.v_biases,
            "k_res": self.k_res,
            "v_res": self.v_res,
        }

    # -- storage ---------------------------------------------------------------------
    def _commit(self, keys: mx.array, values: mx.array) -> None:
        k_res = keys if self.k_res is None else mx.concatenate([self.k_res, keys], axis=2)
        n_flush = k_res.shape[2] // self.flush * self.flush
        if n_flush:
            codes, scales, biases = quantize_per_channel(
                k_res[:, :, :n_flush], self.group, self.code_bits
            )
            self.k_codes.append(codes)
            self.k_scales.append(scales)
            self.k_biases.append(biases)
            k_res = mx.contiguous(k_res[:, :, n_flush:])  # no view pinning the old block
        self.k_res = k_res

        v_res = values if self.v_res is None else mx.concatenate([self.v_res, values], axis=2)
        n_old = v_res.shape[2] - self.residual
        if n_old > 0:
            codes, scales, biases = quantize_per_token(
                v_res[:, :, :n_old], self.group, self.code_bits
            )
            self.v_codes.append(codes)
            self.v_scales.append(scales)
            self.v_biases.append(biases)
            v_res = mx.contiguous(v_res[:, :, n_old:])
        self.v_res = v_res

    def dequantized(self, dtype) -> tuple[mx.array | None, mx.array | None]:
        """The whole stored history in ``dtype`` (transient: for prefill chunks and tests)."""
        parts_k, parts_v = [], []
        if self.k_codes.length:
            parts_k.append(
                dequantize_per_channel(
                    self.k_codes.view(), self.k_scales.view(), self.k_biases.view(),
                    self.group, self.code_bits, dtype,
                )
            )
        if self.v_codes.length:
            parts_v.append(
                dequantize_per_token(
                    self.v_codes.view(), self.v_scales.view(), self.v_biases.view(),
                    self.group, self.code_bits, dtype,
                )
            )
        parts_k += [] if self.k_res is None else [self.k_res.astype(dtype)]
        parts_v += [] if self.v_res is None else [self.v_res.astype(dtype)]
        if not parts_k:
            return None, None
        return mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2)

    # -- protocol --------------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        self._expect_attend()
        head_dim = keys.shape[-1]
        if head_dim % self.group or values.shape[-1] % self.group:
            raise ValueError(
                f"kivi_group_size={self.group} must divide head_dim={head_dim} "
                f"(values: {values.shape[-1]}); allowed here: "
                f"{[g for g in (32, 64, 128) if head_dim % g == 0] or 'none'}"
            )
        self._pending = (keys, values)
        self.offset += keys.shape[2]
        return keys, values

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        self._awaiting_attend = False
        chunk_k, chunk_v = self._pending
        self._pending = None
        if sinks is not None:
            raise NotImplementedError("method 'kivi' does not support attention sinks yet")
        if queries.shape[2] == 1:
            self._commit(chunk_k, chunk_v)
            return self._decode_attention(queries, scale)
        # A prefill chunk: the history (dequantized, transient) plus the chunk itself.
        old_k, old_v = self.dequantized(chunk_k.dtype)
        all_k = chunk_k if old_k is None else mx.concatenate([old_k, chunk_k], axis=2)
        all_v = chunk_v if old_v is None else mx.concatenate([old_v, chunk_v], axis=2)
        out = super().attend(queries, all_k, all_v, scale=scale, mask=mask)
        self._commit(chunk_k, chunk_v)
        return out

    def _decode_attention(self, queries, scale):
        empty = mx.zeros((0,), queries.dtype)

        def buf(g: GrowingArray):
            return g.buffer if g.buffer is not None else empty

        return kivi_decode_attention(
            queries,
            buf(self.k_codes), buf(self.k_scales), buf(self.k_biases), self.n_quantized_keys,
            self.k_res, self._rows(self.k_res),
            buf(self.v_codes), buf(self.v_scales), buf(self.v_biases), self.n_quantized_values,
            self.v_res, self._rows(self.v_res),
            scale=scale, bits=self.code_bits, group_size=self.group, use_kernel=self.use_kernel,
        )
