"""TurboQuant's fused decode read: one kernel over the packed keys and values of a layer.

The read the pure-MLX path does in several passes (``TurboScores``: rows unpacked and
looked up over the whole history, then two products), as one flash-decoding kernel:

- the query is turned once in MLX, ``qm = q scale log2(e) M`` (M: the key codec's
  rotation and sketch, ``codec.py``), so scores come out in base 2;
- a block owns one KV head and a run of tokens (``chunk``), 4 warps taking its tokens in
  turn; lane j holds coordinates ``32 w + j`` of each plane word ``w``, reads bit j of the
  token's words (all lanes one word: a broadcast), builds the level index, looks the level
  up in shared memory, scales by the norm; the G query heads' scores are reduced across
  the warp; the values, unpacked the same way, join a running base-2 softmax;
- the warps' states are merged in shared memory into one partial per (query head, split):
  the output unnormalised, in the values' rotated frame, and (base-2 max, sum).

MLX then turns the partials back (``o Rᵀ``: linear, so before the merge), joins the
partial of the full-precision window (pure MLX) and merges everything with the fused
merge kernel (``kernels/kivi_decode.merge_partials``), the path every part takes
(``kernels/decode.py``). ``turbo_partials_reference`` is the pure-MLX reference the
kernel must match; the first use of a shape class checks the kernel against it once and
falls back to the pure path, with a warning, if it fails (``kernel_partials``).

The CUDA source is checked on the CPU by emulation (tests/test_turboquant.py compiles it
as C++ with threads for lanes). The Metal twin mirrors it line for line: UNTESTED ON
HARDWARE (no Metal device or compiler was available; never compiled or run).
"""

from __future__ import annotations

import functools
import math
import warnings

import mlx.core as mx

from ...kernels import kivi_decode as kd
from ...kernels.names import source_tagged
from .codec import _matrices

NT = 128  # threads a block: 4 warps
TARGET_BLOCKS = 1024  # blocks a launch aims at (several waves of an H200's 132 SMs)
MIN_CHUNK = 32  # tokens a block takes at least
LOG2E = 1.4426950408889634

