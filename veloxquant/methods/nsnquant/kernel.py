"""nsnquant's CUDA decode rows in one launch: ``x_hat H = s1 (s2 y_hat + o H)`` per tensor.

The CUDA read (``NSNStore.attend_parts``) rebuilds every coded row in the rotated frame
and reads them with one fused attention. In MLX ops (``nsn._code_rows``: one compiled pass)
that is still several launches a tensor: the indices viewed or unpacked, the centroids
gathered, the signs read, the norms and the chunk's mean applied. This kernel writes each
row value in one:

- a thread owns one value: token t, channel c (sub-vector ``c / s``, its component ``c % s``);
- the index is read from the token's little-endian bit stream (``vq.pack_indices``' layout:
  8 and 16 bits are its bytes and halves; ``codebook_rows.PACKED_INDEX_CUDA``), the centroid's
  component taken from the codebook;
- at 2 bits the sign is bit ``c % 32`` of the token's sign word ``c / 32`` (``pack_indices(y
  < 0, 1)``), and a set bit negates;
- ``s1 (s2 y + o)`` in float32, ``o`` the token's chunk's rotated mean, then the output dtype.

The same formula as ``_code_rows``, in the same order; CUDA may contract ``s2 y + o`` into
one fused multiply-add, so a value may differ from the MLX pass by one float32 rounding
before the cast (``kernels/checks.within_a_rounding`` allows that). The first use checks the
kernel against ``_code_rows`` once a process; a failure keeps the MLX pass. The CUDA source
is run on the CPU by emulation (tests). The Metal twin mirrors it line for line: UNTESTED ON
HARDWARE.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ...kernels import kivi_decode as kd
from ...kernels.checks import checked_once, gpu_kernel, within_a_rounding
from ...kernels.codebook_rows import PACKED_INDEX_CUDA, PACKED_INDEX_METAL

NT = 256

CUDA_SOURCE = r"""
  const int count = params[0];
  const int room_idx = params[1];
  const int room_norm = params[2];
  const int chunks = params[3];
  const size_t i = (size_t)blockIdx.x * NT + threadIdx.x;
  if (i >= (size_t)count * D) return;
  const int bh = blockIdx.y;
  const int t = (int)(i / D);
  const int c = (int)(i - (size_t)t * D);
  const int j = c / S;
  const unsigned int code = vq_packed_index(idx + ((size_t)bh * room_idx + t) * IW, j, IBITS);
  float y = codebook[(size_t)code * S + (c - j * S)];
  if (SIGNED) {
    const unsigned int s = sign[((size_t)bh * room_idx + t) * SW + (c >> 5)];
    if ((s >> (c & 31)) & 1u) y = -y;
  }
  const float s1 = (float)norms[((size_t)bh * room_norm + t) * 2];
  const float s2 = (float)norms[((size_t)bh * room_norm + t) * 2 + 1];
  const float o = means[((size_t)bh * chunks + t / CHUNK) * D + c];
  out[(size_t)bh * count * D + i] = (T)(s1 * (s2 * y + o));
"""

METAL_SOURCE = r"""
  const int count = params[0];
  const int room_idx = params[1];
  const int room_norm = params[2];
  const int chunks = params[3];
  const size_t i = size_t(threadgroup_position_in_grid.x) * NT + thread_position_in_threadgroup.x;
  if (i >= size_t(count) * D) return;
  const int bh = int(threadgroup_position_in_grid.y);
  const int t = int(i / D);
  const int c = int(i - size_t(t) * D);
  const int j = c / S;
  const uint code = vq_packed_index(idx + (size_t(bh) * room_idx + t) * IW, j, IBITS);
  float y = codebook[size_t(code) * S + (c - j * S)];
  if (SIGNED) {
    const uint s = sign[(size_t(bh) * room_idx + t) * SW + (c >> 5)];
    if ((s >> (c & 31)) & 1u) y = -y;
  }
  const float s1 = float(norms[(size_t(bh) * room_norm + t) * 2]);
  const float s2 = float(norms[(size_t(bh) * room_norm + t) * 2 + 1]);
  const float o = means[(size_t(bh) * chunks + t / CHUNK) * D + c];
  out[size_t(bh) * count * D + i] = T(s1 * (s2 * y + o));
