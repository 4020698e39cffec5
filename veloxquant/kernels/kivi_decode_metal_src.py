"""Metal sources of the fused KIVI decode attention (see ``kivi_decode.py``).

The twin of the CUDA simt kernel, through ``mx.fast.metal_kernel``. No Metal hardware
was available: these sources were never compiled or run.
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