CUDA_SOURCE = r"""
  constexpr int NW = NT / 32;
  constexpr int D = W * 32;
  constexpr int PK = MK + (QJL ? 1 : 0);
  constexpr int NK = QJL ? 2 : 1;
  constexpr int KD = QJL ? 2 * D : D;
  constexpr int QW = QJL ? W : 1;
  __shared__ float klv[1 << MK];
  __shared__ float vlv[1 << PV];
  __shared__ float sm_m[NW * G];
  __shared__ float sm_l[NW * G];
  __shared__ float sm_o[NW * G * D];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int split = blockIdx.x;
  const int bh = blockIdx.y;
  const int n = params[0];
  const int chunk = params[1];
  const int S = params[2];
  const int capk = k_words_shape[2];
  const int capv = v_words_shape[2];
  for (int i = tid; i < (1 << MK); i += NT) klv[i] = k_levels[i];
  for (int i = tid; i < (1 << PV); i += NT) vlv[i] = v_levels[i];
  float qk[G][W];
  float qs[G][QW];
  const float* qp = qm + (size_t)bh * G * KD;
  for (int g = 0; g < G; ++g) {
    for (int w = 0; w < W; ++w) qk[g][w] = qp[g * KD + w * 32 + lane];
    for (int w = 0; w < QW; ++w) qs[g][w] = QJL ? qp[g * KD + D + w * 32 + lane] : 0.f;
  }
  float m[G];
  float l[G];
  float acc[G][W];
  for (int g = 0; g < G; ++g) {
    m[g] = -vqk_inf();
    l[g] = 0.f;
    for (int w = 0; w < W; ++w) acc[g][w] = 0.f;
  }
  __syncthreads();
  const uint32_t* kw = k_words + (size_t)bh * capk * PK * W;
  const __half* kn = k_norms + (size_t)bh * capk * NK;
  const uint32_t* vw = v_words + (size_t)bh * capv * PV * W;
  const __half* vn = v_norms + (size_t)bh * capv;
  const int start = split * chunk;
  const int stop = min(n, start + chunk);
  for (int t = start + warp; t < stop; t += NW) {
    const uint32_t* kt = kw + (size_t)t * PK * W;
    const float kn0 = __half2float(kn[(size_t)t * NK]);
    const float kn1 = QJL ? __half2float(kn[(size_t)t * NK + NK - 1]) : 0.f;
    float s[G];
    for (int g = 0; g < G; ++g) s[g] = 0.f;
    for (int w = 0; w < W; ++w) {
      uint32_t idx = 0;
      for (int p = 0; p < MK; ++p) idx |= ((kt[p * W + w] >> lane) & 1u) << p;
      const float kv = klv[idx] * kn0;
      const float sv = QJL ? (((kt[MK * W + w] >> lane) & 1u) ? kn1 : -kn1) : 0.f;
      for (int g = 0; g < G; ++g) {
        s[g] = fmaf(qk[g][w], kv, s[g]);
        if (QJL) s[g] = fmaf(qs[g][QJL ? w : 0], sv, s[g]);
      }
    }
    for (int off = 16; off > 0; off >>= 1)
      for (int g = 0; g < G; ++g) s[g] += __shfl_xor_sync(0xffffffffu, s[g], off);
    const uint32_t* vt = vw + (size_t)t * PV * W;
    const float vn0 = __half2float(vn[t]);
    float vv[W];
    for (int w = 0; w < W; ++w) {
      uint32_t idx = 0;
      for (int p = 0; p < PV; ++p) idx |= ((vt[p * W + w] >> lane) & 1u) << p;
      vv[w] = vlv[idx] * vn0;
    }
    for (int g = 0; g < G; ++g) {
      const float mn = fmaxf(m[g], s[g]);
      const float c = exp2f(m[g] - mn);
      const float pr = exp2f(s[g] - mn);
      l[g] = fmaf(l[g], c, pr);
      for (int w = 0; w < W; ++w) acc[g][w] = fmaf(acc[g][w], c, pr * vv[w]);
      m[g] = mn;
    }
  }
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      sm_m[warp * G + g] = m[g];
      sm_l[warp * G + g] = l[g];
    }
    for (int w = 0; w < W; ++w) sm_o[(warp * G + g) * D + w * 32 + lane] = acc[g][w];
  }
  __syncthreads();
  for (int e = tid; e < G * D; e += NT) {
    const int g = e / D;
    const int i = e - g * D;
    float M = -vqk_inf();
    for (int w = 0; w < NW; ++w) M = fmaxf(M, sm_m[w * G + g]);
    float L = 0.f;
    float O = 0.f;
    for (int w = 0; w < NW; ++w) {
      const float mw = sm_m[w * G + g];
      const float f = mw == -vqk_inf() ? 0.f : exp2f(mw - M);
      L = fmaf(f, sm_l[w * G + g], L);
      O = fmaf(f, sm_o[(w * G + g) * D + i], O);
    }
    const size_t row = (size_t)(bh * G + g) * S + split;
    o_part[row * D + i] = O;
    if (i == 0) {
      ml_part[row * 2] = M;
      ml_part[row * 2 + 1] = L;
    }
  }
"""

