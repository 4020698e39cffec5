"""Rows from packed codebook indices in one launch: a CUDA decode step's centroid gather.

A codebook store keeps each token as ``n`` indices of ``bits`` packed in a little-endian bit
stream of uint32 words (``quant/vq.pack_indices``' layout). vecinfer's CUDA read rebuilds the
coded tokens' rows (in the code space) by gathering each index's centroid. In MLX ops that
is three gathers and a compiled pass a tensor (the two words an index may span, its bits,
then the centroids: ``vq_store._gathered``), each a launch. This kernel writes the rows in
one:

- a thread owns one output value: token t, channel c of the row (sub-vector ``c / s``,
  its component ``c % s``);
- it reads the index's low word and, where the index crosses into it, the next, shifts
  and masks, and reads the centroid's component from the codebooks laid end to end (row b's
  codebook at ``b * K`` where each row has its own, else at 0);
- the output is (B, H, count, n s) in the codebooks' dtype: the same values the gathers give,
  bit for bit (no arithmetic on them).

The first use checks the kernel against the gathers on a random case, once a process and
layout, and keeps the gathers if it fails. The CUDA source is run on the CPU by emulation
(tests). The Metal twin mirrors it line for line: UNTESTED ON HARDWARE.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import kivi_decode as kd
from .checks import checked_once, gpu_kernel

NT = 256

# An index of ``bits`` (at most 31) from a token's little-endian bit stream of words ``w``:
# index j's low bits in word (j bits) / 32, its high bits in the next where it crosses.
# Shared with nsnquant's code-rows kernel.
PACKED_INDEX_CUDA = r"""
__device__ __forceinline__ unsigned int vq_packed_index(const unsigned int* w, int j, int bits) {
  const int bit = j * bits;
  unsigned int code = w[bit >> 5] >> (bit & 31);
  if ((bit & 31) + bits > 32) code |= w[(bit >> 5) + 1] << (32 - (bit & 31));
  return code & ((1u << bits) - 1u);
}
"""

PACKED_INDEX_METAL = r"""
inline uint vq_packed_index(const device uint* w, int j, int bits) {
  const int bit = j * bits;
  uint code = w[bit >> 5] >> (bit & 31);
  if ((bit & 31) + bits > 32) code |= w[(bit >> 5) + 1] << (32 - (bit & 31));
  return code & ((1u << bits) - 1u);
}
"""

CUDA_SOURCE = r"""
  const int count = params[0];
  const int room = params[1];
  const int book_rows = params[2];
  const int heads = params[3];
  constexpr int ROW = N * S;
  const size_t i = (size_t)blockIdx.x * NT + threadIdx.x;
  if (i >= (size_t)count * ROW) return;
  const int bh = blockIdx.y;
  const int t = (int)(i / ROW);
  const int c = (int)(i - (size_t)t * ROW);
  const int j = c / S;
  const unsigned int code = vq_packed_index(words + ((size_t)bh * room + t) * W, j, BITS);
  const int book = book_rows > 1 ? (bh / heads) * K : 0;
  out[(size_t)bh * count * ROW + i] = books[((size_t)book + code) * S + (c - j * S)];
"""

METAL_SOURCE = r"""
  const int count = params[0];
  const int room = params[1];
  const int book_rows = params[2];
  const int heads = params[3];
  constexpr int ROW = N * S;
  const size_t i = size_t(threadgroup_position_in_grid.x) * NT + thread_position_in_threadgroup.x;
  if (i >= size_t(count) * ROW) return;
  const int bh = int(threadgroup_position_in_grid.y);
  const int t = int(i / ROW);
  const int c = int(i - size_t(t) * ROW);
  const int j = c / S;
  const uint code = vq_packed_index(words + (size_t(bh) * room + t) * W, j, BITS);
  const int book = book_rows > 1 ? (bh / heads) * K : 0;
  out[size_t(bh) * count * ROW + i] = books[(size_t(book) + code) * S + (c - j * S)];
"""


def _kernel(backend: str):
    return gpu_kernel(backend, "vq_codebook_rows", ("words", "books", "params"), ("out",), (CUDA_SOURCE, METAL_SOURCE),
                      (PACKED_INDEX_CUDA, PACKED_INDEX_METAL))


def launch_args(words: mx.array, books: mx.array, n: int, bits: int, book_rows: int, count: int) -> dict:
    """The launch for the code buffer ``words`` (B, H, room, W), the codebooks laid end to end
    ``books`` (book_rows K, s) and ``count`` coded tokens: (B, H, count, n s) out."""
    b, h, room, w = words.shape
    s = books.shape[-1]
    k = books.shape[0] // book_rows
    params = mx.array([count, room, book_rows, h], mx.int32)
    return dict(inputs=[words, books, params],
                template=[("T", books.dtype), ("N", n), ("S", s), ("BITS", bits), ("W", w), ("K", k), ("NT", NT)],
                grid=(-(-count * n * s // NT) * NT, b * h, 1), threadgroup=(NT, 1, 1),
                output_shapes=[(b, h, count, n * s)], output_dtypes=[books.dtype])


def codebook_rows(words, books, n: int, bits: int, book_rows: int, count: int) -> Optional[mx.array]:
    """The coded tokens' rows through the kernel on a GPU; None where it does not run (no GPU,
    a layout past 31 bits, a kernel that failed its check): the caller gathers instead."""
    backend = kd.gpu_backend()
    if backend is None or not count or bits > 31 or not kernel_checked(backend, books.dtype):
        return None
    return _kernel(backend)(**launch_args(words, books, n, bits, book_rows, count))[0]


_CHECKED: dict = {}


def kernel_checked(backend: str, dtype) -> bool:
    """Whether the kernel passed its check for ``dtype`` (``checks.checked_once``): a random
    case of two rows with a codebook each, 12-bit indices that cross words, against the gathers
    (``reference``), bit for bit."""
    return checked_once(_CHECKED, backend, (backend, str(dtype)), lambda: _check_problem(backend, dtype),
                        "codebook-rows kernel", "coded rows are gathered through MLX's ops instead")


def reference(words, books, n: int, bits: int, book_rows: int, count: int) -> mx.array:
    """The rows as gathers give them: each index unpacked from its words, its centroid taken."""
    from ..quant.vq import unpack_indices

    b, h = words.shape[:2]
    idx = unpack_indices(words[:, :, :count], bits, n)  # (B, H, count, n)
    k = books.shape[0] // book_rows
    if book_rows > 1:
        idx = idx + (mx.arange(b, dtype=mx.uint32) * k).reshape(b, 1, 1, 1)
    rows = mx.take(books, idx, axis=0)  # (B, H, count, n, s)
    return rows.reshape(b, h, count, -1)


def _check_problem(backend: str, dtype) -> Optional[str]:
    n, bits, count = 10, 12, 37
    key = mx.random.split(mx.random.key(7), 2)
    w = -(-n * bits // 32)
    words = mx.random.randint(0, 1 << 30, (2, 3, count + 5, w), key=key[0]).astype(mx.uint32)
    books = mx.random.normal((2 * (1 << bits), 4), key=key[1]).astype(dtype)
    try:
        got = _kernel(backend)(**launch_args(words, books, n, bits, 2, count))[0]
        same = mx.array_equal(got, reference(words, books, n, bits, 2, count)).item()
    except Exception as exc:  # a kernel that does not compile or launch fails its check
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None if same else "rows differ from the gathers'"
