"""CUDA sources of the fused KIVI decode attention (see ``kivi_decode.py``): the shared
header and prologue, the "simt" kernel and the merge kernel.

Used through ``mx.fast.cuda_kernel``; checked and timed on an NVIDIA H200. The "mma"
kernel, never dispatched, is in benchmarks/kernels_extra.py and uses the helpers here.
"""

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


def _residual_key_scores(q_of_head_r: str, store: str, q_setup: str = "") -> str:
    """CUDA text shared by the kernels: scores of the chunk's full-precision residual keys
    (tokens kr_begin..kr_end), one warp per token, lanes over channels, summed over the
    warp into part[r] for every query head r; lane 0 then runs `store`. `q_of_head_r` is
    the expression for q of head r at channel c, after `q_setup` (run per channel)."""
    body = """
      for (int t = kr_begin + warp; t < kr_end; t += NWARP) {
        const T* kr = k_res + ((size_t)bh * CKR + (size_t)(t - n_kq)) * HEAD_DIM;
        float part[GQA];
#pragma unroll
        for (int r = 0; r < GQA; ++r) part[r] = 0.f;
        for (int c = lane; c < HEAD_DIM; c += 32) {
          const float kv = vqk_to_f(kr[c]);
@Q_SETUP@#pragma unroll
          for (int r = 0; r < GQA; ++r) part[r] = fmaf(@Q@, kv, part[r]);
        }
#pragma unroll
        for (int r = 0; r < GQA; ++r) {
          float v = part[r];
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
          part[r] = v;
        }
        if (lane == 0) {
@STORE@        }
      }
"""[1:]
    return (body.replace("@Q_SETUP@", q_setup.lstrip("\n")).replace("@Q@", q_of_head_r)
            .replace("@STORE@", store.lstrip("\n")))


#: `store` of _residual_key_scores: each head's score at its token's place in sc[head][CHUNK]
_STORE_SCORES = """
#pragma unroll
          for (int r = 0; r < GQA; ++r) sc[r * CHUNK + (t - t0)] = part[r];
"""


def _online_softmax(scores: str) -> str:
    """Step 3 of the simt kernel (and of benchmarks/kernels_extra.py's mma): the online
    softmax (base 2) of one chunk, a warp per query head, over the chunk's scores in shared
    array `scores` ([head][CHUNK])."""
    return r"""
    // ---- 3. online softmax (base 2), one warp per query head
    for (int r = warp; r < GQA; r += NWARP) {{
      float m = -vqk_inf();
      for (int i = lane; i < CHUNK; i += 32) m = fmaxf(m, {s}[r * CHUNK + i]);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
      const float m_old = sm_m[r];
      const float m_new = fmaxf(m_old, m);  // finite: every chunk has a valid token
      float l = 0.f;
      for (int i = lane; i < CHUNK; i += 32) {{
        const float e = exp2f({s}[r * CHUNK + i] - m_new);
        {s}[r * CHUNK + i] = e;
        l += e;
      }}
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
      if (lane == 0) {{
        const float a = exp2f(m_old - m_new);
        sm_a[r] = a;
        sm_l[r] = sm_l[r] * a + l;
        sm_m[r] = m_new;
      }}
    }}
""".format(s=scores)[1:]


# The main kernels' common start: thread roles, the (batch, kv head) and split of the
# block, buffer capacities from the shape arguments (CUDA_PROLOGUE_GRID), then counts from
# `params` (the frag kernel's may come from the block's row: CUDA_FRAG_SOURCE).
CUDA_PROLOGUE_GRID = r"""
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
"""


def prologue_counts(counts: str) -> str:
    """The prologue's counts, read from the int array ``counts`` (n_kq, n_kres, n_vq at
    0-2); the scale and the split's chunks from ``params`` (4 and 5)."""
    return rf"""
  const int n_kq = {counts}[0];
  const int n_kres = {counts}[1];
  const int n_vq = {counts}[2];
  const float qscale = __int_as_float(params[4]);
  const int cpb = params[5];
  const int Tn = n_kq + n_kres;
  const size_t qrow = (size_t)b * Hq + (size_t)h * GQA;
"""


CUDA_PROLOGUE = CUDA_PROLOGUE_GRID + prologue_counts("params")

# Template constants: T (cache/query dtype), BITS, GROUP, HEAD_DIM, GQA (query heads per
# kv head, <= 8), CHUNK (tokens per inner step), NT (threads per block, 128), TW (codes
# per thread and step: 4 or 8), KUNROLL / VUNROLL (unroll of the key channel loop and
# of the value token loop: loads in flight per thread), MODE (0 at run time; 1 and 2 skip
# the packed values / keys: benchmarks/kernels_extra.py's stage timings).
# Grid: x = split index (gridDim.x splits), y = b * H + h. Runtime counts come from
# `params` (int32): n_kq, n_kres, n_vq, n_vres, bits of scale*log2(e), chunks per split;
# buffer capacities come from the shapes, so neither changes the compiled source.
CUDA_SOURCE = CUDA_PROLOGUE + r"""
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
""" + _residual_key_scores("qsm[c * GQA + r]", """
          const int tl = t - t0;
          const int pi = (tl % TPW) * COLK + tl / TPW;
#pragma unroll
          for (int r = 0; r < GQA; ++r) red[r * CHUNK + pi] = part[r];
""") + r"""    }
    __syncthreads();

""" + _online_softmax("red") + r"""    __syncthreads();

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

# Merge the split partials. Grid: (B * Hq) x (HEAD_DIM / 32) blocks of 256 threads: one
# block per query row and 32-channel slice, its 8 warps take every 8th split (lane =
# channel), so the loads of a row are spread over many threads and blocks; the block
# max of the split maxima comes first, the 8 warp sums are added in shared memory.
CUDA_COMBINE_SOURCE = r"""
  constexpr int NW = 8;
  __shared__ float red_m[NW];
  __shared__ float red_l[NW];
  __shared__ float red_o[NW * 32];
  const int row = blockIdx.x;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int c = blockIdx.y * 32 + lane;
  const int NS = o_part_shape[1];
  const float* ml = ml_part + (size_t)row * NS * 2;
  float m = -vqk_inf();
  for (int s = tid; s < NS; s += 32 * NW) m = fmaxf(m, ml[2 * s]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (lane == 0) red_m[warp] = m;
  __syncthreads();
  float M = red_m[0];
#pragma unroll
  for (int w = 1; w < NW; ++w) M = fmaxf(M, red_m[w]);
  float acc = 0.f;
  float L = 0.f;
  const float* op = o_part + (size_t)row * NS * HEAD_DIM + c;
#pragma unroll 4
  for (int s = warp; s < NS; s += NW) {
    const float w = exp2f(ml[2 * s] - M);
    L = fmaf(w, ml[2 * s + 1], L);
    acc = fmaf(w, op[(size_t)s * HEAD_DIM], acc);
  }
  red_o[warp * 32 + lane] = acc;
  if (lane == 0) red_l[warp] = L;
  __syncthreads();
  if (warp == 0) {
    float a = 0.f;
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      a += red_o[w * 32 + lane];
      l += red_l[w];
    }
    out[(size_t)row * HEAD_DIM + c] = vqk_from_f<OT>(a / l);
  }
"""
