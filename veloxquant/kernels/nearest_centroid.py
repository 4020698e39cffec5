"""Nearest centroid on a GPU without the distances: one kernel keeps each row's running minimum.

``quant/vq.nearest`` finds, for each row x (s channels), ``argmin_c ||c||^2 - 2 x.c`` over K
centroids. As matrix products it writes every distance and reads it back for the argmin: a
4k prompt's keys in vecinfer are a million sub-vectors against 4,096 centroids a layer, 4G
float32 distances (16 GB written and read). This kernel never writes them:

- a thread owns one row, its s channels in registers;
- a block of ``NT`` threads loads ``TILE`` centroids at a time into shared memory as
  ``-2c`` and ``c.c`` (every thread reads the same centroid at once: a broadcast), then each
  thread runs ``c.c + x.(-2c)`` (fused multiply-adds, channel order) over the tile and
  keeps the first strict minimum: ties go to the lowest index, as ``mx.argmin``'s do;
- a codebook per row of a batch: grid ``(ceil(M / NT) * NT, B)``, the books' stride
  ``K * s`` (0 where one codebook serves every row).

The distances are exact float32 fused sums, so on CUDA they are closer to the true ones than
the float32 product's, which cuBLAS runs in TF32 unless ``MLX_ENABLE_TF32=0``; where two
centroids lie within float32 rounding of each other the two routes may pick different ones.

The first use of a sub-vector width checks the kernel against the products on a random
case, once per process (one host read); a kernel that fails warns and ``nearest`` keeps the
products. The CUDA source is also run on the CPU by emulation (tests). The Metal twin mirrors
it line for line: UNTESTED ON HARDWARE (no Metal device was available).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .checks import checked_once, gpu_kernel
from .kivi_decode import gpu_backend

NT = 256  # threads (rows) a block
TILE = 512  # centroids a block holds in shared memory at a time
MAX_SUB_DIM = 32  # channels a row keeps in registers

CUDA_SOURCE = r"""
  __shared__ float tile[TILE * (S + 1)];
  const int m = params[0];
  const int k = params[1];
  const int book_stride = params[2];
  const int b = blockIdx.y;
  const int row = blockIdx.x * NT + threadIdx.x;
  const bool live = row < m;
  float xv[S];
  for (int j = 0; j < S; ++j) xv[j] = live ? rows[((size_t)b * m + row) * S + j] : 0.f;
  const float* book = centroids + (size_t)b * book_stride;
  float best = 0.f;
  unsigned int arg = 0;
  for (int t0 = 0; t0 < k; t0 += TILE) {
    const int n = min(TILE, k - t0);
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += NT) {
      float sq = 0.f;
      for (int j = 0; j < S; ++j) {
        const float c = book[(size_t)(t0 + i) * S + j];
        tile[i * (S + 1) + j] = -2.f * c;
        sq = fmaf(c, c, sq);
      }
      tile[i * (S + 1) + S] = sq;
    }
    __syncthreads();
    for (int i = 0; i < n; ++i) {
      float d = tile[i * (S + 1) + S];
      for (int j = 0; j < S; ++j) d = fmaf(xv[j], tile[i * (S + 1) + j], d);
      if ((t0 == 0 && i == 0) || d < best) {
        best = d;
        arg = (unsigned int)(t0 + i);
      }
    }
  }
  if (live) out[(size_t)b * m + row] = arg;
"""

METAL_SOURCE = r"""
  threadgroup float tile[TILE * (S + 1)];
  const int m = params[0];
  const int k = params[1];
  const int book_stride = params[2];
  const int b = int(threadgroup_position_in_grid.y);
  const int tid = int(thread_position_in_threadgroup.x);
  const int row = int(threadgroup_position_in_grid.x) * NT + tid;
  const bool live = row < m;
  float xv[S];
  for (int j = 0; j < S; ++j) xv[j] = live ? rows[(size_t(b) * m + row) * S + j] : 0.f;
  const device float* book = centroids + size_t(b) * book_stride;
  float best = 0.f;
  uint arg = 0;
  for (int t0 = 0; t0 < k; t0 += TILE) {
    const int n = min(TILE, k - t0);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = tid; i < n; i += NT) {
      float sq = 0.f;
      for (int j = 0; j < S; ++j) {
        const float c = book[size_t(t0 + i) * S + j];
        tile[i * (S + 1) + j] = -2.f * c;
        sq = fma(c, c, sq);
      }
      tile[i * (S + 1) + S] = sq;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = 0; i < n; ++i) {
      float d = tile[i * (S + 1) + S];
      for (int j = 0; j < S; ++j) d = fma(xv[j], tile[i * (S + 1) + j], d);
      if ((t0 == 0 && i == 0) || d < best) {
        best = d;
        arg = uint(t0 + i);
      }
    }
  }
  if (live) out[size_t(b) * m + row] = arg;
