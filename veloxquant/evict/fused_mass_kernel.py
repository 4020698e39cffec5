"""The prompt queries' attention mass over the keys in two launches that never write a
logit (the GPU path of ``attention.attention_mass`` for float16 and bfloat16 queries and
keys: H2O's prompt scoring, SnapKV's window, ChunkKV's and RocketKV's votes).

``mass_kernel.py`` reads logits that a product wrote (in blocks, to bound memory); at a
long prompt H2O's scoring was then most of its prefill: every query's float32 logits against
every key written once and read twice. Here the logits exist only in registers:

- ``lse``: a thread block takes 64 rows (a row is one query of one query head; a KV head's
  group of query heads are its rows) and walks the keys in tiles of 64 staged in shared
  memory. Each warp holds its 16 rows' queries as tensor-core fragments; a tile's logits are
  products ``m16n8k16`` (float32 accumulation) and fold into the rows' online maximum and
  sum of exponentials (base 2). It writes each row's log-sum-exp (+inf for a row that sees
  no key, so that it adds nothing).
- ``columns``: a thread block takes 64 keys, held by its warps as fragments, and walks the
  rows (``splits`` shares of them, each written apart and summed by MLX: deterministic) in
  tiles of 64 staged queries: ``exp(logit - lse) * w`` over the rows whose query sees the
  key, ``w`` the query's weight over the group's heads.

The keys are read where they lie, through their strides (a store's keys are a view of its
larger buffer; MLX would copy a view before each launch and keep the copy until its command
buffer ends): 16-byte loads where the words of a row are adjacent and every row starts on 16
bytes, one word a load otherwise. The other inputs are made row-contiguous first.

A key is visible to a query when its position is at least 0 (-1: a padding slot) and at most
the query's; without positions every key is visible. A tile that no row of a warp can see
is skipped (causal prompts skip about half), and one that no warp sees is not staged. The
logits are the products of the stored float16/bfloat16 values summed in float32, times the
scale, as MLX's float32 product of the same values is, but summed in the tensor cores'
order; the first use checks the kernels against MLX's float32 path once a process and dtype
(``CHECK_RTOL``; one case's keys a view of a larger buffer of two sequences) and keeps the
other paths if they fail. The CUDA source runs on the CPU by
emulation in the tests (float16 and bfloat16). The Metal twin computes the same quantities a
thread a row and a thread a key, without tensor cores: UNTESTED ON HARDWARE.

On by default where they pass their check (``VQ_FUSED_MASS=0`` turns them off): on an H100
they passed it for float16 and bfloat16 (about 2e-6 of the largest mass) and cut h2o's warm
prefill at 4k from 2.91x to 1.54x mlx-lm's KVCache's and keyformer's from 3.97x to 2.31x
(``benchmarks/results/h200_s82/README.md``). Reading the keys in place (session 83) is
emulated and compiled with nvcc, not yet run on a GPU: its self-check case guards it.
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx

from ..kernels import kivi_decode as kd
from ..kernels.checks import checked_once, gpu_kernel
from . import mass_kernel
from .mass_kernel import flat_positions

TILE = 64  # rows a block of the lse launch, keys a block of the columns launch, and a staged tile
NT = 128  # threads a block: 4 warps of 16 rows (or keys) each
MAX_HEAD_DIM = 256  # two staged tiles of 64 x (256 + 8) 16-bit words fit in static shared memory
TARGET_BLOCKS = 1024  # thread blocks the columns launch aims for (rows split to get there)
LOG2E = 1.4426950408889634

CUDA_HEADER = r"""
#ifndef VQK_EMULATION  // (the CPU emulation in the tests supplies its own)
template <bool BF16>
__device__ __forceinline__ void vqm_mma(float* c, const uint32_t* a, const uint32_t* b) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}
#endif
// a pair of 16-bit words (p[0] low, p[cs] high) as one 32-bit word; `vec`: adjacent (cs 1) and
// on 4 bytes, one load
__device__ __forceinline__ uint32_t vqm_pair(const uint16_t* p, long long cs, bool vec) {
  return vec ? *reinterpret_cast<const uint32_t*>(p) : (uint32_t)p[0] | ((uint32_t)p[cs] << 16);
}
// a warp's 16 rows of 16-bit words (word c of row i at rows + i * rs + c * cs) as an m16n8k16 A
// fragment per 16 columns; rows past `valid` are zero. `vec`: cs 1 and every row on 16 bytes
template <int KS>
__device__ __forceinline__ void vqm_load_a(uint32_t (*a)[4], const uint16_t* rows, long long rs, long long cs,
                                           bool vec, int g, int t, bool valid0, bool valid1) {
  const uint16_t* r0 = rows + g * rs + 2 * t * cs;
  const uint16_t* r1 = rows + (g + 8) * rs + 2 * t * cs;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    a[ks][0] = valid0 ? vqm_pair(r0 + 16 * ks * cs, cs, vec) : 0u;
    a[ks][1] = valid1 ? vqm_pair(r1 + 16 * ks * cs, cs, vec) : 0u;
    a[ks][2] = valid0 ? vqm_pair(r0 + (16 * ks + 8) * cs, cs, vec) : 0u;
    a[ks][3] = valid1 ? vqm_pair(r1 + (16 * ks + 8) * cs, cs, vec) : 0u;
  }
}
// 64 rows of HEAD_DIM 16-bit words from src (word c of row i at src + i * rs + c * cs, rows at
// and past `count` zero) into a shared tile of row stride HEAD_DIM + 8; `vec` (cs 1, every row
// on 16 bytes): 16 bytes a copy
template <int HEAD_DIM, int NTH>
__device__ __forceinline__ void vqm_stage(uint16_t* tile, const uint16_t* src, long long rs, long long cs, bool vec,
                                          int count, int tid) {
  constexpr int CH = HEAD_DIM / 8;
  for (int c = tid; c < 64 * CH; c += NTH) {
    const int r = c / CH, cc = c - r * CH;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r < count) {
      const uint16_t* p = src + r * rs + cc * 8 * cs;
      v = vec ? *reinterpret_cast<const uint4*>(p)
              : make_uint4(vqm_pair(p, cs, false), vqm_pair(p + 2 * cs, cs, false), vqm_pair(p + 4 * cs, cs, false),
                           vqm_pair(p + 6 * cs, cs, false));
    }
    *reinterpret_cast<uint4*>(tile + r * (HEAD_DIM + 8) + cc * 8) = v;
  }
}
// the keys as MLX gives them (a view of a store's larger buffer is not copied): head bh's first
// row, and whether rows are 16-byte loads (words adjacent, every row on 16 bytes)
template <typename S>  // MLX's Strides, whatever its namespace
__device__ __forceinline__ const uint16_t* vqm_key_head(const void* keys, const S& st, int bh, int hkv) {
  return reinterpret_cast<const uint16_t*>(keys) + (bh / hkv) * st[0] + (bh % hkv) * st[1];
}
template <typename S>
__device__ __forceinline__ bool vqm_key_vec(const void* keys, const S& st) {
  return st[3] == 1 && st[2] % 8 == 0 && st[1] % 8 == 0 && st[0] % 8 == 0 &&
         reinterpret_cast<unsigned long long>(keys) % 16 == 0;
}
// keyformer's Gumbel noise term log(E) of a logit from its row and column hashes
// (methods/keyformer.py's _log_e: h = (rows ^ cols) * an odd constant, E = log(C / float(h | 1)))
__device__ __forceinline__ uint32_t vqm_fmix(uint32_t h) {
  h = (h ^ (h >> 16)) * 0x85EBCA6Bu;
  h = (h ^ (h >> 13)) * 0xC2B2AE35u;
  return h ^ (h >> 16);
}
__device__ __forceinline__ float vqm_log_e(uint32_t rows, uint32_t cols) {
  const uint32_t h = ((rows ^ cols) * 0x85EBCA6Bu) | 1u;
  return logf(fmaxf(logf(4294967808.0f / (float)h), 2.98023223876953125e-8f));
}
__device__ __forceinline__ float vqm_warp_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
}
"""

LSE_CUDA = r"""
  constexpr int KS = HEAD_DIM / 16;
  constexpr int STR = HEAD_DIM + 8;  // 16 bytes of padding a staged row: no bank conflicts
  const int n = params[0], N = params[1], G = params[2], q_stride = params[3], hkv = params[5];
  const int R = G * N;
  const int bh = (int)blockIdx.y;
  const int tid = (int)threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const float inf = __uint_as_float(0x7f800000u);
  const float c2 = scale[0] * 1.4426950408889634f;  // logits in base 2
  const float noise2 = 1.4426950408889634f / scale[1];  // NOISE: (x scale - log E) / tau in base 2
  __shared__ __align__(16) uint16_t tile[64 * STR];
  __shared__ int tpos[64];
  __shared__ int seen[4];

  const int r0 = (int)blockIdx.x * 64 + warp * 16;
  const int row[2] = {r0 + g, r0 + g + 8};
  const bool valid[2] = {row[0] < R, row[1] < R};
  int qp[2];
  float wmax = -1.f;
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    qp[x] = -1;
    if (valid[x]) qp[x] = MASKED ? q_pos[(size_t)bh * q_stride + row[x] % N] : 0;
    wmax = fmaxf(wmax, (float)qp[x]);
  }
  wmax = vqm_warp_max(wmax);  // the latest query of the warp's rows
  uint32_t rh[2] = {0u, 0u};
  if (NOISE) {
#pragma unroll
    for (int x = 0; x < 2; ++x)
      if (valid[x]) rh[x] = vqm_fmix(head_keys[(size_t)bh * G + row[x] / N] ^ (uint32_t)qp[x]);
  }
  uint32_t a[KS][4];
  vqm_load_a<KS>(a, reinterpret_cast<const uint16_t*>(queries) + ((size_t)bh * R + r0) * HEAD_DIM, HEAD_DIM, 1, true,
                 g, t, valid[0], valid[1]);
  const uint16_t* k16 = vqm_key_head(keys, keys_strides, bh, hkv);
  const long long krs = keys_strides[2], kcs = keys_strides[3];
  const bool kvec = vqm_key_vec(keys, keys_strides);

  float m[2] = {-inf, -inf}, l[2] = {0.f, 0.f};
  for (int k0 = 0; k0 < n; k0 += 64) {
    __syncthreads();  // the previous tile is read
    if (tid < 64) tpos[tid] = k0 + tid < n ? (MASKED ? k_pos[(size_t)bh * n + k0 + tid] : 0) : -1;
    __syncthreads();
    float sees = 0.f;
    for (int e = lane; e < 64; e += 32) {
      const int p = tpos[e];
      if (p >= 0 && (float)p <= wmax) sees = 1.f;
    }
    sees = vqm_warp_max(sees);
    if (lane == 0) seen[warp] = sees > 0.f;
    __syncthreads();
    if (!(seen[0] | seen[1] | seen[2] | seen[3])) continue;  // the same for every thread
    vqm_stage<HEAD_DIM, NT>(tile, k16 + k0 * krs, krs, kcs, kvec, n - k0, tid);
    __syncthreads();
    if (sees == 0.f) continue;  // the same for the warp
    float s[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
      const uint16_t* kr = tile + (nt * 8 + g) * STR + 2 * t;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const uint32_t b[2] = {*reinterpret_cast<const uint32_t*>(kr + 16 * ks),
                               *reinterpret_cast<const uint32_t*>(kr + 16 * ks + 8)};
        vqm_mma<BF16>(s[nt], a[ks], b);
      }
    }
    float top[2] = {-inf, -inf};
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int x = e >> 1;
        const int p = tpos[nt * 8 + 2 * t + (e & 1)];
        const bool vis = p >= 0 && p <= qp[x];
        float y = s[nt][e] * c2;
        if (NOISE) y = (s[nt][e] * scale[0] - vqm_log_e(rh[x], vqm_fmix((uint32_t)p ^ col_key[0]))) * noise2;
        s[nt][e] = vis ? y : -inf;
        top[x] = fmaxf(top[x], s[nt][e]);
      }
    }
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      if (top[x] == -inf) continue;
      const float mm = fmaxf(m[x], top[x]);
      l[x] = m[x] == -inf ? 0.f : l[x] * exp2f(m[x] - mm);
      m[x] = mm;
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (s[nt][e] != -inf) l[e >> 1] += exp2f(s[nt][e] - m[e >> 1]);
      }
    }
  }
