"""CUDA source of the "frag" fused KIVI decode attention (see ``kivi_decode.py``).

The packed words feed the tensor cores in the order ``mx.quantize`` stores them. A lane
holds one packed word per (channel, block of tokens) for keys and per (token, block of
channels) for values; the mma fragments are filled with the codes at one position of
the word, so a fragment's rows (values) or columns (keys) are every ``PACK``-th
channel or token, and the mapping is carried through the softmax instead of
rearranging any data. Consequences:

* keys: ``scores^T (heads x tokens) = (q * s_k) . codes + q . b_k``. The mma's A operand
  is ``q * s_k`` split into a float16 value (rows 0-7) and its float16 residual (rows
  8-15), built once per key group and channel step, B is the codes; one product gives
  both parts of every score, and the C fragment of the scores is, lane for lane, the B
  fragment of the probabilities for the values (no shuffles, no shared memory);
* values: ``o^T (channels x heads) += codes^T . (p * s_v) + sum_t p b_v``; A is the codes,
  B is ``p * s_v`` (float16 value in columns 0-3, residual in 4-7 when a kv head has at
  most 4 query heads, two products otherwise), computed by the lane that holds p;
* a code becomes a float16 operand with a byte permute and a masked OR into the mantissa
  of 1024 (1024 + code, exact); a float16 subtraction takes the 1024 off, except for the
  codes KEEP lets keep it, whose offset comes off the scores (1024 q . s_k) and outputs
  (1024 sum_t p s_v) in float32. Codes that sit higher in their byte come out multiplied
  by 16 (2-bit: 4, 16, 64), undone once on the scores and at the end on the output rows.

Each warp walks its own tiles of ``8 * PACK`` tokens (one packed word per lane and row)
with its own online softmax and its own key and value buffers in shared memory, filled
by ``cp.async`` (the next tile's keys, scales included, while this tile's softmax and
values run, its values while the next keys are scored), so warps never wait for each
other until the end of the block, where the block's warps merge into one (max, sum,
output) partial. Shared-memory slots are XOR-swizzled so that the four rows a warp reads
at once fall on different banks. Tiles cover the tokens whose keys and values are both
quantized, split evenly over blocks that fit in one wave; the rest (the residual
windows, and the quantized keys whose values are still in the window) is the "tail":
chunks of ``TAIL`` tokens in float32 on the CUDA cores, in blocks of their own where
those fit in the same wave (batch 1), else in the tile blocks (batch 8), before their
tiles (TAIL_FIRST). Why: benchmarks/notes/fused_attention.md, sessions 4 and 6.

Template constants: T (float16), BITS, GROUP, HEAD_DIM (64 or 128), GQA (<= 8), NT (64:
two warps), KVEC (4: key rows 16-byte aligned; 1: 4-byte copies), KEEP (which codes keep
their float16 offset of 1024 into the products: 0 none, exact; 1 the codes 4 or more
bits up their byte, whose unit is at least 16, so the float32 sums lose ~6 bits of it
instead of ~10 (none at 8 bits); 2 every key code and the values as in 1; 3 every code.
The dispatcher takes 1, or 0 where a block sums many tiles; 2 and 3 only the benchmarks),
TAIL_FIRST (the block's tail chunks before its tiles, their partial kept in shared
memory), ROWS (a packed batch, ``kivi_decode_attention_rows``: sequence b's counts, its
first tail token and its value window's ring start from its row of ``params``, from
ROW_PARAMS0 on; the plan is the batch's widest, and a block past its sequence's tiles or
tail chunks has nothing of them to do). ``params`` adds to the counts of the other kernels: tiles per block, the first
tail token (a multiple of the tile), the number of tail chunks and the first block that
takes them. The header of this kernel ends with :func:`cuda_frag_bounds` (launch bounds:
the register budget).

Checked on an H200 against the float32 reference: every 4- and 8-bit configuration of
benchmarks/fused_attention.py's check and 2-bit group 64 (run 15 of
benchmarks/results/fused_attention.md: 25 of 25, worst 9.8e-5); the other 2-bit groups
less (benchmarks/notes/fused_attention.md). The dispatcher uses folded at 2 bits.
"""

from .kivi_decode_cuda_src import CUDA_PROLOGUE_GRID, prologue_counts

#: ROWS: where sequence b's counts start in ``params`` and how many it has (n_kq, n_kres,
#: n_vq, n_vres, its first tile-free token, the first row of its value window)
ROW_PARAMS0, ROW_PARAMS = 9, 6