"""

_INPUT_NAMES = ["rows", "centroids", "params"]


def _kernel(backend: str):
    return gpu_kernel(backend, "vq_nearest_centroid", tuple(_INPUT_NAMES), ("out",), (CUDA_SOURCE, METAL_SOURCE))


def launch_args(rows: mx.array, centroids: mx.array) -> dict:
    """The launch of ``rows`` (M, s) or (B, M, s) against ``centroids`` (K, s), or (1 or B,
    K, s): its inputs, template, grid, threadgroup and output (B * M,) uint32."""
    b = rows.shape[0] if rows.ndim == 3 else 1
    m, s = rows.shape[-2:]
    k = centroids.shape[-2]
    stride = k * s if centroids.ndim == 3 and centroids.shape[0] > 1 else 0
    params = mx.array([m, k, stride], mx.int32)
    return dict(inputs=[rows.astype(mx.float32), centroids.astype(mx.float32), params],
                template=[("S", s), ("NT", NT), ("TILE", TILE)],
                grid=(-(-m // NT) * NT, b, 1), threadgroup=(NT, 1, 1),
                output_shapes=[(b * m,)], output_dtypes=[mx.uint32])


def nearest_rows(rows: mx.array, centroids: mx.array) -> Optional[mx.array]:
    """The index of each row's nearest centroid, (M,) or (B, M) uint32, through the kernel; None
    where there is no GPU kernel for it (the CPU, a width past ``MAX_SUB_DIM``, or a kernel that
    failed its check), so that the caller forms the distances itself."""
    backend = gpu_backend()
    s = rows.shape[-1]
    if backend is None or s > MAX_SUB_DIM or not _passes_check(backend, s):
        return None
    return _launch(backend, rows, centroids)


def _launch(backend: str, rows: mx.array, centroids: mx.array) -> mx.array:
    return _kernel(backend)(**launch_args(rows, centroids))[0].reshape(rows.shape[:-1])


def distance_slack(rows: mx.array, centroids: mx.array) -> mx.array:
    """How far a chosen centroid's distance may lie above the least through float32 rounding
    of ``c.c - 2 x.c`` (s + 1 terms, each rounded at most twice): per row, 4 (s + 2) eps
    (|x|^2 + 2 |x| max|c| + max|c|^2), with a margin of 2."""
    s = rows.shape[-1]
    x2 = (rows.astype(mx.float32) ** 2).sum(axis=-1)
    c2 = (centroids.astype(mx.float32) ** 2).sum(axis=-1).max(axis=-1, keepdims=centroids.ndim == 3)
    return 4 * (s + 2) * 2.0 ** -24 * (x2 + 2 * mx.sqrt(x2 * c2) + c2)


def excess_distance(rows: mx.array, centroids: mx.array, idx: mx.array) -> mx.array:
    """Per row, how far the squared distance to centroid ``idx`` lies above the least one
    (both summed as (x - c)^2 in float32): 0 where ``idx`` is a nearest centroid."""
    x = rows.astype(mx.float32)[..., None, :]
    c = centroids.astype(mx.float32)
    c = c if c.ndim == 2 else c[:, None]
    d = ((x - c) ** 2).sum(axis=-1)
    chosen = mx.take_along_axis(d, idx.astype(mx.int32)[..., None], axis=-1)[..., 0]
    return chosen - d.min(axis=-1)


_CHECKED: dict = {}


def _passes_check(backend: str, s: int) -> bool:
    """Whether the kernel passed its check for sub-vectors of ``s`` (``checks.checked_once``)."""
    return checked_once(_CHECKED, backend, (backend, s), lambda: _check_problem(backend, s),
                        f"nearest-centroid kernel (sub-vectors of {s})",
                        "nearest centroids of this width are found through matrix products instead")


def _check_problem(backend: str, s: int) -> Optional[str]:
    """What is wrong with the kernel on a random case (two rows of a batch, each its own
    codebook of more centroids than a tile, rows past a block): a failure to compile or run,
    or a row whose chosen centroid lies further than rounding from its nearest. None if
    nothing. One host read, once per process and width."""
    key = mx.random.key(20261206)
    rows = mx.random.normal((2, NT + 37, s), key=key)
    books = mx.random.normal((2, TILE + 100, s), key=mx.random.split(key)[1])
    try:
        idx = _launch(backend, rows, books)
        over = excess_distance(rows, books, idx) - distance_slack(rows, books)
        worst = over.max().item()
    except Exception as exc:  # a kernel that does not compile or launch fails its check
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    if not worst <= 0:  # NaN fails too
        return f"a chosen centroid lies {worst:.3g} further than rounding allows from the nearest"
    return None