#pragma unroll
  for (int x = 0; x < 2; ++x) {  // the quad's four column shares of each row
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[x], off);
      const float lo = __shfl_xor_sync(0xffffffffu, l[x], off);
      const float mm = fmaxf(m[x], mo);
      l[x] = (m[x] == -inf ? 0.f : l[x] * exp2f(m[x] - mm)) + (mo == -inf ? 0.f : lo * exp2f(mo - mm));
      m[x] = mm;
    }
    if (t == 0 && valid[x]) lse[(size_t)bh * R + row[x]] = l[x] > 0.f ? m[x] + log2f(l[x]) : inf;
  }
"""

COLUMNS_CUDA = r"""
  constexpr int KS = HEAD_DIM / 16;
  constexpr int STR = HEAD_DIM + 8;
  const int n = params[0], N = params[1], G = params[2], q_stride = params[3], SPLITS = params[4], hkv = params[5];
  const int R = G * N;
  const int bh = (int)blockIdx.y / SPLITS;
  const int split = (int)blockIdx.y - bh * SPLITS;
  const int heads = (int)gridDim.y / SPLITS;
  const int tid = (int)threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const float inf = __uint_as_float(0x7f800000u);
  const float c2 = scale[0] * 1.4426950408889634f;
  const float noise2 = 1.4426950408889634f / scale[1];
  __shared__ __align__(16) uint16_t tile[64 * STR];
  __shared__ int tpos[64];
  __shared__ uint32_t trh[64];
  __shared__ float tlse[64];
  __shared__ float tw[64];
  __shared__ int seen[4];

  const int j0 = (int)blockIdx.x * 64 + warp * 16;
  const int key[2] = {j0 + g, j0 + g + 8};
  int kp[2];
  float wmin = inf;
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    kp[x] = key[x] < n ? (MASKED ? k_pos[(size_t)bh * n + key[x]] : 0) : -1;
    if (kp[x] >= 0) wmin = fminf(wmin, (float)kp[x]);
  }
  wmin = -vqm_warp_max(-wmin);  // the earliest key of the warp's
  uint32_t kh[2] = {0u, 0u};
  if (NOISE) {
#pragma unroll
    for (int x = 0; x < 2; ++x) kh[x] = vqm_fmix((uint32_t)kp[x] ^ col_key[0]);
  }
  uint32_t a[KS][4];
  const long long krs = keys_strides[2];
  vqm_load_a<KS>(a, vqm_key_head(keys, keys_strides, bh, hkv) + j0 * krs, krs, keys_strides[3],
                 vqm_key_vec(keys, keys_strides), g, t, key[0] < n, key[1] < n);
  const uint16_t* q16 = reinterpret_cast<const uint16_t*>(queries) + (size_t)bh * R * HEAD_DIM;

  const int r_begin = (int)((long long)R * split / SPLITS);
  const int r_end = (int)((long long)R * (split + 1) / SPLITS);
  float acc[2] = {0.f, 0.f};
  for (int r0 = r_begin; r0 < r_end; r0 += 64) {
    __syncthreads();
    if (tid < 64) {
      const int r = r0 + tid;
      const bool ok = r < r_end;
      tpos[tid] = ok ? (MASKED ? q_pos[(size_t)bh * q_stride + r % N] : 0) : -1;
      trh[tid] = NOISE && ok ? vqm_fmix(head_keys[(size_t)bh * G + r / N] ^ (uint32_t)tpos[tid]) : 0u;
      tlse[tid] = ok ? lse[(size_t)bh * R + r] : inf;
      tw[tid] = ok ? weights[r % N] : 0.f;
    }
    __syncthreads();
    float sees = 0.f;
    for (int e = lane; e < 64; e += 32) {
      const int p = tpos[e];
      if (p >= 0 && (float)p >= wmin) sees = 1.f;
    }
    sees = vqm_warp_max(sees);
    if (lane == 0) seen[warp] = sees > 0.f;
    __syncthreads();
    if (!(seen[0] | seen[1] | seen[2] | seen[3])) continue;
    vqm_stage<HEAD_DIM, NT>(tile, q16 + (size_t)r0 * HEAD_DIM, HEAD_DIM, 1, true, r_end - r0, tid);
    __syncthreads();
    if (sees == 0.f) continue;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      float s[4] = {0.f, 0.f, 0.f, 0.f};
      const uint16_t* qr = tile + (nt * 8 + g) * STR + 2 * t;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const uint32_t b[2] = {*reinterpret_cast<const uint32_t*>(qr + 16 * ks),
                               *reinterpret_cast<const uint32_t*>(qr + 16 * ks + 8)};
        vqm_mma<BF16>(s, a[ks], b);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // s[e]: key x's logit against row nt * 8 + 2 t + (e & 1)
        const int x = e >> 1, rr = nt * 8 + 2 * t + (e & 1);
        const int p = tpos[rr];
        if (kp[x] >= 0 && p >= 0 && kp[x] <= p) {
          float y = s[e] * c2;
          if (NOISE) y = (s[e] * scale[0] - vqm_log_e(trh[rr], kh[x])) * noise2;
          acc[x] += exp2f(y - tlse[rr]) * tw[rr];
        }
      }
    }
  }
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    acc[x] += __shfl_xor_sync(0xffffffffu, acc[x], 1);
    acc[x] += __shfl_xor_sync(0xffffffffu, acc[x], 2);
    if (t == 0 && key[x] < n) partial[((size_t)split * heads + bh) * n + key[x]] = acc[x];
  }