# Line-for-line twin of CUDA_SOURCE. UNTESTED ON HARDWARE: never compiled or run (no Metal
# device or compiler was available).
METAL_SOURCE = r"""
  constexpr int NW = NT / 32;
  constexpr int D = W * 32;
  constexpr int PK = MK + (QJL ? 1 : 0);
  constexpr int NK = QJL ? 2 : 1;
  constexpr int KD = QJL ? 2 * D : D;
  constexpr int QW = QJL ? W : 1;
  threadgroup float klv[1 << MK];
  threadgroup float vlv[1 << PV];
  threadgroup float sm_m[NW * G];
  threadgroup float sm_l[NW * G];
  threadgroup float sm_o[NW * G * D];
  const int tid = int(thread_position_in_threadgroup.x);
  const int lane = int(thread_index_in_simdgroup);
  const int warp = int(simdgroup_index_in_threadgroup);
  const int split = int(threadgroup_position_in_grid.x);
  const int bh = int(threadgroup_position_in_grid.y);
  const int n = params[0];
  const int chunk = params[1];
  const int S = params[2];
  const int capk = k_words_shape[2];
  const int capv = v_words_shape[2];
  for (int i = tid; i < (1 << MK); i += NT) klv[i] = k_levels[i];
  for (int i = tid; i < (1 << PV); i += NT) vlv[i] = v_levels[i];
  float qk[G][W];
  float qs[G][QW];
  const device float* qp = qm + size_t(bh) * G * KD;
  for (int g = 0; g < G; ++g) {
    for (int w = 0; w < W; ++w) qk[g][w] = qp[g * KD + w * 32 + lane];
    for (int w = 0; w < QW; ++w) qs[g][w] = QJL ? qp[g * KD + D + w * 32 + lane] : 0.f;
  }
  float m[G];
  float l[G];
  float acc[G][W];
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
    for (int w = 0; w < W; ++w) acc[g][w] = 0.f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const device uint32_t* kw = k_words + size_t(bh) * capk * PK * W;
  const device half* kn = k_norms + size_t(bh) * capk * NK;
  const device uint32_t* vw = v_words + size_t(bh) * capv * PV * W;
  const device half* vn = v_norms + size_t(bh) * capv;
  const int start = split * chunk;
  const int stop = min(n, start + chunk);
  for (int t = start + warp; t < stop; t += NW) {
    const device uint32_t* kt = kw + size_t(t) * PK * W;
    const float kn0 = float(kn[size_t(t) * NK]);
    const float kn1 = QJL ? float(kn[size_t(t) * NK + NK - 1]) : 0.f;
    float s[G];
    for (int g = 0; g < G; ++g) s[g] = 0.f;
    for (int w = 0; w < W; ++w) {
      uint32_t idx = 0;
      for (int p = 0; p < MK; ++p) idx |= ((kt[p * W + w] >> uint(lane)) & 1u) << uint(p);
      const float kv = klv[idx] * kn0;
      const float sv = QJL ? (((kt[MK * W + w] >> uint(lane)) & 1u) ? kn1 : -kn1) : 0.f;
      for (int g = 0; g < G; ++g) {
        s[g] = fma(qk[g][w], kv, s[g]);
        if (QJL) s[g] = fma(qs[g][QJL ? w : 0], sv, s[g]);
      }
    }
    for (int off = 16; off > 0; off >>= 1)
      for (int g = 0; g < G; ++g) s[g] += simd_shuffle_xor(s[g], ushort(off));
    const device uint32_t* vt = vw + size_t(t) * PV * W;
    const float vn0 = float(vn[t]);
    float vv[W];
    for (int w = 0; w < W; ++w) {
      uint32_t idx = 0;
      for (int p = 0; p < PV; ++p) idx |= ((vt[p * W + w] >> uint(lane)) & 1u) << uint(p);
      vv[w] = vlv[idx] * vn0;
    }
    for (int g = 0; g < G; ++g) {
      const float mn = max(m[g], s[g]);
      const float c = exp2(m[g] - mn);
      const float pr = exp2(s[g] - mn);
      l[g] = fma(l[g], c, pr);
      for (int w = 0; w < W; ++w) acc[g][w] = fma(acc[g][w], c, pr * vv[w]);
      m[g] = mn;
    }
  }
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      sm_m[warp * G + g] = m[g];
      sm_l[warp * G + g] = l[g];
    }
    for (int w = 0; w < W; ++w) sm_o[(warp * G + g) * D + w * 32 + lane] = acc[g][w];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int e = tid; e < G * D; e += NT) {
    const int g = e / D;
    const int i = e - g * D;
    float M = -INFINITY;
    for (int w = 0; w < NW; ++w) M = max(M, sm_m[w * G + g]);
    float L = 0.f;
    float O = 0.f;
    for (int w = 0; w < NW; ++w) {
      const float mw = sm_m[w * G + g];
      const float f = mw == -INFINITY ? 0.f : exp2(mw - M);
      L = fma(f, sm_l[w * G + g], L);
      O = fma(f, sm_o[(w * G + g) * D + i], O);
    }
    const size_t row = size_t(bh * G + g) * S + split;
    o_part[row * D + i] = O;
    if (i == 0) {
      ml_part[row * 2] = M;
      ml_part[row * 2 + 1] = L;
    }
  }
"""

