"""A token latent shared by several layers, each with its own reconstruction (xKV).

The keys of G layers over the same T tokens, heads side by side along the channels,
form ``X = [K_1 | ... | K_G]`` (B, T, G*H*d). Its SVD ``X ~ U_r S_r V_rᵀ`` gives one token
latent ``A = U_r S_r`` (B, T, r) for the whole group and, per layer, the rows of ``V_r``
that rebuild its channels: ``K_l ~ A B_l`` with ``B_l = V_r[cols(l)]ᵀ`` (B, r, H*d).

The latent is kept quantized per latent channel (min-max over groups of tokens, the
layout KIVI gives keys: ``quant/affine.py``'s per-channel codes, one "head"), its
ragged last tokens (fewer than a packing unit) in the model dtype; at 16 bits all of it
stays in the model dtype. ``LatentKeys`` reads it at a decode step without rebuilding
the keys: ``q · k_t = (B_lᵀ q) · a_t``, so the queries are folded into the latent space
first (one product per head) and scored against the packed latent by the shared
per-channel reader.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from ..kernels import kivi_decode as kd
from ..quant.affine import dequantize_per_channel, quantize_per_channel
from .factors import leading_bases, randomized_basis

DENSE_BITS = 16  # the latent kept in the model dtype


def heads_to_channels(k: mx.array) -> mx.array:
    """(B, H, T, d) -> (B, T, H*d)."""
    b, h, t, d = k.shape
    return k.transpose(0, 2, 1, 3).reshape(b, t, h * d)


def joint_keys(blocks: list[mx.array]) -> mx.array:
    """``X = [K_1 | ... | K_G]`` (B, T, G*H*d) float32 of keys ``blocks`` (B, H, T, d)."""
    return mx.concatenate([heads_to_channels(k.astype(mx.float32)) for k in blocks], axis=-1)


def joint_bases(groups: list[list[mx.array]], rank: int | None, energy: float) -> list:
    """``(V_r, r)`` of each group's ``joint_keys`` as ``joint_factors`` fits it, every group's
    eigenproblem queued before their ranks are read (``factors.leading_bases``)."""
    return leading_bases([joint_keys(blocks) for blocks in groups], rank, energy)


def joint_factors(blocks: list[mx.array], rank: int | None, energy: float, basis=None):
    """The shared latent and each layer's reconstruction of keys ``blocks`` (B, H, T, d)
    of the same tokens: (A (B, T, r) float32, [B_l (B, r, H*d) float32], r). ``rank``
    None: the smallest r holding ``energy`` of the squared singular values (the largest
    over the batch); any rank is capped at min(T, G*H*d). ``basis``: ``(V_r, r)`` fitted
    already (``joint_bases``), for these blocks with this rank rule.

    The basis ``V_r`` comes from ``factors.randomized_basis`` over at most
    ``FIT_SAMPLE_TOKENS`` tokens (the Gram matrix's one eigenproblem up to ``GRAM_MAX``
    channels for the energy rule, a randomized SVD with eigenproblems of rank size past it)
    instead of the exact SVD of the T x G*H*d matrix; ``A = X V_r`` over every token, so
    ``A B_l`` is X's projection on the basis. Under the energy rule the projection holds at
    least ``energy`` of the sampled rows' energy, with at least the exact rule's rank."""
    x = joint_keys(blocks)
    v, r = randomized_basis(x, rank, energy) if basis is None else basis
    a = mx.where(mx.isfinite(x), x, 0.0) @ v
    width = blocks[0].shape[1] * blocks[0].shape[3]
    bs = [v[:, i * width : (i + 1) * width].swapaxes(1, 2) for i in range(len(blocks))]
    return a, bs, r


def packing_unit(group: int) -> int:
    """Tokens quantized at a time: whole groups that also fill whole uint32 words."""
    return group * 32 // math.gcd(group, 32)


@dataclass(frozen=True)
class SharedLatentCodec:
    bits: int  # 1-6, 8, or DENSE_BITS
    group: int  # tokens per scale/zero of one latent channel

    def encode(self, a: mx.array, dtype) -> dict[str, mx.array]:
        """``a`` (B, T, r) -> what is kept: codes/scales/biases of the first whole
        packing units (absent at 16 bits) and the rest in ``dtype``."""
        a = a[:, None]  # one latent "head": the per-channel layout of quant/affine.py
        n_q = 0 if self.bits == DENSE_BITS else a.shape[2] // packing_unit(self.group) * packing_unit(self.group)
        # a copy: a view (astype to the same dtype is one) would pin the whole SVD output
        out = {"latent_tail": mx.contiguous(a[:, :, n_q:].astype(dtype)) if n_q < a.shape[2] else None}
        if n_q:
            codes, scales, biases = quantize_per_channel(a[:, :, :n_q].astype(dtype), self.group, self.bits)
            out.update(latent_codes=codes, latent_scales=scales, latent_biases=biases)
        return out

    def problems(self, kept: dict):
        """(field, found, expected) for kept arrays this codec cannot read (a saved file whose
        bit width or group was edited, or whose arrays were cut)."""
        codes = kept.get("latent_codes")
        if codes is None:
            return
        scales, biases = kept.get("latent_scales"), kept.get("latent_biases")
        if scales is None or biases is None:
            yield "latent scales and biases", None, "arrays beside the latent codes"
            return
        if biases.shape != scales.shape:
            yield "latent biases shape", biases.shape, f"the scales' {scales.shape}"
        elif codes.shape[:-1] != scales.shape[:-1]:
            yield "latent codes shape", codes.shape, f"{scales.shape[:-1]} (the scales') x packed tokens"
        elif self.bits == DENSE_BITS:
            yield "latent codes", f"an array {codes.shape}", "none (xkv_latent_bits=16 keeps the latent unquantized)"
        elif codes.shape[-1] * 32 != scales.shape[-1] * self.group * self.bits:
            tokens = scales.shape[-1] * self.group
            yield ("latent codes width", codes.shape[-1],
                   f"{tokens} tokens x {self.bits} bits / 32 = {tokens * self.bits / 32:g} words "
                   f"(xkv_latent_bits={self.bits}, xkv_group_quant_size={self.group})")

    def decode(self, kept: dict, dtype) -> mx.array:
        """The latent (B, T, r) in ``dtype`` (transient: prefill chunks and tests)."""
        parts = []
        if kept.get("latent_codes") is not None:
            parts.append(dequantize_per_channel(kept["latent_codes"], kept["latent_scales"],
                                                kept["latent_biases"], self.group, self.bits, dtype))
        if kept.get("latent_tail") is not None:
            parts.append(kept["latent_tail"].astype(dtype))
        return (parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2))[:, 0]


@dataclass(frozen=True)
class LatentKeys:
    """Keys of one layer as the shared latent times its ``b`` (B, r, H*d): the
    ``PackedScores`` of kernels/decode.py (keys only: xKV leaves values alone)."""

    codec: SharedLatentCodec
    kept: dict  # the owner's latent arrays (SharedLatentCodec.encode)
    b: mx.array
    count: int
    n_heads: int

    def scores(self, q: mx.array, views=None) -> mx.array:
        """float32 ``q Kᵀ`` (B, H, R, count) for scaled float32 queries (B, H, R, d).
        ``views``: ``read_views()`` kept by the caller between decode steps."""
        bsz, h, r_q, d = q.shape
        b_heads, tail_t = self.read_views(h, d) if views is None else views
        qb = (q @ b_heads.astype(mx.float32)).reshape(bsz, 1, h * r_q, -1)  # the queries in the latent space
        s = []
        codes = self.kept.get("latent_codes")
        if codes is not None:
            scales = self.kept["latent_scales"]
            n_q = scales.shape[-1] * self.codec.group
            s.append(kd.affine_key_scores(qb, codes, scales, self.kept["latent_biases"], n_q,
                                          self.codec.bits, self.codec.group))
        if tail_t is not None:
            s.append(qb @ tail_t.astype(mx.float32))
        s = s[0] if len(s) == 1 else mx.concatenate(s, axis=-1)
        return s.reshape(bsz, h, r_q, -1)

    def read_views(self, h: int, d: int):
        """(b as (B, H, d, rank), the latent tail transposed (B, 1, rank, n) or None): views
        of what is kept, in the layout ``scores`` reads."""
        tail = self.kept.get("latent_tail")
        b_heads = self.b.reshape(self.b.shape[0], -1, h, d).transpose(0, 2, 3, 1)
        return b_heads, None if tail is None else tail.swapaxes(-1, -2)

    def reconstruct(self, dtype) -> mx.array:
        """The keys (B, H, count, d) in ``dtype`` (transient)."""
        a = self.codec.decode(self.kept, mx.float32)
        k = a @ self.b.astype(mx.float32)  # (B, T, H*d)
        bsz, t, _ = k.shape
        return k.reshape(bsz, t, self.n_heads, -1).transpose(0, 2, 1, 3).astype(dtype)