"""

# The Metal twin: the same two launches' outputs, a thread a row (lse, in base 2) and a thread
# a key (columns), dot products in float32 without tensor cores. UNTESTED ON HARDWARE.
LSE_METAL = r"""
  const int n = params[0], N = params[1], G = params[2], q_stride = params[3], hkv = params[5];
  const int R = G * N;
  const int r = int(thread_position_in_grid.x);
  const int bh = int(thread_position_in_grid.y);
  if (r >= R) return;
  const float c2 = scale[0] * 1.4426950408889634f;
  const float noise2 = 1.4426950408889634f / scale[1];
  const device T* q = queries + (size_t(bh) * R + r) * HEAD_DIM;
  const device T* k = keys + (bh / hkv) * keys_strides[0] + (bh % hkv) * keys_strides[1];
  const int64_t krs = keys_strides[2], kcs = keys_strides[3];
  const int qp = MASKED ? q_pos[size_t(bh) * q_stride + r % N] : 0;
  const uint32_t rh = NOISE ? vqm_fmix(head_keys[size_t(bh) * G + r / N] ^ uint32_t(qp)) : 0u;
  float m = -INFINITY, l = 0.f;
  for (int j = 0; j < n; ++j) {
    const int p = MASKED ? k_pos[size_t(bh) * n + j] : 0;
    if (p < 0 || p > qp) continue;
    float s = 0.f;
    for (int d = 0; d < HEAD_DIM; ++d) s += float(q[d]) * float(k[j * krs + d * kcs]);
    s = NOISE ? (s * scale[0] - vqm_log_e(rh, vqm_fmix(uint32_t(p) ^ col_key[0]))) * noise2 : s * c2;
    if (s > m) { l = l * metal::exp2(m - s) + 1.f; m = s; }
    else l += metal::exp2(s - m);
  }
  lse[size_t(bh) * R + r] = l > 0.f ? m + metal::log2(l) : INFINITY;