CUDA_FRAG_HEADER = r"""
// code C of both words as a float16 pair (wa's, wb's): 1024 + code * 2^((C * BITS) % 8),
// exact; sub: minus the 1024
template <int BITS>
__device__ __forceinline__ uint32_t vqk_codes2(uint32_t wa, uint32_t wb, int c, bool sub) {
  const uint32_t byte = (uint32_t)(c * BITS) / 8;
  const uint32_t sel = byte | (byte << 4) | ((byte + 4) << 8) | ((byte + 4) << 12);
  const uint32_t m = (((1u << BITS) - 1u) << ((c * BITS) % 8)) * 0x10001u;
  const uint32_t x = vqk_and_or(__byte_perm(wa, wb, sel), m, 0x64006400u);
  return sub ? vqk_sub1024(x) : x;
}
// Whether code C of a key / value word keeps its float16 offset of 1024 into the product
// (KEEP, see the kernel's docstring). A code 4 or more bits up its byte has a unit of at
// least 16: the offset costs the float32 sums ~6 bits of it instead of ~10
template <int BITS, int KEEP>
__device__ __forceinline__ constexpr bool vqk_keep_k(int c) {
  return KEEP >= 2 || (KEEP == 1 && (c * BITS) % 8 >= 4);
}
template <int BITS, int KEEP>
__device__ __forceinline__ constexpr bool vqk_keep_v(int c) {
  return KEEP == 3 || (KEEP >= 1 && (c * BITS) % 8 >= 4);
}
// 2^x in one MUFU instruction (relative error ~2^-22; exp2f adds range checks); 2^-inf = 0
__device__ __forceinline__ float vqk_exp2(float x) {
#ifdef VQK_EMULATION
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#endif
}
// (hi, lo) float16 pairs with hi + lo == (x0, x1) to about 2^-22 (lo from the packed hi)
__device__ __forceinline__ void vqk_split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = vqk_h2(x0, x1);
  const float2 h = vqk_h2f(hi);
  lo = vqk_h2(x0 - h.x, x1 - h.y);
}
"""



def cuda_frag_bounds(threads: int, min_blocks: int) -> str:
    """Appended to the header of the frag kernel only: MLX declares the kernel right after
    the header as ``__global__ void name(``, so this gives it launch bounds (``threads``
    a block, ``min_blocks`` resident blocks an SM: the register budget a thread)."""
    return (f"\n#ifndef VQK_EMULATION\n#undef __global__\n#define __global__ "
            f"__attribute__((global)) __attribute__((launch_bounds({threads}, {min_blocks})))"
            f"\n#endif\n")

