"""Benchmark-side kernel code: what the dispatcher never runs, and the knobs that checks,
sweeps and timelines turn on what it does run (veloxquant/kernels/ holds only the
dispatched kernels, their Metal twin and their references).

* The "mma" kernel (tensor cores on dequantized float16 operands; sessions 1-2 of
  notes/fused_attention.md): never dispatched (frag and folded were faster wherever it
  ran), kept runnable for the tables and sweeps. Its source is the text that was timed.
* :func:`attention`: one call of any kernel (simt, mma, folded, frag) with every knob:
  ``chunk``, split target ``target_blocks``, simt's ``variant=(TW, KUNROLL, VUNROLL)``,
  the stage-skipping ``mode`` of simt and mma (1: packed values left out, 2: packed
  keys; outputs meaningless, for timing), frag's ``keep`` (KEEP), ``tail_first``
  (TAIL_FIRST) and launch bounds ``min_blocks``, the output dtype, and ``poison=True``
  (every output filled with NaN before the kernels run, so an unwritten one shows). Every
  knob left at None is the dispatcher's choice, through the runtime's own launch code.
* :func:`frag_call`: the frag main kernel alone, with outputs of one's own after the
  partials (the timelines' %globaltimer stamps).
* :func:`packed_bytes_read`: the bytes a call must read, for bandwidth figures.

The kernels folder is loaded as a package of its own ("vq_kernels"): the device machines
have MLX only, not mlx-lm, so the veloxquant_mlx package itself is not importable there.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent


def _load_kernels():
    if "vq_kernels" not in sys.modules:
        kdir = ROOT / "veloxquant" / "kernels"
        spec = importlib.util.spec_from_file_location(
            "vq_kernels", kdir / "__init__.py", submodule_search_locations=[str(kdir)])
        sys.modules["vq_kernels"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["vq_kernels"])
    return importlib.import_module("vq_kernels.kivi_decode")


kd = _load_kernels()
_src = importlib.import_module("vq_kernels.kivi_decode_cuda_src")
CUDA_PROLOGUE = _src.CUDA_PROLOGUE
_STORE_SCORES = _src._STORE_SCORES
_online_softmax = _src._online_softmax
_residual_key_scores = _src._residual_key_scores

ALGOS = ("simt", "mma", "folded", "frag")
STAGE_ALGOS = ("simt", "mma")  # kernels with stage-skipping modes (MODE 1 and 2)

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
CUDA_MMA_SOURCE = CUDA_PROLOGUE + r"""
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

  const int g = lane >> 2;
  const int q4 = lane & 3;

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
""" + _residual_key_scores("qsm[c * GQA + r]", _STORE_SCORES) + r"""    }
    __syncthreads();

""" + _online_softmax("sc") + r"""    __syncthreads();

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


_MMA: dict = {}