"""

COLUMNS_METAL = r"""
  const int n = params[0], N = params[1], G = params[2], q_stride = params[3], SPLITS = params[4], hkv = params[5];
  const int R = G * N;
  const int j = int(thread_position_in_grid.x);
  const int heads = int(threads_per_grid.y) / SPLITS;
  const int bh = int(thread_position_in_grid.y) / SPLITS;
  const int split = int(thread_position_in_grid.y) - bh * SPLITS;
  if (j >= n) return;
  const float c2 = scale[0] * 1.4426950408889634f;
  const float noise2 = 1.4426950408889634f / scale[1];
  const device T* k = keys + (bh / hkv) * keys_strides[0] + (bh % hkv) * keys_strides[1] + j * keys_strides[2];
  const int64_t kcs = keys_strides[3];
  const device T* q = queries + size_t(bh) * R * HEAD_DIM;
  const int kp = MASKED ? k_pos[size_t(bh) * n + j] : 0;
  const int r0 = int((long(R) * split) / SPLITS), r1 = int((long(R) * (split + 1)) / SPLITS);
  float acc = 0.f;
  if (kp >= 0) {
    for (int r = r0; r < r1; ++r) {
      const int qp = MASKED ? q_pos[size_t(bh) * q_stride + r % N] : 0;
      if (kp > qp) continue;
      float s = 0.f;
      for (int d = 0; d < HEAD_DIM; ++d) s += float(q[size_t(r) * HEAD_DIM + d]) * float(k[d * kcs]);
      const uint32_t kh = vqm_fmix(uint32_t(kp) ^ col_key[0]);
      const uint32_t rh = vqm_fmix(head_keys[size_t(bh) * G + r / N] ^ uint32_t(qp));
      const float y = NOISE ? (s * scale[0] - vqm_log_e(rh, kh)) * noise2 : s * c2;
      acc += metal::exp2(y - lse[size_t(bh) * R + r]) * weights[r % N];
    }
  }
  partial[(size_t(split) * heads + bh) * n + j] = acc;
