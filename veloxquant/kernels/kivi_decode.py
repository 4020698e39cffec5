"""Fused decode attention over a KIVI-layout packed KV cache.

One decode step (one query token per sequence) attends over a cache that holds

* quantized keys, per channel, in groups of ``group_size`` consecutive tokens, stored
  transposed: exactly ``mx.quantize(K.transpose(0, 1, 3, 2), group_size, bits)`` of the
  ``(B, H, T, D)`` keys, i.e. ``k_codes`` uint32 ``(B, H, D, Ck_words)`` and
  ``k_scales`` / ``k_biases`` ``(B, H, D, Ck_groups)``; the first ``n_kq`` tokens are
  valid (a multiple of ``group_size``);
* quantized values, per token, in groups of ``group_size`` consecutive channels:
  exactly ``mx.quantize(V, group_size, bits)``, i.e. ``v_codes`` uint32
  ``(B, H, Cv, D // (32 // bits))`` and ``v_scales`` / ``v_biases``
  ``(B, H, Cv, D // group_size)``; the first ``n_vq`` rows are valid;
* full-precision residual windows ``k_res`` ``(B, H, Ck_res, D)`` (first ``n_kres`` rows
  valid) and ``v_res`` ``(B, H, Cv_res, D)`` (first ``n_vres`` rows valid).

Every buffer may carry spare capacity past its valid part (along the token axis); the
functions here read only the valid part and never copy the buffers in the kernel paths.
Logical token order is ``[quantized..., residual...]`` for keys and for values
separately, with ``n_kq + n_kres == n_vq + n_vres == T``.

Queries are ``(B, Hq, 1, D)`` with ``Hq`` a multiple of ``H`` (grouped-query attention:
query head ``h`` reads kv head ``h // (Hq // H)``). There is no mask: at a decode step
every cached token is visible. The output is ``(B, Hq, 1, D)`` in the query dtype.

Paths
-----
``kivi_decode_attention_reference``
    dequantize the valid part in float32 and run a float32 softmax attention. This is
    the function of record: CI checks the other paths against it on the CPU.
``kivi_decode_attention_qmm``
    ``mx.quantized_matmul(..., transpose=False)`` straight on the packed keys (q . K^T on
    the transposed per-channel codes) and values (p . V on the per-token codes), plus
    the residual windows, under one joint softmax.
``kivi_decode_attention_cuda``
    a flash-decoding kernel through ``mx.fast.cuda_kernel`` (MLX's CUDA back-end), one of
    three (:func:`default_algo` picks): ``algo="frag"`` (tensor cores on the packed words
    in their stored order, each warp with its own tiles, softmax and copies; float16
    caches), ``algo="folded"`` (tensor cores on the raw codes, the affine scales folded
    into the queries and probabilities; float16 caches) and ``algo="simt"`` (CUDA cores,
    float32 throughout). Each was checked on an H200 against the float32 reference.
``kivi_decode_attention_metal``
    the twin of the simt kernel through ``mx.fast.metal_kernel``. No Metal hardware was
    available: it is untested on hardware.
``kivi_decode_attention``
    the dispatcher: a CUDA kernel on the CUDA back-end (:func:`default_algo`), the Metal
    one on Metal, otherwise the faster pure-mlx path on the CPU (``CPU_DEFAULT_PATH``).

Checking and timing live in benchmarks/: fused_attention.py (check against the reference
with NaN-poisoned outputs, timing table), kernels_extra.py (the undispatched "mma"
kernel, every tuning knob of the sweeps, stage timings), the timelines; measured tables
in benchmarks/results/fused_attention.md, the attempts behind the constants here in
benchmarks/notes/fused_attention.md.
"""

from __future__ import annotations

import functools
import struct
import warnings
from collections import OrderedDict
from typing import Optional

import mlx.core as mx

from .compiled import code_shifts
from .kivi_decode_cuda_src import CUDA_COMBINE_SOURCE, CUDA_HEADER, CUDA_SOURCE
from .kivi_decode_cuda_folded_src import CUDA_FOLDED_HEADER, CUDA_FOLDED_SOURCE
from .kivi_decode_cuda_frag_src import (
    CUDA_FRAG_HEADER,
    CUDA_FRAG_SOURCE,
    ROW_PARAMS,
    ROW_PARAMS0,
    cuda_frag_bounds,
)
from .kivi_decode_metal_src import METAL_COMBINE_SOURCE, METAL_HEADER, METAL_SOURCE
from .names import source_tagged

__all__ = [
    "SUPPORTED_BITS",
    "SUPPORTED_GROUP_SIZES",
    "CPU_DEFAULT_PATH",
    "kivi_decode_attention",
    "kivi_decode_attention_reference",
    "kivi_decode_attention_qmm",
    "kivi_decode_attention_cuda",
    "kivi_decode_attention_metal",
    "kivi_decode_attention_rows",
    "kivi_decode_attention_rows_reference",
    "kernel_supports",
    "default_algo",
]

SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)

#: Pure-mlx path used when no GPU kernel applies: "qmm" or "reference" (why "qmm":
#: benchmarks/notes/kernel_constants.md).
CPU_DEFAULT_PATH = "qmm"

_LOG2E = 1.4426950408889634

# Launch shape of the simt and folded kernels: blocks of 128 threads, each walking one or
# more chunks of CHUNK tokens of one (batch, kv head) with an online softmax and writing
# one partial (m, l, o) per query head; a second tiny kernel merges the partials.
_NT = 128
#: The dispatcher's CUDA kernel for float16 caches: "frag" at FRAG_DEFAULT_BITS, "folded"
#: at FOLDED_DEFAULT_BITS, where they handle the shape; otherwise DEFAULT_CUDA_ALGO
#: (folded serves the shapes frag does not take). How these were chosen:
#: benchmarks/notes/kernel_constants.md.
DEFAULT_CUDA_ALGO = "simt"
FOLDED_DEFAULT_BITS = (2, 4)
FRAG_DEFAULT_BITS = (2, 4, 8)
#: simt: tokens per chunk and split target (blocks); folded: its split target, one wave of
#: 6 blocks an SM on a 132-SM GPU
DEFAULT_CHUNK = 256
DEFAULT_TARGET_BLOCKS = 1024
FOLDED_TARGET_BLOCKS = 792
_MAX_GQA = 8


# ---------------------------------------------------------------------------------
# argument handling shared by every path
# ---------------------------------------------------------------------------------


