"""A block of prompt queries' attention mass in two launches after the logits' product (the
GPU path of ``attention.attention_mass``: H2O's prompt scoring, SnapKV's window, ChunkKV's
and RocketKV's votes).

In MLX ops a block of scores is the product, a mask, a float32 softmax and a weighted sum
over the rows: each a pass over the block's logits and most a copy of it, in launches that
run one after another (the blocks are chained to bound memory). Here, after the product:

- ``rows``: one thread block a logits row (a query of one query head), an online maximum and
  sum of exponentials over the keys that query sees, combined over the block's threads: the
  row's log-sum-exp (+inf for a row that sees no key, so that it adds nothing);
- ``columns``: a thread a key, walking a share of the rows (``splits`` shares, each written
  apart and summed by MLX, deterministic): ``exp(logit - lse) * w`` over the rows whose query
  sees the key, ``w`` the query's weight over the group's heads.

The logits are read twice and never copied; the softmax is not written. A key is visible to
a query when its position is at least 0 (-1: a padding slot) and at most the query's;
without positions every key is visible. The sums differ from MLX's in their order (float32
rounding), so the first use checks the kernels against the MLX block once a process and
dtype and keeps MLX's ops if they fail. The CUDA source is run on the CPU by emulation
(tests). The Metal twin mirrors it line for line: UNTESTED ON HARDWARE.
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx

from ..kernels import kivi_decode as kd
from ..kernels.checks import checked_once, gpu_kernel

NT = 256
TARGET_BLOCKS = 1024  # thread blocks the columns' launch aims for (rows split to get there)

ROWS_CUDA = r"""
  const int n = params[0];
  const int R = params[1];
  const int m = params[2];
  const int q_stride = params[3];
  const int row = (int)blockIdx.x;
  const int bh = row / R;
  const int jq = (row - bh * R) % m;
  const T* s = logits + (size_t)row * n;
  const float inf = __uint_as_float(0x7f800000u);  // NVRTC has no INFINITY
  const int qp = MASKED ? q_pos[(size_t)bh * q_stride + jq] : 0;
  float top = -inf, total = 0.f;
  for (int j = (int)threadIdx.x; j < n; j += NT) {
    if (MASKED) {
      const int p = k_pos[(size_t)bh * n + j];
      if (p < 0 || p > qp) continue;
    }
    const float x = (float)s[j];
    if (x == -inf) continue;
    if (x > top) { total = total * expf(top - x) + 1.f; top = x; }
    else total += expf(x - top);
  }
  __shared__ float tops[NT];
  __shared__ float totals[NT];
  tops[threadIdx.x] = top;
  totals[threadIdx.x] = total;
  __syncthreads();
  for (int stride = NT / 2; stride > 0; stride >>= 1) {
    if ((int)threadIdx.x < stride) {
      const float a = tops[threadIdx.x], b = tops[threadIdx.x + stride];
      const float c = fmaxf(a, b);
      totals[threadIdx.x] = c == -inf ? 0.f
          : totals[threadIdx.x] * expf(a - c) + totals[threadIdx.x + stride] * expf(b - c);
      tops[threadIdx.x] = c;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) lse[row] = totals[0] > 0.f ? tops[0] + logf(totals[0]) : inf;
"""

COLUMNS_CUDA = r"""
  const int n = params[0];
  const int R = params[1];
  const int m = params[2];
  const int q_stride = params[3];
  const int j = (int)blockIdx.x * NT + (int)threadIdx.x;
  if (j >= n) return;
  const int heads = (int)gridDim.y / SPLITS;
  const int bh = (int)blockIdx.y / SPLITS;
  const int split = (int)blockIdx.y - bh * SPLITS;
  const int r0 = (int)((long long)R * split / SPLITS);
  const int r1 = (int)((long long)R * (split + 1) / SPLITS);
  const int kp = MASKED ? k_pos[(size_t)bh * n + j] : 0;
  float acc = 0.f;
  if (kp >= 0) {
    for (int r = r0; r < r1; ++r) {
      const int jq = r % m;
      if (MASKED && kp > q_pos[(size_t)bh * q_stride + jq]) continue;
      const size_t row = (size_t)bh * R + r;
      acc += expf((float)logits[row * n + j] - lse[row]) * weights[jq];
    }
  }
  partial[((size_t)split * heads + bh) * n + j] = acc;
"""

ROWS_METAL = r"""
  const int n = params[0];
  const int R = params[1];
  const int m = params[2];
  const int q_stride = params[3];
  const int row = int(threadgroup_position_in_grid.x);
  const int tid = int(thread_position_in_threadgroup.x);
  const int bh = row / R;
  const int jq = (row - bh * R) % m;
  const device T* s = logits + size_t(row) * n;
  const int qp = MASKED ? q_pos[size_t(bh) * q_stride + jq] : 0;
  float top = -INFINITY, total = 0.f;
  for (int j = tid; j < n; j += NT) {
    if (MASKED) {
      const int p = k_pos[size_t(bh) * n + j];
      if (p < 0 || p > qp) continue;
    }
    const float x = float(s[j]);
    if (x == -INFINITY) continue;
    if (x > top) { total = total * metal::exp(top - x) + 1.f; top = x; }
    else total += metal::exp(x - top);
  }
  threadgroup float tops[NT];
  threadgroup float totals[NT];
  tops[tid] = top;
  totals[tid] = total;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int stride = NT / 2; stride > 0; stride >>= 1) {
    if (tid < stride) {
      const float a = tops[tid], b = tops[tid + stride];
      const float c = metal::fmax(a, b);
      totals[tid] = c == -INFINITY ? 0.f : totals[tid] * metal::exp(a - c) + totals[tid + stride] * metal::exp(b - c);
      tops[tid] = c;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (tid == 0) lse[row] = totals[0] > 0.f ? tops[0] + metal::log(totals[0]) : INFINITY;
"""

COLUMNS_METAL = r"""
  const int n = params[0];
  const int R = params[1];
  const int m = params[2];
  const int q_stride = params[3];
  const int j = int(threadgroup_position_in_grid.x) * NT + int(thread_position_in_threadgroup.x);
  if (j >= n) return;
  const int heads = int(threadgroups_per_grid.y) / SPLITS;
  const int bh = int(threadgroup_position_in_grid.y) / SPLITS;
  const int split = int(threadgroup_position_in_grid.y) - bh * SPLITS;
  const int r0 = int((long(R) * split) / SPLITS);
  const int r1 = int((long(R) * (split + 1)) / SPLITS);
  const int kp = MASKED ? k_pos[size_t(bh) * n + j] : 0;
  float acc = 0.f;
  if (kp >= 0) {
    for (int r = r0; r < r1; ++r) {
      const int jq = r % m;
      if (MASKED && kp > q_pos[size_t(bh) * q_stride + jq]) continue;
      const size_t row = size_t(bh) * R + r;
      acc += metal::exp(float(logits[row * n + j]) - lse[row]) * weights[jq];
    }
  }
  partial[(size_t(split) * heads + bh) * n + j] = acc;
"""

_ROWS_IN = ("logits", "q_pos", "k_pos", "params")
_COLUMNS_IN = ("logits", "lse", "q_pos", "k_pos", "weights", "params")


def _kernels(backend: str):
    rows = gpu_kernel(backend, "vq_mass_rows", _ROWS_IN, ("lse",), (ROWS_CUDA, ROWS_METAL))
    columns = gpu_kernel(backend, "vq_mass_columns", _COLUMNS_IN, ("partial",), (COLUMNS_CUDA, COLUMNS_METAL))
    return rows, columns


def splits_for(rows_per_head: int, n: int, heads: int) -> int:
    """Shares of the rows the columns' launch splits into: enough thread blocks to fill a GPU
    (``TARGET_BLOCKS``), each share at least 8 rows."""
    blocks = -(-n // NT) * heads
    return max(1, min(-(-TARGET_BLOCKS // blocks), rows_per_head // 8))


def flat_positions(q_positions, k_positions, m: int) -> tuple[int, mx.array, mx.array]:
    """The kernels' positions: (the stride between KV heads' query positions, 0 where the
    heads share them; the query positions and the key positions as flat int32), from
    ``q_positions`` (m,) or (B, Hkv, m) and ``k_positions`` (B, Hkv, n), or both None (a
    placeholder each: every key visible)."""
    if k_positions is None:
        none = mx.zeros((1,), mx.int32)
        return 0, none, none
    q_stride = 0 if q_positions.ndim == 1 else m
    return q_stride, q_positions.astype(mx.int32).reshape(-1), k_positions.astype(mx.int32).reshape(-1)


def launch_args(logits, q_positions, k_positions, weights) -> tuple[dict, dict, int]:
    """The two launches' keywords for logits (B, Hkv, R, n), R = g m rows (head i's query j
    at row i m + j), ``q_positions`` (m,) or (B, Hkv, m) and ``k_positions`` (B, Hkv, n), or
    both None, ``weights`` (m,) float32 (a query's weight over its group's heads); the
    ``columns`` launch's input ``lse`` is left out (the ``rows`` launch's output). Returns
    (rows' keywords, columns' keywords, splits)."""
    b, h, r, n = logits.shape
    m = weights.shape[0]
    masked = k_positions is not None
    q_stride, q_pos, k_pos = flat_positions(q_positions, k_positions, m)
    params = mx.array([n, r, m, q_stride], mx.int32)
    splits = splits_for(r, n, b * h)
    template = [("T", logits.dtype), ("NT", NT), ("MASKED", masked)]
    flat = mx.contiguous(logits).reshape(b * h * r, n)
    rows = dict(inputs=[flat, q_pos, k_pos, params], template=template, grid=(b * h * r * NT, 1, 1),
                threadgroup=(NT, 1, 1), output_shapes=[(b * h * r,)], output_dtypes=[mx.float32])
    columns = dict(inputs=[flat, None, q_pos, k_pos, weights.astype(mx.float32), params],
                   template=template + [("SPLITS", splits)], grid=(-(-n // NT) * NT, b * h * splits, 1),
                   threadgroup=(NT, 1, 1), output_shapes=[(splits, b * h, n)], output_dtypes=[mx.float32])
    return rows, columns, splits


def block_mass(backend: str, logits, q_positions, k_positions, weights) -> mx.array:
    """(B, Hkv, n) float32: each key's attention from the block's rows, weighted by
    ``weights`` (``launch_args``' inputs), through the two kernels."""
    b, h, _, n = logits.shape
    rows_kernel, columns_kernel = _kernels(backend)
    rows, columns, _ = launch_args(logits, q_positions, k_positions, weights)
    (lse,) = rows_kernel(**rows)
    columns["inputs"][1] = lse
    (partial,) = columns_kernel(**columns)
    return partial.sum(axis=0).reshape(b, h, n)


def reference_mass(logits, q_positions, k_positions, weights) -> mx.array:
    """What the kernels compute, through MLX's ops (``attention.attention_mass``'s block)."""
    b, h, r, n = logits.shape
    m = weights.shape[0]
    g = r // m
    logits = logits.reshape(b, h, g, m, n)
    if k_positions is not None:
        qp = q_positions[None, None, None, :, None] if q_positions.ndim == 1 else q_positions[:, :, None, :, None]
        k = k_positions[:, :, None, None, :]
        logits = mx.where((k >= 0) & (k <= qp), logits, -float("inf"))
    p = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True).reshape(b, h, r, n)
    return (mx.tile(weights.astype(mx.float32), (g,))[None, None, None] @ p)[:, :, 0]