"""

METAL_HEADER = r"""
inline uint32_t vqm_fmix(uint32_t h) {
  h = (h ^ (h >> 16)) * 0x85EBCA6Bu;
  h = (h ^ (h >> 13)) * 0xC2B2AE35u;
  return h ^ (h >> 16);
}
inline float vqm_log_e(uint32_t rows, uint32_t cols) {
  const uint32_t h = ((rows ^ cols) * 0x85EBCA6Bu) | 1u;
  return metal::log(metal::fmax(metal::log(4294967808.0f / float(h)), 2.98023223876953125e-8f));
}
"""

LSE_IN = ("queries", "keys", "q_pos", "k_pos", "head_keys", "col_key", "scale", "params")
COLUMNS_IN = ("queries", "keys", "lse", "q_pos", "k_pos", "head_keys", "col_key", "weights", "scale", "params")


def _kernels(backend: str):
    headers = (CUDA_HEADER, METAL_HEADER)
    # the keys are read through their strides: a store's keys are a view of its larger buffer,
    # which MLX would otherwise copy at each launch and keep until the command buffer ends
    lse = gpu_kernel(backend, "vq_fused_mass_lse", LSE_IN, ("lse",), (LSE_CUDA, LSE_METAL), headers,
                     row_contiguous=False)
    columns = gpu_kernel(backend, "vq_fused_mass_columns", COLUMNS_IN, ("partial",), (COLUMNS_CUDA, COLUMNS_METAL),
                         headers, row_contiguous=False)
    return lse, columns


def takes(queries, keys) -> bool:
    """Whether the kernels take these shapes and dtypes: float16 or bfloat16 queries and keys
    of one dtype, a head dim that is a multiple of 16 up to ``MAX_HEAD_DIM``."""
    d = keys.shape[-1]
    return (queries.dtype == keys.dtype and keys.dtype in (mx.float16, mx.bfloat16)
            and d % 16 == 0 and d <= MAX_HEAD_DIM)


def splits_for(rows_per_head: int, n: int, heads: int) -> int:
    """Shares of the rows the columns launch splits into: enough thread blocks to fill a GPU
    (``TARGET_BLOCKS``), each share at least one tile of rows."""
    blocks = -(-n // TILE) * heads
    return max(1, min(-(-TARGET_BLOCKS // blocks), -(-rows_per_head // TILE)))


def launch_args(backend: str, queries, keys, scale: float, q_positions, k_positions, weights, noise=None):
    """The two launches' keywords for queries (B, Hq, N, D), keys (B, Hkv, n, D),
    ``q_positions`` (N,) or (B, Hkv, N) and ``k_positions`` (B, Hkv, n), or both None,
    ``weights`` (N,) float32 (a query's weight over its group's heads) and ``noise``:
    keyformer's (head keys (B, Hkv, G, 1, 1) uint32, column key uint32, tau), whose logits
    are (x scale + zeta) / tau (positions required), or None. The columns launch's ``lse``
    input is left out (the lse launch's output). Returns (lse keywords, columns keywords,
    splits)."""
    b, hq, nq, d = queries.shape
    hkv, n = keys.shape[1], keys.shape[2]
    g = hq // hkv
    rows = g * nq
    masked = k_positions is not None
    if noise is not None and not masked:
        raise ValueError("fused_mass: keyformer's noise is a hash of the positions; pass q_positions and k_positions")
    q_stride, q_pos, k_pos = flat_positions(q_positions, k_positions, nq)
    splits = splits_for(rows, n, b * hkv)
    params = mx.array([n, nq, g, q_stride, splits, hkv], mx.int32)  # shapes as parameters: one kernel a head dim
    if noise is None:
        head_keys = col_key = mx.zeros((1,), mx.uint32)
        tau = 1.0
    else:
        head_keys, col_key, tau = noise
        head_keys, col_key = head_keys.astype(mx.uint32).reshape(-1), col_key.astype(mx.uint32).reshape(1)
    # a Python number or an array alike (an array scale is never read on the host)
    scales = mx.concatenate([mx.array(scale, mx.float32).reshape(1), mx.array(tau, mx.float32).reshape(1)])
    template = [("T", keys.dtype), ("HEAD_DIM", d), ("MASKED", masked), ("BF16", keys.dtype == mx.bfloat16),
                ("NOISE", noise is not None), ("NT", NT)]
    cuda = backend == "cuda"
    lse_grid = (-(-rows // TILE) * NT, b * hkv, 1) if cuda else (rows, b * hkv, 1)
    lse_group = (NT, 1, 1) if cuda else (min(NT, rows), 1, 1)
    col_grid = (-(-n // TILE) * NT, b * hkv * splits, 1) if cuda else (n, b * hkv * splits, 1)
    col_group = (NT, 1, 1) if cuda else (min(NT, n), 1, 1)
    # every input but the keys row-contiguous (the launches read the keys' strides)
    queries, q_pos, k_pos, head_keys, weights = (mx.contiguous(a) for a in (
        queries, q_pos, k_pos, head_keys, weights.astype(mx.float32)))
    lse = dict(inputs=[queries, keys, q_pos, k_pos, head_keys, col_key, scales, params], template=template,
               grid=lse_grid, threadgroup=lse_group, output_shapes=[(b * hkv * rows,)], output_dtypes=[mx.float32])
    columns = dict(inputs=[queries, keys, None, q_pos, k_pos, head_keys, col_key, weights, scales, params],
                   template=template, grid=col_grid, threadgroup=col_group,
                   output_shapes=[(splits, b * hkv, n)], output_dtypes=[mx.float32])
    return lse, columns, splits


def fused_mass(backend: str, queries, keys, scale: float, q_positions, k_positions, weights, noise=None) -> mx.array:
    """(B, Hkv, n) float32: each key's attention from every query, weighted by ``weights``
    (``launch_args``' inputs), through the two kernels."""
    b, hkv, n = keys.shape[0], keys.shape[1], keys.shape[2]
    lse_kernel, columns_kernel = _kernels(backend)
    lse, columns, _ = launch_args(backend, queries, keys, scale, q_positions, k_positions, weights, noise)
    (row_lse,) = lse_kernel(**lse)
    columns["inputs"][2] = row_lse
    (partial,) = columns_kernel(**columns)
    return partial.sum(axis=0).reshape(b, hkv, n)


def kernel_backend(queries, keys) -> Optional[str]:
    """The GPU back-end the kernels run on for these queries and keys; None where they do not
    (switched off by ``VQ_FUSED_MASS=0``, no GPU, shapes or dtypes they do not take, kernels
    that failed their check): the caller scores through logits it writes."""
    if os.environ.get("VQ_FUSED_MASS") == "0" or not takes(queries, keys):
        return None
    backend = kd.gpu_backend()
    if backend is None:
        return None
    return backend if kernel_checked(backend, keys.dtype) else None


_CHECKED: dict = {}
# Of the largest mass. The tensor cores sum a logit's products in another order (and, on some
# GPUs, with truncated intermediate rounding): about 1e-6 of a logit of 10, 1e-5 of its
# exponential, summed over a few hundred rows.
CHECK_RTOL = 1e-4


def kernel_checked(backend: str, dtype) -> bool:
    return checked_once(_CHECKED, backend, (backend, str(dtype)), lambda: _check_problem(backend, dtype),
                        "fused prompt-mass kernels", "prompt scores are computed through written logits instead")


def check_case(dtype, masked: bool = True, per_head_positions: bool = False, b: int = 1, hkv: int = 2, g: int = 2,
               nq: int = 37, n: int = 150, d: int = 32, seed: int = 31):
    """Random queries of ``nq`` prompt tokens at the end of ``n`` keys, some keys padding (-1)
    and the latest queries' own keys in the future of the earlier ones (causal), decaying
    weights: (queries, keys, scale, q_positions, k_positions, weights)."""
    keys_ = iter(mx.random.split(mx.random.key(seed), 3))
    queries = (2 * mx.random.normal((b, hkv * g, nq, d), key=next(keys_))).astype(dtype)
    keys = (2 * mx.random.normal((b, hkv, n, d), key=next(keys_))).astype(dtype)
    weights = 0.9 ** mx.arange(nq - 1, -1, -1, dtype=mx.float32) / g
    scale = d ** -0.5
    if not masked:
        return queries, keys, scale, None, None, weights
    k_pos = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (b, hkv, n))
    k_pos = mx.where(mx.random.uniform(shape=(b, hkv, n), key=next(keys_)) < 0.1, -1, k_pos)
    q_pos = mx.arange(n - nq, n, dtype=mx.int32)
    if per_head_positions:
        q_pos = mx.broadcast_to(q_pos, (b, hkv, nq)) - 3 * mx.arange(hkv, dtype=mx.int32)[None, :, None]
    return queries, keys, scale, q_pos, k_pos, weights


