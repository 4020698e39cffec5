"""Symmetric eigendecomposition on a GPU: parallel cyclic Jacobi, one block a matrix.

MLX has no GPU ``eigh`` (CUDA's back-end declares none), so the prompt fits that need a
spectrum (``lowrank/factors.gram_basis``: palu's and svdq's bases, amc's and kvtc's PCA)
run LAPACK on the CPU stream, and the device waits for it: palu's 512 x 512 eigh was
40-50 ms a layer on the H200 (``benchmarks/notes/fits.md``). This kernel keeps the work on
the device:

- a block owns one matrix A (n x n, n even) and its eigenvectors V (starting at I), both
  in the block's slices of the outputs (global memory, cached);
- a round rotates n/2 disjoint pairs (p, q) at once: each pair's rotation, the
  Golub-Van Loan symmetric Schur one that zeroes A[p, q] (``c``, ``s`` from A[p, p],
  A[q, q], A[p, q]), then every pair's two rows of A (``J^T A``), then every pair's two
  columns of A and of V (``A J``, ``V J``); disjoint pairs commute, so this is the product
  of the round's rotations;
- the pairs follow the round-robin order: one index stays, the others move one place a
  round, so n - 1 rounds meet every pair once (a sweep);
- a rotation is skipped where A[p, q] is negligible: at most ``2^-24`` of
  ``sqrt(|A[p, p] A[q, q]|)``, or ``2^-40`` of A's Frobenius norm; the sweeps stop after
  one that rotated nothing, or after ``MAX_SWEEPS``.

The eigenvalues are the diagonal left; ``jacobi_eigh`` orders them ascending, with V's
columns, as ``mx.linalg.eigh`` does. Jacobi's float32 eigenvalues are as accurate as
LAPACK's (backward stable) and its vectors as orthogonal. The CUDA source is also run on
the CPU by emulation (tests). The Metal twin mirrors it line for line: UNTESTED ON HARDWARE.

Which sizes take the kernel on a GPU: ``GPU_MAX_N``. It is 0, so none do, until the
device's timings against the CPU stream's eigh are in (``benchmarks/gpu_eigh.py``).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .checks import gpu_kernel
from .kivi_decode import gpu_backend

GPU_MAX_N = 0  # the largest n the kernel takes on a GPU (0: none, until measured)
MAX_SWEEPS = 15
NT = 1024  # threads a block

CUDA_SOURCE = r"""
  constexpr int M = N / 2;
  __shared__ int top[M];
  __shared__ int bot[M];
  __shared__ int pp[M];
  __shared__ int qq[M];
  __shared__ float cs[M];
  __shared__ float sn[M];
  __shared__ float red[NT / 32];
  const int tid = threadIdx.x;
  const size_t base = (size_t)blockIdx.x * N * N;
  const float* src = a + base;
  float* A = work + base;
  float* V = vecs + base;
  auto block_sum = [&](float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((tid & 31) == 0) red[tid >> 5] = v;
    __syncthreads();
    float s = 0.f;
    for (int w = 0; w < NT / 32; ++w) s += red[w];
    __syncthreads();
    return s;
  };
  float own = 0.f;
  for (int i = tid; i < N * N; i += NT) {
    const float x = src[i];
    A[i] = x;
    V[i] = (i / N == i % N) ? 1.f : 0.f;
    own += x * x;
  }
  for (int k = tid; k < M; k += NT) {
    top[k] = 2 * k;
    bot[k] = 2 * k + 1;
  }
  const float floor_abs = sqrtf(block_sum(own)) * 9.094947e-13f;  // 2^-40 of the norm
  for (int sweep = 0; sweep < MAX_SWEEPS; ++sweep) {
    float rotated = 0.f;
    for (int round = 0; round < N - 1; ++round) {
      for (int k = tid; k < M; k += NT) {
        const int p = min(top[k], bot[k]);
        const int q = max(top[k], bot[k]);
        const float app = A[p * N + p];
        const float aqq = A[q * N + q];
        const float apq = A[p * N + q];
        float c = 1.f;
        float s = 0.f;
        if (fabsf(apq) > floor_abs && fabsf(apq) > 5.9604645e-08f * sqrtf(fabsf(app * aqq))) {
          const float tau = (aqq - app) / (2.f * apq);
          const float t = (tau >= 0.f ? 1.f : -1.f) / (fabsf(tau) + sqrtf(1.f + tau * tau));
          c = 1.f / sqrtf(1.f + t * t);
          s = t * c;
          rotated += 1.f;
        }
        pp[k] = p;
        qq[k] = q;
        cs[k] = c;
        sn[k] = s;
      }
      __syncthreads();
      for (int i = tid; i < M * N; i += NT) {  // rows p and q of A: J^T A
        const int k = i / N;
        const int j = i - k * N;
        const float c = cs[k];
        const float s = sn[k];
        if (s != 0.f) {
          const float x = A[pp[k] * N + j];
          const float y = A[qq[k] * N + j];
          A[pp[k] * N + j] = c * x - s * y;
          A[qq[k] * N + j] = s * x + c * y;
        }
      }
      __syncthreads();
      for (int i = tid; i < M * N; i += NT) {  // columns p and q of A and V: A J, V J
        const int k = i / N;
        const int j = i - k * N;
        const float c = cs[k];
        const float s = sn[k];
        if (s != 0.f) {
          const float x = A[j * N + pp[k]];
          const float y = A[j * N + qq[k]];
          A[j * N + pp[k]] = c * x - s * y;
          A[j * N + qq[k]] = s * x + c * y;
          const float u = V[j * N + pp[k]];
          const float w = V[j * N + qq[k]];
          V[j * N + pp[k]] = c * u - s * w;
          V[j * N + qq[k]] = s * u + c * w;
        }
      }
      int next_top = 0;
      int next_bot = 0;
      if (tid < M) {  // the round-robin: index top[0] stays, the others move one place
        next_top = tid == 0 ? top[0] : (tid == 1 ? bot[0] : top[tid - 1]);
        next_bot = tid == M - 1 ? top[M - 1] : bot[tid + 1];
      }
      __syncthreads();
      if (tid < M) {
        top[tid] = next_top;
        bot[tid] = next_bot;
      }
      __syncthreads();
    }
    if (block_sum(rotated) == 0.f) break;
  }
