"""Per-token group-affine rows as the pure-MLX decode path reads them, keys included.

The fused decode kernels read keys per channel (groups along the tokens of one channel,
KIVI's layout) and values per token. A method that quantizes keys per token too (groups
along head_dim: SKVQ) hands its keys as ``TokenRows``, the ``PackedScores`` protocol of
``kernels/decode.py``: ``scores(q)`` is ``q Kᵀ`` straight on the packed rows, one
``quantized_matmul`` (transpose=True: the rows are a quantized weight matrix) on the CPU,
a float32 dequantization where it has no kernel (a GPU, as ``affine_key_scores`` does);
``mix(p)`` the same for values at a width the shared readers do not take (7 bits: unpacked
by hand). Whole buffers with spare room are passed; only ``count`` rows are read.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..kernels import kivi_decode as kd
from .affine import SUPPORTED_BITS
from .clip import dequantize_rows
from .packed import AffineLayout


def _quantized_matmul_here(bits: int) -> bool:
    return bits in SUPPORTED_BITS and kd.CPU_DEFAULT_PATH == "qmm" and mx.default_device() == mx.cpu


@dataclass(frozen=True)
class TokenRows:
    """A per-token ``AffineLayout`` (axis "token") read as keys (``scores``) or values (``mix``)."""

    layout: AffineLayout

    @property
    def count(self) -> int:
        return self.layout.count

    @property
    def n_heads(self) -> int:
        return self.layout.codes.shape[1]

    def _valid(self):
        n, x = self.layout.count, self.layout
        return x.codes[:, :, :n], x.scales[:, :, :n], x.biases[:, :, :n]

    def rows(self) -> mx.array:
        """The valid rows (B, H, count, D), float32 (transient)."""
        x = self.layout
        return dequantize_rows(*self._valid(), x.group, x.bits, mx.float32)

    def scores(self, q: mx.array) -> mx.array:
        """float32 ``q Kᵀ`` (B, H, R, count) for scaled float32 queries (B, H, R, D)."""
        x = self.layout
        if _quantized_matmul_here(x.bits):
            return mx.quantized_matmul(q, *self._valid(), transpose=True, group_size=x.group, bits=x.bits)
        return q @ self.rows().swapaxes(-1, -2)

    def mix(self, p: mx.array) -> mx.array:
        """float32 ``p V`` (B, H, R, D) for probabilities (B, H, R, count)."""
        x = self.layout
        if _quantized_matmul_here(x.bits):
            return mx.quantized_matmul(p, *self._valid(), transpose=False, group_size=x.group, bits=x.bits)
        return p @ self.rows()