def reference_mass(queries, keys, scale, q_positions, k_positions, weights) -> mx.array:
    """What the kernels compute, through MLX's float32 ops (``attention_mass``'s terms)."""
    b, hq, nq, d = queries.shape
    hkv, n = keys.shape[1], keys.shape[2]
    g = hq // hkv
    q = queries.astype(mx.float32).reshape(b, hkv, g, nq, d)
    logits = (q @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)) * scale
    if k_positions is not None:
        qp = q_positions[None, None, None, :, None] if q_positions.ndim == 1 else q_positions[:, :, None, :, None]
        k = k_positions[:, :, None, None, :]
        logits = mx.where((k >= 0) & (k <= qp), logits, -float("inf"))
    p = mx.softmax(logits, axis=-1, precise=True)
    p = mx.where(mx.isnan(p), 0.0, p)  # a row that sees no key adds nothing
    return (p * weights[None, None, None, :, None]).sum(axis=(2, 3))


def within_check_tolerance(got: mx.array, ref: mx.array) -> bool:
    """Equal to ``CHECK_RTOL`` of the largest mass (``mass_kernel``'s rule). A host read: a check's."""
    return mass_kernel.within_check_tolerance(got, ref, CHECK_RTOL)


def in_a_larger_buffer(keys: mx.array, spare: int = 29) -> mx.array:
    """``keys`` (B, H, n, D) as a store holds them: the first n rows of a buffer with ``spare``
    rows more (+inf, so that a read of one shows), a view the launches read in place."""
    b, h, n, d = keys.shape
    return mx.concatenate([keys, mx.full((b, h, spare, d), float("inf"), keys.dtype)], axis=2)[:, :, :n]


def _check_problem(backend: str, dtype) -> Optional[str]:
    try:
        for masked, per_head, b in ((True, False, 1), (True, True, 1), (False, False, 1), (True, False, 2)):
            case = check_case(dtype, masked, per_head, b=b, d=128, n=300, nq=70)
            keys = in_a_larger_buffer(case[1]) if b > 1 else case[1]  # a store's keys: a view, read in place
            if not within_check_tolerance(fused_mass(backend, case[0], keys, *case[2:]), reference_mass(*case)):
                return f"masses differ from MLX's by more than {CHECK_RTOL:g} of the largest"
    except Exception as exc:  # kernels that do not compile or launch fail their check
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None