"""

METAL_SOURCE = r"""
  constexpr int M = N / 2;
  threadgroup int top[M];
  threadgroup int bot[M];
  threadgroup int pp[M];
  threadgroup int qq[M];
  threadgroup float cs[M];
  threadgroup float sn[M];
  threadgroup float red[NT / 32];
  const int tid = int(thread_position_in_threadgroup.x);
  const size_t base = size_t(threadgroup_position_in_grid.x) * N * N;
  const device float* src = a + base;
  device float* A = work + base;
  device float* V = vecs + base;
  float own = 0.f;
  for (int i = tid; i < N * N; i += NT) {
    const float x = src[i];
    A[i] = x;
    V[i] = (i / N == i % N) ? 1.f : 0.f;
    own += x * x;
  }
  for (int k = tid; k < M; k += NT) {
    top[k] = 2 * k;
    bot[k] = 2 * k + 1;
  }
  own = simd_sum(own);
  if ((tid & 31) == 0) red[tid >> 5] = own;
  threadgroup_barrier(mem_flags::mem_threadgroup | mem_flags::mem_device);
  float total = 0.f;
  for (int w = 0; w < NT / 32; ++w) total += red[w];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float floor_abs = sqrt(total) * 9.094947e-13f;
  for (int sweep = 0; sweep < MAX_SWEEPS; ++sweep) {
    float rotated = 0.f;
    for (int round = 0; round < N - 1; ++round) {
      for (int k = tid; k < M; k += NT) {
        const int p = min(top[k], bot[k]);
        const int q = max(top[k], bot[k]);
        const float app = A[p * N + p];
        const float aqq = A[q * N + q];
        const float apq = A[p * N + q];
        float c = 1.f;
        float s = 0.f;
        if (fabs(apq) > floor_abs && fabs(apq) > 5.9604645e-08f * sqrt(fabs(app * aqq))) {
          const float tau = (aqq - app) / (2.f * apq);
          const float t = (tau >= 0.f ? 1.f : -1.f) / (fabs(tau) + sqrt(1.f + tau * tau));
          c = 1.f / sqrt(1.f + t * t);
          s = t * c;
          rotated += 1.f;
        }
        pp[k] = p;
        qq[k] = q;
        cs[k] = c;
        sn[k] = s;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup | mem_flags::mem_device);
      for (int i = tid; i < M * N; i += NT) {
        const int k = i / N;
        const int j = i - k * N;
        const float c = cs[k];
        const float s = sn[k];
        if (s != 0.f) {
          const float x = A[pp[k] * N + j];
          const float y = A[qq[k] * N + j];
          A[pp[k] * N + j] = c * x - s * y;
          A[qq[k] * N + j] = s * x + c * y;
        }
      }
      threadgroup_barrier(mem_flags::mem_device);
      for (int i = tid; i < M * N; i += NT) {
        const int k = i / N;
        const int j = i - k * N;
        const float c = cs[k];
        const float s = sn[k];
        if (s != 0.f) {
          const float x = A[j * N + pp[k]];
          const float y = A[j * N + qq[k]];
          A[j * N + pp[k]] = c * x - s * y;
          A[j * N + qq[k]] = s * x + c * y;
          const float u = V[j * N + pp[k]];
          const float w = V[j * N + qq[k]];
          V[j * N + pp[k]] = c * u - s * w;
          V[j * N + qq[k]] = s * u + c * w;
        }
      }
      int next_top = 0;
      int next_bot = 0;
      if (tid < M) {
        next_top = tid == 0 ? top[0] : (tid == 1 ? bot[0] : top[tid - 1]);
        next_bot = tid == M - 1 ? top[M - 1] : bot[tid + 1];
      }
      threadgroup_barrier(mem_flags::mem_threadgroup | mem_flags::mem_device);
      if (tid < M) {
        top[tid] = next_top;
        bot[tid] = next_bot;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    rotated = simd_sum(rotated);
    if ((tid & 31) == 0) red[tid >> 5] = rotated;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float any = 0.f;
    for (int w = 0; w < NT / 32; ++w) any += red[w];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (any == 0.f) break;
  }
"""


def _kernel(backend: str):
    return gpu_kernel(backend, "vq_jacobi_eigh", ("a",), ("work", "vecs"), (CUDA_SOURCE, METAL_SOURCE))


def threads(n: int) -> int:
    """Threads a block: about 16 of a round's n^2 / 2 row and column updates each, at most NT,
    and never fewer than the round's n / 2 rotations (the pairing's move takes one each)."""
    return min(NT, max(32, -(-(n * n // 16) // 32) * 32, -(-n // 2 // 32) * 32))


def launch_args(a: mx.array) -> dict:
    """The launch for matrices a (B, n, n): one block of ``threads(n)`` each."""
    b, n, _ = a.shape
    nt = threads(n)
    return dict(inputs=[a.astype(mx.float32)], template=[("N", n), ("NT", nt), ("MAX_SWEEPS", MAX_SWEEPS)],
                grid=(b * nt, 1, 1), threadgroup=(nt, 1, 1), output_shapes=[(b, n, n), (b, n, n)],
                output_dtypes=[mx.float32, mx.float32])


def ordered(work: mx.array, vecs: mx.array) -> tuple[mx.array, mx.array]:
    """(eigenvalues ascending (B, n), eigenvectors as columns (B, n, n)) from the rotated
    matrices and their accumulated rotations."""
    w = mx.diagonal(work, axis1=-2, axis2=-1)
    order = mx.argsort(w, axis=-1)
    return mx.take_along_axis(w, order, axis=-1), mx.take_along_axis(vecs, order[..., None, :], axis=-1)


def kernel_applies(n: int) -> Optional[str]:
    """The GPU back-end the kernel would run on for n x n problems, or None."""
    backend = gpu_backend()
    if backend is None or n > min(GPU_MAX_N, 2 * NT) or n % 2 or n < 4:
        return None
    return backend


def symmetric_eigh(a: mx.array) -> tuple[mx.array, mx.array]:
    """``mx.linalg.eigh`` of symmetric float32 matrices (..., n, n): ascending eigenvalues and
    their vectors as columns; through the Jacobi kernel where it applies on a GPU, else on
    the CPU stream (LAPACK)."""
    n = a.shape[-1]
    backend = kernel_applies(n)
    if backend is None:
        return mx.linalg.eigh(a, stream=mx.cpu)
    lead = a.shape[:-2]
    work, vecs = _kernel(backend)(**launch_args(a.reshape(-1, n, n)))
    w, v = ordered(work, vecs)
    return w.reshape(*lead, n), v.reshape(*lead, n, n)