def _check_layout(queries, k_codes, k_scales, n_kq, k_res, n_kres, v_codes, v_scales,
                  n_vq, v_res, n_vres, bits, group_size):
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(
            f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    if queries.ndim != 4 or queries.shape[2] != 1:
        raise ValueError(
            f"queries must be (B, Hq, 1, D) for a decode step, got {queries.shape}")
    B, Hq, _, D = queries.shape
    n_kq, n_kres, n_vq, n_vres = int(n_kq), int(n_kres), int(n_vq), int(n_vres)
    if min(n_kq, n_kres, n_vq, n_vres) < 0:
        raise ValueError("token counts must be non-negative")
    T = n_kq + n_kres
    if T != n_vq + n_vres:
        raise ValueError(
            f"n_kq + n_kres ({n_kq} + {n_kres}) must equal n_vq + n_vres ({n_vq} + {n_vres})")
    if T == 0:
        raise ValueError("the cache is empty: nothing to attend to")
    if n_kq % group_size:
        raise ValueError(f"n_kq={n_kq} must be a multiple of group_size={group_size}")
    if D % group_size:
        raise ValueError(f"head_dim {D} must be a multiple of group_size {group_size}")
    pack = 32 // bits
    H = None
    if n_kq:
        H = k_codes.shape[1]
        if k_codes.shape[:3] != (B, H, D) or k_codes.shape[3] * pack < n_kq:
            raise ValueError(f"k_codes {k_codes.shape} cannot hold {n_kq} tokens of (B,H,D)")
        if k_scales.shape[3] * group_size < n_kq:
            raise ValueError(f"k_scales {k_scales.shape} cannot hold {n_kq} tokens")
    if n_vq:
        H = v_codes.shape[1] if H is None else H
        if v_codes.shape[:2] != (B, H) or v_codes.shape[2] < n_vq \
                or v_codes.shape[3] != D // pack:
            raise ValueError(f"v_codes {v_codes.shape} cannot hold {n_vq} rows of D={D}")
        if v_scales.shape[2] < n_vq or v_scales.shape[3] != D // group_size:
            raise ValueError(f"v_scales {v_scales.shape} cannot hold {n_vq} rows")
    if n_kres:
        H = k_res.shape[1] if H is None else H
        if k_res.shape[0] != B or k_res.shape[1] != H or k_res.shape[2] < n_kres \
                or k_res.shape[3] != D:
            raise ValueError(f"k_res {k_res.shape} cannot hold {n_kres} rows")
    if n_vres:
        H = v_res.shape[1] if H is None else H
        if v_res.shape[0] != B or v_res.shape[1] != H or v_res.shape[2] < n_vres \
                or v_res.shape[3] != D:
            raise ValueError(f"v_res {v_res.shape} cannot hold {n_vres} rows")
    if Hq % H:
        raise ValueError(f"query heads {Hq} must be a multiple of kv heads {H}")
    return B, Hq, H, D, T, n_kq, n_kres, n_vq, n_vres


def _unpack_codes(words: mx.array, bits: int) -> mx.array:
    """uint32 words (..., W) -> float32 codes (..., W * 32 // bits), mx.quantize order."""
    pack = 32 // bits
    codes = (words[..., None] >> code_shifts(bits)) & ((1 << bits) - 1)
    return codes.reshape(*words.shape[:-1], words.shape[-1] * pack).astype(mx.float32)


def dequantize(codes, scales, biases, group_size: int, bits: int) -> mx.array:
    """``mx.dequantize`` along the last axis, in the scales' dtype, but 1-bit words unpacked
    here on every device: MLX 0.32.4's CUDA back-end reads them wrongly (relative error 1.5;
    benchmarks/results/affine_widths_h200.md)."""
    if bits != 1:
        return mx.dequantize(codes, scales, biases, group_size=group_size, bits=bits)
    return unpacked_affine(codes, scales, biases, group_size, bits)


def unpacked_affine(codes, scales, biases, group_size: int, bits: int) -> mx.array:
    """``mx.dequantize``'s values bit for bit (``code * scale + bias`` in the scales' dtype),
    the words (``32 % bits == 0``) unpacked here in one shift: where MLX's own reading is
    wrong (1 bit on CUDA) or, on the CPU, a graph of one shift per code in a word."""
    q = _unpack_codes(codes, bits).astype(scales.dtype).reshape(*scales.shape, group_size)
    return (q * scales[..., None] + biases[..., None]).reshape(*codes.shape[:-1], -1)


def _dequant_keys_f32(k_codes, k_scales, k_biases, n_kq, bits, group_size):
    """Valid quantized keys as float32 (B, H, n_kq, D)."""
    pack = 32 // bits
    codes = _unpack_codes(k_codes[..., : n_kq // pack], bits)  # (B, H, D, n_kq)
    s = mx.repeat(k_scales[..., : n_kq // group_size].astype(mx.float32), group_size, axis=-1)
    b = mx.repeat(k_biases[..., : n_kq // group_size].astype(mx.float32), group_size, axis=-1)
    return (s * codes + b).transpose(0, 1, 3, 2)


def _dequant_values_f32(v_codes, v_scales, v_biases, n_vq, bits, group_size):
    """Valid quantized values as float32 (B, H, n_vq, D)."""
    codes = _unpack_codes(v_codes[:, :, :n_vq], bits)  # (B, H, n_vq, D)
    s = mx.repeat(v_scales[:, :, :n_vq].astype(mx.float32), group_size, axis=-1)
    b = mx.repeat(v_biases[:, :, :n_vq].astype(mx.float32), group_size, axis=-1)
    return s * codes + b


# ---------------------------------------------------------------------------------
# pure-mlx paths
# ---------------------------------------------------------------------------------


def kivi_decode_attention_reference(queries, k_codes, k_scales, k_biases, n_kq, k_res,
                                    n_kres, v_codes, v_scales, v_biases, n_vq, v_res,
                                    n_vres, *, scale, bits, group_size):
    """Dequantize the valid cache in float32 and attend with a float32 softmax.

    The function of record for the fused kernels. Costs a float32 copy of the valid
    K/V per call: use it for checking, and on the CPU where it is the faster path.
    """
    B, Hq, H, D, T, n_kq, n_kres, n_vq, n_vres = _check_layout(
        queries, k_codes, k_scales, n_kq, k_res, n_kres, v_codes, v_scales, n_vq,
        v_res, n_vres, bits, group_size)
    R = Hq // H
    keys, values = [], []
    if n_kq:
        keys.append(_dequant_keys_f32(k_codes, k_scales, k_biases, n_kq, bits, group_size))
    if n_kres:
        keys.append(k_res[:, :, :n_kres].astype(mx.float32))
    if n_vq:
        values.append(_dequant_values_f32(v_codes, v_scales, v_biases, n_vq, bits,
                                          group_size))
    if n_vres:
        values.append(v_res[:, :, :n_vres].astype(mx.float32))
    K = keys[0] if len(keys) == 1 else mx.concatenate(keys, axis=2)
    V = values[0] if len(values) == 1 else mx.concatenate(values, axis=2)
    q = queries.astype(mx.float32).reshape(B, H, R, D) * scale
    s = q @ K.transpose(0, 1, 3, 2)  # (B, H, R, T)
    p = mx.softmax(s, axis=-1)
    out = p @ V  # (B, H, R, D)
    return out.reshape(B, Hq, 1, D).astype(queries.dtype)


def kivi_decode_attention_qmm(queries, k_codes, k_scales, k_biases, n_kq, k_res, n_kres,
                              v_codes, v_scales, v_biases, n_vq, v_res, n_vres, *, scale,
                              bits, group_size, compute_dtype=mx.float32):
    """``mx.quantized_matmul`` on the packed K and V, residual windows dense.

    Scores: ``q @ deq(K^T)`` with ``transpose=False`` on the per-channel (transposed)
    key codes, plus ``q @ k_res^T``; one float32 softmax over the joint score vector
    (logical token order); output: ``p[:, :n_vq] @ deq(V)`` (``transpose=False`` on the
    per-token value codes) plus ``p[:, n_vq:] @ v_res``. Queries and probabilities are
    cast to ``compute_dtype`` (float32 by default; the packed data and its scales stay
    as they are). Slicing the valid part of a buffer with spare capacity makes MLX
    copy that slice before the matmul: this path does not avoid copies.
    """
    B, Hq, H, D, T, n_kq, n_kres, n_vq, n_vres = _check_layout(
        queries, k_codes, k_scales, n_kq, k_res, n_kres, v_codes, v_scales, n_vq,
        v_res, n_vres, bits, group_size)
    R = Hq // H
    pack = 32 // bits
    q = (queries.reshape(B, H, R, D).astype(mx.float32) * scale).astype(compute_dtype)
    parts = []
    if n_kq:
        parts.append(mx.quantized_matmul(
            q, k_codes[..., : n_kq // pack], k_scales[..., : n_kq // group_size],
            k_biases[..., : n_kq // group_size], transpose=False, group_size=group_size,
            bits=bits))
    if n_kres:
        parts.append(q @ k_res[:, :, :n_kres].astype(compute_dtype).transpose(0, 1, 3, 2))
    s = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    p = mx.softmax(s.astype(mx.float32), axis=-1).astype(compute_dtype)
    out = None
    if n_vq:
        out = mx.quantized_matmul(
            p[..., :n_vq], v_codes[:, :, :n_vq], v_scales[:, :, :n_vq],
            v_biases[:, :, :n_vq], transpose=False, group_size=group_size, bits=bits)
    if n_vres:
        r = p[..., n_vq:] @ v_res[:, :, :n_vres].astype(compute_dtype)
        out = r if out is None else out + r
    return out.reshape(B, Hq, 1, D).astype(queries.dtype)


_INPUT_NAMES = ["queries", "k_codes", "k_scales", "k_biases", "k_res", "v_codes",
                "v_scales", "v_biases", "v_res", "params"]
_KERNELS: dict = {}


def cuda_header(min_blocks: int = 0) -> str:
    """The CUDA kernels' shared header; with ``min_blocks``, ending in the frag kernel's
    launch bounds (:func:`cuda_frag_bounds`)."""
    header = CUDA_HEADER + CUDA_FOLDED_HEADER + CUDA_FRAG_HEADER
    return header + (cuda_frag_bounds(FRAG_NT, min_blocks) if min_blocks else "")


def _get_kernels(backend: str, algo: str = "simt", min_blocks: int = 0):
    """(main, merge) kernels; ``min_blocks``: frag's launch bounds (blocks an SM)."""
    min_blocks = (min_blocks or FRAG_MIN_BLOCKS) if algo == "frag" else 0
    key = (backend, algo, min_blocks)
    if key not in _KERNELS:
        if backend == "cuda":
            source = {"simt": CUDA_SOURCE, "folded": CUDA_FOLDED_SOURCE,
                      "frag": CUDA_FRAG_SOURCE}[algo]
            # MLX caches a compiled kernel by its name (and template): the launch bounds,
            # which are in the header, must be in the name too, and so is the text's digest
            header = cuda_header(min_blocks)
            main = mx.fast.cuda_kernel(
                name=source_tagged("vq_kivi_decode" + ("" if algo == "simt" else "_" + algo) + (
                    f"_mb{min_blocks}" if algo == "frag" else ""), source, header),
                input_names=_INPUT_NAMES, output_names=["o_part", "ml_part"],
                source=source, header=header)
            comb = mx.fast.cuda_kernel(
                name=source_tagged("vq_kivi_decode_combine", CUDA_COMBINE_SOURCE, CUDA_HEADER),
                input_names=["o_part", "ml_part"],
                output_names=["out"], source=CUDA_COMBINE_SOURCE, header=CUDA_HEADER)
        elif backend == "metal":
            if algo != "simt":
                raise ValueError("the Metal twin exists for the 'simt' kernel only")
            main = mx.fast.metal_kernel(
                name=source_tagged("vq_kivi_decode", METAL_SOURCE, METAL_HEADER), input_names=_INPUT_NAMES,
                output_names=["o_part", "ml_part"], source=METAL_SOURCE,
                header=METAL_HEADER)
            comb = mx.fast.metal_kernel(
                name=source_tagged("vq_kivi_decode_combine", METAL_COMBINE_SOURCE, METAL_HEADER),
                input_names=["o_part", "ml_part"],
                output_names=["out"], source=METAL_COMBINE_SOURCE, header=METAL_HEADER)
        else:
            raise ValueError(backend)
        _KERNELS[key] = (main, comb)
    return _KERNELS[key]


def _default_variant(gqa: int):
    """(TW, KUNROLL, VUNROLL) of the simt kernel for a GQA ratio: (8, 8, 8) was the fastest
    of run 3's sweep; GQA 8 needs TW=4 to stay near 128 registers (notes, v3)."""
    return (8, 8, 8) if gqa <= 4 else (4, 8, 8)


def _default_chunk(algo: str, bits: int) -> int:
    """Tokens per chunk of the simt and folded kernels (frag's tile is fixed)."""
    if algo == "folded":  # 16 packed words per key channel row and chunk at 4 and 8 bits
        return 64 if bits == 8 else 128
    return DEFAULT_CHUNK


def _simt_supports(head_dim, bits, chunk, tw) -> bool:
    """Whether the simt kernel's thread tiling fits: TW codes a thread, CHUNK tokens."""
    per = min(32 // bits, tw)
    colk = chunk // per
    if chunk % per or colk > _NT or _NT % colk or head_dim % (_NT // colk):
        return False
    colv = head_dim // per
    return colv <= _NT and _NT % colv == 0


def _folded_shared_bytes(head_dim, gqa, bits, group_size, chunk) -> int:
    """Static shared memory of the folded kernel (its declarations, in bytes)."""
    pack = 32 // bits
    dg = head_dim // group_size
    return (4 * head_dim * (chunk // pack + 4) + 4 * chunk * (head_dim // pack + 4)
            + 4 * max(1, chunk // group_size) * head_dim + 4 * chunk * dg
            + 4 * gqa * chunk + 16 * 32 * (head_dim // 16) + 2 * 2 * dg * gqa * chunk
            + 4 * gqa * (3 + dg))


def _folded_supports(head_dim, gqa, bits, group_size, dtype, chunk) -> bool:
    pack = 32 // bits
    return (dtype == mx.float16 and 1 <= gqa <= _MAX_GQA and head_dim % 64 == 0
            and chunk % 64 == 0 and chunk % pack == 0 and (chunk // pack) % 4 == 0
            and (head_dim // pack) % 4 == 0 and group_size % 16 == 0
            and head_dim % group_size == 0
            and _folded_shared_bytes(head_dim, gqa, bits, group_size, chunk) <= 48 * 1024)


#: frag: threads per block (two warps, each with its own tiles and buffers) and tail
#: tokens per chunk
FRAG_NT = 64
FRAG_TAIL = 8 * (FRAG_NT // 32)
#: frag: KEEP of kivi_decode_cuda_frag_src.py (1: the codes 4+ bits up their byte keep their
#: float16 offset of 1024: less GPU time, errors well inside the bound); exact codes
#: (KEEP 0) for blocks of more than FRAG_KEEP_MAX_TILES tiles, as the error of kept
#: offsets grows with the tiles a warp sums
FRAG_KEEP_OFFSET = 1
FRAG_KEEP_MAX_TILES = 256
#: frag's split target (blocks) and launch bounds (resident blocks an SM: the register
#: budget) by the kv heads of a call (batch x kv heads): 792 and 6 below FRAG_MANY_HEADS,
#: 528 and 4 from there (tuned on an H200 only: benchmarks/notes/kernel_constants.md)
FRAG_TARGET_BLOCKS = 792
FRAG_MIN_BLOCKS = 6
FRAG_TARGET_BLOCKS_MANY_HEADS = 528
FRAG_MIN_BLOCKS_MANY_HEADS = 4
FRAG_MANY_HEADS = 32
#: frag's split target below FRAG_MANY_HEADS kv heads at contexts up to FRAG_SHORT_TOKENS,
#: per code width where one was measured (4 bits: benchmarks/notes/decode_kernels.md); a
#: short context's tiles in the wave target's many blocks leave each block too little work
FRAG_SHORT_TOKENS = 4096
FRAG_TARGET_BLOCKS_SHORT = {4: 99}


def frag_target_blocks(BH: int, tokens: int | None = None, bits: int | None = None) -> int:
    """The frag kernel's split target for a call over ``BH`` kv heads (and, where known,
    ``tokens`` a sequence at ``bits``)."""
    if BH >= FRAG_MANY_HEADS:
        return FRAG_TARGET_BLOCKS_MANY_HEADS
    if tokens is not None and tokens <= FRAG_SHORT_TOKENS and bits in FRAG_TARGET_BLOCKS_SHORT:
        return FRAG_TARGET_BLOCKS_SHORT[bits]
    return FRAG_TARGET_BLOCKS


def frag_launch_bounds(BH: int) -> int:
    """The frag kernel's launch bounds (blocks an SM) for a call over ``BH`` kv heads."""
    return FRAG_MIN_BLOCKS_MANY_HEADS if BH >= FRAG_MANY_HEADS else FRAG_MIN_BLOCKS


def _frag_tile(bits: int) -> int:
    """Tokens in a frag tile: one packed word per lane and row, 8 lanes across."""
    return 8 * (32 // bits)


def _frag_shared_bytes(head_dim, gqa, bits, group_size) -> int:
    """Static shared memory of the frag kernel (its declarations, in bytes; with the
    tail's partials of TAIL_FIRST, the most it takes)."""
    nw, tt = FRAG_NT // 32, _frag_tile(bits)
    kgt, dg = max(1, tt // group_size), head_dim // group_size
    return (2 * nw * 8 * head_dim * 4 + nw * kgt * head_dim * 8 + nw * dg * (tt + 8) * 8
            + (head_dim // 16) * 32 * 16 + 2 * nw * gqa * 4
            + nw * gqa * (head_dim + 2) * 4)  # the tail's partials


def _frag_supports(head_dim, gqa, bits, group_size, dtype) -> bool:
    return (dtype == mx.float16 and 1 <= gqa <= _MAX_GQA and head_dim in (64, 128)
            and head_dim % _frag_tile(bits) == 0 and head_dim % group_size == 0
            and _frag_shared_bytes(head_dim, gqa, bits, group_size) <= 48 * 1024)


def _frag_plan(n_kq, n_vq, T, BH, bits, target_blocks):
    """(first tail token, tail chunks, blocks per kv head, tiles per block, first block
    with tail chunks) of the frag kernel. Tiles of :func:`_frag_tile` tokens cover the
    tokens whose keys and values are both quantized, split evenly over blocks that fit in
    ``target_blocks`` (one wave: a block more per kv head would run in a second wave,
    after all the others); the rest goes in chunks of FRAG_TAIL tokens to blocks of their
    own where those fit in the same wave, else to the tile blocks (block s taking chunks
    s, s + blocks, ...)."""
    tt = _frag_tile(bits)
    t_fast = min(n_kq, n_vq) // tt * tt
    ns_tail = -(-(T - t_fast) // FRAG_TAIL)
    return (t_fast, ns_tail, *_frag_split(t_fast // tt, ns_tail, BH, target_blocks))


def _frag_split(n_tiles, ns_tail, BH, target_blocks):
    """(blocks per kv head, tiles per block, first block with tail chunks) for ``n_tiles``
    tiles and ``ns_tail`` tail chunks a kv head (:func:`_frag_plan`)."""
    if n_tiles == 0:
        return max(ns_tail, 1), 1, 0
    ns = max(1, min(n_tiles, target_blocks // BH))
    tps = -(-n_tiles // ns)
    ns = -(-n_tiles // tps)
    if (ns + ns_tail) * BH <= target_blocks:
        return ns + ns_tail, tps, ns
    return ns, tps, 0


def _frag_launch_args(dtype, head_dim, gqa, bits, group_size, key_words, n_kq, n_kres, n_vq,
                      n_vres, BH, scale, target_blocks):
    """What a launch of the frag kernel takes besides its buffers: (blocks per kv head,
    params, template, first block with tail chunks, tail chunks). ``key_words``: the
    capacity of a key code row (16-byte copies where it is a multiple of 4). KEEP:
    FRAG_KEEP_OFFSET, or 0 past FRAG_KEEP_MAX_TILES tiles a block; TAIL_FIRST: tail chunks
    that share a block with tiles go first (shorter at batch 8)."""
    t_fast, ns_tail, ns, tps, tail0 = _frag_plan(n_kq, n_vq, n_kq + n_kres, BH, bits,
                                                 target_blocks)
    keep = FRAG_KEEP_OFFSET if tps <= FRAG_KEEP_MAX_TILES else 0
    tail_first = tail0 == 0 and t_fast > 0
    params = _params(n_kq, n_kres, n_vq, n_vres, scale, tps, t_fast, ns_tail, tail0)
    template = _frag_template(dtype, head_dim, gqa, bits, group_size, key_words, keep, tail_first, False)
    return ns, params, template, tail0, ns_tail


def _frag_template(dtype, head_dim, gqa, bits, group_size, key_words, keep, tail_first, rows):
    """The frag kernel's template constants (kivi_decode_cuda_frag_src.py)."""
    return [("T", dtype), ("BITS", bits), ("GROUP", group_size), ("HEAD_DIM", head_dim),
            ("GQA", gqa), ("NT", FRAG_NT), ("KVEC", 4 if key_words % 4 == 0 else 1),
            ("KEEP", int(keep)), ("TAIL_FIRST", bool(tail_first)), ("ROWS", rows)]


@functools.lru_cache(maxsize=64)  # a decode step's layers share their rows: one plan a step
def _frag_rows_launch_args(dtype, head_dim, gqa, bits, group_size, key_words, rows, H, scale,
                           target_blocks):
    """The frag kernel's launch over a packed batch (template ROWS): (blocks per kv head,
    params, template). ``rows[b]``: sequence b's (n_kq, n_kres, n_vq, n_vres, v_ring). The
    split is planned for the most tiles and the most tail chunks of any sequence; each
    sequence's counts, first tail token and ring start follow in ``params``."""
    tt = _frag_tile(bits)
    fast = [min(kq, vq) // tt * tt for kq, _, vq, _, _ in rows]
    n_tiles = max(fast) // tt
    ns_tail = max(-(-(kq + kr - f) // FRAG_TAIL) for (kq, kr, _, _, _), f in zip(rows, fast))
    ns, tps, tail0 = _frag_split(n_tiles, ns_tail, len(rows) * H, target_blocks)
    keep = FRAG_KEEP_OFFSET if tps <= FRAG_KEEP_MAX_TILES else 0
    per_row = [n for row, f in zip(rows, fast) for n in (*row[:4], f, row[4])]
    widest = [max(row[i] for row in rows) for i in range(4)]
    params = mx.array([*widest, _scale_bits(scale), tps, max(fast), ns_tail, tail0, *per_row], mx.int32)
    assert params.size == ROW_PARAMS0 + ROW_PARAMS * len(rows)
    template = _frag_template(dtype, head_dim, gqa, bits, group_size, key_words, keep,
                              tail0 == 0 and n_tiles > 0, True)
    return ns, params, template


def _chunk_launch_args(algo, dtype, head_dim, gqa, bits, group_size, key_words, n_kq, n_kres,
                       n_vq, n_vres, BH, scale, chunk, target_blocks):
    """What a launch of the simt or folded kernel takes besides its buffers: (blocks per
    kv head, params, template), for ``chunk``-token chunks split over about
    ``target_blocks`` blocks."""
    ns, cpb = _plan(n_kq + n_kres, BH, chunk, target_blocks)
    params = _params(n_kq, n_kres, n_vq, n_vres, scale, cpb)
    template = [("T", dtype), ("BITS", bits), ("GROUP", group_size), ("HEAD_DIM", head_dim),
                ("GQA", gqa), ("CHUNK", chunk), ("NT", _NT)]
    if algo == "folded":
        # 16-byte copies of key rows only where every row starts 16-byte aligned
        template.append(("KVEC", 4 if key_words % 4 == 0 else 1))
    else:
        tw, kunroll, vunroll = _default_variant(gqa)
        template += [("TW", tw), ("KUNROLL", kunroll), ("VUNROLL", vunroll), ("MODE", 0)]
    return ns, params, template


def _supports_any(head_dim, gqa, bits, group_size, dtype) -> bool:
    """What every fused kernel needs."""
    if bits not in SUPPORTED_BITS or group_size not in SUPPORTED_GROUP_SIZES:
        return False
    if dtype not in (mx.float16, mx.bfloat16, mx.float32):
        return False
    # head_dim % 32: the CUDA combine kernel owns 32-channel slices
    return 1 <= gqa <= _MAX_GQA and not head_dim % group_size and head_dim <= 256 \
        and not head_dim % 32


def kernel_supports(head_dim: int, gqa: int, bits: int, group_size: int,
                    dtype=mx.float16, algo: str = "simt") -> bool:
    """Whether a fused kernel handles this shape (else the dispatcher falls back)."""
    if not _supports_any(head_dim, gqa, bits, group_size, dtype):
        return False
    if algo == "frag":
        return _frag_supports(head_dim, gqa, bits, group_size, dtype)
    chunk = _default_chunk(algo, bits)
    if algo == "folded":
        return _folded_supports(head_dim, gqa, bits, group_size, dtype, chunk)
    if algo != "simt":
        raise ValueError(f"unknown kernel {algo!r}")
    return _simt_supports(head_dim, bits, chunk, _default_variant(gqa)[0])


def default_algo(head_dim: int, gqa: int, bits: int, group_size: int, dtype) -> Optional[str]:
    """The CUDA kernel the dispatcher uses for a shape: "frag", "folded", "simt" or None.

    The tensor-core kernels only for float16 inputs: their operands are float16, which
    bfloat16/float32 caches could overflow (|x| > 65504)."""
    if dtype == mx.float16 and bits in FRAG_DEFAULT_BITS and kernel_supports(
            head_dim, gqa, bits, group_size, dtype, algo="frag"):
        return "frag"
    if dtype == mx.float16 and bits in FOLDED_DEFAULT_BITS and kernel_supports(
            head_dim, gqa, bits, group_size, dtype, algo="folded"):
        return "folded"
    if kernel_supports(head_dim, gqa, bits, group_size, dtype):
        return DEFAULT_CUDA_ALGO
    return None


def _plan(T: int, BH: int, chunk: int, target_blocks: int):
    n_chunks = -(-T // chunk)
    ns = max(1, min(n_chunks, -(-target_blocks // BH)))
    cpb = -(-n_chunks // ns)
    ns = -(-n_chunks // cpb)
    return ns, cpb


_PARAMS_CACHE: "OrderedDict[tuple, mx.array]" = OrderedDict()


def _scale_bits(scale) -> int:
    """The bits of the float32 ``scale * log2(e)`` as an int32 (the kernels' params)."""
    return struct.unpack("<i", struct.pack("<f", float(scale) * _LOG2E))[0]


def _params(n_kq, n_kres, n_vq, n_vres, scale, cpb, *extra):
    key = (n_kq, n_kres, n_vq, n_vres, float(scale), cpb, *extra)
    arr = _PARAMS_CACHE.get(key)
    if arr is None:
        arr = mx.array([n_kq, n_kres, n_vq, n_vres, _scale_bits(scale), cpb, *extra], dtype=mx.int32)
        _PARAMS_CACHE[key] = arr
        if len(_PARAMS_CACHE) > 256:
            _PARAMS_CACHE.popitem(last=False)
    return arr


def _nonempty(x, shape, dtype):
    """A stand-in for an absent or empty buffer (never read by the kernel)."""
    if x is None or x.size == 0:
        return mx.zeros(shape, dtype=dtype)
    return x


def _kernel_inputs(queries, k_codes, k_scales, k_biases, n_kq, k_res, n_kres, v_codes,
                   v_scales, v_biases, n_vq, v_res, n_vres, bits, group_size):
    """The checked layout (B, Hq, H, D, T, n_kq, n_kres, n_vq, n_vres) and the 12 cache
    arguments as the kernels take them: stand-ins for absent or empty buffers, every
    floating-point buffer in the query dtype."""
    dims = _check_layout(queries, k_codes, k_scales, n_kq, k_res, n_kres, v_codes, v_scales,
                         n_vq, v_res, n_vres, bits, group_size)
    B, _, H, D, _, n_kq, n_kres, n_vq, n_vres = dims
    dt = queries.dtype
    pack = 32 // bits
    k_codes = _nonempty(k_codes, (B, H, D, 1), mx.uint32)
    k_scales = _nonempty(k_scales, (B, H, D, 1), dt)
    k_biases = _nonempty(k_biases, (B, H, D, 1), dt)
    v_codes = _nonempty(v_codes, (B, H, 1, D // pack), mx.uint32)
    v_scales = _nonempty(v_scales, (B, H, 1, D // group_size), dt)
    v_biases = _nonempty(v_biases, (B, H, 1, D // group_size), dt)
    k_res = _nonempty(k_res, (B, H, 1, D), dt)
    v_res = _nonempty(v_res, (B, H, 1, D), dt)
    for name, arr in (("k_scales", k_scales), ("k_biases", k_biases), ("k_res", k_res),
                      ("v_scales", v_scales), ("v_biases", v_biases), ("v_res", v_res)):
        if arr.dtype != dt:
            raise ValueError(f"{name} has dtype {arr.dtype}, queries {dt}: must match")
    return dims, (k_codes, k_scales, k_biases, n_kq, k_res, n_kres, v_codes, v_scales,
                  v_biases, n_vq, v_res, n_vres)


def launch_main(kernel, queries, cache, splits, threads, params, template, init=None):
    """One lazy launch of a main kernel over ``cache`` (the 12 arguments of
    :func:`_kernel_inputs`): ``splits`` blocks of ``threads`` per kv head; its partials
    (o_part, ml_part). ``init``: MLX's ``init_value`` of the outputs (None: unset)."""
    kc, ks, kb, _, kr, _, vc, vs, vb, _, vr, _ = cache
    B, Hq, _, D = queries.shape
    return tuple(kernel(
        inputs=[queries, kc, ks, kb, kr, vc, vs, vb, vr, params],
        template=template, grid=(splits * threads, B * kc.shape[1], 1),
        threadgroup=(threads, 1, 1), output_shapes=[(B * Hq, splits, D), (B * Hq, splits, 2)],
        output_dtypes=[mx.float32, mx.float32], init_value=init))


def _main_plan(backend, queries, cache, scale, bits, group_size, algo=None):
    """What a main kernel's launch over one layout needs besides the buffers: (kernel,
    splits, threads, params, template, the kernel's cache arguments, kernel key);
    ``algo`` None: the dispatcher's."""
    (B, Hq, H, D, T, n_kq, n_kres, n_vq, n_vres), cache = _kernel_inputs(
        queries, *cache, bits, group_size)
    R = Hq // H
    dt = queries.dtype
    if algo is None:
        algo = (default_algo(D, R, bits, group_size, dt) or "simt") if backend == "cuda" \
            else "simt"
    if not kernel_supports(D, R, bits, group_size, dt, algo=algo):
        raise ValueError(
            f"the fused {algo} kernel does not handle head_dim={D}, gqa={R}, bits={bits}, "
            f"group_size={group_size}, dtype={dt}")
    args = (dt, D, R, bits, group_size, cache[0].shape[3], n_kq, n_kres, n_vq, n_vres, B * H,
            scale)
    if algo == "frag":
        key = (backend, algo, frag_launch_bounds(B * H))
        ns, params, template, _, _ = _frag_launch_args(*args, frag_target_blocks(B * H, T, bits))
        return _get_kernels(*key)[0], ns, FRAG_NT, params, template, cache, key
    key = (backend, algo, 0)
    target = FOLDED_TARGET_BLOCKS if algo == "folded" else DEFAULT_TARGET_BLOCKS
    ns, params, template = _chunk_launch_args(algo, *args, _default_chunk(algo, bits), target)
    return _get_kernels(backend, algo)[0], ns, _NT, params, template, cache, key


def _partials(backend, queries, *cache, scale, bits, group_size, algo=None):
    """The main kernel's partials (o_part, ml_part) over one layout; ``algo`` None: the
    dispatcher's."""
    main, ns, threads, params, template, cache, _ = _main_plan(
        backend, queries, cache, scale, bits, group_size, algo)
    return launch_main(main, queries, cache, ns, threads, params, template)


def _launch(backend, queries, *cache, scale, bits, group_size, algo=None):
    """The main kernel's launch, then the merge of its partials into the output."""
    o_part, ml_part = _partials(backend, queries, *cache, scale=scale, bits=bits,
                                group_size=group_size, algo=algo)
    return merge_partials(backend, o_part, ml_part, queries.shape, queries.dtype)


def decode_partials(backend, queries, *cache, scale, bits, group_size):
    """The dispatcher's kernel over one layout, before the merge: (o_part, ml_part), the
    per-split partial softmax states (base-2 max and sum, unnormalised output), which
    partials of other layouts over other tokens may join (``kernels/decode.py``). Launched
    from the cached :class:`_StepPlan` of the layout where one applies (a multi-part
    store's other layers reuse it)."""
    plan = _step_plan(backend, (queries, *cache), bits, group_size, scale)
    if plan is not None:
        return plan.partials((queries, *cache))
    return _partials(backend, queries, *cache, scale=scale, bits=bits, group_size=group_size)


def merge_partials(backend, o_part, ml_part, out_shape, odt, init=None):
    """The merge kernel's launch: the splits' partials into the attention output.
    ``init``: MLX's ``init_value`` of the output (None: unset)."""
    (out,) = _get_kernels(backend)[1](inputs=[o_part, ml_part],
                                      **_merge_launch(backend, out_shape, odt, init))
    return out


def _merge_launch(backend, out_shape, odt, init=None) -> dict:
    """The merge kernel's launch arguments besides its inputs."""
    B, Hq, _, D = out_shape
    if backend == "cuda":  # a block per (row, 32-channel slice), 8 warps over the splits
        template = [("OT", odt), ("HEAD_DIM", D)]
        grid, group = (B * Hq * 256, D // 32, 1), (256, 1, 1)
    else:
        ng = max(1, 256 // D)
        template = [("OT", odt), ("HEAD_DIM", D), ("NG", ng)]
        grid, group = (B * Hq * D * ng, 1, 1), (D * ng, 1, 1)
    return dict(template=template, grid=grid, threadgroup=group, output_shapes=[out_shape],
                output_dtypes=[odt], init_value=init)


def kivi_decode_attention_cuda(queries, k_codes, k_scales, k_biases, n_kq, k_res, n_kres,
                               v_codes, v_scales, v_biases, n_vq, v_res, n_vres, *, scale,
                               bits, group_size, algo=None):
    """Fused flash-decoding kernel on MLX's CUDA back-end.

    Grid: (splits, B * H). A block owns one kv head and a contiguous run of tokens; it
    reads the packed key codes, scales and biases of its tokens once for all ``Hq // H``
    query heads of that kv head (GQA without repeating K/V), keeps an online base-2
    softmax and a float32 running output, and writes one (max, sum, output) partial per
    query head; a second kernel merges the partials. Counts travel in a small int32 array
    and capacities in the shape arguments, so the compiled code depends only on dtype,
    bits, group size, head_dim, GQA ratio and the launch constants. ``algo``: "frag"
    (tiles of packed words on tensor cores, split over blocks in one wave, FRAG_TAIL-token
    chunks of the full-precision part in blocks of their own where those fit, else in the
    tile blocks; :func:`_frag_plan`), "folded" or "simt"; default from
    :func:`default_algo`.
    """
    return _launch("cuda", queries, k_codes, k_scales, k_biases, n_kq, k_res, n_kres,
                   v_codes, v_scales, v_biases, n_vq, v_res, n_vres, scale=scale,
                   bits=bits, group_size=group_size, algo=algo)


def kivi_decode_attention_metal(queries, k_codes, k_scales, k_biases, n_kq, k_res,
                                n_kres, v_codes, v_scales, v_biases, n_vq, v_res, n_vres,
                                *, scale, bits, group_size):
    """Metal twin of the "simt" CUDA kernel (same contract, inputs and algorithm).

    UNTESTED ON HARDWARE: no Metal hardware was available when this was written, so
    this source has never been compiled or run on a Metal device. It mirrors the simt
    CUDA kernel line for line (simdgroups of 32 for warps, threadgroup memory for
    shared memory); there is no Metal twin of the tensor-core kernels. Check it against
    :func:`kivi_decode_attention_reference` (tests/test_kernel_kivi_decode.py does, on a
    Metal machine) before relying on it.
    """
    return _launch("metal", queries, k_codes, k_scales, k_biases, n_kq, k_res, n_kres,
                   v_codes, v_scales, v_biases, n_vq, v_res, n_vres, scale=scale,
                   bits=bits, group_size=group_size, algo="simt")


def gpu_backend() -> Optional[str]:
    if mx.default_device() != mx.gpu:
        return None
    return _gpu_kind()


@functools.lru_cache(maxsize=None)
def _gpu_kind() -> Optional[str]:
    """The process's GPU back-end (fixed once MLX is loaded; asked at every layer's step)."""
    try:
        if mx.cuda.is_available():
            return "cuda"
    except AttributeError:
        pass
    try:
        if mx.metal.is_available():
            return "metal"
    except AttributeError:
        pass
    return None


def kivi_decode_attention(queries, k_codes, k_scales, k_biases, n_kq, k_res, n_kres,
                          v_codes, v_scales, v_biases, n_vq, v_res, n_vres, *, scale,
                          bits, group_size, use_kernel=True):
    """Decode attention over a KIVI-layout cache; picks the best available path.

    On MLX's CUDA back-end: :func:`kivi_decode_attention_cuda`; on Metal:
    :func:`kivi_decode_attention_metal` (untested on hardware); otherwise, or with
    ``use_kernel=False``, or for a shape the kernels do not handle (GQA ratio above 8,
    head_dim not a multiple of the group or above 256, ...): the pure-mlx path named
    by ``CPU_DEFAULT_PATH``. A GPU launch's plan is kept for the next call with the same
    shapes and counts (:class:`_StepPlan`: the other layers of a decode step).
    """
    args = (queries, k_codes, k_scales, k_biases, n_kq, k_res, n_kres, v_codes, v_scales,
            v_biases, n_vq, v_res, n_vres)
    kw = dict(scale=scale, bits=bits, group_size=group_size)
    if use_kernel:
        backend = gpu_backend()
        if backend is not None:
            plan = _step_plan(backend, args, bits, group_size, scale)
            if plan is not None:
                return plan.launch(args)
    if _pure_path() == "qmm":
        return kivi_decode_attention_qmm(*args, **kw)
    return kivi_decode_attention_reference(*args, **kw)


# ---------------------------------------------------------------------------------
# a packed batch: one launch, counts per sequence
# ---------------------------------------------------------------------------------


def rows_kernel_applies(head_dim: int, bits: int, group_size: int, dtype,
                        gqa: int = _MAX_GQA) -> bool:
    """Whether :func:`kivi_decode_attention_rows` launches a kernel for this shape here (the
    frag kernel's shapes, on CUDA; its self-check is asked at the first launch). ``gqa``
    defaults to the widest a kernel takes: the check then holds for every narrower one."""
    return (gpu_backend() == "cuda" and dtype == mx.float16 and bits in FRAG_DEFAULT_BITS
            and kernel_supports(head_dim, gqa, bits, group_size, dtype, algo="frag"))


def _unrolled_ring(v_res, b, n_vres, ring):
    """Sequence b's value window in token order: ``n_vres`` rows of its ring from ``ring``."""
    if not n_vres:
        return None
    return v_res[b:b + 1][:, :, (ring + mx.arange(n_vres)) % v_res.shape[2]]


def kivi_decode_attention_rows_reference(queries, k_codes, k_scales, k_biases, k_res, v_codes,
                                         v_scales, v_biases, v_res, rows, *, scale, bits,
                                         group_size):
    """The function of record for a packed batch (:func:`kivi_decode_attention_rows`):
    each sequence through :func:`kivi_decode_attention_reference` on its own rows."""
    return mx.concatenate([
        kivi_decode_attention_reference(
            queries[b:b + 1], k_codes[b:b + 1], k_scales[b:b + 1], k_biases[b:b + 1], n_kq,
            k_res[b:b + 1], n_kres, v_codes[b:b + 1], v_scales[b:b + 1], v_biases[b:b + 1],
            n_vq, _unrolled_ring(v_res, b, n_vres, ring), n_vres, scale=scale, bits=bits,
            group_size=group_size)
        for b, (n_kq, n_kres, n_vq, n_vres, ring) in enumerate(rows)])


def _rows_launch(queries, buffers, rows, *, scale, bits, group_size):
    """The frag kernel's launch over a packed batch, then the merge."""
    kc, ks, kb, kr, vc, vs, vb, vr = buffers
    B, Hq, _, D = queries.shape
    H = kc.shape[1]
    key = ("cuda", "frag", frag_launch_bounds(B * H))
    widest = max(kq + kr_ for kq, kr_, _, _, _ in rows)
    ns, params, template = _frag_rows_launch_args(
        queries.dtype, D, Hq // H, bits, group_size, kc.shape[3], rows, H, scale,
        frag_target_blocks(B * H, widest, bits))
    cache = (kc, ks, kb, None, kr, None, vc, vs, vb, None, vr, None)  # counts: in params
    o_part, ml_part = launch_main(_get_kernels(*key)[0], queries, cache, ns, FRAG_NT, params, template)
    return merge_partials("cuda", o_part, ml_part, queries.shape, queries.dtype)


def kivi_decode_attention_rows(queries, k_codes, k_scales, k_biases, k_res, v_codes, v_scales,
                               v_biases, v_res, rows, *, scale, bits, group_size):
    """Decode attention over a packed batch of KIVI layouts in one launch of the frag kernel,
    or None where it does not run here (:func:`rows_kernel_applies`, or its self-check
    failed): the caller then reads the batch its own way.

    The buffers are those of the module docstring with the batch first; sequence b holds
    ``rows[b] = (n_kq, n_kres, n_vq, n_vres, v_ring)``: its first ``n_kq`` keys packed, then
    ``n_kres`` full-precision keys from row 0 of ``k_res[b]``; its first ``n_vq`` values
    packed, then ``n_vres`` full-precision values in a ring, token ``n_vq + i`` at row
    ``(v_ring + i) % v_res.shape[2]`` of ``v_res[b]``. What lies past a sequence's counts is
    never read. Host work: the split plan of the batch's widest sequence and one small int
    array per distinct ``rows`` (kept for the next call: a step's other layers).
    """
    B, Hq, _, D = queries.shape
    H = k_codes.shape[1]
    if len(rows) != B or Hq % H or not rows_kernel_applies(D, bits, group_size, queries.dtype,
                                                              Hq // H):
        return None
    if any(x.dtype != queries.dtype for x in (k_scales, k_biases, k_res, v_scales, v_biases, v_res)):
        return None
    if not rows_self_check(D, Hq // H, bits, group_size, queries.dtype):
        return None
    return _rows_launch(queries, (k_codes, k_scales, k_biases, k_res, v_codes, v_scales,
                                  v_biases, v_res), rows, scale=scale, bits=bits,
                        group_size=group_size)


#: the rows self-check's batch: tiles and tails of different lengths, a sequence with no
#: tile, and rings that wrap
CHECK_ROWS = ((256, 5, 257, 4, 3), (512, 37, 540, 9, 7), (0, 13, 0, 13, 11))


def rows_case(head_dim, gqa, bits, group_size, dtype, rows=CHECK_ROWS, n_kv_heads=2,
              key_room=64, value_room=16, seed=0):
    """A random packed batch for ``rows`` (:func:`kivi_decode_attention_rows`'s layout, each
    buffer with room past its widest sequence, garbage in the room): (queries, the 8
    buffers). The rings are ``value_room`` rows longer than the widest value window."""
    B, H, D = len(rows), n_kv_heads, head_dim
    kq_max, kr_max, vq_max, vr_max = (max(r[i] for r in rows) for i in range(4))
    keys = mx.random.split(mx.random.key(seed), 5)  # own keys: global RNG untouched
    kq_room = -(-(kq_max + key_room) // group_size) * group_size
    t_all = max(max(r[0] + r[1] for r in rows) + key_room, kq_room, vq_max + value_room)
    queries = mx.random.normal((B, H * gqa, 1, D), key=keys[0]).astype(dtype)
    k_all = mx.random.normal((B, H, t_all, D), key=keys[1]).astype(dtype)
    v_all = mx.random.normal((B, H, t_all, D), key=keys[2]).astype(dtype)
    kc, ks, kb = mx.quantize(k_all[:, :, :kq_room].swapaxes(-1, -2), group_size=group_size, bits=bits)
    vc, vs, vb = mx.quantize(v_all[:, :, :vq_max + value_room], group_size=group_size, bits=bits)
    # each sequence's windows: its own tokens after its packed ones (the rest garbage)
    k_res = mx.random.normal((B, H, kr_max + value_room, D), key=keys[3]).astype(dtype)
    cap = vr_max + value_room
    v_res = mx.random.normal((B, H, cap, D), key=keys[4]).astype(dtype) * 3
    k_rows, v_rows = [], []
    for b, (n_kq, n_kres, n_vq, n_vres, ring) in enumerate(rows):
        k_rows.append(mx.concatenate([k_all[b:b + 1, :, n_kq:n_kq + n_kres],
                                      k_res[b:b + 1, :, n_kres:]], axis=2))
        slots = (ring + mx.arange(n_vres)) % cap
        v_rows.append(_put_rows(v_res[b:b + 1], slots, v_all[b:b + 1, :, n_vq:n_vq + n_vres])
                      if n_vres else v_res[b:b + 1])
    return queries, (kc, ks, kb, mx.concatenate(k_rows), vc, vs, vb, mx.concatenate(v_rows))


def _put_rows(buffer, slots, rows):
    """``buffer`` (1, H, cap, D) with ``rows`` (1, H, n, D) written at ``slots`` (n,)."""
    index = mx.broadcast_to(slots[None, None, :, None], rows.shape)
    return mx.put_along_axis(buffer, index, rows, axis=2)


_ROWS_SELF_CHECKS: dict = {}


def rows_self_check(head_dim, gqa, bits, group_size, dtype) -> bool:
    """:func:`kernel_self_check` for the rows launch: once per process and shape class,
    against :func:`kivi_decode_attention_rows_reference` on :data:`CHECK_ROWS`; on a
    mismatch this warns once and the rows launch answers None from then on."""

    def problem():
        queries, buffers = rows_case(head_dim, gqa, bits, group_size, dtype)
        kw = dict(scale=head_dim ** -0.5, bits=bits, group_size=group_size)
        return _mismatch(lambda: _rows_launch(queries, buffers, CHECK_ROWS, **kw),
                         lambda: kivi_decode_attention_rows_reference(queries, *buffers, CHECK_ROWS, **kw),
                         dtype)

    return _checked_once(
        _ROWS_SELF_CHECKS, (head_dim, gqa, bits, group_size, dtype), problem,
        f"the fused CUDA decode kernel 'frag' over a packed batch (head_dim={head_dim}, gqa={gqa}, "
        f"bits={bits}, group_size={group_size}, dtype={dtype})",
        "packed batches of this shape attend through the pure-MLX path")


class _StepPlan:
    """The dispatcher's two launches for one layout, everything but the buffers worked out:
    what :func:`_launch` computes per call (checks, kernel choice, split plan, params,
    templates, stand-ins for absent buffers), kept for the next call with the same shapes
    and counts (the other layers of a decode step: their counts are equal)."""

    __slots__ = ("main", "comb", "kernel_keys", "standins", "params", "main_kw", "comb_kw")

    def __init__(self, backend, algo, queries, cache, scale, bits, group_size):
        self.main, ns, threads, self.params, template, full, main_key = _main_plan(
            backend, queries, cache, scale, bits, group_size, algo)
        B, Hq, _, D = queries.shape
        # the stand-ins _kernel_inputs made for absent or empty buffers (position -> array)
        self.standins = {i: full[i] for i in (0, 1, 2, 4, 6, 7, 8, 10) if full[i] is not cache[i]}
        self.main_kw = dict(template=template, grid=(ns * threads, B * full[0].shape[1], 1),
                            threadgroup=(threads, 1, 1),
                            output_shapes=[(B * Hq, ns, D), (B * Hq, ns, 2)],
                            output_dtypes=[mx.float32, mx.float32], init_value=None)
        self.comb = _get_kernels(backend)[1]
        self.kernel_keys = main_key, (backend, "simt", 0)
        self.comb_kw = _merge_launch(backend, queries.shape, queries.dtype)

    def current(self) -> bool:
        """Whether its kernels are still those ``_get_kernels`` gives (not replaced)."""
        main, comb = (_KERNELS.get(k, (None, None)) for k in self.kernel_keys)
        return main[0] is self.main and comb[1] is self.comb

    def partials(self, args):
        """The main kernel's launch of :func:`_partials`: (o_part, ml_part)."""
        q, kc, ks, kb, _, kr, _, vc, vs, vb, _, vr, _ = args
        bufs = [kc, ks, kb, None, kr, None, vc, vs, vb, None, vr]
        for i, x in self.standins.items():
            bufs[i] = x
        o_part, ml_part = self.main(
            inputs=[q, bufs[0], bufs[1], bufs[2], bufs[4], bufs[6], bufs[7], bufs[8], bufs[10],
                    self.params], **self.main_kw)
        return o_part, ml_part

    def launch(self, args):
        """The same two launches as :func:`_launch` (main kernel, then the merge)."""
        (out,) = self.comb(inputs=list(self.partials(args)), **self.comb_kw)
        return out


_STEP_PLANS: "OrderedDict[tuple, Optional[_StepPlan]]" = OrderedDict()


def _step_plan(backend, args, bits, group_size, scale) -> Optional[_StepPlan]:
    """The cached :class:`_StepPlan` of a dispatched launch, None where no kernel applies
    (the dispatcher then falls back). Keyed by everything the plan reads: backend, shapes
    and dtypes of the buffers, counts, bits, group and scale; rebuilt where ``_KERNELS``
    no longer holds its kernels; not keyed by the module's tuning constants (whoever
    changes those clears ``_STEP_PLANS``)."""
    q, kc, ks, kb, n_kq, kr, n_kres, vc, vs, vb, n_vq, vr, n_vres = args
    # scales and biases take their codes' shape bar the last axis, and the query's dtype
    # (checked when a plan is made): codes, windows and the scales' dtype decide the rest
    # spelled out, not a call a buffer: built for every layer at every decode step
    key = (backend, q.shape, q.dtype,
           None if kc is None else kc.shape, None if kc is None else kc.dtype,
           None if ks is None else ks.shape, None if ks is None else ks.dtype,
           None if kr is None else kr.shape, None if kr is None else kr.dtype,
           None if vc is None else vc.shape, None if vc is None else vc.dtype,
           None if vs is None else vs.shape, None if vs is None else vs.dtype,
           None if vr is None else vr.shape, None if vr is None else vr.dtype,
           n_kq, n_kres, n_vq, n_vres, bits, group_size, float(scale))
    plan = _STEP_PLANS.get(key, False)
    if plan is None or (plan and plan.current()):
        return plan
    H = next(a.shape[1] for a in (kc, vc, kr, vr) if a is not None and a.size)
    algo = kernel_algo(backend, q, H, bits, group_size)
    plan = None if algo is None else _StepPlan(backend, algo, q, args[1:], scale, bits, group_size)
    _STEP_PLANS[key] = plan
    if len(_STEP_PLANS) > 64:
        _STEP_PLANS.popitem(last=False)
    return plan


def _pure_path() -> str:
    """CPU_DEFAULT_PATH on the CPU; the reference on a GPU, where MLX's CUDA back-end has
    no ``quantized_matmul`` for these shapes (measured on MLX 0.32.4)."""
    return CPU_DEFAULT_PATH if mx.default_device() == mx.cpu else "reference"


def kernel_algo(backend: str, queries, n_kv_heads: int, bits: int, group_size: int):
    """The kernel the dispatcher runs for this shape on ``backend``, or None (no kernel
    takes the shape, or the kernel failed its self-check: :func:`kernel_self_check`)."""
    if queries.shape[1] % n_kv_heads:
        return None
    gqa, head_dim = queries.shape[1] // n_kv_heads, queries.shape[3]
    if backend == "cuda":
        algo = default_algo(head_dim, gqa, bits, group_size, queries.dtype)
    else:
        algo = "simt" if kernel_supports(head_dim, gqa, bits, group_size, queries.dtype) \
            else None
    if algo is None or not kernel_self_check(backend, algo, head_dim, gqa, bits, group_size,
                                             queries.dtype):
        return None
    return algo


#: (backend, algo, head_dim, gqa, bits, group_size, dtype) -> None where the kernel matched
#: its reference, else what went wrong; filled once per process by kernel_self_check
_SELF_CHECKS: dict = {}
#: counts of the self-check's cache: a quantized part of several frag tiles at every width
#: plus a residual window each, keys and values split at different tokens
_CHECK_COUNTS = (256, 5, 257, 4)


def kernel_self_check(backend, algo, head_dim, gqa, bits, group_size, dtype) -> bool:
    """Whether the fused kernel ``algo`` agrees with :func:`kivi_decode_attention_reference`
    on a small random cache of this shape class; checked once per process and shape class,
    at its first use. Neither the Metal twin nor every CUDA build has been run on every
    device, and a wrong kernel would give wrong text silently: on a mismatch (or an error
    compiling or running it) this warns once, naming the kernel and the error, and the
    dispatcher then takes the pure-MLX path for that shape class."""
    key = (backend, algo, head_dim, gqa, bits, group_size, dtype)
    return _checked_once(
        _SELF_CHECKS, key, lambda: _self_check_problem(*key),
        f"the fused {backend} decode kernel '{algo}' (head_dim={head_dim}, gqa={gqa}, bits={bits}, "
        f"group_size={group_size}, dtype={dtype})", "attention for this shape uses the reference path instead")


def _checked_once(table: dict, key, problem, kernel: str, instead: str) -> bool:
    """Whether ``problem()`` found nothing wrong, asked once per ``key`` (kept in ``table``);
    a problem warns once, naming the ``kernel`` and what runs ``instead``."""
    if key not in table:
        table[key] = found = problem()
        if found is not None:
            warnings.warn(f"veloxquant: {kernel} failed its self-check against the pure-MLX reference: "
                          f"{found}; {instead}", RuntimeWarning, stacklevel=3)
    return table[key] is None


def _mismatch(launch, reference, dtype) -> Optional[str]:
    """What is wrong with ``launch()`` against ``reference()``: an error compiling or running
    it, or a largest relative error past :func:`self_check_tolerance` (NaN included); None
    where they agree. Its one host sync runs once per process and shape class."""
    try:
        out, ref = launch().astype(mx.float32), reference().astype(mx.float32)
        error = (mx.abs(out - ref).max() / mx.abs(ref).max()).item()
    except Exception as exc:  # a kernel that does not compile or launch fails its check
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    tolerance = self_check_tolerance(dtype)
    if not error <= tolerance:  # NaN fails too
        return f"max relative error {error:.3g} (allowed {tolerance:.3g})"
    return None


def self_check_tolerance(dtype) -> float:
    """Relative error allowed: the output's rounding plus the kernels' own (tensor-core
    float16 operands, TF32, a different summation order), with a margin of 4; a wrong
    kernel is off by order 1 or not finite."""
    unit_roundoff = {mx.float16: 2.0 ** -11, mx.bfloat16: 2.0 ** -8}.get(dtype, 2.0 ** -24)
    return 4 * (unit_roundoff + 1e-3)


def _self_check_problem(backend, algo, head_dim, gqa, bits, group_size, dtype):
    n_kq, n_kres, n_vq, n_vres = _CHECK_COUNTS
    n_kv_heads, tokens = 2, n_kq + n_kres
    kq, kk, kv = mx.random.split(mx.random.key(0), 3)  # own keys: global RNG untouched
    queries = mx.random.normal((1, n_kv_heads * gqa, 1, head_dim), key=kq).astype(dtype)
    keys = mx.random.normal((1, n_kv_heads, tokens, head_dim), key=kk).astype(dtype)
    values = mx.random.normal((1, n_kv_heads, tokens, head_dim), key=kv).astype(dtype)
    k_codes, k_scales, k_biases = mx.quantize(
        keys[:, :, :n_kq].swapaxes(-1, -2), group_size=group_size, bits=bits)
    v_codes, v_scales, v_biases = mx.quantize(values[:, :, :n_vq], group_size=group_size,
                                              bits=bits)
    args = (queries, k_codes, k_scales, k_biases, n_kq, keys[:, :, n_kq:], n_kres, v_codes,
            v_scales, v_biases, n_vq, values[:, :, n_vq:], n_vres)
    kw = dict(scale=head_dim ** -0.5, bits=bits, group_size=group_size)
    return _mismatch(lambda: _launch(backend, *args, **kw, algo=algo),
                     lambda: kivi_decode_attention_reference(*args, **kw), dtype)


def affine_key_scores(q, codes, scales, biases, count, bits, group_size):
    """Pure-MLX ``q Kᵀ`` (B, H, R, count), float32, over per-channel packed keys; ``q``
    (B, H, R, D) float32, already scaled. ``quantized_matmul`` on the CPU, a float32
    dequantization where it has no kernel (a GPU). Any width mx.quantize packs."""
    words, groups = count * bits // 32, count // group_size
    codes, scales, biases = codes[..., :words], scales[..., :groups], biases[..., :groups]
    if _pure_path() == "qmm":
        return mx.quantized_matmul(q, codes, scales, biases, transpose=False,
                                   group_size=group_size, bits=bits)
    # float32 scales: the dequantization writes float32 rows, no second pass to cast them
    keys_t = dequantize(codes, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits)
    return q @ keys_t


#: tokens per batch entry of a product over the token axis on CUDA (``token_mix``)
SPLIT_TOKENS = 512


def _splits_tokens() -> bool:
    """Whether ``token_mix`` cuts the token axis here (CUDA only: measured there)."""
    return gpu_backend() == "cuda"


def token_mix(w: mx.array, v: mx.array) -> mx.array:
    """``w @ v`` for weights (..., R, T) over rows (..., T, D): a decode step's ``p V``. On
    CUDA, from 2 * SPLIT_TOKENS tokens, the token axis is cut into SPLIT_TOKENS-token batch
    entries whose products are summed: cuBLAS tiles the small (R, D) output into a few
    blocks that each walk every token, which leaves the GPU idle while a layer's attention
    waits on it (benchmarks/notes/decode_kernels.md). Elsewhere the one product."""
    t = w.shape[-1]
    if t < 2 * SPLIT_TOKENS or not _splits_tokens():
        return w @ v
    whole = t - t % SPLIT_TOKENS
    *lead, r, _ = w.shape
    ws = w[..., :whole].reshape(*lead, r, whole // SPLIT_TOKENS, SPLIT_TOKENS).swapaxes(-3, -2)
    vs = v[..., :whole, :].reshape(*v.shape[:-2], whole // SPLIT_TOKENS, SPLIT_TOKENS, v.shape[-1])
    out = (ws @ vs).sum(axis=-3)
    return out if whole == t else out + w[..., whole:] @ v[..., whole:, :]


def affine_value_mix(p, codes, scales, biases, count, bits, group_size):
    """Pure-MLX ``p V`` (B, H, R, D), float32, over per-token packed values; ``p``
    (B, H, R, count) float32. Any width mx.quantize packs."""
    codes, scales, biases = codes[:, :, :count], scales[:, :, :count], biases[:, :, :count]
    if _pure_path() == "qmm":
        return mx.quantized_matmul(p, codes, scales, biases, transpose=False,
                                   group_size=group_size, bits=bits)
    values = dequantize(codes, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits)
    return token_mix(p, values)