def default_chunk(algo: str, bits: int) -> int:
    """Tokens per chunk by default (frag takes none)."""
    if algo == "mma":  # a key super-tile is 8 words = 8 * (32 // bits) tokens: 4 per chunk
        return max(kd.DEFAULT_CHUNK, 32 * (32 // bits))
    return kd._default_chunk(algo, bits)


def _mma_supports(head_dim, gqa, bits, chunk) -> bool:
    pack = 32 // bits
    return (1 <= gqa <= kd._MAX_GQA and head_dim % 16 == 0 and head_dim % (8 * pack) == 0
            and chunk % (8 * pack) == 0 and chunk % 16 == 0)


def supports(head_dim: int, gqa: int, bits: int, group_size: int, dtype=mx.float16,
             chunk=None, tw=None, algo: str = "simt") -> bool:
    """``kd.kernel_supports`` for any kernel of ALGOS with a chunk (None: the default) and
    a simt TW (None: the dispatcher's) of one's own."""
    if not kd._supports_any(head_dim, gqa, bits, group_size, dtype):
        return False
    if algo == "frag":
        return kd._frag_supports(head_dim, gqa, bits, group_size, dtype)
    chunk = default_chunk(algo, bits) if chunk is None else chunk
    if algo == "mma":
        return _mma_supports(head_dim, gqa, bits, chunk)
    if algo == "folded":
        return kd._folded_supports(head_dim, gqa, bits, group_size, dtype, chunk)
    tw = kd._default_variant(gqa)[0] if tw is None else tw
    return tw in (4, 8) and kd._simt_supports(head_dim, bits, chunk, tw)


def main_kernel(backend: str, algo: str, min_blocks: int = 0):
    """The main kernel of ``algo``; frag's with launch bounds ``min_blocks`` (blocks an SM;
    its name carries them, as MLX caches compiled kernels by name)."""
    if algo != "mma":
        return kd._get_kernels(backend, algo, min_blocks)[0]
    if backend != "cuda":
        raise ValueError("the mma kernel has no Metal twin")
    if "mma" not in _MMA:
        _MMA["mma"] = mx.fast.cuda_kernel(
            name=kd.source_tagged("vq_kivi_decode_mma", CUDA_MMA_SOURCE, kd.cuda_header(0)),
            input_names=kd._INPUT_NAMES, output_names=["o_part", "ml_part"], source=CUDA_MMA_SOURCE,
            header=kd.cuda_header(0))
    return _MMA["mma"]


def with_template(template, **entries):
    """``template`` with some entries' values replaced, in the same order (MLX names a
    compiled kernel by its template arguments)."""
    unknown = set(entries) - {k for k, _ in template}
    if unknown:
        raise ValueError(f"not template arguments of this kernel: {sorted(unknown)}")
    return [(k, entries.get(k, v)) for k, v in template]


def frag_launch_args(dtype, head_dim, gqa, bits, group_size, key_words, n_kq, n_kres, n_vq,
                     n_vres, BH, scale, target_blocks=None, keep=None, tail_first=None):
    """``kd._frag_launch_args`` with a split target (None: ``kd.frag_target_blocks``),
    ``keep`` in place of FRAG_KEEP_OFFSET (still 0 past FRAG_KEEP_MAX_TILES tiles a
    block) and TAIL_FIRST forced to ``tail_first``, where not None."""
    if target_blocks is None:
        target_blocks = kd.frag_target_blocks(BH)
    target_blocks = int(target_blocks)
    ns, params, template, tail0, ns_tail = kd._frag_launch_args(
        dtype, head_dim, gqa, bits, group_size, key_words, n_kq, n_kres, n_vq, n_vres, BH,
        scale, target_blocks)
    over = {}
    if keep is not None:
        tps = kd._frag_plan(n_kq, n_vq, n_kq + n_kres, BH, bits, target_blocks)[3]
        over["KEEP"] = int(keep) if tps <= kd.FRAG_KEEP_MAX_TILES else 0
    if tail_first is not None:
        over["TAIL_FIRST"] = bool(tail_first)
    return ns, params, with_template(template, **over), tail0, ns_tail


def chunk_launch_args(algo, dtype, head_dim, gqa, bits, group_size, key_words, n_kq, n_kres,
                      n_vq, n_vres, BH, scale, chunk=None, target_blocks=None, variant=None,
                      mode=0):
    """(blocks per kv head, params, template) of a simt, mma or folded launch; None: the
    dispatcher's chunk, split target and simt variant. mma takes simt's template (its
    TW, KUNROLL and VUNROLL unused)."""
    chunk = default_chunk(algo, bits) if chunk is None else int(chunk)
    if target_blocks is None:
        target_blocks = kd.FOLDED_TARGET_BLOCKS if algo == "folded" else kd.DEFAULT_TARGET_BLOCKS
    ns, params, template = kd._chunk_launch_args(
        "folded" if algo == "folded" else "simt", dtype, head_dim, gqa, bits, group_size,
        key_words, n_kq, n_kres, n_vq, n_vres, BH, scale, chunk, int(target_blocks))
    over = {}
    if algo == "folded":
        if mode:
            raise ValueError("the folded kernel has no stage-skipping modes")
    else:
        if variant is not None:
            over.update(zip(("TW", "KUNROLL", "VUNROLL"), variant))
        over["MODE"] = int(mode)
    return ns, params, with_template(template, **over)


def frag_call(kernel, queries, cache, *, scale, bits, group_size, target_blocks=None,
              keep=None, tail_first=None, extra_outputs=None, init=None):
    """A lazy launch of the frag main kernel ``kernel`` (its partials, before the merge):
    ``cache`` the 12 cache arguments of ``kd.kivi_decode_attention``, ``extra_outputs`` a
    function of the blocks per kv head giving (shape, dtype) of outputs after the partials
    (the timelines' stamps). Returns (outputs, blocks per kv head, first block with tail
    chunks, tail chunks)."""
    kc, ks, kb, n_kq, kr, n_kres, vc, vs, vb, n_vq, vr, n_vres = cache
    B, Hq, _, D = queries.shape
    H = kc.shape[1]
    ns, params, template, tail0, ns_tail = frag_launch_args(
        queries.dtype, D, Hq // H, bits, group_size, kc.shape[3], n_kq, n_kres, n_vq, n_vres,
        B * H, scale, target_blocks, keep, tail_first)
    extra = extra_outputs(ns) if extra_outputs else []
    if not extra:
        outs = kd.launch_main(kernel, queries, cache, ns, kd.FRAG_NT, params, template, init)
        return outs, ns, tail0, ns_tail
    outs = kernel(
        inputs=[queries, kc, ks, kb, kr, vc, vs, vb, vr, params],
        template=template, grid=(ns * kd.FRAG_NT, B * H, 1), threadgroup=(kd.FRAG_NT, 1, 1),
        output_shapes=[(B * Hq, ns, D), (B * Hq, ns, 2), *(s for s, _ in extra)],
        output_dtypes=[mx.float32, mx.float32, *(d for _, d in extra)], init_value=init)
    return outs, ns, tail0, ns_tail


def partials(backend, queries, *cache, scale, bits, group_size, algo=None, chunk=None,
             target_blocks=None, variant=None, mode=0, keep=None, tail_first=None,
             min_blocks=None, init=None):
    """The main kernel's partials (o_part, ml_part) with the knobs of :func:`attention`."""
    (B, Hq, H, D, T, n_kq, n_kres, n_vq, n_vres), cache = kd._kernel_inputs(
        queries, *cache, bits, group_size)
    R = Hq // H
    dt = queries.dtype
    if algo is None:
        algo = (kd.default_algo(D, R, bits, group_size, dt) or "simt") if backend == "cuda" \
            else "simt"
    if algo == "frag":
        chunk = variant = None  # frag's tile is fixed: it takes neither
    tw = None if variant is None else variant[0]
    if not supports(D, R, bits, group_size, dt, chunk, tw, algo):
        raise ValueError(
            f"the fused {algo} kernel does not handle head_dim={D}, gqa={R}, bits={bits}, "
            f"group_size={group_size}, dtype={dt}, chunk={chunk}, tw={tw}")
    args = (dt, D, R, bits, group_size, cache[0].shape[3], n_kq, n_kres, n_vq, n_vres, B * H,
            scale)
    if algo == "frag":
        if mode:
            raise ValueError("the frag kernel has no stage-skipping modes")
        kernel = main_kernel(backend, algo, min_blocks or kd.frag_launch_bounds(B * H))
        return frag_call(kernel, queries, cache, scale=scale, bits=bits, group_size=group_size,
                         target_blocks=target_blocks, keep=keep, tail_first=tail_first,
                         init=init)[0]
    ns, params, template = chunk_launch_args(algo, *args, chunk, target_blocks, variant, mode)
    return kd.launch_main(main_kernel(backend, algo), queries, cache, ns, kd._NT, params,
                          template, init)


def attention(queries, *cache, scale, bits, group_size, backend="cuda", out_dtype=None,
              poison=False, **knobs):
    """One call of a fused kernel and the merge: ``kd.kivi_decode_attention_cuda`` (or the
    Metal twin, ``backend="metal"``) with the knobs of :func:`partials` (``algo`` any of
    ALGOS), ``out_dtype`` (float32 to check without the final rounding) and ``poison``."""
    init = float("nan") if poison else None
    o_part, ml_part = partials(backend, queries, *cache, scale=scale, bits=bits,
                               group_size=group_size, init=init, **knobs)
    return kd.merge_partials(backend, o_part, ml_part, queries.shape,
                             queries.dtype if out_dtype is None else out_dtype, init)


def packed_bytes_read(B, H, Hq, D, n_kq, n_kres, n_vq, n_vres, bits, group_size,
                      itemsize=2) -> int:
    """Bytes the fused kernel must read: valid codes + scales + biases + residual rows."""
    pack = 32 // bits
    kq = B * H * D * (n_kq // pack * 4 + 2 * (n_kq // group_size) * itemsize)
    vq = B * H * n_vq * (D // pack * 4 + 2 * (D // group_size) * itemsize)
    res = B * H * (n_kres + n_vres) * D * itemsize
    q = B * Hq * D * itemsize
    return kq + vq + res + q
