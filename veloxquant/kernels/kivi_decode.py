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
    a flash-decoding kernel through ``mx.fast.cuda_kernel`` (MLX's CUDA back-end), in
    two versions: ``algo="simt"`` (CUDA cores, float32 throughout) and ``algo="mma"``
    (tensor cores, float16 operands, float32 accumulation). Both were checked on an
    H200 against the float32 reference; timings in benchmarks/results/fused_attention.md.
``kivi_decode_attention_metal``
    the twin of the simt kernel through ``mx.fast.metal_kernel``. No Metal hardware was
    available: it is untested on hardware.
``kivi_decode_attention``
    the dispatcher: a CUDA kernel on the CUDA back-end (:func:`default_algo`), the Metal
    one on Metal, otherwise the faster pure-mlx path on the CPU (``CPU_DEFAULT_PATH``).

Measured (H200, MLX 0.32.4, fp16, 32 q / 8 kv heads, d 128, dispatcher defaults): the
fused kernels read the packed cache at 0.13-1.5 TB/s and run at 0.76x-1.9x the speed of
fp16 ``mx.fast.scaled_dot_product_attention`` on the same shape (faster only at 4k
context): so far they save memory, not time. See benchmarks/notes/fused_attention.md.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from typing import Optional

import mlx.core as mx

__all__ = [
    "SUPPORTED_BITS",
    "SUPPORTED_GROUP_SIZES",
    "CPU_DEFAULT_PATH",
    "kivi_decode_attention",
    "kivi_decode_attention_reference",
    "kivi_decode_attention_qmm",
    "kivi_decode_attention_cuda",
    "kivi_decode_attention_metal",
    "kernel_supports",
    "default_algo",
    "packed_bytes_read",
]

SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)

#: Pure-mlx path used when no GPU kernel applies: "qmm" or "reference". Measured on the
#: 2-core CPU of the development machines, "qmm" (float32 compute) is 7-20x faster
#: (benchmarks/notes/fused_attention.md).
CPU_DEFAULT_PATH = "qmm"

_LOG2E = 1.4426950408889634