CUDA_FRAG_SOURCE = CUDA_PROLOGUE_GRID + rf"""
  const auto* counts = ROWS ? params + ({ROW_PARAMS0} + {ROW_PARAMS} * b) : params;
""" + prologue_counts("counts") + r"""
  constexpr int PACK = 32 / BITS;
  constexpr int NW = NT / 32;
  constexpr int TT = 8 * PACK;                   // tokens per tile
  constexpr int KS = HEAD_DIM / 16;              // key channel steps
  constexpr int KGT = TT > GROUP ? TT / GROUP : 1;  // key groups per tile
  constexpr int DW = HEAD_DIM / PACK;            // value words per token
  constexpr int DG = HEAD_DIM / GROUP;           // value groups per token
  constexpr int NH = HEAD_DIM / (8 * PACK);      // value word columns per lane
  constexpr int VGT = 8 * PACK > GROUP ? 8 * PACK / GROUP : 1;  // value groups per m-tile
  constexpr int NJ = PACK / 2;                   // code pairs per word
  constexpr int CW = 8 * HEAD_DIM;               // code words per tile (keys; values too)
  constexpr int NKS = KGT * HEAD_DIM / 32;       // key (scale, bias) per lane and tile
  constexpr int NVS = TT * DG / 32;              // value (scale, bias) per lane and tile
  constexpr int TPW = 8;                         // tail tokens per warp, in rounds of 4
  constexpr int TAIL = TPW * NW;                 // tail tokens per chunk
  constexpr int CPL = HEAD_DIM / 32;             // tail: channels per lane
  constexpr bool TWO_B = GQA > 4;                // values: hi and lo B in two products
  // whether any key / value code keeps its 1024 (a word's top code is the first to): the
  // float32 offset sums only then (none at 8 bits with KEEP 1)
  constexpr bool KEEP_K = vqk_keep_k<BITS, KEEP>(PACK - 1);
  constexpr bool KEEP_V = vqk_keep_v<BITS, KEEP>(PACK - 1);
  static_assert(NT % 32 == 0 && GQA <= 8 && HEAD_DIM % 32 == 0, "shape");
  static_assert(HEAD_DIM % (8 * PACK) == 0 && NKS >= 1 && NVS >= 1, "tiling");
  static_assert((NKS * 32) % KGT == 0 && (NVS * 32) % DG == 0, "scales");
  static_assert(GQA * HEAD_DIM <= CW && 2 * GQA * DG <= CW && GQA * HEAD_DIM <= KS * 128, "epilogue");

  __shared__ __align__(16) uint32_t kc_s[NW * CW];   // [warp][channel][8 words]
  __shared__ __align__(16) uint32_t vc_s[NW * CW];   // [warp][token][DW words]
  __shared__ __align__(16) float2 ksb_s[NW * KGT * HEAD_DIM];  // [warp][group][channel]
  constexpr int TTP = TT + 8;  // value scale rows padded: 16 bytes every 2 PACK tokens
  __shared__ __align__(16) float2 vsb_s[NW * DG * TTP];        // [warp][group][token]
  __shared__ __align__(16) float4 qf[KS * 32];  // a lane's q: its head, 4 channels a step
  // TAIL_FIRST: the warp's tail partial [head][channel] and its (max, sum) per head
  __shared__ float tail_o[TAIL_FIRST ? NW * GQA * HEAD_DIM : 1];
  __shared__ float tail_ml[TAIL_FIRST ? NW * GQA * 2 : 1];
  __shared__ float ep_m[NW * GQA];
  __shared__ float ep_l[NW * GQA];

  const int g = lane >> 2;
  const int q4 = lane & 3;
  const int t_fast = ROWS ? counts[4] : params[6];
  const int v_ring = ROWS ? counts[5] : 0;  // the value window's row of token n_vq
  const int ns_tail = params[7];  // tail chunks
  const int tail0 = params[8];    // the first block that takes tail chunks
  const bool has_tail = split >= tail0 && split - tail0 < ns_tail;
  // the warp's unnormalized output [head][channel] for the epilogue (its key buffer)
  float* obuf = reinterpret_cast<float*>(kc_s + warp * CW);

  // ---- tail: the block's chunks of TAIL tokens from t_fast (chunks split - tail0, plus
  //      multiples of NS - tail0), float32 on the CUDA cores, into a warp's (m, l, o); a
  //      warp takes 4 tokens a round, a lane CPL channels of each. Blocks of their own
  //      (tail0 = the tile blocks) where they fit in the wave beside the tile blocks, else
  //      the tile blocks' (tail0 = 0), where with TAIL_FIRST they go before the tiles,
  //      even before the first tile's copies are issued (after the tiles they added
  //      4.5-17.5 us to a block at batch 8, beside the first copies ~10), the partial
  //      waiting in tail_o and tail_ml for the tiles' epilogue
  auto tail_partial = [&](float (&m)[GQA], float (&l)[GQA], float (&o)[GQA][CPL]) {
    __syncwarp();
    // the lane's channels of every head's query (times qscale), read back from qf: head r
    // is row r of the A fragments, channel c component (c & 1) + 2 ((c & 15) >= 8) of the
    // float4 of lane 4 r + (c & 7) / 2 of key step c / 16
    float qs[GQA][CPL];
#pragma unroll
    for (int r = 0; r < GQA; ++r)
#pragma unroll
      for (int x = 0; x < CPL; ++x) {
        const int c = lane + 32 * x, w = c & 15;
        qs[r][x] = reinterpret_cast<const float*>(qf)[4 * ((c >> 4) * 32 + 4 * r + (w & 7) / 2)
                                                      + (w & 1) + (w >= 8 ? 2 : 0)];
      }
#pragma unroll
    for (int r = 0; r < GQA; ++r) {
      m[r] = -vqk_inf();
      l[r] = 0.f;
#pragma unroll
      for (int x = 0; x < CPL; ++x) o[r][x] = 0.f;
    }
    constexpr uint32_t MASK = (1u << BITS) - 1u;
    // tokens a pass, all their loads issued before any is used; 4 at GQA > 4 (registers).
    // Alone this did not shorten the tail (measured with its other changes, session 6)
    constexpr int TP = GQA <= 4 ? TPW : 4;
    for (int chunk = split - tail0; chunk < ns_tail; chunk += NS - tail0) {
#pragma unroll
      for (int p0 = 0; p0 < TPW; p0 += TP) {
        const int tp = t_fast + chunk * TAIL + warp * TPW + p0;  // warp-uniform
        if (tp >= Tn) break;
        float kx[TP][CPL], vx[TP][CPL], s[TP][GQA];
#pragma unroll
        for (int j0 = 0; j0 < TP; j0 += 4) {
          // A round's 4 tokens share their key words, scales and biases (n_kq is a
          // multiple of the group, tw of 4, and a word holds >= 4 tokens): one load of
          // each per channel, not per token. Both sources are read (element 0 of the one
          // not used): no branch, so that the loads are in flight together.
          // a round past the end reads the last one again (masked below)
          const int tw = min(tp + j0, (Tn - 1) & ~3);
          const bool kq = tw < n_kq;
          uint32_t kw[CPL];
          float ks[CPL], kb[CPL];
#pragma unroll
          for (int x = 0; x < CPL; ++x) {
            const size_t krow = (size_t)bh * HEAD_DIM + lane + 32 * x;
            kw[x] = k_codes[kq ? krow * CKW + tw / PACK : 0];
            ks[x] = vqk_to_f(k_scales[kq ? krow * CKG + tw / GROUP : 0]);
            kb[x] = vqk_to_f(k_biases[kq ? krow * CKG + tw / GROUP : 0]);
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int t = min(tw + j, Tn - 1);  // past the end: a valid token, masked below
            const bool vq = t < n_vq;
#pragma unroll
            for (int x = 0; x < CPL; ++x) {
              const int c = lane + 32 * x;
              const size_t vrow_ = (size_t)bh * CV + t;
              const float kr =
                  vqk_to_f(k_res[kq ? 0 : ((size_t)bh * CKR + (t - n_kq)) * HEAD_DIM + c]);
              const uint32_t vw = v_codes[vq ? vrow_ * DW + c / PACK : 0];
              const float vs = vqk_to_f(v_scales[vq ? vrow_ * DG + c / GROUP : 0]);
              const float vb = vqk_to_f(v_biases[vq ? vrow_ * DG + c / GROUP : 0]);
              const int vrr = ROWS ? (v_ring + t - n_vq) % CVR : t - n_vq;
              const float vr = vqk_to_f(v_res[vq ? 0 : ((size_t)bh * CVR + vrr) * HEAD_DIM + c]);
              const uint32_t code = (kw[x] >> (((tw + j) % PACK) * BITS)) & MASK;
              kx[j0 + j][x] = kq ? fmaf(ks[x], (float)code, kb[x]) : kr;
              vx[j0 + j][x] = vq ? fmaf(vs, (float)((vw >> ((c % PACK) * BITS)) & MASK), vb) : vr;
            }
          }
        }
#pragma unroll
        for (int j = 0; j < TP; ++j)
#pragma unroll
          for (int r = 0; r < GQA; ++r) {
            float d = 0.f;
#pragma unroll
            for (int x = 0; x < CPL; ++x) d = fmaf(qs[r][x], kx[j][x], d);
            s[j][r] = d;
          }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)  // the TP x GQA sums side by side
#pragma unroll
          for (int j = 0; j < TP; ++j)
#pragma unroll
            for (int r = 0; r < GQA; ++r) s[j][r] += __shfl_xor_sync(0xffffffffu, s[j][r], off);
        // the pass's tokens in one step of the online softmax (tokens past the end: p = 0)
#pragma unroll
        for (int r = 0; r < GQA; ++r) {
          float mn = m[r];
#pragma unroll
          for (int j = 0; j < TP; ++j)
            if (tp + j < Tn) mn = fmaxf(mn, s[j][r]);
          const float a = vqk_exp2(m[r] - mn);
          m[r] = mn;
          float lsum = 0.f;
#pragma unroll
          for (int x = 0; x < CPL; ++x) o[r][x] *= a;
#pragma unroll
          for (int j = 0; j < TP; ++j) {
            const float p = tp + j < Tn ? vqk_exp2(s[j][r] - mn) : 0.f;
            lsum += p;
#pragma unroll
            for (int x = 0; x < CPL; ++x) o[r][x] = fmaf(p, vx[j][x], o[r][x]);
          }
          l[r] = fmaf(l[r], a, lsum);
        }
      }
    }
  };

  {
    // ---- tiles: whole key and value words, tensor cores
    const int n_tiles = t_fast / TT;
    const int k_begin = split * cpb;
    const int k_end = min(k_begin + cpb, n_tiles);
    for (int i = tid; i < KS * 32; i += NT) {
      // row g of the A fragments and column g of the value B fragments: query head hh
      const int gg = (i & 31) >> 2;
      const int hh = GQA <= 4 ? (gg & 3) % GQA : gg % GQA;
      const int c = 16 * (i / 32) + 2 * (i & 3);
      const T* qp = queries + (qrow + hh) * HEAD_DIM;
      qf[i] = make_float4(vqk_to_f(qp[c]) * qscale, vqk_to_f(qp[c + 1]) * qscale,
                          vqk_to_f(qp[c + 8]) * qscale, vqk_to_f(qp[c + 9]) * qscale);
    }
    __syncthreads();

    uint32_t* kc = kc_s + warp * CW;
    uint32_t* vc = vc_s + warp * CW;
    float2* ksw = ksb_s + warp * KGT * HEAD_DIM;
    float2* vsw = vsb_s + warp * DG * TTP;
    T rvs[NVS], rvb[NVS];
    // Shared-memory slot of word f of a tile (f = channel * 8 + word for keys, token * DW +
    // word for values): bits 3-4 of f (which 8-word quarter of a 32-word line) are XORed
    // with bits of the row, so that the four rows a warp reads at once (channels 2 q4
    // apart, tokens 2 PACK q4 apart) fall on different banks. The 16-byte pieces the
    // copies move stay whole; for the reads the XOR is a constant of the lane.
    auto kslot = [](int f) { return f ^ (8 * ((f >> 5) & 1)); };
    auto vslot = [](int f) { return f ^ (8 * (((f / DW) / (2 * PACK)) & 3)); };
    // The lane's reads: key rows 16 s + 2 q4 + {0, 1, 8, 9} (word g), whose slots are
    // those of rows 2 q4 + {0, 1, 8, 9} plus 128 s; value word w of token 2 PACK q4 + o,
    // whose slot is 2 HEAD_DIM q4 + g + ((C & 24) ^ 8 q4) + (C & ~24) for C = o DW + w - g
    // (the XOR touches bits 3-4 only): one pointer per value of C & 24, C a constant.
    const int kx = 8 * (q4 >> 1);
    const uint32_t* krow[4] = {kc + (((2 * q4) * 8 + g) ^ kx), kc + (((2 * q4 + 1) * 8 + g) ^ kx),
                               kc + (((2 * q4 + 8) * 8 + g) ^ kx), kc + (((2 * q4 + 9) * 8 + g) ^ kx)};
    const uint32_t* vrow[4];
#pragma unroll
    for (int x = 0; x < 4; ++x) vrow[x] = vc + 2 * HEAD_DIM * q4 + g + ((8 * x) ^ (8 * q4));
    const size_t kscale0 = (size_t)bh * HEAD_DIM * CKG + (lane / KGT) * CKG + lane % KGT;
    // copies of one tile's codes (cp.async) and scales (registers, stored after a wait)
    // this lane's part of the key copies (16 bytes: row lane / 2 + 16 j, half lane & 1)
    const uint32_t* ksrc = k_codes + (size_t)bh * HEAD_DIM * CKW + (lane >> 1) * CKW + 4 * (lane & 1);
    uint32_t* kdst = kc + kslot(4 * lane);
    auto issue_keys = [&](int k) {
      if constexpr (KVEC == 4) {
        const uint32_t* sp = ksrc + k * (TT / PACK);
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 16; ++j)
          vqk_cp_async<16>(kdst + 128 * j, sp + (size_t)(16 * j) * CKW);
      } else {
        const uint32_t* src = k_codes + (size_t)bh * HEAD_DIM * CKW + k * (TT / PACK);
#pragma unroll
        for (int i = lane; i < CW; i += 32) vqk_cp_async<4>(kc + kslot(i), src + (i >> 3) * CKW + (i & 7));
      }
      // Key scales and biases: the 4-byte word holding each (two float16s; the buffers
      // hold an even count, so the word is in bounds) copied raw into the element's
      // float2 slot, converted there after the wait. Loaded into registers instead, they
      // were the kernel's largest stall (13% of the samples, ncu): 128 rows a tile, each
      // a separate sector, arriving after the codes.
      const size_t s0 = kscale0 + (k * TT) / GROUP;
#pragma unroll
      for (int u = 0; u < NKS; ++u) {  // element lane + 32 u: channel (lane + 32 u) / KGT
        const int e = lane + 32 * u;
        const size_t i = s0 + (size_t)(u * (32 / KGT)) * CKG;
        float2* slot = ksw + (e % KGT) * HEAD_DIM + e / KGT;
        vqk_cp_async<4>(&slot->x, reinterpret_cast<const uint32_t*>(k_scales) + i / 2);
        vqk_cp_async<4>(&slot->y, reinterpret_cast<const uint32_t*>(k_biases) + i / 2);
      }
      vqk_cp_commit();
    };
    auto issue_values = [&](int k) {
      const uint32_t* src = v_codes + ((size_t)bh * CV + k * TT) * DW;
#pragma unroll
      for (int i = lane; i < CW / 4; i += 32) vqk_cp_async<16>(vc + vslot(4 * i), src + 4 * i);
      vqk_cp_commit();
      const size_t s0 = ((size_t)bh * CV + k * TT) * DG;
#pragma unroll
      for (int u = 0; u < NVS; ++u) {
        rvs[u] = v_scales[s0 + lane + 32 * u];
        rvb[u] = v_biases[s0 + lane + 32 * u];
      }
    };

    float oacc[NH * NJ][4];
#pragma unroll
    for (int i = 0; i < NH * NJ; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) oacc[i][e] = 0.f;
    float m_run = -vqk_inf(), l_run = 0.f;
    float bsum[DG];  // sum_t p_t b_v,t per value group, head of row g, this lane's tokens
    float psum[DG];  // sum_t p_t s_v,t likewise (the 1024 the value codes may keep)
#pragma unroll
    for (int i = 0; i < DG; ++i) bsum[i] = psum[i] = 0.f;
    // value C columns 2 q4 and 2 q4 + 1: their heads (for the rescale)
    const int ch0 = GQA <= 4 ? ((2 * q4) & 3) % GQA : (2 * q4) % GQA;
    const int ch1 = GQA <= 4 ? ((2 * q4 + 1) & 3) % GQA : (2 * q4 + 1) % GQA;
    const int gcol = KGT > 1 ? (g * PACK) / GROUP : 0;      // key group of B column g
    const int gk = KGT > 1 ? (2 * q4 * PACK) / GROUP : 0;   // key group of C columns

    int k = k_begin + warp;
    if (TAIL_FIRST && has_tail) {
      float m[GQA], l[GQA], o[GQA][CPL];
      tail_partial(m, l, o);
#pragma unroll
      for (int r = 0; r < GQA; ++r) {
#pragma unroll
        for (int x = 0; x < CPL; ++x)
          tail_o[(warp * GQA + r) * HEAD_DIM + lane + 32 * x] = o[r][x];
        if (lane == 0) {
          tail_ml[(warp * GQA + r) * 2] = m[r];
          tail_ml[(warp * GQA + r) * 2 + 1] = l[r];
        }
      }
    }
    if (k < k_end) {
      issue_keys(k);
      issue_values(k);
    }
    for (; k < k_end; k += NW) {
      const bool next = k + NW < k_end;
      vqk_cp_wait<1>();  // this tile's keys (its values may still be in flight)
      const size_t s0 = kscale0 + (k * TT) / GROUP;
#pragma unroll
      for (int u = 0; u < NKS; ++u) {
        const int e = lane + 32 * u;
        const bool odd = (s0 + (size_t)(u * (32 / KGT)) * CKG) & 1;
        float2* slot = ksw + (e % KGT) * HEAD_DIM + e / KGT;
        const float2 raw = *slot;
        const float2 sc = vqk_h2f(__float_as_uint(raw.x)), bi = vqk_h2f(__float_as_uint(raw.y));
        *slot = make_float2(odd ? sc.y : sc.x, odd ? bi.y : bi.x);
      }
      __syncwarp();

      // 1. scores of the head of row g: column 2 q4 (+1) of n-tile i is token
      //    PACK * 2 q4 + i (+ PACK)
      float acc[PACK][4];
#pragma unroll
      for (int i = 0; i < PACK; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
      float beta[KGT];  // q . b_k
#pragma unroll
      for (int i = 0; i < KGT; ++i) beta[i] = 0.f;
      float qsum[KGT];
#pragma unroll
      for (int i = 0; i < KGT; ++i) qsum[i] = 0.f;
#pragma unroll
      for (int s = 0; s < KS; ++s) {
        const float4 qv = qf[s * 32 + lane];
        const int d0 = 16 * s + 2 * q4;
        const uint32_t w0 = krow[0][128 * s], w1 = krow[1][128 * s];
        const uint32_t w2 = krow[2][128 * s], w3 = krow[3][128 * s];
        uint32_t a[KGT][4];
#pragma unroll
        for (int gi = 0; gi < KGT; ++gi) {
          const float2* sb = ksw + gi * HEAD_DIM + d0;
          const float2 s0 = sb[0], s1 = sb[1], s8 = sb[8], s9 = sb[9];
          beta[gi] = fmaf(qv.x, s0.y, fmaf(qv.y, s1.y, fmaf(qv.z, s8.y, fmaf(qv.w, s9.y, beta[gi]))));
          const float x0 = qv.x * s0.x, x1 = qv.y * s1.x, x8 = qv.z * s8.x, x9 = qv.w * s9.x;
          vqk_split2(x0, x1, a[gi][0], a[gi][1]);
          vqk_split2(x8, x9, a[gi][2], a[gi][3]);
          // q . s_k for the codes that keep their 1024 (the float16 parts the mma sees
          // differ from it by ~2^-22 of it: far below what the offset costs)
          if constexpr (KEEP_K) qsum[gi] += (x0 + x1) + (x8 + x9);
        }
#pragma unroll
        for (int i = 0; i < PACK; ++i) {
          const bool sub = !vqk_keep_k<BITS, KEEP>(i);
          const uint32_t bb[2] = {vqk_codes2<BITS>(w0, w1, i, sub), vqk_codes2<BITS>(w2, w3, i, sub)};
          if constexpr (KGT == 1) {
            vqk_mma(acc[i], a[0], bb);
          } else {
#pragma unroll
            for (int gi = 0; gi < KGT; ++gi) {
              const uint32_t z = gcol == gi ? ~0u : 0u;
              const uint32_t bm[2] = {bb[0] & z, bb[1] & z};
              vqk_mma(acc[i], a[gi], bm);
            }
          }
        }
      }
      float bk = 0.f, qk = 0.f;
#pragma unroll
      for (int gi = 0; gi < KGT; ++gi) {
        float x = beta[gi], y = qsum[gi];
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        if constexpr (KEEP_K) {
          y += __shfl_xor_sync(0xffffffffu, y, 1);
          y += __shfl_xor_sync(0xffffffffu, y, 2);
        }
        if (gi == gk) {
          bk = x;
          qk = 1024.f * y;
        }
      }
      __syncwarp();  // the key buffer is read: copy the next tile's keys
      if (next) issue_keys(k + NW);

      // 2. online softmax (base 2) over the tile
      float sc[PACK][2];
      float mt = -vqk_inf();
#pragma unroll
      for (int i = 0; i < PACK; ++i) {
        const float f = 1.f / (float)(1 << ((i * BITS) % 8));
        const float off = vqk_keep_k<BITS, KEEP>(i) ? qk : 0.f;
        sc[i][0] = fmaf(acc[i][0] + acc[i][2] - off, f, bk);
        sc[i][1] = fmaf(acc[i][1] + acc[i][3] - off, f, bk);
        mt = fmaxf(mt, fmaxf(sc[i][0], sc[i][1]));
      }
      mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
      mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
      const float m_new = fmaxf(m_run, mt);
      const float alpha = vqk_exp2(m_run - m_new);
      m_run = m_new;
      float lsum = 0.f;
#pragma unroll
      for (int i = 0; i < PACK; ++i) {
        sc[i][0] = vqk_exp2(sc[i][0] - m_new);
        sc[i][1] = vqk_exp2(sc[i][1] - m_new);
        lsum += sc[i][0] + sc[i][1];
      }
      l_run = fmaf(l_run, alpha, lsum);
#pragma unroll
      for (int i = 0; i < DG; ++i) {
        bsum[i] *= alpha;
        if constexpr (KEEP_V) psum[i] *= alpha;
      }
      const float a0 = __shfl_sync(0xffffffffu, alpha, 4 * ch0);
      const float a1 = __shfl_sync(0xffffffffu, alpha, 4 * ch1);
#pragma unroll
      for (int i = 0; i < NH * NJ; ++i) {
        oacc[i][0] *= a0;
        oacc[i][1] *= a1;
        oacc[i][2] *= a0;
        oacc[i][3] *= a1;
      }

      // 3. values, 16 tokens a step: n-tiles 2u and 2u + 1 of the scores
      if (next)
        vqk_cp_wait<1>();  // this tile's values (the next keys may be in flight)
      else
        vqk_cp_wait<0>();
#pragma unroll
      for (int u = 0; u < NVS; ++u) {
        const int e = lane + 32 * u;
        const int t = e / DG;
        vsw[(e % DG) * TTP + t + 2 * (t / (2 * PACK))] = make_float2(vqk_to_f(rvs[u]), vqk_to_f(rvb[u]));
      }
      __syncwarp();
#pragma unroll
      for (int u = 0; u < NJ; ++u) {
        const int tA = PACK * 2 * q4 + 2 * u;  // k 2q4, 2q4+1: tA, tB; k + 8: tA + 1, tB + 1
        const int tB = tA + PACK;
        const float pA = sc[2 * u][0], pB = sc[2 * u][1];
        const float pC = sc[2 * u + 1][0], pD = sc[2 * u + 1][1];
        uint32_t bhi[DG][2], blo[DG][2];
#pragma unroll
        for (int gv = 0; gv < DG; ++gv) {
          const float4 sa = *reinterpret_cast<const float4*>(vsw + gv * TTP + tA + 2 * q4);
          const float4 sbb = *reinterpret_cast<const float4*>(vsw + gv * TTP + tB + 2 * q4);
          bsum[gv] = fmaf(pA, sa.y, fmaf(pC, sa.w, fmaf(pB, sbb.y, fmaf(pD, sbb.w, bsum[gv]))));
          const float xA = pA * sa.x, xB = pB * sbb.x, xC = pC * sa.z, xD = pD * sbb.z;
          if constexpr (KEEP_V) psum[gv] += (xA + xB) + (xC + xD);
          vqk_split2(xA, xB, bhi[gv][0], blo[gv][0]);
          vqk_split2(xC, xD, bhi[gv][1], blo[gv][1]);
          if constexpr (!TWO_B) {  // columns 0-3: float16 values, 4-7: residuals
            if (g >= 4) {
              bhi[gv][0] = blo[gv][0];
              bhi[gv][1] = blo[gv][1];
            }
          }
        }
#pragma unroll
        for (int hh = 0; hh < NH; ++hh) {
          // offsets o DW + 8 hh of tokens tA, tB, tA + 1, tB + 1 (constants once unrolled)
          const int cA = 2 * u * DW + 8 * hh, cB = cA + PACK * DW, cC = cA + DW, cD = cB + DW;
          const uint32_t wA = vrow[(cA >> 3) & 3][cA & ~24], wB = vrow[(cB >> 3) & 3][cB & ~24];
          const uint32_t wC = vrow[(cC >> 3) & 3][cC & ~24], wD = vrow[(cD >> 3) & 3][cD & ~24];
#pragma unroll
          for (int j = 0; j < NJ; ++j) {
            const bool s0 = !vqk_keep_v<BITS, KEEP>(2 * j), s1 = !vqk_keep_v<BITS, KEEP>(2 * j + 1);
            const uint32_t a[4] = {vqk_codes2<BITS>(wA, wB, 2 * j, s0),
                                   vqk_codes2<BITS>(wA, wB, 2 * j + 1, s1),
                                   vqk_codes2<BITS>(wC, wD, 2 * j, s0),
                                   vqk_codes2<BITS>(wC, wD, 2 * j + 1, s1)};
            float* o = oacc[hh * NJ + j];
#pragma unroll
            for (int vg = 0; vg < VGT; ++vg) {
              const int gv = (8 * PACK * hh) / GROUP + vg;
              uint32_t am[4] = {a[0], a[1], a[2], a[3]};
              if constexpr (VGT > 1) {
                const uint32_t z = (g * PACK) / GROUP == vg ? ~0u : 0u;
#pragma unroll
                for (int e = 0; e < 4; ++e) am[e] &= z;
              }
              vqk_mma(o, am, bhi[gv]);
              if constexpr (TWO_B) vqk_mma(o, am, blo[gv]);
            }
          }
        }
      }
      __syncwarp();  // the value buffer is read: copy the next tile's values
      if (next) issue_values(k + NW);
    }

    // ---- the warp's partial: sums over the quad, bias term, hi + lo columns
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
#pragma unroll
    for (int i = 0; i < DG; ++i) {
      bsum[i] += __shfl_xor_sync(0xffffffffu, bsum[i], 1);
      bsum[i] += __shfl_xor_sync(0xffffffffu, bsum[i], 2);
      if constexpr (KEEP_V) {
        psum[i] += __shfl_xor_sync(0xffffffffu, psum[i], 1);
        psum[i] += __shfl_xor_sync(0xffffffffu, psum[i], 2);
      }
    }
    float* ep_b = reinterpret_cast<float*>(vc);  // [head][value group]: bias term
    float* ep_p = ep_b + GQA * DG;               // [head][value group]: 1024 * sum p s_v
    if (q4 == 0 && g < GQA) {
      ep_m[warp * GQA + g] = m_run;
      ep_l[warp * GQA + g] = l_run;
#pragma unroll
      for (int i = 0; i < DG; ++i) {
        ep_b[g * DG + i] = bsum[i];
        ep_p[g * DG + i] = 1024.f * psum[i];
      }
    }
    __syncwarp();
#pragma unroll
    for (int hh = 0; hh < NH; ++hh)
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = oacc[hh * NJ + j][e];
          if constexpr (!TWO_B) v += __shfl_xor_sync(0xffffffffu, v, 2);  // column + 4
          const int col = 2 * q4 + (e & 1);
          const int code = 2 * j + (e >> 1);
          const int c = PACK * (8 * hh + g) + code;
          if (col < GQA && (TWO_B || col < 4)) {
            const float f = 1.f / (float)(1 << ((code * BITS) % 8));
            const float off = vqk_keep_v<BITS, KEEP>(code) ? ep_p[col * DG + c / GROUP] : 0.f;
            obuf[col * HEAD_DIM + c] = fmaf(v - off, f, ep_b[col * DG + c / GROUP]);
          }
        }
  }

  // ---- the tail's partial into the warp's (written above by the tiles, empty if none)
  if (has_tail) {
    float m[GQA], l[GQA], o[GQA][CPL];
    if constexpr (TAIL_FIRST) {
      __syncwarp();
#pragma unroll
      for (int r = 0; r < GQA; ++r) {
        m[r] = tail_ml[(warp * GQA + r) * 2];
        l[r] = tail_ml[(warp * GQA + r) * 2 + 1];
#pragma unroll
        for (int x = 0; x < CPL; ++x) o[r][x] = tail_o[(warp * GQA + r) * HEAD_DIM + lane + 32 * x];
      }
    } else {
      tail_partial(m, l, o);
    }
#pragma unroll
    for (int r = 0; r < GQA; ++r) {
      const float mw = ep_m[warp * GQA + r];
      const float M = fmaxf(mw, m[r]);
      if (M > -vqk_inf()) {
        const float aw = exp2f(mw - M), at = exp2f(m[r] - M);
#pragma unroll
        for (int x = 0; x < CPL; ++x) {
          float* ob = obuf + r * HEAD_DIM + lane + 32 * x;
          *ob = fmaf(*ob, aw, o[r][x] * at);
        }
        __syncwarp();
        if (lane == 0) {
          ep_l[warp * GQA + r] = fmaf(ep_l[warp * GQA + r], aw, l[r] * at);
          ep_m[warp * GQA + r] = M;
        }
      }
    }
  }

  // ---- merge the block's warps into one partial
  __syncthreads();
  for (int i = tid; i < GQA * HEAD_DIM; i += NT) {
    const int r = i / HEAD_DIM;
    float M = -vqk_inf();
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, ep_m[w * GQA + r]);
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float mw = ep_m[w * GQA + r];
      if (mw > -vqk_inf())
        acc = fmaf(exp2f(mw - M), reinterpret_cast<const float*>(kc_s + w * CW)[i], acc);
    }
    o_part[((qrow + r) * NS + split) * HEAD_DIM + (i - r * HEAD_DIM)] = acc;
  }
  if (tid < GQA) {
    float M = -vqk_inf();
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, ep_m[w * GQA + tid]);
    float L = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float mw = ep_m[w * GQA + tid];
      if (mw > -vqk_inf()) L = fmaf(exp2f(mw - M), ep_l[w * GQA + tid], L);
    }
    ml_part[((qrow + tid) * NS + split) * 2 + 0] = M;
    ml_part[((qrow + tid) * NS + split) * 2 + 1] = L;
  }
"""