def kernel_backend(dtype) -> Optional[str]:
    """The GPU back-end the kernels run on for logits in ``dtype``; None where they do not (no
    GPU, ``VQ_MASS_KERNEL=0``, kernels that failed their check): the caller runs MLX's ops."""
    backend = kd.gpu_backend()
    if backend is None or os.environ.get("VQ_MASS_KERNEL") == "0":
        return None
    return backend if kernel_checked(backend, dtype) else None


_CHECKED: dict = {}
CHECK_RTOL = 1e-5  # of the largest mass: float32 sums of a few hundred terms in another order


def kernel_checked(backend: str, dtype) -> bool:
    return checked_once(_CHECKED, backend, (backend, str(dtype)), lambda: _check_problem(backend, dtype),
                        "prompt-mass kernels", "prompt scores are computed through MLX's ops instead")


def check_case(dtype, masked: bool = True, per_head_positions: bool = False, b: int = 1, h: int = 2, g: int = 2,
               m: int = 5, n: int = 300):
    """Random logits of ``m`` queries at the end of ``n`` keys, some keys padding (-1) and the
    last queries' own keys in the future of the earlier ones (causal), with decaying weights:
    (logits, q_positions, k_positions, weights)."""
    logits = (4 * mx.random.normal((b, h, g * m, n), key=mx.random.key(21))).astype(dtype)
    weights = 0.9 ** mx.arange(m - 1, -1, -1, dtype=mx.float32) / g
    if not masked:
        return logits, None, None, weights
    k_pos = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (b, h, n))
    k_pos = mx.where(mx.random.uniform(shape=(b, h, n), key=mx.random.key(22)) < 0.1, -1, k_pos)
    q_pos = mx.arange(n - m, n, dtype=mx.int32)
    if per_head_positions:
        q_pos = mx.broadcast_to(q_pos, (b, h, m)) - mx.arange(h, dtype=mx.int32)[None, :, None]
    return logits, q_pos, k_pos, weights


def within_check_tolerance(got: mx.array, ref: mx.array, rtol: float = CHECK_RTOL) -> bool:
    """Equal to ``rtol`` of the largest mass. A host read: a check's."""
    return bool((mx.abs(got - ref).max() <= rtol * mx.maximum(mx.abs(ref).max(), 1e-30)).item())


def _check_problem(backend: str, dtype) -> Optional[str]:
    try:
        for masked, per_head in ((True, False), (True, True), (False, False)):
            case = check_case(dtype, masked, per_head)
            if not within_check_tolerance(block_mass(backend, *case), reference_mass(*case)):
                return f"masses differ from MLX's by more than {CHECK_RTOL:g} of the largest"
    except Exception as exc:  # kernels that do not compile or launch fail their check
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None