# Kernel launch shape. Each block holds 128 threads, walks one or more chunks of
# ``CHUNK`` tokens of one (batch, kv head) with an online softmax, and writes one
# partial (m, l, o) per query head; a second tiny kernel merges the partials.
_NT = 128
#: CUDA kernel of the dispatcher: "simt" (CUDA cores, float32 throughout), except for the
#: bit widths listed in MMA_DEFAULT_BITS with float16 inputs, which use "mma" (tensor
#: cores, float16 operands, float32 accumulation). Chosen from the H200 table in
#: benchmarks/results/fused_attention.md: mma was faster at 2 bits in all six shapes,
#: slower at 4 and 8 bits.
DEFAULT_CUDA_ALGO = "simt"
MMA_DEFAULT_BITS = (2,)
DEFAULT_CHUNK = 256
DEFAULT_TARGET_BLOCKS = 1024
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
    shifts = mx.arange(pack, dtype=mx.uint32) * bits
    codes = (words[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*words.shape[:-1], words.shape[-1] * pack).astype(mx.float32)


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


# ---------------------------------------------------------------------------------
# CUDA kernel (mx.fast.cuda_kernel)
# ---------------------------------------------------------------------------------

CUDA_HEADER = r"""
__device__ __forceinline__ float vqk_inf() { return __uint_as_float(0x7f800000u); }
__device__ __forceinline__ float vqk_to_f(float x) { return x; }
__device__ __forceinline__ float vqk_to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float vqk_to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename U> __device__ __forceinline__ U vqk_from_f(float x);
template <> __device__ __forceinline__ float vqk_from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half vqk_from_f<__half>(float x) {
  return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 vqk_from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
// Code J of a packed word (bits [J*BITS, (J+1)*BITS)) as the float 1 + code / 2^BITS:
// shift the code to the top of the mantissa and OR in the exponent of 1.0 (a shift and
// a logic op instead of a quarter-rate int-to-float conversion). Dequantize with
// fma(scale * 2^BITS, f, bias - scale * 2^BITS) == scale * code + bias.
template <int BITS, int J>
__device__ __forceinline__ float vqk_code1(uint32_t w) {
  constexpr int SH = 23 - BITS - J * BITS;
  constexpr uint32_t M = ((1u << BITS) - 1u) << (23 - BITS);
  const uint32_t x = SH >= 0 ? (w << (SH >= 0 ? SH : 0)) : (w >> (SH < 0 ? -SH : 0));
  return __uint_as_float((x & M) | 0x3F800000u);
}
#ifndef VQK_EMULATION  // (the CPU emulation in the tests supplies its own)
// ---- tensor-core helpers (sm_80+): one m16n8k16 f16 x f16 -> f32 product per call
__device__ __forceinline__ uint32_t vqk_h2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ void vqk_mma(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif
// the float16 rounding residual of (lo, hi): q = hi-part + lo-part to ~2^-22
__device__ __forceinline__ uint32_t vqk_h2_lo(float lo, float hi) {
  return vqk_h2(lo - __half2float(__float2half_rn(lo)), hi - __half2float(__float2half_rn(hi)));
}
template <int BITS, int J>
__device__ __forceinline__ float vqk_deq(uint32_t w, float s2, float b2) {
  return fmaf(s2, vqk_code1<BITS, J>(w), b2);
}
template <int BITS, int N>
__device__ __forceinline__ void vqk_dequant(uint32_t w, float s2, float b2, float* out) {
  // out[j] = scale * code_j + bias for j < N, with s2 = scale * 2^BITS, b2 = bias - s2
  if constexpr (N > 0) out[0] = fmaf(s2, vqk_code1<BITS, 0>(w), b2);
  if constexpr (N > 1) out[1] = fmaf(s2, vqk_code1<BITS, 1>(w), b2);
  if constexpr (N > 2) out[2] = fmaf(s2, vqk_code1<BITS, 2>(w), b2);
  if constexpr (N > 3) out[3] = fmaf(s2, vqk_code1<BITS, 3>(w), b2);
  if constexpr (N > 4) out[4] = fmaf(s2, vqk_code1<BITS, 4>(w), b2);
  if constexpr (N > 5) out[5] = fmaf(s2, vqk_code1<BITS, 5>(w), b2);
  if constexpr (N > 6) out[6] = fmaf(s2, vqk_code1<BITS, 6>(w), b2);
  if constexpr (N > 7) out[7] = fmaf(s2, vqk_code1<BITS, 7>(w), b2);
}
"""

# Template constants: T (cache/query dtype), BITS, GROUP, HEAD_DIM, GQA (query heads per
# kv head, <= 8), CHUNK (tokens per inner step), NT (threads per block, 128), TW (codes
# per thread and step: 4 or 8), KUNROLL / VUNROLL (unroll of the key channel loop and
# of the value token loop: loads in flight per thread), MODE (0; 1 and 2 skip the
# packed values / keys, for timing the stages only).
# Grid: x = split index (gridDim.x splits), y = b * H + h. Runtime counts come from
# `params` (int32): n_kq, n_kres, n_vq, n_vres, bits of scale*log2(e), chunks per split;
# buffer capacities come from the shapes, so neither changes the compiled source.
CUDA_SOURCE = r"""
  constexpr int PACK = 32 / BITS;                 // codes per uint32 word
  constexpr int TPW = PACK < TW ? PACK : TW;      // key tokens per thread column
  constexpr int COLK = CHUNK / TPW;               // key thread columns per chunk
  constexpr int NCS = NT / COLK;                  // key channel slices
  constexpr int CPS = HEAD_DIM / NCS;             // channels per key slice
  constexpr int CPT = PACK < TW ? PACK : TW;      // value channels per thread
  constexpr int COLV = HEAD_DIM / CPT;            // value thread columns
  constexpr int NSV = NT / COLV;                  // value token slices
  constexpr int DW = HEAD_DIM / PACK;             // value words per row
  constexpr int DG = HEAD_DIM / GROUP;            // value groups per row
  constexpr int NWARP = NT / 32;
  constexpr int KSTRIDE = GQA * CHUNK + (COLK < 32 ? COLK : 0);
  constexpr int VSTRIDE = GQA * HEAD_DIM + (COLV < 32 ? COLV : 0);
  constexpr int RED = (NCS * KSTRIDE > NSV * VSTRIDE) ? NCS * KSTRIDE : NSV * VSTRIDE;
  static_assert(NT % 32 == 0 && NT % COLK == 0 && HEAD_DIM % NCS == 0, "key tiling");
  static_assert(NT % COLV == 0 && HEAD_DIM % CPT == 0, "value tiling");
  static_assert(GROUP % PACK == 0 && HEAD_DIM % GROUP == 0, "grouping");

  __shared__ __align__(16) float red[RED];
  __shared__ __align__(16) float qsm[HEAD_DIM * GQA];
  __shared__ float sm_m[GQA];
  __shared__ float sm_l[GQA];
  __shared__ float sm_a[GQA];

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int split = blockIdx.x;
  const int NS = gridDim.x;
  const int bh = blockIdx.y;
  const int H = k_codes_shape[1];
  const int Hq = queries_shape[1];
  const int b = bh / H;
  const int h = bh - b * H;
  const int CKW = k_codes_shape[3];
  const int CKG = k_scales_shape[3];
  const int CKR = k_res_shape[2];
  const int CV = v_codes_shape[2];
  const int CVR = v_res_shape[2];
  const int n_kq = params[0];
  const int n_kres = params[1];
  const int n_vq = params[2];
  const float qscale = __int_as_float(params[4]);
  const int cpb = params[5];
  const int Tn = n_kq + n_kres;
  const size_t qrow = (size_t)b * Hq + (size_t)h * GQA;

  // queries, pre-scaled by scale * log2(e), layout [channel][head]
  for (int i = tid; i < GQA * HEAD_DIM; i += NT) {
    const int r = i / HEAD_DIM;
    const int c = i - r * HEAD_DIM;
    qsm[c * GQA + r] = vqk_to_f(queries[(qrow + r) * HEAD_DIM + c]) * qscale;
  }
  if (tid < GQA) {
    sm_m[tid] = -vqk_inf();
    sm_l[tid] = 0.f;
  }

  // key-phase thread role: TPW consecutive tokens x CPS channels
  const int col = tid % COLK;
  const int slice = tid / COLK;
  // value-phase thread role: CPT consecutive channels x every NSV-th token
  const int colv = tid % COLV;
  const int sv = tid / COLV;
  const int c0 = colv * CPT;
  const uint32_t* vcp = v_codes + (c0 / PACK);
  const int vsh = (c0 % PACK) * BITS;
  const int vg = c0 / GROUP;

  float o[GQA][CPT];
#pragma unroll
  for (int r = 0; r < GQA; ++r)
#pragma unroll
    for (int j = 0; j < CPT; ++j) o[r][j] = 0.f;

  __syncthreads();

  const int n_chunks = (Tn + CHUNK - 1) / CHUNK;
  const int ch_begin = split * cpb;
  const int ch_end = min(ch_begin + cpb, n_chunks);
  for (int chunk = ch_begin; chunk < ch_end; ++chunk) {
    const int t0 = chunk * CHUNK;

    // ---- 1. partial scores of this thread's tokens over its channel slice
    {
      const int tg = t0 + col * TPW;
      float acc[GQA][TPW];
#pragma unroll
      for (int r = 0; r < GQA; ++r)
#pragma unroll
        for (int j = 0; j < TPW; ++j) acc[r][j] = 0.f;
      if (MODE != 2 && tg < n_kq) {
        const int sh = (tg % PACK) * BITS;
        const size_t krow = (size_t)bh * HEAD_DIM + (size_t)slice * CPS;
        const uint32_t* kc = k_codes + krow * CKW + tg / PACK;
        const T* ks = k_scales + krow * CKG + tg / GROUP;
        const T* kb = k_biases + krow * CKG + tg / GROUP;
        const float* qp = qsm + slice * CPS * GQA;
#pragma unroll KUNROLL
        for (int k = 0; k < CPS; ++k) {
          const uint32_t wd = kc[(size_t)k * CKW] >> sh;
          const float s2 = vqk_to_f(ks[(size_t)k * CKG]) * (float)(1 << BITS);
          const float b2 = vqk_to_f(kb[(size_t)k * CKG]) - s2;
          float kd[TPW];
          vqk_dequant<BITS, TPW>(wd, s2, b2, kd);
#pragma unroll
          for (int r = 0; r < GQA; ++r) {
            const float a = qp[k * GQA + r];
#pragma unroll
            for (int j = 0; j < TPW; ++j) acc[r][j] = fmaf(a, kd[j], acc[r][j]);
          }
        }
      }
      // layout per slice: [head][j][col] (token = col * TPW + j): conflict-free stores
      float* rp = red + slice * KSTRIDE;
#pragma unroll
      for (int r = 0; r < GQA; ++r)
#pragma unroll
        for (int j = 0; j < TPW; ++j) rp[(r * TPW + j) * COLK + col] = acc[r][j];
    }
    __syncthreads();

    // ---- 2. sum the slices into slice 0, mask tokens past the end
    for (int i = tid; i < GQA * CHUNK; i += NT) {
      float v = red[i];
#pragma unroll
      for (int s2 = 1; s2 < NCS; ++s2) v += red[s2 * KSTRIDE + i];
      const int loc = i % CHUNK;
      const int j = loc / COLK;
      const int cc = loc - j * COLK;
      if (t0 + cc * TPW + j >= Tn) v = -vqk_inf();
      red[i] = v;
    }
    // residual keys of this chunk (full precision): one warp per token, lanes over
    // channels; overwrites the (zero) partial sums of those tokens
    const int kr_begin = max(t0, n_kq);
    const int kr_end = min(t0 + CHUNK, Tn);
    if (kr_begin < kr_end) {  // block-uniform condition
      __syncthreads();
      for (int t = kr_begin + warp; t < kr_end; t += NWARP) {
        const T* kr = k_res + ((size_t)bh * CKR + (size_t)(t - n_kq)) * HEAD_DIM;
        float part[GQA];
#pragma unroll
        for (int r = 0; r < GQA; ++r) part[r] = 0.f;
        for (int c = lane; c < HEAD_DIM; c += 32) {
          const float kv = vqk_to_f(kr[c]);
#pragma unroll
          for (int r = 0; r < GQA; ++r) part[r] = fmaf(qsm[c * GQA + r], kv, part[r]);
        }
#pragma unroll
        for (int r = 0; r < GQA; ++r) {
          float v = part[r];
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
          part[r] = v;
        }
        if (lane == 0) {
          const int tl = t - t0;
          const int pi = (tl % TPW) * COLK + tl / TPW;
#pragma unroll
          for (int r = 0; r < GQA; ++r) red[r * CHUNK + pi] = part[r];
        }
      }
    }
    __syncthreads();

    // ---- 3. online softmax (base 2), one warp per query head
    for (int r = warp; r < GQA; r += NWARP) {
      float m = -vqk_inf();
      for (int i = lane; i < CHUNK; i += 32) m = fmaxf(m, red[r * CHUNK + i]);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
      const float m_old = sm_m[r];
      const float m_new = fmaxf(m_old, m);  // finite: every chunk has a valid token
      float l = 0.f;
      for (int i = lane; i < CHUNK; i += 32) {
        const float e = exp2f(red[r * CHUNK + i] - m_new);
        red[r * CHUNK + i] = e;
        l += e;
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
      if (lane == 0) {
        const float a = exp2f(m_old - m_new);
        sm_a[r] = a;
        sm_l[r] = sm_l[r] * a + l;
        sm_m[r] = m_new;
      }
    }
    __syncthreads();

    // ---- 4. values: rescale the running output, accumulate this chunk
    {
#pragma unroll
      for (int r = 0; r < GQA; ++r) {
        const float a = sm_a[r];
#pragma unroll
        for (int j = 0; j < CPT; ++j) o[r][j] *= a;
      }
      const int tend = min(CHUNK, Tn - t0);
      const int qend = min(tend, n_vq - t0);
      int t = sv;
      if (MODE == 1)  // timing only: skip the packed values
        while (t < qend) t += NSV;
#pragma unroll VUNROLL
      for (; t < qend; t += NSV) {
        const size_t row = (size_t)bh * CV + (size_t)(t0 + t);
        const uint32_t wd = vcp[row * DW] >> vsh;
        const float s2 = vqk_to_f(v_scales[row * DG + vg]) * (float)(1 << BITS);
        const float b2 = vqk_to_f(v_biases[row * DG + vg]) - s2;
        const int pi = (t % TPW) * COLK + t / TPW;
        float vd[CPT];
        vqk_dequant<BITS, CPT>(wd, s2, b2, vd);
#pragma unroll
        for (int r = 0; r < GQA; ++r) {
          const float p = red[r * CHUNK + pi];
#pragma unroll
          for (int j = 0; j < CPT; ++j) o[r][j] = fmaf(p, vd[j], o[r][j]);
        }
      }
      for (; t < tend; t += NSV) {
        const T* vr = v_res + ((size_t)bh * CVR + (size_t)(t0 + t - n_vq)) * HEAD_DIM + c0;
        const int pi = (t % TPW) * COLK + t / TPW;
        float vv[CPT];
#pragma unroll
        for (int j = 0; j < CPT; ++j) vv[j] = vqk_to_f(vr[j]);
#pragma unroll
        for (int r = 0; r < GQA; ++r) {
          const float p = red[r * CHUNK + pi];
#pragma unroll
          for (int j = 0; j < CPT; ++j) o[r][j] = fmaf(p, vv[j], o[r][j]);
        }
      }
    }
    __syncthreads();
  }

  // ---- 5. sum the token slices, write this split's partial (m, l, o)
#pragma unroll
  for (int r = 0; r < GQA; ++r)
#pragma unroll
    for (int j = 0; j < CPT; ++j) red[sv * VSTRIDE + (r * CPT + j) * COLV + colv] = o[r][j];
  __syncthreads();
  for (int i = tid; i < GQA * HEAD_DIM; i += NT) {
    const int r = i / HEAD_DIM;
    const int c = i - r * HEAD_DIM;
    const int j = c % CPT;
    const int cv = c / CPT;
    float v = 0.f;
#pragma unroll
    for (int s2 = 0; s2 < NSV; ++s2) v += red[s2 * VSTRIDE + (r * CPT + j) * COLV + cv];
    o_part[((qrow + r) * NS + split) * HEAD_DIM + c] = v;
  }
  if (tid < GQA) {
    ml_part[((qrow + tid) * NS + split) * 2 + 0] = sm_m[tid];
    ml_part[((qrow + tid) * NS + split) * 2 + 1] = sm_l[tid];
  }
"""

# Tensor-core variant (sm_80+). Same inputs, outputs, grid and partials as CUDA_SOURCE.
# Keys: scores^T (tokens x heads) = deq(K) (tokens x channels) . q^T (channels x heads) with
# mma.m16n8k16; values: o^T (channels x heads) = deq(V)^T (channels x tokens) . p^T. The
# fragment rows are permuted so that each lane dequantizes whole packed words: in a key
# "super-tile" of 8 * PACK tokens, m-tile i row g is token PACK*g + 2i and row g+8 is
# PACK*g + 2i + 1 (lane group g owns word g of each channel row); values use the same
# permutation on channels. Dequantization in float32 (fma(scale*2^b, 1+code/2^b, ...)),
# then rounded to float16 operands (q as a float16 pair, value + residual); products and
# sums in float32. Template constants
# as CUDA_SOURCE (TW, KUNROLL, VUNROLL unused).
CUDA_MMA_SOURCE = r"""
  constexpr int PACK = 32 / BITS;
  constexpr int NWARP = NT / 32;
  constexpr int ST = 8 * PACK;            // key super-tile: 8 words per channel row
  constexpr int NST = CHUNK / ST;
  constexpr int MT = PACK / 2;            // m-tiles per super-tile / per value channel block
  constexpr int KS = HEAD_DIM / 16;       // key k-steps (16 channels)
  constexpr int CB = 8 * PACK;            // value channel block (8 words per token row)
  constexpr int NCB = HEAD_DIM / CB;
  constexpr int VM = NCB * MT;            // value m-tiles (16 channels each)
  constexpr int VK = CHUNK / 16;          // value k-steps (16 tokens) per chunk
  constexpr int DW = HEAD_DIM / PACK;
  constexpr int DG = HEAD_DIM / GROUP;
  constexpr float SC2 = (float)(1 << BITS);
  static_assert(CHUNK % ST == 0 && HEAD_DIM % CB == 0 && GQA <= 8 && NT % 32 == 0, "tiling");
  static_assert(GROUP % PACK == 0 && HEAD_DIM % GROUP == 0, "grouping");

  __shared__ __align__(16) float sc[GQA * CHUNK];
  __shared__ __align__(16) float qsm[HEAD_DIM * GQA];
  __shared__ __align__(16) float ored[NWARP * GQA * HEAD_DIM];
  __shared__ uint4 qfr[KS * 32];
  __shared__ float sm_m[GQA];
  __shared__ float sm_l[GQA];
  __shared__ float sm_a[GQA];

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int q4 = lane & 3;
  const int split = blockIdx.x;
  const int NS = gridDim.x;
  const int bh = blockIdx.y;
  const int H = k_codes_shape[1];
  const int Hq = queries_shape[1];
  const int b = bh / H;
  const int h = bh - b * H;
  const int CKW = k_codes_shape[3];
  const int CKG = k_scales_shape[3];
  const int CKR = k_res_shape[2];
  const int CV = v_codes_shape[2];
  const int CVR = v_res_shape[2];
  const int n_kq = params[0];
  const int n_kres = params[1];
  const int n_vq = params[2];
  const float qscale = __int_as_float(params[4]);
  const int cpb = params[5];
  const int Tn = n_kq + n_kres;
  const size_t qrow = (size_t)b * Hq + (size_t)h * GQA;

  for (int i = tid; i < GQA * HEAD_DIM; i += NT) {
    const int r = i / HEAD_DIM;
    const int c = i - r * HEAD_DIM;
    qsm[c * GQA + r] = vqk_to_f(queries[(qrow + r) * HEAD_DIM + c]) * qscale;
  }
  if (tid < GQA) {
    sm_m[tid] = -vqk_inf();
    sm_l[tid] = 0.f;
  }
  __syncthreads();

  // q^T as B fragments (k = channel, n = head g), constant for the block, kept in shared
  // memory per lane: {hi, hi, lo, lo}. q is split into a float16 value and its float16
  // residual (two products): a single rounded q would shift every score of a head the
  // same way (the largest error term otherwise).
  if (warp == 0) {
    for (int s = 0; s < KS; ++s) {
      const int c = 16 * s + 2 * q4;
      const bool hv = g < GQA;
      const float x0 = hv ? qsm[c * GQA + g] : 0.f;
      const float x1 = hv ? qsm[(c + 1) * GQA + g] : 0.f;
      const float x8 = hv ? qsm[(c + 8) * GQA + g] : 0.f;
      const float x9 = hv ? qsm[(c + 9) * GQA + g] : 0.f;
      qfr[s * 32 + lane] = make_uint4(vqk_h2(x0, x1), vqk_h2(x8, x9), vqk_h2_lo(x0, x1),
                                      vqk_h2_lo(x8, x9));
    }
  }
  __syncthreads();

  float oacc[VM][4];
#pragma unroll
  for (int m = 0; m < VM; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) oacc[m][e] = 0.f;

  const int n_chunks = (Tn + CHUNK - 1) / CHUNK;
  const int ch_begin = split * cpb;
  const int ch_end = min(ch_begin + cpb, n_chunks);
  for (int chunk = ch_begin; chunk < ch_end; ++chunk) {
    const int t0 = chunk * CHUNK;

    // ---- 1. quantized keys: one warp per super-tile, all channels
    if (MODE != 2) {
      for (int st = warp; st < NST; st += NWARP) {
        const int tb = t0 + st * ST;
        if (tb >= n_kq) break;  // warp-uniform
        const int tw = tb + PACK * g;      // first token of this lane's word
        const bool quant = tw < n_kq;      // n_kq is a multiple of PACK
        const int wi = tw / PACK;
        const int gi = tw / GROUP;
        float acc[MT][4];
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
#pragma unroll 2
        for (int s = 0; s < KS; ++s) {
          const uint4 qv = qfr[s * 32 + lane];
          const uint32_t qh[2] = {qv.x, qv.y};
          const uint32_t qlo[2] = {qv.z, qv.w};
          uint32_t w[4];
          float s2[4], b2[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const size_t row = (size_t)bh * HEAD_DIM + 16 * s + 2 * q4 + (u & 1) + (u >> 1) * 8;
            w[u] = quant ? k_codes[row * CKW + wi] : 0u;
            const float sv = quant ? vqk_to_f(k_scales[row * CKG + gi]) * SC2 : 0.f;
            const float bv = quant ? vqk_to_f(k_biases[row * CKG + gi]) : 0.f;
            s2[u] = sv;
            b2[u] = bv - sv;
          }
#pragma unroll
          for (int i = 0; i < MT; ++i) {
            uint32_t a[4];
            a[0] = vqk_h2(vqk_deq<BITS, 0>(w[0] >> (2 * i * BITS), s2[0], b2[0]),
                          vqk_deq<BITS, 0>(w[1] >> (2 * i * BITS), s2[1], b2[1]));
            a[1] = vqk_h2(vqk_deq<BITS, 1>(w[0] >> (2 * i * BITS), s2[0], b2[0]),
                          vqk_deq<BITS, 1>(w[1] >> (2 * i * BITS), s2[1], b2[1]));
            a[2] = vqk_h2(vqk_deq<BITS, 0>(w[2] >> (2 * i * BITS), s2[2], b2[2]),
                          vqk_deq<BITS, 0>(w[3] >> (2 * i * BITS), s2[3], b2[3]));
            a[3] = vqk_h2(vqk_deq<BITS, 1>(w[2] >> (2 * i * BITS), s2[2], b2[2]),
                          vqk_deq<BITS, 1>(w[3] >> (2 * i * BITS), s2[3], b2[3]));
            vqk_mma(acc[i], a, qh);
            vqk_mma(acc[i], a, qlo);
          }
        }
        // C: row g -> token tw + 2i, row g+8 -> tw + 2i + 1; columns 2*q4, 2*q4+1 -> heads
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          const int tl = tw - t0 + 2 * i;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int hh = 2 * q4 + e;
            if (hh < GQA) {
              sc[hh * CHUNK + tl] = acc[i][e];
              sc[hh * CHUNK + tl + 1] = acc[i][2 + e];
            }
          }
        }
      }
    }
    __syncthreads();

    // ---- 2. mask past the end; residual keys (one warp per token)
    for (int i = tid; i < GQA * CHUNK; i += NT) {
      const int loc = i % CHUNK;
      if (t0 + loc >= Tn) sc[i] = -vqk_inf();
    }
    {
      const int kr_begin = max(t0, n_kq);
      const int kr_end = min(t0 + CHUNK, Tn);
      for (int t = kr_begin + warp; t < kr_end; t += NWARP) {
        const T* kr = k_res + ((size_t)bh * CKR + (size_t)(t - n_kq)) * HEAD_DIM;
        float part[GQA];
#pragma unroll
        for (int r = 0; r < GQA; ++r) part[r] = 0.f;
        for (int c = lane; c < HEAD_DIM; c += 32) {
          const float kv = vqk_to_f(kr[c]);
#pragma unroll
          for (int r = 0; r < GQA; ++r) part[r] = fmaf(qsm[c * GQA + r], kv, part[r]);
        }
#pragma unroll
        for (int r = 0; r < GQA; ++r) {
          float v = part[r];
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
          part[r] = v;
        }
        if (lane == 0) {
#pragma unroll
          for (int r = 0; r < GQA; ++r) sc[r * CHUNK + (t - t0)] = part[r];
        }
      }
    }
    __syncthreads();

    // ---- 3. online softmax (base 2), one warp per query head
    for (int r = warp; r < GQA; r += NWARP) {
      float m = -vqk_inf();
      for (int i = lane; i < CHUNK; i += 32) m = fmaxf(m, sc[r * CHUNK + i]);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
      const float m_old = sm_m[r];
      const float m_new = fmaxf(m_old, m);
      float l = 0.f;
      for (int i = lane; i < CHUNK; i += 32) {
        const float e = exp2f(sc[r * CHUNK + i] - m_new);
        sc[r * CHUNK + i] = e;
        l += e;
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
      if (lane == 0) {
        const float a = exp2f(m_old - m_new);
        sm_a[r] = a;
        sm_l[r] = sm_l[r] * a + l;
        sm_m[r] = m_new;
      }
    }
    __syncthreads();

    // ---- 4. values: o^T += deq(V)^T . p^T, one warp per 16-token k-step
    {
      const float a0 = (2 * q4 < GQA) ? sm_a[2 * q4] : 0.f;
      const float a1 = (2 * q4 + 1 < GQA) ? sm_a[2 * q4 + 1] : 0.f;
#pragma unroll
      for (int m = 0; m < VM; ++m) {
        oacc[m][0] *= a0;
        oacc[m][1] *= a1;
        oacc[m][2] *= a0;
        oacc[m][3] *= a1;
      }
      const int tend = min(CHUNK, Tn - t0);
      for (int ks = warp; ks * 16 < tend; ks += NWARP) {
        int tok[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) tok[u] = 16 * ks + 2 * q4 + (u & 1) + (u >> 1) * 8;
        uint32_t pb[2];
        {
          const bool hv = g < GQA;
          const float* pr = sc + (hv ? g : 0) * CHUNK;
          pb[0] = vqk_h2(hv ? pr[tok[0]] : 0.f, hv ? pr[tok[1]] : 0.f);
          pb[1] = vqk_h2(hv ? pr[tok[2]] : 0.f, hv ? pr[tok[3]] : 0.f);
        }
        const bool all_quant = t0 + 16 * ks + 16 <= n_vq;  // warp-uniform
        if (MODE == 1 && all_quant) continue;
#pragma unroll
        for (int cb = 0; cb < NCB; ++cb) {
          const int cw = cb * 8 + g;                 // this lane's word in each token row
          const int cg = (cb * CB + PACK * g) / GROUP;
          uint32_t w[4];
          float s2[4], b2[4];
          const T* vr[4];
          bool res[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int t = t0 + tok[u];
            const bool qv = t < n_vq;
            res[u] = !qv && t < Tn;
            const size_t row = (size_t)bh * CV + (size_t)(qv ? t : 0);
            w[u] = qv ? v_codes[row * DW + cw] : 0u;
            const float sv = qv ? vqk_to_f(v_scales[row * DG + cg]) * SC2 : 0.f;
            const float bv = qv ? vqk_to_f(v_biases[row * DG + cg]) : 0.f;
            s2[u] = sv;
            b2[u] = bv - sv;
            vr[u] = v_res + ((size_t)bh * CVR + (size_t)(res[u] ? t - n_vq : 0)) * HEAD_DIM
                + cb * CB + PACK * g;
          }
          if (all_quant) {
#pragma unroll
            for (int i = 0; i < MT; ++i) {
              uint32_t a[4];
              a[0] = vqk_h2(vqk_deq<BITS, 0>(w[0] >> (2 * i * BITS), s2[0], b2[0]),
                            vqk_deq<BITS, 0>(w[1] >> (2 * i * BITS), s2[1], b2[1]));
              a[1] = vqk_h2(vqk_deq<BITS, 1>(w[0] >> (2 * i * BITS), s2[0], b2[0]),
                            vqk_deq<BITS, 1>(w[1] >> (2 * i * BITS), s2[1], b2[1]));
              a[2] = vqk_h2(vqk_deq<BITS, 0>(w[2] >> (2 * i * BITS), s2[2], b2[2]),
                            vqk_deq<BITS, 0>(w[3] >> (2 * i * BITS), s2[3], b2[3]));
              a[3] = vqk_h2(vqk_deq<BITS, 1>(w[2] >> (2 * i * BITS), s2[2], b2[2]),
                            vqk_deq<BITS, 1>(w[3] >> (2 * i * BITS), s2[3], b2[3]));
              vqk_mma(oacc[cb * MT + i], a, pb);
            }
          } else {
#pragma unroll
            for (int i = 0; i < MT; ++i) {
              float v[4][2];
#pragma unroll
              for (int u = 0; u < 4; ++u) {
                v[u][0] = vqk_deq<BITS, 0>(w[u] >> (2 * i * BITS), s2[u], b2[u]);
                v[u][1] = vqk_deq<BITS, 1>(w[u] >> (2 * i * BITS), s2[u], b2[u]);
                if (res[u]) {
                  v[u][0] = vqk_to_f(vr[u][2 * i]);
                  v[u][1] = vqk_to_f(vr[u][2 * i + 1]);
                }
              }
              uint32_t a[4];
              a[0] = vqk_h2(v[0][0], v[1][0]);
              a[1] = vqk_h2(v[0][1], v[1][1]);
              a[2] = vqk_h2(v[2][0], v[3][0]);
              a[3] = vqk_h2(v[2][1], v[3][1]);
              vqk_mma(oacc[cb * MT + i], a, pb);
            }
          }
        }
      }
    }
    __syncthreads();
  }

  // ---- 5. sum the warps' outputs, write this split's partial (m, l, o)
  // C of value m-tile m = cb*MT + i: row g -> channel cb*CB + PACK*g + 2i, row g+8 -> +1;
  // columns 2*q4, 2*q4+1 -> heads
#pragma unroll
  for (int m = 0; m < VM; ++m) {
    const int cb = m / MT;
    const int i = m - cb * MT;
    const int ch = cb * CB + PACK * g + 2 * i;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int hh = 2 * q4 + e;
      if (hh < GQA) {
        ored[(warp * GQA + hh) * HEAD_DIM + ch] = oacc[m][e];
        ored[(warp * GQA + hh) * HEAD_DIM + ch + 1] = oacc[m][2 + e];
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < GQA * HEAD_DIM; i += NT) {
    float v = 0.f;
#pragma unroll
    for (int w2 = 0; w2 < NWARP; ++w2) v += ored[w2 * GQA * HEAD_DIM + i];
    const int r = i / HEAD_DIM;
    const int c = i - r * HEAD_DIM;
    o_part[((qrow + r) * NS + split) * HEAD_DIM + c] = v;
  }
  if (tid < GQA) {
    ml_part[((qrow + tid) * NS + split) * 2 + 0] = sm_m[tid];
    ml_part[((qrow + tid) * NS + split) * 2 + 1] = sm_l[tid];
  }
"""

# Merge the split partials: one block per (batch, query head), HEAD_DIM * NG threads.
CUDA_COMBINE_SOURCE = r"""
  __shared__ float sacc[HEAD_DIM * NG];
  __shared__ float sl[NG];
  const int row = blockIdx.x;
  const int tid = threadIdx.x;
  const int c = tid % HEAD_DIM;
  const int g = tid / HEAD_DIM;
  const int NS = o_part_shape[1];
  const float* ml = ml_part + (size_t)row * NS * 2;
  float M = -vqk_inf();
  for (int s = 0; s < NS; ++s) M = fmaxf(M, ml[2 * s]);
  float acc = 0.f;
  float L = 0.f;
  const float* op = o_part + (size_t)row * NS * HEAD_DIM + c;
#pragma unroll 4
  for (int s = g; s < NS; s += NG) {
    const float w = exp2f(ml[2 * s] - M);
    L = fmaf(w, ml[2 * s + 1], L);
    acc = fmaf(w, op[(size_t)s * HEAD_DIM], acc);
  }
  sacc[tid] = acc;
  if (c == 0) sl[g] = L;
  __syncthreads();
  if (g == 0) {
    float a = 0.f;
    float l = 0.f;
    for (int gg = 0; gg < NG; ++gg) {
      a += sacc[gg * HEAD_DIM + c];
      l += sl[gg];
    }
    out[(size_t)row * HEAD_DIM + c] = vqk_from_f<OT>(a / l);
  }
"""

# ---------------------------------------------------------------------------------
# Metal twin (mx.fast.metal_kernel)
# ---------------------------------------------------------------------------------

METAL_HEADER = r"""
#include <metal_stdlib>
using namespace metal;
// Code j of a packed word as the float 1 + code / 2^BITS (see the CUDA header).
template <int BITS>
inline float vqk_code1(uint w, int j) {
  const uint code = (w >> uint(j * BITS)) & ((1u << BITS) - 1u);
  return as_type<float>((code << uint(23 - BITS)) | 0x3F800000u);
}
"""

# Line-for-line twin of CUDA_SOURCE (same template constants and inputs). Never compiled:
# no Metal device or compiler was available (see kivi_decode_attention_metal).
METAL_SOURCE = r"""
  constexpr int PACK = 32 / BITS;
  constexpr int TPW = PACK < TW ? PACK : TW;
  constexpr int COLK = CHUNK / TPW;
  constexpr int NCS = NT / COLK;
  constexpr int CPS = HEAD_DIM / NCS;
  constexpr int CPT = PACK < TW ? PACK : TW;
  constexpr int COLV = HEAD_DIM / CPT;
  constexpr int NSV = NT / COLV;
  constexpr int DW = HEAD_DIM / PACK;
  constexpr int DG = HEAD_DIM / GROUP;
  constexpr int NWARP = NT / 32;
  constexpr int KSTRIDE = GQA * CHUNK + (COLK < 32 ? COLK : 0);
  constexpr int VSTRIDE = GQA * HEAD_DIM + (COLV < 32 ? COLV : 0);
  constexpr int RED = (NCS * KSTRIDE > NSV * VSTRIDE) ? NCS * KSTRIDE : NSV * VSTRIDE;
  constexpr float SC2 = float(1 << BITS);

  threadgroup float red[RED];
  threadgroup float qsm[HEAD_DIM * GQA];
  threadgroup float sm_m[GQA];
  threadgroup float sm_l[GQA];
  threadgroup float sm_a[GQA];

  const int tid = int(thread_position_in_threadgroup.x);
  const int lane = int(thread_index_in_simdgroup);
  const int warp = int(simdgroup_index_in_threadgroup);
  const int split = int(threadgroup_position_in_grid.x);
  const int NS = int(threadgroups_per_grid.x);
  const int bh = int(threadgroup_position_in_grid.y);
  const int H = k_codes_shape[1];
  const int Hq = queries_shape[1];
  const int b = bh / H;
  const int h = bh - b * H;
  const int CKW = k_codes_shape[3];
  const int CKG = k_scales_shape[3];
  const int CKR = k_res_shape[2];
  const int CV = v_codes_shape[2];
  const int CVR = v_res_shape[2];
  const int n_kq = params[0];
  const int n_kres = params[1];
  const int n_vq = params[2];
  const float qscale = as_type<float>(params[4]);
  const int cpb = params[5];
  const int Tn = n_kq + n_kres;
  const ulong qrow = ulong(b) * ulong(Hq) + ulong(h) * GQA;

  for (int i = tid; i < GQA * HEAD_DIM; i += NT) {
    const int r = i / HEAD_DIM;
    const int c = i - r * HEAD_DIM;
    qsm[c * GQA + r] = float(queries[(qrow + r) * HEAD_DIM + c]) * qscale;
  }
  if (tid < GQA) {
    sm_m[tid] = -INFINITY;
    sm_l[tid] = 0.f;
  }
  const int col = tid % COLK;
  const int slice = tid / COLK;
  const int colv = tid % COLV;
  const int sv = tid / COLV;
  const int c0 = colv * CPT;
  const int vsh = (c0 % PACK) * BITS;
  const int vg = c0 / GROUP;

  float o[GQA][CPT];
  for (int r = 0; r < GQA; ++r)
    for (int j = 0; j < CPT; ++j) o[r][j] = 0.f;
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const int n_chunks = (Tn + CHUNK - 1) / CHUNK;
  const int ch_begin = split * cpb;
  const int ch_end = min(ch_begin + cpb, n_chunks);
  for (int chunk = ch_begin; chunk < ch_end; ++chunk) {
    const int t0 = chunk * CHUNK;

    // 1. partial scores of this thread's tokens over its channel slice
    {
      const int tg = t0 + col * TPW;
      float acc[GQA][TPW];
      for (int r = 0; r < GQA; ++r)
        for (int j = 0; j < TPW; ++j) acc[r][j] = 0.f;
      if (tg < n_kq) {
        const int sh = (tg % PACK) * BITS;
        const ulong krow = ulong(bh) * HEAD_DIM + ulong(slice * CPS);
        const ulong kw0 = krow * ulong(CKW) + ulong(tg / PACK);
        const ulong kg0 = krow * ulong(CKG) + ulong(tg / GROUP);
        for (int k = 0; k < CPS; ++k) {
          const uint wd = k_codes[kw0 + ulong(k) * ulong(CKW)] >> uint(sh);
          const float s2 = float(k_scales[kg0 + ulong(k) * ulong(CKG)]) * SC2;
          const float b2 = float(k_biases[kg0 + ulong(k) * ulong(CKG)]) - s2;
          float kd[TPW];
          for (int j = 0; j < TPW; ++j) kd[j] = fma(s2, vqk_code1<BITS>(wd, j), b2);
          for (int r = 0; r < GQA; ++r) {
            const float a = qsm[(slice * CPS + k) * GQA + r];
            for (int j = 0; j < TPW; ++j) acc[r][j] = fma(a, kd[j], acc[r][j]);
          }
        }
      }
      for (int r = 0; r < GQA; ++r)
        for (int j = 0; j < TPW; ++j)
          red[slice * KSTRIDE + (r * TPW + j) * COLK + col] = acc[r][j];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // 2. sum the slices into slice 0, mask tokens past the end
    for (int i = tid; i < GQA * CHUNK; i += NT) {
      float v = red[i];
      for (int s2 = 1; s2 < NCS; ++s2) v += red[s2 * KSTRIDE + i];
      const int loc = i % CHUNK;
      const int j = loc / COLK;
      const int cc = loc - j * COLK;
      if (t0 + cc * TPW + j >= Tn) v = -INFINITY;
      red[i] = v;
    }
    // residual keys: one simdgroup per token, lanes over channels
    const int kr_begin = max(t0, n_kq);
    const int kr_end = min(t0 + CHUNK, Tn);
    if (kr_begin < kr_end) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int t = kr_begin + warp; t < kr_end; t += NWARP) {
        const ulong kr0 = (ulong(bh) * ulong(CKR) + ulong(t - n_kq)) * HEAD_DIM;
        float part[GQA];
        for (int r = 0; r < GQA; ++r) part[r] = 0.f;
        for (int c = lane; c < HEAD_DIM; c += 32) {
          const float kv = float(k_res[kr0 + ulong(c)]);
          for (int r = 0; r < GQA; ++r) part[r] = fma(qsm[c * GQA + r], kv, part[r]);
        }
        for (int r = 0; r < GQA; ++r) part[r] = simd_sum(part[r]);
        if (lane == 0) {
          const int tl = t - t0;
          const int pi = (tl % TPW) * COLK + tl / TPW;
          for (int r = 0; r < GQA; ++r) red[r * CHUNK + pi] = part[r];
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // 3. online softmax (base 2), one simdgroup per query head
    for (int r = warp; r < GQA; r += NWARP) {
      float m = -INFINITY;
      for (int i = lane; i < CHUNK; i += 32) m = fmax(m, red[r * CHUNK + i]);
      m = simd_max(m);
      const float m_old = sm_m[r];
      const float m_new = fmax(m_old, m);
      float l = 0.f;
      for (int i = lane; i < CHUNK; i += 32) {
        const float e = exp2(red[r * CHUNK + i] - m_new);
        red[r * CHUNK + i] = e;
        l += e;
      }
      l = simd_sum(l);
      if (lane == 0) {
        const float a = exp2(m_old - m_new);
        sm_a[r] = a;
        sm_l[r] = sm_l[r] * a + l;
        sm_m[r] = m_new;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // 4. values
    {
      for (int r = 0; r < GQA; ++r) {
        const float a = sm_a[r];
        for (int j = 0; j < CPT; ++j) o[r][j] *= a;
      }
      const int tend = min(CHUNK, Tn - t0);
      const int qend = min(tend, n_vq - t0);
      int t = sv;
      for (; t < qend; t += NSV) {
        const ulong row = ulong(bh) * ulong(CV) + ulong(t0 + t);
        const uint wd = v_codes[row * DW + ulong(c0 / PACK)] >> uint(vsh);
        const float s2 = float(v_scales[row * DG + ulong(vg)]) * SC2;
        const float b2 = float(v_biases[row * DG + ulong(vg)]) - s2;
        const int pi = (t % TPW) * COLK + t / TPW;
        float vd[CPT];
        for (int j = 0; j < CPT; ++j) vd[j] = fma(s2, vqk_code1<BITS>(wd, j), b2);
        for (int r = 0; r < GQA; ++r) {
          const float p = red[r * CHUNK + pi];
          for (int j = 0; j < CPT; ++j) o[r][j] = fma(p, vd[j], o[r][j]);
        }
      }
      for (; t < tend; t += NSV) {
        const ulong vr0 = (ulong(bh) * ulong(CVR) + ulong(t0 + t - n_vq)) * HEAD_DIM + ulong(c0);
        const int pi = (t % TPW) * COLK + t / TPW;
        float vv[CPT];
        for (int j = 0; j < CPT; ++j) vv[j] = float(v_res[vr0 + ulong(j)]);
        for (int r = 0; r < GQA; ++r) {
          const float p = red[r * CHUNK + pi];
          for (int j = 0; j < CPT; ++j) o[r][j] = fma(p, vv[j], o[r][j]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // 5. sum the token slices, write this split's partial (m, l, o)
  for (int r = 0; r < GQA; ++r)
    for (int j = 0; j < CPT; ++j) red[sv * VSTRIDE + (r * CPT + j) * COLV + colv] = o[r][j];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int i = tid; i < GQA * HEAD_DIM; i += NT) {
    const int r = i / HEAD_DIM;
    const int c = i - r * HEAD_DIM;
    const int j = c % CPT;
    const int cv = c / CPT;
    float v = 0.f;
    for (int s2 = 0; s2 < NSV; ++s2) v += red[s2 * VSTRIDE + (r * CPT + j) * COLV + cv];
    o_part[((qrow + ulong(r)) * ulong(NS) + ulong(split)) * HEAD_DIM + ulong(c)] = v;
  }
  if (tid < GQA) {
    ml_part[((qrow + ulong(tid)) * ulong(NS) + ulong(split)) * 2 + 0] = sm_m[tid];
    ml_part[((qrow + ulong(tid)) * ulong(NS) + ulong(split)) * 2 + 1] = sm_l[tid];
  }
"""

METAL_COMBINE_SOURCE = r"""
  threadgroup float sacc[HEAD_DIM * NG];
  threadgroup float sl[NG];
  const int row = int(threadgroup_position_in_grid.x);
  const int tid = int(thread_position_in_threadgroup.x);
  const int c = tid % HEAD_DIM;
  const int g = tid / HEAD_DIM;
  const int NS = o_part_shape[1];
  const ulong mlb = ulong(row) * ulong(NS) * 2;
  float M = -INFINITY;
  for (int s = 0; s < NS; ++s) M = fmax(M, ml_part[mlb + 2 * s]);
  float acc = 0.f;
  float L = 0.f;
  const ulong ob = ulong(row) * ulong(NS) * HEAD_DIM + ulong(c);
  for (int s = g; s < NS; s += NG) {
    const float w = exp2(ml_part[mlb + 2 * s] - M);
    L = fma(w, ml_part[mlb + 2 * s + 1], L);
    acc = fma(w, o_part[ob + ulong(s) * HEAD_DIM], acc);
  }
  sacc[tid] = acc;
  if (c == 0) sl[g] = L;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (g == 0) {
    float a = 0.f;
    float l = 0.f;
    for (int gg = 0; gg < NG; ++gg) {
      a += sacc[gg * HEAD_DIM + c];
      l += sl[gg];
    }
    out[ulong(row) * HEAD_DIM + ulong(c)] = static_cast<OT>(a / l);
  }
"""

_INPUT_NAMES = ["queries", "k_codes", "k_scales", "k_biases", "k_res", "v_codes",
                "v_scales", "v_biases", "v_res", "params"]
_KERNELS: dict = {}


def _get_kernels(backend: str, algo: str = "simt"):
    key = (backend, algo)
    if key not in _KERNELS:
        if backend == "cuda":
            main = mx.fast.cuda_kernel(
                name="vq_kivi_decode" + ("_mma" if algo == "mma" else ""),
                input_names=_INPUT_NAMES, output_names=["o_part", "ml_part"],
                source=CUDA_MMA_SOURCE if algo == "mma" else CUDA_SOURCE,
                header=CUDA_HEADER)
            comb = mx.fast.cuda_kernel(
                name="vq_kivi_decode_combine", input_names=["o_part", "ml_part"],
                output_names=["out"], source=CUDA_COMBINE_SOURCE, header=CUDA_HEADER)
        elif backend == "metal":
            if algo != "simt":
                raise ValueError("the Metal twin exists for the 'simt' kernel only")
            main = mx.fast.metal_kernel(
                name="vq_kivi_decode", input_names=_INPUT_NAMES,
                output_names=["o_part", "ml_part"], source=METAL_SOURCE,
                header=METAL_HEADER)
            comb = mx.fast.metal_kernel(
                name="vq_kivi_decode_combine", input_names=["o_part", "ml_part"],
                output_names=["out"], source=METAL_COMBINE_SOURCE, header=METAL_HEADER)
        else:
            raise ValueError(backend)
        _KERNELS[key] = (main, comb)
    return _KERNELS[key]


def _default_variant(gqa: int):
    """(TW, KUNROLL, VUNROLL) of the simt kernel for a GQA ratio (H200 sweep: (8, 8, 8)
    ran 13% faster than (4, 16, 8) at batch 8, 32k, GQA 4; GQA 8 needs TW=4 to stay
    near 128 registers)."""
    return (8, 8, 8) if gqa <= 4 else (4, 8, 8)


def _mma_supports(head_dim, gqa, bits, chunk) -> bool:
    pack = 32 // bits
    return (1 <= gqa <= _MAX_GQA and head_dim % 16 == 0 and head_dim % (8 * pack) == 0
            and chunk % (8 * pack) == 0 and chunk % 16 == 0)


def _default_chunk(algo: str, bits: int) -> int:
    # mma: a key super-tile is 8 words = 8 * (32 // bits) tokens; keep 4 per chunk
    return max(DEFAULT_CHUNK, 32 * (32 // bits)) if algo == "mma" else DEFAULT_CHUNK


def kernel_supports(head_dim: int, gqa: int, bits: int, group_size: int,
                    dtype=mx.float16, chunk: Optional[int] = None, tw: int = 4,
                    algo: str = "simt") -> bool:
    """Whether a fused kernel handles this shape (else the dispatcher falls back)."""
    if bits not in SUPPORTED_BITS or group_size not in SUPPORTED_GROUP_SIZES:
        return False
    if dtype not in (mx.float16, mx.bfloat16, mx.float32) or tw not in (4, 8):
        return False
    if not 1 <= gqa <= _MAX_GQA or head_dim % group_size or head_dim > 256:
        return False
    chunk = _default_chunk(algo, bits) if chunk is None else chunk
    if algo == "mma":
        return _mma_supports(head_dim, gqa, bits, chunk)
    per = min(32 // bits, tw)
    colk = chunk // per
    if chunk % per or colk > _NT or _NT % colk or head_dim % (_NT // colk):
        return False
    colv = head_dim // per
    return colv <= _NT and _NT % colv == 0


def default_algo(head_dim: int, gqa: int, bits: int, group_size: int, dtype) -> Optional[str]:
    """The CUDA kernel the dispatcher uses for a shape: "mma", "simt" or None (none fits).

    mma only for float16 inputs: it rounds dequantized K/V to float16 operands, which
    for bfloat16/float32 caches could overflow (|x| > 65504)."""
    if bits in MMA_DEFAULT_BITS and dtype == mx.float16 and kernel_supports(
            head_dim, gqa, bits, group_size, dtype, algo="mma"):
        return "mma"
    if kernel_supports(head_dim, gqa, bits, group_size, dtype, tw=_default_variant(gqa)[0]):
        return DEFAULT_CUDA_ALGO
    return None


def _plan(T: int, BH: int, chunk: int, target_blocks: int):
    n_chunks = -(-T // chunk)
    ns = max(1, min(n_chunks, -(-target_blocks // BH)))
    cpb = -(-n_chunks // ns)
    ns = -(-n_chunks // cpb)
    return ns, cpb


_PARAMS_CACHE: "OrderedDict[tuple, mx.array]" = OrderedDict()


def _params(n_kq, n_kres, n_vq, n_vres, scale, cpb):
    key = (n_kq, n_kres, n_vq, n_vres, float(scale), cpb)
    arr = _PARAMS_CACHE.get(key)
    if arr is None:
        sbits = struct.unpack("<i", struct.pack("<f", float(scale) * _LOG2E))[0]
        arr = mx.array([n_kq, n_kres, n_vq, n_vres, sbits, cpb], dtype=mx.int32)
        _PARAMS_CACHE[key] = arr
        if len(_PARAMS_CACHE) > 256:
            _PARAMS_CACHE.popitem(last=False)
    return arr


def _nonempty(x, shape, dtype):
    """A stand-in for an absent or empty buffer (never read by the kernel)."""
    if x is None or x.size == 0:
        return mx.zeros(shape, dtype=dtype)
    return x


def _launch(backend, queries, k_codes, k_scales, k_biases, n_kq, k_res, n_kres, v_codes,
            v_scales, v_biases, n_vq, v_res, n_vres, *, scale, bits, group_size,
            chunk=None, target_blocks=None, variant=None, out_dtype=None, poison=False,
            algo=None, _mode=0):
    B, Hq, H, D, T, n_kq, n_kres, n_vq, n_vres = _check_layout(
        queries, k_codes, k_scales, n_kq, k_res, n_kres, v_codes, v_scales, n_vq,
        v_res, n_vres, bits, group_size)
    R = Hq // H
    dt = queries.dtype
    if algo is None:
        algo = (default_algo(D, R, bits, group_size, dt) or "simt") if backend == "cuda" \
            else "simt"
    chunk = _default_chunk(algo, bits) if chunk is None else int(chunk)
    target_blocks = DEFAULT_TARGET_BLOCKS if target_blocks is None else int(target_blocks)
    tw, kunroll, vunroll = _default_variant(R) if variant is None else variant
    if not kernel_supports(D, R, bits, group_size, dt, chunk, tw, algo):
        raise ValueError(
            f"the fused {algo} kernel does not handle head_dim={D}, gqa={R}, bits={bits}, "
            f"group_size={group_size}, dtype={dt}, chunk={chunk}, tw={tw}")
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
    ns, cpb = _plan(T, B * H, chunk, target_blocks)
    params = _params(n_kq, n_kres, n_vq, n_vres, scale, cpb)
    main, comb = _get_kernels(backend, algo)
    init = float("nan") if poison else None
    o_part, ml_part = main(
        inputs=[queries, k_codes, k_scales, k_biases, k_res, v_codes, v_scales, v_biases,
                v_res, params],
        template=[("T", dt), ("BITS", bits), ("GROUP", group_size), ("HEAD_DIM", D),
                  ("GQA", R), ("CHUNK", chunk), ("NT", _NT), ("TW", tw),
                  ("KUNROLL", kunroll), ("VUNROLL", vunroll), ("MODE", int(_mode))],
        grid=(ns * _NT, B * H, 1), threadgroup=(_NT, 1, 1),
        output_shapes=[(B * Hq, ns, D), (B * Hq, ns, 2)],
        output_dtypes=[mx.float32, mx.float32], init_value=init)
    ng = max(1, 256 // D)
    odt = dt if out_dtype is None else out_dtype
    (out,) = comb(
        inputs=[o_part, ml_part],
        template=[("OT", odt), ("HEAD_DIM", D), ("NG", ng)],
        grid=(B * Hq * D * ng, 1, 1), threadgroup=(D * ng, 1, 1),
        output_shapes=[(B, Hq, 1, D)], output_dtypes=[odt], init_value=init)
    return out


def kivi_decode_attention_cuda(queries, k_codes, k_scales, k_biases, n_kq, k_res, n_kres,
                               v_codes, v_scales, v_biases, n_vq, v_res, n_vres, *, scale,
                               bits, group_size, chunk=None, target_blocks=None,
                               variant=None, out_dtype=None, poison=False, algo=None,
                               _mode=0):
    """Fused flash-decoding kernel on MLX's CUDA back-end.

    Grid: (splits, B * H). A block owns one kv head and a contiguous run of
    ``chunk``-token chunks; it reads the packed key codes, scales and biases of its
    tokens once for all ``Hq // H`` query heads of that kv head (GQA without repeating
    K/V), keeps an online base-2 softmax and a float32 running output, and writes one
    (max, sum, output) partial per query head; a second kernel merges the partials.
    Counts travel in a small int32 array and capacities in the shape arguments, so the
    compiled code depends only on dtype, bits, group size, head_dim, GQA ratio and chunk.
    ``algo``: "mma" (tensor cores: dequantized K/V and q/p rounded to float16 operands,
    float32 products and sums; fragment rows permuted so each lane dequantizes whole
    packed words) or "simt" (CUDA cores, float32 throughout); default from
    :func:`default_algo`. ``variant=(TW, KUNROLL, VUNROLL)`` tunes the simt kernel;
    ``out_dtype`` the output dtype (float32 to check without the final rounding);
    ``poison=True`` fills every output with NaN before the kernels run (checking).
    """
    return _launch("cuda", queries, k_codes, k_scales, k_biases, n_kq, k_res, n_kres,
                   v_codes, v_scales, v_biases, n_vq, v_res, n_vres, scale=scale,
                   bits=bits, group_size=group_size, chunk=chunk,
                   target_blocks=target_blocks, variant=variant, out_dtype=out_dtype,
                   poison=poison, algo=algo, _mode=_mode)


def kivi_decode_attention_metal(queries, k_codes, k_scales, k_biases, n_kq, k_res,
                                n_kres, v_codes, v_scales, v_biases, n_vq, v_res, n_vres,
                                *, scale, bits, group_size, chunk=None, target_blocks=None,
                                variant=None, out_dtype=None, poison=False, algo="simt"):
    """Metal twin of the "simt" CUDA kernel (same contract, inputs and algorithm).

    UNTESTED ON HARDWARE: no Metal hardware was available when this was written, so
    this source has never been compiled or run on a Metal device. It mirrors the simt
    CUDA kernel line for line (simdgroups of 32 for warps, threadgroup memory for
    shared memory); there is no Metal twin of the tensor-core ("mma") kernel. Check it
    against :func:`kivi_decode_attention_reference` (tests/test_kernel_kivi_decode.py
    does, on a Metal machine) before relying on it.
    """
    return _launch("metal", queries, k_codes, k_scales, k_biases, n_kq, k_res, n_kres,
                   v_codes, v_scales, v_biases, n_vq, v_res, n_vres, scale=scale,
                   bits=bits, group_size=group_size, chunk=chunk,
                   target_blocks=target_blocks, variant=variant, out_dtype=out_dtype,
                   poison=poison, algo=algo)


def _gpu_backend() -> Optional[str]:
    if mx.default_device() != mx.gpu:
        return None
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
    by ``CPU_DEFAULT_PATH``.
    """
    args = (queries, k_codes, k_scales, k_biases, n_kq, k_res, n_kres, v_codes, v_scales,
            v_biases, n_vq, v_res, n_vres)
    kw = dict(scale=scale, bits=bits, group_size=group_size)
    if use_kernel:
        backend = _gpu_backend()
        if backend is not None:
            H = next(a.shape[1] for a in (k_codes, v_codes, k_res, v_res)
                     if a is not None and a.size)
            R = queries.shape[1] // H if queries.shape[1] % H == 0 else 0
            D = queries.shape[3]
            if backend == "cuda" and R:
                algo = default_algo(D, R, bits, group_size, queries.dtype)
                if algo is not None:
                    return _launch(backend, *args, **kw, algo=algo)
            elif R and kernel_supports(D, R, bits, group_size, queries.dtype,
                                       tw=_default_variant(R)[0]):
                return _launch(backend, *args, **kw, algo="simt")
    if CPU_DEFAULT_PATH == "qmm":
        return kivi_decode_attention_qmm(*args, **kw)
    return kivi_decode_attention_reference(*args, **kw)


def packed_bytes_read(B, H, Hq, D, n_kq, n_kres, n_vq, n_vres, bits, group_size,
                      itemsize=2) -> int:
    """Bytes the fused kernel must read: valid codes + scales + biases + residual rows."""
    pack = 32 // bits
    kq = B * H * D * (n_kq // pack * 4 + 2 * (n_kq // group_size) * itemsize)
    vq = B * H * n_vq * (D // pack * 4 + 2 * (D // group_size) * itemsize)
    res = B * H * (n_kres + n_vres) * D * itemsize
    q = B * Hq * D * itemsize
    return kq + vq + res + q
