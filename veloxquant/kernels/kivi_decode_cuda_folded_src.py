"""CUDA source of the "folded" fused KIVI decode attention (see ``kivi_decode.py``).

Tensor cores multiply the raw integer codes; the affine scales are folded into the
other operand, so nothing is dequantized element by element:

* scores: ``q . (s_k * code + b_k) = (q * s_k) . code + q . b_k`` per key group: the
  mma's A operand is the key codes (exact small integers in float16), its B operand
  ``q * s_k`` split into a float16 value and its float16 residual (two products, so q
  is effectively float32); the bias term ``q . b_k`` is a dot product per group and head;
* output: ``sum_t p_t (s_v,t * code_t + b_v,t) = sum_t (p_t * s_v,t) code_t +
  sum_t p_t b_v,t`` per value channel group: A = value codes, B = ``p * s_v`` (split the
  same way), the bias term summed per head and group.

A fragment register (two codes from two packed words) costs a byte permute, a masked
OR into the mantissa of 1024.0 and a float16 subtraction of 1024.

Memory: one chunk of packed codes per block in shared memory, copied with ``cp.async``
(16-byte copies where rows are 16-byte aligned) and software-pipelined: the next
chunk's keys are copied while this chunk's softmax and values run, the next chunk's
values while the next keys are scored. Scales go through registers the same way.
For keys the warps split a chunk's tokens (16-token tiles, one key group's scales folded
per warp); for values they split the channels (16-channel tiles), and ``p * s_v`` and the
value bias term are computed once per token and group in the softmax step.

Same inputs, outputs, grid, partials and combine kernel as the other CUDA kernels; the
cache dtype must be float16 (residual values become mma operands as they are).
Template constants: T (float16), BITS, GROUP, HEAD_DIM, GQA (<= 8), CHUNK (tokens per
step; 128, or 64 at 8 bits), NT (128), KVEC (4: key rows 16-byte aligned; 1: 4-byte
copies).
"""

from .kivi_decode_cuda_src import _STORE_SCORES, CUDA_PROLOGUE, _residual_key_scores

CUDA_FOLDED_HEADER = r"""
// float16 pair x - (1024, 1024)
__device__ __forceinline__ uint32_t vqk_sub1024(uint32_t x) {
#ifdef VQK_EMULATION
  return vqk_h2(vqk_half(x, 0) - 1024.f, vqk_half(x, 1) - 1024.f);
#else
  const __half2 h = __hsub2(*reinterpret_cast<const __half2*>(&x), __float2half2_rn(1024.f));
  return *reinterpret_cast<const uint32_t*>(&h);
#endif
}
// (x & m) | c in one LOP3: with two immediates the compiler emits two
__device__ __forceinline__ uint32_t vqk_and_or(uint32_t x, uint32_t m, uint32_t c) {
#ifdef VQK_EMULATION
  return (x & m) | c;
#else
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(d) : "r"(x), "r"(m), "r"(c));
  return d;
#endif
}
// Codes j and j + 1 of words w0 and w1 as exact float16 pairs: lo = (code j of w0, of
// w1), hi = (code j + 1 of w0, of w1). `sel` picks byte (j * BITS) / 8 of both words
// (sel2: the next byte, 8-bit codes), `p` is the bit offset of code j in that byte.
template <int BITS>
__device__ __forceinline__ void vqk_pair(uint32_t w0, uint32_t w1, uint32_t sel,
                                         uint32_t sel2, int p, uint32_t& lo, uint32_t& hi) {
  constexpr uint32_t M2 = ((1u << BITS) - 1u) * 0x10001u;
  if constexpr (BITS == 8) {
    lo = vqk_and_or(__byte_perm(w0, w1, sel), M2, 0x64006400u);
    hi = vqk_and_or(__byte_perm(w0, w1, sel2), M2, 0x64006400u);
  } else {
    const uint32_t r = __byte_perm(w0, w1, sel);
    lo = vqk_and_or(BITS == 4 ? r : r >> p, M2, 0x64006400u);  // 4 bits: p == 0
    hi = vqk_and_or(r >> ((BITS == 4 ? 0 : p) + BITS), M2, 0x64006400u);
  }
  lo = vqk_sub1024(lo);
  hi = vqk_sub1024(hi);
}
// A fragment (m16 x k16): k columns 2q4, 2q4+1, 2q4+8, 2q4+9 from words w[0..3]; row g
// is code j of each word, row g + 8 code j + 1
template <int BITS>
__device__ __forceinline__ void vqk_frag(const uint32_t* w, uint32_t sel, uint32_t sel2,
                                         int p, uint32_t* a) {
  vqk_pair<BITS>(w[0], w[1], sel, sel2, p, a[0], a[1]);
  vqk_pair<BITS>(w[2], w[3], sel, sel2, p, a[2], a[3]);
}
// acc += A . (bhi + blo), A the codes of rows r[0], r[s], r[8 s], r[9 s] (k columns)
template <int BITS>
__device__ __forceinline__ void vqk_mma_codes(float* acc, const uint32_t* r, int s,
                                              uint32_t sel, uint32_t sel2, int p,
                                              const uint32_t* bhi, const uint32_t* blo) {
  const uint32_t w[4] = {r[0], r[s], r[8 * s], r[9 * s]};
  uint32_t a[4];
  vqk_frag<BITS>(w, sel, sel2, p, a);
  vqk_mma(acc, a, bhi);
  vqk_mma(acc, a, blo);
}
// (hi, lo) float16 pairs with hi + lo == (x0, x1) to about 2^-22
__device__ __forceinline__ void vqk_split(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = vqk_h2(x0, x1);
  lo = vqk_h2_lo(x0, x1);
}
__device__ __forceinline__ float2 vqk_h2f(uint32_t x) {  // float16 pair -> floats
#ifdef VQK_EMULATION
  return make_float2(vqk_half(x, 0), vqk_half(x, 1));
#else
  return __half22float2(*reinterpret_cast<const __half2*>(&x));
#endif
}
__device__ __forceinline__ uint32_t vqk_pack(__half lo, __half hi) {
  uint16_t a, b;
  memcpy(&a, &lo, 2);
  memcpy(&b, &hi, 2);
  return (uint32_t)a | ((uint32_t)b << 16);
}
#ifndef VQK_EMULATION
template <int BYTES>
__device__ __forceinline__ void vqk_cp_async(void* dst, const void* src) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  if constexpr (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(src));
}
__device__ __forceinline__ void vqk_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void vqk_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
#endif
"""