INPUT_NAMES = ["qm", "k_words", "k_norms", "v_words", "v_norms", "k_levels", "v_levels", "params"]
MAX_STATE = 2048  # G * D floats a warp keeps (shared memory: 4 warps of them, 32 KB)


@functools.lru_cache(maxsize=None)
def _kernel(backend: str):
    if backend == "cuda":
        return mx.fast.cuda_kernel(name=source_tagged("vq_turboquant_decode", CUDA_SOURCE, kd.CUDA_HEADER),
                                   input_names=INPUT_NAMES, output_names=["o_part", "ml_part"], source=CUDA_SOURCE,
                                   header=kd.CUDA_HEADER)
    header = "#include <metal_stdlib>\nusing namespace metal;\n"
    return mx.fast.metal_kernel(name=source_tagged("vq_turboquant_decode", METAL_SOURCE, header),
                                input_names=INPUT_NAMES, output_names=["o_part", "ml_part"], source=METAL_SOURCE,
                                header=header)


def supports(d: int, gqa: int, key_level_bits: int) -> bool:
    return d % 32 == 0 and d <= 256 and gqa * d <= MAX_STATE and key_level_bits >= 1


def plan(n: int, bh: int) -> tuple[int, int]:
    """(splits, chunk) for ``n`` tokens over ``bh`` (batch x KV head) rows of blocks."""
    splits = max(1, min(-(-TARGET_BLOCKS // bh), -(-n // MIN_CHUNK)))
    chunk = -(-n // splits)
    return -(-n // chunk), chunk


@functools.lru_cache(maxsize=256)
def _params(n: int, chunk: int, splits: int) -> mx.array:
    return mx.array([n, chunk, splits], mx.int32)


def launch_args(keys, values, qm):
    """What one launch takes besides its kernel: inputs, template, grid, threadgroup,
    output shapes and dtypes (``keys``/``values``: ``TurboScores``; ``qm`` (B, H, G, KD))."""
    kc, vc = keys.tokens.codec, values.tokens.codec
    b, h, g, _ = qm.shape
    n = keys.count
    w = keys.tokens.words.buffer.shape[4]
    splits, chunk = plan(n, b * h)
    inputs = [qm, keys.tokens.words.buffer, keys.tokens.norms.buffer, values.tokens.words.buffer,
              values.tokens.norms.buffer, _levels(kc, w * 32), _levels(vc, w * 32), _params(n, chunk, splits)]
    template = [("NT", NT), ("G", g), ("W", w), ("MK", kc.level_bits), ("QJL", kc.qjl), ("PV", vc.level_bits)]
    return dict(inputs=inputs, template=template, grid=(splits * NT, b * h, 1), threadgroup=(NT, 1, 1),
                output_shapes=[(b * h * g, splits, w * 32), (b * h * g, splits, 2)],
                output_dtypes=[mx.float32, mx.float32])


@functools.lru_cache(maxsize=None)
def _levels(codec, d: int) -> mx.array:
    from .levels import sphere_levels

    return mx.array(sphere_levels(codec.level_bits, d), mx.float32)


def turned_query(queries, keys, scale):
    """``qm``: (B, H, G, KD) float32, the queries scaled into base 2 and turned by M (a
    Python scale: one compiled call a step, the cast and the product one pass)."""
    b, hq, _, d = queries.shape
    h = keys.n_heads
    if isinstance(scale, (int, float)):
        return _turner(keys.tokens.codec, b, h, hq // h, d, queries.dtype, scale * LOG2E)(queries)
    q = queries.astype(mx.float32).reshape(b, h, hq // h, d) * (scale * LOG2E)
    return q @ _matrices(keys.tokens.codec, d)[0]


@functools.lru_cache(maxsize=64)
def _turner(codec, b: int, h: int, g: int, d: int, dtype, factor: float):
    """``turned_query`` for queries (b, h * g, 1, d) of ``dtype``, compiled, M a constant."""
    m = _matrices(codec, d)[0]
    return mx.compile(lambda q: (q.astype(mx.float32).reshape(b, h, g, d) * factor) @ m)


def launch_partials(backend, queries, keys, values, scale):
    """The kernel's partials over the packed rows, turned back into the model's frame:
    (o (B*Hq, S, D) unnormalised, ml (B*Hq, S, 2))."""
    o, ml = _kernel(backend)(**launch_args(keys, values, turned_query(queries, keys, scale)))
    d = queries.shape[-1]
    return o @ _matrices(values.tokens.codec, d)[1], ml


def turbo_partials_reference(queries, keys, values, scale):
    """The pure-MLX reference of ``launch_partials``, in one split: o (B*Hq, 1, D), ml."""
    from ...kernels.decode import DecodePart, _pure_partials

    return _pure_partials(queries, DecodePart(keys, None, values, None), scale)


_CHECKED: dict = {}


class _Shaped:
    """Stands for the turned query in ``launch_args`` where only its shape is read."""

    __slots__ = ("shape",)

    def __init__(self, shape):
        self.shape = shape


class _Launch:
    """A launch's plan, kept on the key run between two flushes (its count and the four
    buffers unchanged): the checked shape class, the compiled query turn, every input but
    the turned query, the template, grid and output shapes, the values' turn back. A
    decode step then builds only the turned query, the launch and the product."""

    __slots__ = ("stamp", "buffers", "check", "turner", "rest", "fixed", "m_t")

    def __init__(self, stamp, buffers, check, queries, keys, values, scale):
        self.stamp, self.buffers, self.check = stamp, buffers, check
        b, hq, _, d = queries.shape
        h = keys.n_heads
        self.turner = _turner(keys.tokens.codec, b, h, hq // h, d, queries.dtype, scale * LOG2E)
        args = launch_args(keys, values, _Shaped((b, h, hq // h, 0)))
        self.rest = args.pop("inputs")[1:]
        self.fixed = args
        self.m_t = _matrices(values.tokens.codec, d)[1]

    def __deepcopy__(self, memo):  # a copied cache plans its own launch (new buffers)
        return None

    def partials(self, backend, queries):
        o, ml = _kernel(backend)(inputs=[self.turner(queries), *self.rest], **self.fixed)
        return o @ self.m_t, ml


def kernel_partials(backend, queries, keys, values, scale):
    """The kernel's partials, or None where it does not take the shape or failed its
    check against the reference (once per process and shape class: a warning)."""
    kt, vt = keys.tokens, values.tokens
    plan = kt.launch
    # type(scale) before scale: an array scale is never compared (its == would be an array)
    if plan is not None and plan.stamp == (backend, keys.count, vt, queries.shape, queries.dtype, type(scale), scale):
        kw, kn, vw, vn = plan.buffers
        if (kw is kt.words.buffer and kn is kt.norms.buffer and vw is vt.words.buffer
                and vn is vt.norms.buffer and plan.check in _CHECKED and _CHECKED[plan.check] is None):
            return plan.partials(backend, queries)
    out = _checked_partials(backend, queries, keys, values, scale)
    if out is not None and isinstance(scale, (int, float)) and not isinstance(scale, bool):
        d = queries.shape[-1]
        kc, vc = kt.codec, vt.codec
        check = (backend, d, queries.shape[1] // keys.n_heads, kc.level_bits, kc.qjl, vc.level_bits,
                 queries.dtype)
        stamp = (backend, keys.count, vt, queries.shape, queries.dtype, type(scale), scale)
        buffers = (kt.words.buffer, kt.norms.buffer, vt.words.buffer, vt.norms.buffer)
        kt.launch = _Launch(stamp, buffers, check, queries, keys, values, scale)
    return out


def _checked_partials(backend, queries, keys, values, scale):
    """``kernel_partials`` without the kept plan (the first step after a flush or a growth)."""
    d, hq = queries.shape[-1], queries.shape[1]
    gqa = hq // keys.n_heads
    kc, vc = keys.tokens.codec, values.tokens.codec
    if backend not in ("cuda", "metal") or not supports(d, gqa, kc.level_bits):
        return None
    key = (backend, d, gqa, kc.level_bits, kc.qjl, vc.level_bits, queries.dtype)
    if key not in _CHECKED:
        _CHECKED[key] = _self_check_problem(backend, kc, vc, d, gqa, queries.dtype)
        if _CHECKED[key] is not None:
            warnings.warn(f"veloxquant: the fused {backend} TurboQuant decode kernel (head_dim={d}, "
                          f"gqa={gqa}, {kc.bits}/{vc.bits} bits, qjl={kc.qjl}) failed its self-check "
                          f"against the pure-MLX reference: {_CHECKED[key]}; this shape reads through "
                          "the pure-MLX path instead", RuntimeWarning, stacklevel=2)
    if _CHECKED[key] is not None:
        return None
    return launch_partials(backend, queries, keys, values, scale)


def _self_check_problem(backend, kc, vc, d, gqa, dtype, tokens=300, heads=2):
    from .codec import TurboScores

    kq, kk, kv = mx.random.split(mx.random.key(0), 3)  # own keys: the global RNG untouched
    queries = mx.random.normal((1, heads * gqa, 1, d), key=kq).astype(dtype)
    k_run, v_run = kc.tokens(), vc.tokens()
    k_run.append(mx.random.normal((1, heads, tokens, d), key=kk).astype(dtype))
    v_run.append(mx.random.normal((1, heads, tokens, d), key=kv).astype(dtype))
    keys, values = TurboScores(k_run, tokens), TurboScores(v_run, tokens)
    try:
        o, ml = launch_partials(backend, queries, keys, values, d ** -0.5)
        out = kd.merge_partials(backend, o, ml, queries.shape, mx.float32)
        ro, rml = turbo_partials_reference(queries, keys, values, d ** -0.5)
        ref = ro.reshape(queries.shape) / rml[..., 1:].reshape(*queries.shape[:3], 1)
        # the check's one host sync: once per process and shape class, at first use
        error = (mx.abs(out - ref).max() / mx.abs(ref).max()).item()
    except Exception as exc:  # a kernel that does not compile or launch fails its check
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    # the fused kivi kernels' allowance (rounding of the dtype, the kernels' own float16 /
    # TF32 arithmetic, another summation order, a margin of 4): the H200 gave 1.06e-3 for
    # float32 at 4 bits, a wrong kernel is off by order 1
    tolerance = kd.self_check_tolerance(dtype)
    if not math.isfinite(error) or error > tolerance:
        return f"relative error {error:.3g} (allowed {tolerance:.3g})"
    return None