"""

_INPUTS = ["idx", "sign", "norms", "means", "codebook", "params"]


def _kernel(backend: str):
    return gpu_kernel(backend, "vq_nsn_code_rows", tuple(_INPUTS), ("out",), (CUDA_SOURCE, METAL_SOURCE),
                      (PACKED_INDEX_CUDA, PACKED_INDEX_METAL))


def launch_args(idx, sign, norms, rotated_means, codebook, head_dim: int, chunk: int, count: int, dtype) -> dict:
    """The launch over the buffers (``NSNTokens.fused_inputs``: index words (B, H, room, IW),
    sign words (B, H, room, SW) or None, norms (B, H, room, 2), rotated means (B, H, chunks,
    D) float32) and the float32 codebook (K, s): (B, H, count, D) in ``dtype``."""
    b, h, room, iw = idx.shape
    k, s = codebook.shape
    signed = sign is not None
    sign = sign if signed else mx.zeros((1,), mx.uint32)
    params = mx.array([count, room, norms.shape[2], rotated_means.shape[2]], mx.int32)
    return dict(inputs=[idx, sign, norms, rotated_means.astype(mx.float32), codebook.astype(mx.float32), params],
                template=[("T", dtype), ("D", head_dim), ("S", s), ("IBITS", k.bit_length() - 1), ("IW", iw),
                          ("SW", sign.shape[-1] if signed else 1), ("SIGNED", signed), ("CHUNK", chunk), ("NT", NT)],
                grid=(-(-count * head_dim // NT) * NT, b * h, 1), threadgroup=(NT, 1, 1),
                output_shapes=[(b, h, count, head_dim)], output_dtypes=[dtype])


def code_rows(idx, sign, norms, rotated_means, codebook, head_dim: int, chunk: int, count: int, dtype):
    """The coded rows (B, H, count, D) through the kernel on a GPU; None where it does not run
    (no GPU, a kernel that failed its check): the caller runs ``_code_rows``."""
    backend = kd.gpu_backend()
    if backend is None or not count or not kernel_checked(backend, dtype):
        return None
    args = launch_args(idx, sign, norms, rotated_means, codebook, head_dim, chunk, count, dtype)
    return _kernel(backend)(**args)[0]


_CHECKED: dict = {}


def kernel_checked(backend: str, dtype) -> bool:
    """Whether the kernel passed its check for ``dtype`` (``checks.checked_once``): a random
    2-bit store's rows against ``nsn._code_rows``, within one float32 rounding."""
    return checked_once(_CHECKED, backend, (backend, str(dtype)), lambda: _check_problem(backend, dtype),
                        "nsnquant code-rows kernel", "rows are rebuilt through MLX's ops instead")


def reference(idx, sign, norms, rotated_means, codebook, bits: int, head_dim: int, chunk: int, count: int, dtype):
    """The rows as ``nsn._code_rows`` gives them (its compiled pass), cut to ``count``."""
    from .nsn import _code_rows_fn, _sign_tables

    return _code_rows_fn(bits, head_dim, chunk, dtype)(idx, sign, norms, rotated_means, codebook,
                                                        *_sign_tables())[:, :, :count]


def random_store(b: int, h: int, room: int, head_dim: int, sub_dim: int, index_bits: int, chunk: int, seed: int):
    """Random 2-bit buffers as ``NSNTokens.fused_inputs`` holds them, and a codebook: (index
    words, sign words, norms float16, rotated means float32, codebook (2^bits, s) float32).
    Any bits are valid codes, so the words are random."""
    from ...quant.vq import index_words

    key = mx.random.split(mx.random.key(seed), 5)
    iw, sw = index_words(head_dim // sub_dim, index_bits), index_words(head_dim, 1)
    idx = mx.random.randint(0, 1 << 30, (b, h, room, iw), key=key[0]).astype(mx.uint32) * 5
    sign = mx.random.randint(0, 1 << 30, (b, h, room, sw), key=key[1]).astype(mx.uint32) * 3
    norms = mx.random.uniform(0.5, 2.0, (b, h, room, 2), key=key[2]).astype(mx.float16)
    means = mx.random.normal((b, h, -(-room // chunk), head_dim), key=key[3])
    codebook = mx.abs(mx.random.normal((1 << index_bits, sub_dim), key=key[4]))
    return idx, sign, norms, means, codebook


def _check_problem(backend: str, dtype) -> Optional[str]:
    d, chunk, count = 64, 16, 40
    idx, sign, norms, means, codebook = random_store(1, 2, 48, d, 4, 8, chunk, seed=11)
    try:
        got = _kernel(backend)(**launch_args(idx, sign, norms, means, codebook, d, chunk, count, dtype))[0]
        same = within_a_rounding(got, reference(idx, sign, norms, means, codebook, 2, d, chunk, count, dtype))
    except Exception as exc:  # a kernel that does not compile or launch fails its check
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None if same else "rows differ from _code_rows' by more than a rounding"