CUDA_FOLDED_SOURCE = CUDA_PROLOGUE + r"""
  constexpr int PACK = 32 / BITS;
  constexpr int NWARP = NT / 32;
  constexpr int KW = CHUNK / PACK;              // key words per channel row and chunk
  constexpr int KSTR = KW + 4;                  // padded rows: conflict-free fragments
  constexpr int DW = HEAD_DIM / PACK;           // value words per token row
  constexpr int VSTR = DW + 4;
  constexpr int KGC = CHUNK >= GROUP ? CHUNK / GROUP : 1;  // key groups per chunk
  constexpr int DG = HEAD_DIM / GROUP;          // value groups per token row
  constexpr int KS = HEAD_DIM / 16;             // key k-steps (channels)
  constexpr int MPW = CHUNK / 16 / NWARP;       // key m-tiles (16 tokens) per warp
  constexpr int MTG = GROUP / 16;               // 16-wide tiles per group
  constexpr int SEG = MPW < MTG ? MPW : MTG;    // key m-tiles sharing one group's scales
  constexpr int VKS = CHUNK / 16;               // value k-steps (16 tokens) per chunk
  constexpr int VMW = HEAD_DIM / 16 / NWARP;    // value m-tiles (16 channels) per warp
  constexpr int NKSC = (HEAD_DIM * KGC + NT - 1) / NT;
  constexpr int NVSC = (CHUNK * DG + NT - 1) / NT;
  static_assert(NT == 128 && CHUNK % 64 == 0 && HEAD_DIM % 64 == 0 && GQA <= 8, "tiling");
  static_assert(KW % KVEC == 0 && DW % 4 == 0 && KW % 4 == 0, "copies");
  static_assert((CHUNK * (DW / 4)) % NT == 0, "value copies");
  static_assert(GROUP % 16 == 0 && HEAD_DIM % GROUP == 0 && MPW % SEG == 0, "grouping");
  static_assert((VMW * 16) % GROUP == 0 || GROUP % (VMW * 16) == 0, "value groups");

  __shared__ __align__(16) uint32_t kc_s[HEAD_DIM * KSTR];
  __shared__ __align__(16) uint32_t vc_s[CHUNK * VSTR];
  __shared__ uint32_t ksb[KGC * HEAD_DIM];      // (scale, bias) pairs, [group][channel]
  __shared__ uint32_t vsb[CHUNK * DG];          // (scale, bias) pairs, [token][group]
  __shared__ __align__(16) float sc[GQA * CHUNK];
  __shared__ __align__(16) float4 qf[KS * 32];  // lane's q for its head and 4 channels
  __shared__ __align__(4) __half phi[DG * GQA * CHUNK];  // p * s_v as float16 hi + lo,
  __shared__ __align__(4) __half plo[DG * GQA * CHUNK];  // [group][head][token]
  __shared__ float sm_m[GQA];
  __shared__ float sm_l[GQA];
  __shared__ float sm_a[GQA];
  __shared__ float sm_vb[GQA * DG];              // running sum_t p_t b_v,t per head, group

  const int g = lane >> 2;
  const int q4 = lane & 3;

  // ---- staging: codes by cp.async, scales through registers
  T rks[NKSC], rkb[NKSC], rvs[NVSC], rvb[NVSC];
  // (one 64-bit base per buffer and chunk, 32-bit offsets from it: per-copy 64-bit
  // address arithmetic was a fifth of the kernel's instructions)
  auto issue_keys = [&](int t0) {
    const int nw = min(KW, n_kq / PACK - t0 / PACK);  // valid words per channel row
    const uint32_t* src = k_codes + (size_t)bh * HEAD_DIM * CKW + t0 / PACK;
    if (nw > 0) {
      for (int row = tid; row < HEAD_DIM; row += NT) {
#pragma unroll
        for (int v = 0; v < KW; v += KVEC)
          if (v < nw) vqk_cp_async<4 * KVEC>(kc_s + row * KSTR + v, src + row * CKW + v);
      }
    }
    const T* ss = k_scales + (size_t)bh * HEAD_DIM * CKG + t0 / GROUP;
    const T* sb = k_biases + (size_t)bh * HEAD_DIM * CKG + t0 / GROUP;
    const int ng = (n_kq - t0 + GROUP - 1) / GROUP;   // valid groups from t0
#pragma unroll
    for (int u = 0; u < NKSC; ++u) {
      const int i = tid + u * NT;
      const int row = i / KGC;
      const int j = i - row * KGC;
      if (i < HEAD_DIM * KGC && j < ng) {
        rks[u] = ss[row * CKG + j];
        rkb[u] = sb[row * CKG + j];
      }
    }
  };
  auto store_key_scales = [&]() {
#pragma unroll
    for (int u = 0; u < NKSC; ++u) {
      const int i = tid + u * NT;
      const int row = i / KGC;
      if (i < HEAD_DIM * KGC) ksb[(i - row * KGC) * HEAD_DIM + row] = vqk_pack(rks[u], rkb[u]);
    }
  };
  auto issue_values = [&](int t0) {
    const int nv = min(CHUNK, n_vq - t0);
    // the chunk's rows are contiguous: copy i is words 4 i .. 4 i + 3 from the chunk start
    const uint32_t* src = v_codes + ((size_t)bh * CV + t0) * DW;
#pragma unroll
    for (int u = 0; u < CHUNK * (DW / 4) / NT; ++u) {
      const int i = tid + u * NT;
      const int row = i / (DW / 4);
      if (row < nv)
        vqk_cp_async<16>(vc_s + row * VSTR + (i - row * (DW / 4)) * 4, src + 4 * i);
    }
    const T* ss = v_scales + ((size_t)bh * CV + t0) * DG;
    const T* sb = v_biases + ((size_t)bh * CV + t0) * DG;
#pragma unroll
    for (int u = 0; u < NVSC; ++u) {
      const int i = tid + u * NT;
      if (i < CHUNK * DG && i / DG < nv) {
        rvs[u] = ss[i];
        rvb[u] = sb[i];
      }
    }
  };
  auto store_value_scales = [&]() {
#pragma unroll
    for (int u = 0; u < NVSC; ++u) {
      const int i = tid + u * NT;
      if (i < CHUNK * DG) vsb[i] = vqk_pack(rvs[u], rvb[u]);
    }
  };

  const int n_chunks = (Tn + CHUNK - 1) / CHUNK;
  const int ch_begin = split * cpb;
  const int ch_end = min(ch_begin + cpb, n_chunks);
  issue_keys(ch_begin * CHUNK);
  vqk_cp_commit();
  issue_values(ch_begin * CHUNK);
  vqk_cp_commit();

  for (int i = tid; i < KS * 32; i += NT) {
    const int gg = (i & 31) >> 2;
    const int c = 16 * (i / 32) + 2 * (i & 3);
    const T* qp = queries + (qrow + gg) * HEAD_DIM;
    qf[i] = gg < GQA ? make_float4(vqk_to_f(qp[c]) * qscale, vqk_to_f(qp[c + 1]) * qscale,
                                   vqk_to_f(qp[c + 8]) * qscale, vqk_to_f(qp[c + 9]) * qscale)
                     : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (tid < GQA) {
    sm_m[tid] = -vqk_inf();
    sm_l[tid] = 0.f;
  }
  if (tid < GQA * DG) sm_vb[tid] = 0.f;
  store_key_scales();
  store_value_scales();
  vqk_cp_wait<0>();
  __syncthreads();
  const float* qflat = reinterpret_cast<const float*>(qf);

  // byte selectors of this lane's code pair (j = 2g mod PACK) in a packed word
  const int jc = (2 * g) % PACK;
  const uint32_t kb = (uint32_t)(jc * BITS) / 8;
  const int pbit = (jc * BITS) % 8;
  const uint32_t sel = kb | (kb << 4) | ((kb + 4) << 8) | ((kb + 4) << 12);
  const uint32_t sel2 = sel + 0x1111u;  // the next byte (8-bit codes)
  const int gq = g < GQA ? g : GQA - 1;  // B columns past GQA: any finite values
  const int vgrp = (warp * VMW * 16) / GROUP;  // value channel group of this warp

  float oacc[VMW][4];
#pragma unroll
  for (int m = 0; m < VMW; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) oacc[m][e] = 0.f;

  for (int chunk = ch_begin; chunk < ch_end; ++chunk) {
    const int t0 = chunk * CHUNK;
    const bool next = chunk + 1 < ch_end;

    // ---- 1. quantized keys: scores^T (tokens x heads) = codes . (q * s_k)^T + q . b_k
#pragma unroll
    for (int seg = 0; seg < MPW; seg += SEG) {
      const int mt0 = warp * MPW + seg;       // first m-tile of the segment
      if (t0 + mt0 * 16 >= n_kq) break;       // warp-uniform; n_kq is a multiple of GROUP
      const int gl = (mt0 * 16) / GROUP;      // local key group (0 when CHUNK < GROUP)
      float acc[SEG][4];
#pragma unroll
      for (int m = 0; m < SEG; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m][e] = 0.f;
      float beta = 0.f;
      const uint32_t* kbase = kc_s + 2 * q4 * KSTR + (mt0 * 16 + 2 * g) / PACK;
      const uint32_t* sbase = ksb + gl * HEAD_DIM + 2 * q4;
#pragma unroll
      for (int s = 0; s < KS; ++s) {
        const float4 qv = qf[s * 32 + lane];
        const float2 sb0 = vqk_h2f(sbase[16 * s]);
        const float2 sb1 = vqk_h2f(sbase[16 * s + 1]);
        const float2 sb8 = vqk_h2f(sbase[16 * s + 8]);
        const float2 sb9 = vqk_h2f(sbase[16 * s + 9]);
        beta = fmaf(qv.x, sb0.y, fmaf(qv.y, sb1.y, fmaf(qv.z, sb8.y, fmaf(qv.w, sb9.y, beta))));
        uint32_t bhi[2], blo[2];
        vqk_split(qv.x * sb0.x, qv.y * sb1.x, bhi[0], blo[0]);
        vqk_split(qv.z * sb8.x, qv.w * sb9.x, bhi[1], blo[1]);
        const uint32_t* kr = kbase + 16 * s * KSTR;
#pragma unroll
        for (int m = 0; m < SEG; ++m)
          vqk_mma_codes<BITS>(acc[m], kr + m * 16 / PACK, KSTR, sel, sel2, pbit, bhi, blo);
      }
      beta += __shfl_xor_sync(0xffffffffu, beta, 1);
      beta += __shfl_xor_sync(0xffffffffu, beta, 2);
      const float be0 = __shfl_sync(0xffffffffu, beta, 8 * q4);      // head 2 q4
      const float be1 = __shfl_sync(0xffffffffu, beta, 8 * q4 + 4);  // head 2 q4 + 1
#pragma unroll
      for (int m = 0; m < SEG; ++m) {
        const int tl = (mt0 + m) * 16 + 2 * g;  // C row g: token tl, row g + 8: tl + 1
        if (2 * q4 < GQA) {
          sc[(2 * q4) * CHUNK + tl] = acc[m][0] + be0;
          sc[(2 * q4) * CHUNK + tl + 1] = acc[m][2] + be0;
        }
        if (2 * q4 + 1 < GQA) {
          sc[(2 * q4 + 1) * CHUNK + tl] = acc[m][1] + be1;
          sc[(2 * q4 + 1) * CHUNK + tl + 1] = acc[m][3] + be1;
        }
      }
    }

    // ---- 2. mask past the end; residual keys (full precision, one warp per token)
    if (t0 + CHUNK > n_kq) {  // block-uniform
      for (int i = tid; i < GQA * CHUNK; i += NT) {
        if (t0 + i % CHUNK >= Tn) sc[i] = -vqk_inf();
      }
      const int kr_begin = max(t0, n_kq);
      const int kr_end = min(t0 + CHUNK, Tn);
""" + _residual_key_scores("qc[r * 16]", _STORE_SCORES, q_setup="""
          // q of head r at channel c, from its slot in the fragment table qf
          const int cc = c & 15;
          const float* qc = qflat + (c >> 4) * 128 + ((cc & 7) >> 1) * 4 + (cc & 1) + (cc >> 3) * 2;
""") + r"""    }
    if (chunk > ch_begin) store_value_scales();  // this chunk's, loaded during its keys
    __syncthreads();
    if (next) {  // the key buffers are free: copy the next chunk's keys
      issue_keys(t0 + CHUNK);
      vqk_cp_commit();
    }

    // ---- 3. online softmax (base 2), one warp per query head; p * s_v as float16
    //         hi + lo per value group, and the value bias term sum_t p_t b_v,t
    const int qend = n_vq - t0;  // local end of the quantized values (may be <= 0)
    for (int r = warp; r < GQA; r += NWARP) {
      float m = -vqk_inf();
      for (int i = lane; i < CHUNK; i += 32) m = fmaxf(m, sc[r * CHUNK + i]);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
      const float m_old = sm_m[r];
      const float m_new = fmaxf(m_old, m);
      float l = 0.f;
      float vb[DG];
#pragma unroll
      for (int d = 0; d < DG; ++d) vb[d] = 0.f;
      for (int i = lane; i < CHUNK; i += 32) {
        const float e = exp2f(sc[r * CHUNK + i] - m_new);
        sc[r * CHUNK + i] = e;
        l += e;
        const bool qv = i < qend;
#pragma unroll
        for (int d = 0; d < DG; ++d) {
          const float2 sb = qv ? vqk_h2f(vsb[i * DG + d]) : make_float2(0.f, 0.f);
          const float ps = e * sb.x;
          vb[d] = fmaf(e, sb.y, vb[d]);
          const __half hi = __float2half_rn(ps);
          phi[(d * GQA + r) * CHUNK + i] = hi;
          plo[(d * GQA + r) * CHUNK + i] = __float2half_rn(ps - __half2float(hi));
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        l += __shfl_xor_sync(0xffffffffu, l, off);
#pragma unroll
        for (int d = 0; d < DG; ++d) vb[d] += __shfl_xor_sync(0xffffffffu, vb[d], off);
      }
      if (lane == 0) {
        const float a = exp2f(m_old - m_new);
        sm_a[r] = a;
        sm_l[r] = sm_l[r] * a + l;
        sm_m[r] = m_new;
#pragma unroll
        for (int d = 0; d < DG; ++d) sm_vb[r * DG + d] = sm_vb[r * DG + d] * a + vb[d];
      }
    }
    if (next)
      vqk_cp_wait<1>();  // this chunk's values (the next keys may still be in flight)
    else
      vqk_cp_wait<0>();
    __syncthreads();

    // ---- 4. values: o^T (channels x heads) += codes^T . (p * s_v)^T; a warp owns
    //         VMW 16-channel tiles (one value group) and walks every token
    {
      const float a0 = (2 * q4 < GQA) ? sm_a[2 * q4] : 0.f;
      const float a1 = (2 * q4 + 1 < GQA) ? sm_a[2 * q4 + 1] : 0.f;
#pragma unroll
      for (int m = 0; m < VMW; ++m) {
        oacc[m][0] *= a0;
        oacc[m][1] *= a1;
        oacc[m][2] *= a0;
        oacc[m][3] *= a1;
      }
      const int tend = min(CHUNK, Tn - t0);
      const __half* ph = phi + (vgrp * GQA + gq) * CHUNK + 2 * q4;
      const __half* pl = plo + (vgrp * GQA + gq) * CHUNK + 2 * q4;
      const uint32_t* vbase = vc_s + 2 * q4 * VSTR + (warp * VMW * 16 + 2 * g) / PACK;
#pragma unroll
      for (int ks = 0; ks < VKS; ++ks) {
        if (16 * ks >= tend) break;  // block-uniform
        if (16 * ks < qend) {        // p * s_v is 0 past the quantized part
          const uint32_t bhi[2] = {*reinterpret_cast<const uint32_t*>(ph + 16 * ks),
                                   *reinterpret_cast<const uint32_t*>(ph + 16 * ks + 8)};
          const uint32_t blo[2] = {*reinterpret_cast<const uint32_t*>(pl + 16 * ks),
                                   *reinterpret_cast<const uint32_t*>(pl + 16 * ks + 8)};
          const uint32_t* vr = vbase + 16 * ks * VSTR;
#pragma unroll
          for (int m = 0; m < VMW; ++m)
            vqk_mma_codes<BITS>(oacc[m], vr + m * 16 / PACK, VSTR, sel, sel2, pbit, bhi, blo);
        }
        if (16 * ks + 16 > qend) {  // residual values in this k-step: float16 operands
          float pr[4];
          const T* vr[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int tl = 16 * ks + 2 * q4 + (u & 1) + (u >> 1) * 8;
            const bool ok = tl >= qend && tl < tend && g < GQA;
            pr[u] = ok ? sc[g * CHUNK + tl] : 0.f;
            vr[u] = tl >= qend && tl < tend
                        ? v_res + ((size_t)bh * CVR + (size_t)(t0 + tl - n_vq)) * HEAD_DIM
                        : nullptr;
          }
          uint32_t bhi[2], blo[2];
          vqk_split(pr[0], pr[1], bhi[0], blo[0]);
          vqk_split(pr[2], pr[3], bhi[1], blo[1]);
#pragma unroll
          for (int m = 0; m < VMW; ++m) {
            const int cl = (warp * VMW + m) * 16 + 2 * g;  // C row g: channel cl, g+8: cl+1
            float x[4][2];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
              x[u][0] = vr[u] ? vqk_to_f(vr[u][cl]) : 0.f;
              x[u][1] = vr[u] ? vqk_to_f(vr[u][cl + 1]) : 0.f;
            }
            uint32_t a[4];
            a[0] = vqk_h2(x[0][0], x[1][0]);
            a[1] = vqk_h2(x[0][1], x[1][1]);
            a[2] = vqk_h2(x[2][0], x[3][0]);
            a[3] = vqk_h2(x[2][1], x[3][1]);
            vqk_mma(oacc[m], a, bhi);
            vqk_mma(oacc[m], a, blo);
          }
        }
      }
    }
    __syncthreads();
    if (next) {  // the value buffers are free: copy the next chunk's values
      issue_values(t0 + CHUNK);
      vqk_cp_commit();
      store_key_scales();
      vqk_cp_wait<1>();  // the next keys (the next values may still be in flight)
      __syncthreads();
    }
  }

  // ---- 5. add the value bias term, write this split's partial (m, l, o)
  const float vb0 = (2 * q4 < GQA) ? sm_vb[(2 * q4) * DG + vgrp] : 0.f;
  const float vb1 = (2 * q4 + 1 < GQA) ? sm_vb[(2 * q4 + 1) * DG + vgrp] : 0.f;
#pragma unroll
  for (int m = 0; m < VMW; ++m) {
    const int cl = (warp * VMW + m) * 16 + 2 * g;
    if (2 * q4 < GQA) {
      float* op = o_part + ((qrow + 2 * q4) * NS + split) * HEAD_DIM;
      op[cl] = oacc[m][0] + vb0;
      op[cl + 1] = oacc[m][2] + vb0;
    }
    if (2 * q4 + 1 < GQA) {
      float* op = o_part + ((qrow + 2 * q4 + 1) * NS + split) * HEAD_DIM;
      op[cl] = oacc[m][1] + vb1;
      op[cl + 1] = oacc[m][3] + vb1;
    }
  }
  if (tid < GQA) {
    ml_part[((qrow + tid) * NS + split) * 2 + 0] = sm_m[tid];
    ml_part[((qrow + tid) * NS + split) * 2 + 1] = sm_l[tid];
  }
"""
