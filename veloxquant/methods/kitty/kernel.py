"""Kitty's stored keys from their two planes in one launch (the CUDA decode read).

``KittyStore._decoded_attention`` decodes the keys over the buffers' room in one compiled
MLX pass (``promoted._compiled_rows``): the lo plane unpacked, the promoted channels' up
plane unpacked and joined in by a gather and a scatter along the channels, the affine step,
a transpose. That is several launches a layer. This kernel writes the stored keys in one:

- a thread owns channel c of token t (block ``t / BLOCK``, row ``t % BLOCK``) of a KV head;
- the lo code is the token's field in channel c's bit stream (per-channel layout: tokens
  along the words, ``affine.pack_codes``' order; ``codebook_rows.PACKED_INDEX_CUDA``);
- where c is one of the block's promoted channels (``index``: the block's k channels, in
  increasing order), the up plane's field of row ``t % BLOCK`` is joined above it:
  ``lo + 2^lo_bits up``, the hi-bit code, as ``_compiled_rows`` joins them;
- ``code * scale + min`` with the channel's group's scale and minimum, in float32, then the
  output dtype.

Only the stored rows are written. CUDA may fuse ``code * scale + min``, so a value may differ
from the MLX pass by one float32 rounding before the cast (``kernels/checks.within_a_rounding``
allows that). The first use checks the kernel against the MLX pass once a process; a failure
keeps the pass. The CUDA source is run on the CPU by emulation (tests). The Metal twin mirrors
it line for line: UNTESTED ON HARDWARE.
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
  const int code_words = params[1];
  const int groups = params[2];
  const int blocks = params[3];
  const size_t i = (size_t)blockIdx.x * NT + threadIdx.x;
  if (i >= (size_t)count * D) return;
  const int bh = blockIdx.y;
  const int t = (int)(i / D);
  const int c = (int)(i - (size_t)t * D);
  unsigned int code = vq_packed_index(codes + ((size_t)bh * D + c) * code_words, t, LO);
  if (K > 0) {
    const int blk = t / BLOCK;
    const size_t at = ((size_t)bh * blocks + blk) * K;
    for (int j = 0; j < K; ++j) {
      if ((int)index[at + j] == c) {
        code |= vq_packed_index(up + (at + j) * UW, t - blk * BLOCK, UP) << LO;
        break;
      }
    }
  }
  const size_t s = ((size_t)bh * D + c) * groups + t / GROUP;
  keys[((size_t)bh * count + t) * D + c] = (T)((float)code * (float)scales[s] + (float)biases[s]);
"""

METAL_SOURCE = r"""
  const int count = params[0];
  const int code_words = params[1];
  const int groups = params[2];
  const int blocks = params[3];
  const size_t i = size_t(threadgroup_position_in_grid.x) * NT + thread_position_in_threadgroup.x;
  if (i >= size_t(count) * D) return;
  const int bh = int(threadgroup_position_in_grid.y);
  const int t = int(i / D);
  const int c = int(i - size_t(t) * D);
  uint code = vq_packed_index(codes + (size_t(bh) * D + c) * code_words, t, LO);
  if (K > 0) {
    const int blk = t / BLOCK;
    const size_t at = (size_t(bh) * blocks + blk) * K;
    for (int j = 0; j < K; ++j) {
      if (int(index[at + j]) == c) {
        code |= vq_packed_index(up + (at + j) * UW, t - blk * BLOCK, UP) << LO;
        break;
      }
    }
  }
  const size_t s = (size_t(bh) * D + c) * groups + t / GROUP;
  keys[(size_t(bh) * count + t) * D + c] = T(float(code) * float(scales[s]) + float(biases[s]));
"""

_INPUTS = ["codes", "scales", "biases", "up", "index", "params"]


def _kernel(backend: str):
    return gpu_kernel(backend, "vq_kitty_key_rows", tuple(_INPUTS), ("keys",), (CUDA_SOURCE, METAL_SOURCE),
                      (PACKED_INDEX_CUDA, PACKED_INDEX_METAL))


def launch_args(codes, scales, biases, up, index, *, codec, count: int, dtype) -> dict:
    """The launch over the whole buffers (lo codes (B, H, D, words), scales and minima (B, H,
    D, groups), up codes (B, H, blocks, k, words a block) and channel indices (B, H, blocks,
    k), or None for both where no channel is promoted): keys (B, H, count, D) in ``dtype``."""
    b, h, d, words = codes.shape
    promoted = up is not None
    up = up if promoted else mx.zeros((1,), mx.uint32)
    index = index if promoted else mx.zeros((1,), mx.uint8)
    k = index.shape[3] if promoted else 0
    params = mx.array([count, words, scales.shape[-1], up.shape[2] if promoted else 0], mx.int32)
    return dict(inputs=[codes, scales, biases, up, index, params],
                template=[("T", dtype), ("D", d), ("LO", codec.lo_bits), ("UP", codec.up_bits),
                          ("UW", up.shape[-1] if promoted else 1), ("K", k), ("BLOCK", codec.block),
                          ("GROUP", codec.group), ("NT", NT)],
                grid=(-(-count * d // NT) * NT, b * h, 1), threadgroup=(NT, 1, 1),
                output_shapes=[(b, h, count, d)], output_dtypes=[dtype])


def kernel_backend(dtype) -> Optional[str]:
    """The GPU back-end the kernel runs on for keys in ``dtype``; None where it does not (no
    GPU, a kernel that failed its check): the caller runs the MLX pass."""
    backend = kd.gpu_backend()
    return backend if backend is not None and kernel_checked(backend, dtype) else None


def key_rows(backend: str, codes, scales, biases, up, index, *, codec, count: int, dtype) -> mx.array:
    """The stored keys (B, H, count, D) through the kernel (``launch_args``' buffers)."""
    return _kernel(backend)(**launch_args(codes, scales, biases, up, index, codec=codec, count=count,
                                          dtype=dtype))[0]


_CHECKED: dict = {}


def kernel_checked(backend: str, dtype) -> bool:
    """Whether the kernel passed its check for ``dtype`` (``checks.checked_once``): random keys
    at the defaults' planes (``check_case``) against the MLX pass, within one float32 rounding."""
    return checked_once(_CHECKED, backend, (backend, str(dtype)), lambda: _check_problem(backend, dtype),
                        "kitty key-rows kernel", "keys are decoded through MLX's ops instead")


def check_case(dtype, lo: int = 2, hi: int = 4, fraction: float = 0.25, tokens: int = 96):
    """Keys of random tokens in kitty's planes (``PromotedKeys``) and their decode through the
    MLX pass (``room_rows``, cut to the count): what the self-check and tests compare with."""
    from .promoted import PromotedChannels, PromotedKeys

    keys = PromotedKeys(PromotedChannels(lo, hi, 32, 32, fraction))
    x = mx.random.normal((2, 2, tokens, 64), key=mx.random.key(9)) * (1 + 6 * (mx.arange(64) % 9 == 0))
    keys.append(x.astype(dtype))
    return keys, keys.room_rows(dtype)[:, :, : keys.count]


def _check_problem(backend: str, dtype) -> Optional[str]:
    keys, reference = check_case(dtype)
    try:
        got = _kernel(backend)(**launch_args(*keys.kernel_inputs(), codec=keys.codec, count=keys.count, dtype=dtype))[0]
        same = within_a_rounding(got, reference)
    except Exception as exc:  # a kernel that does not compile or launch fails its check
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None if same else "keys differ from the MLX pass's by more than a rounding"
