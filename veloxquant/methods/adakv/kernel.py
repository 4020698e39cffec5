"""AdaKV's stored keys and values from their bit planes in one launch (a GPU decode step).

``PlaneStore.attend`` dequantizes the planes over the buffers' room in one compiled MLX pass
(``heads.compiled_dequant``). That pass is still a gather of a plane for every bit of keys
and values (``take_along_axis``), and more launches around them. This kernel writes both
tensors' stored rows in one:

- a thread owns channel c of token t (block ``t / G``, row ``t % G``) of one KV head;
- for each bit k it reads the word ``c / 32`` of the plane that holds the head's bit k in
  that block (``sources``), takes bit ``c % 32`` and adds the bit's weight (``weights``: 2^k,
  or 0 past the head's width), as ``heads.from_planes`` sums them;
- keys: ``code * scale + min`` with the block's per-channel scale and minimum; values: with
  the token's group's; in float32, then the output dtype.

The rows past the stored count are not written (the output holds ``stored`` rows). CUDA may
fuse ``code * scale + min`` into one multiply-add, so a value may differ from the MLX pass by
one float32 rounding before the cast; the check allows that. The first use checks the kernel
against the MLX pass once a process; a failure keeps the pass. The CUDA source is run on the
CPU by emulation (tests). The Metal twin mirrors it line for line: UNTESTED ON HARDWARE.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ...kernels import kivi_decode as kd
from ...kernels.checks import checked_once, gpu_kernel, within_a_rounding

NT = 256

CUDA_SOURCE = r"""
  const int stored = params[0];
  const int blocks = params[1];
  const int planes = params[2];
  const int heads = params[3];
  constexpr int DM = DK > DV ? DK : DV;
  const size_t i = (size_t)blockIdx.x * NT + threadIdx.x;
  if (i >= (size_t)stored * DM) return;
  const int bh = blockIdx.y;
  const int b = bh / heads;
  const int t = (int)(i / DM);
  const int c = (int)(i - (size_t)t * DM);
  const int blk = t / G;
  const int row = t - blk * G;
  const size_t at = (size_t)bh * blocks + blk;
  unsigned int kcode = 0;
  unsigned int vcode = 0;
  for (int k = 0; k < HI; ++k) {
    const int p = sources[(size_t)k * gridDim.y * blocks + at];
    const unsigned int w = weights[(size_t)k * gridDim.y * blocks + at];
    const size_t plane = (((size_t)b * planes + p) * blocks + blk) * G + row;
    if (c < DK) kcode += ((k_planes[plane * (DK / 32) + (c >> 5)] >> (c & 31)) & 1u) * w;
    if (c < DV) vcode += ((v_planes[plane * (DV / 32) + (c >> 5)] >> (c & 31)) & 1u) * w;
  }
  if (c < DK) {
    const size_t s = at * DK + c;
    keys[((size_t)bh * stored + t) * DK + c] = (T)((float)kcode * (float)k_scales[s] + (float)k_min[s]);
  }
  if (c < DV) {
    const size_t s = (at * G + row) * (DV / GROUP) + c / GROUP;
    values[((size_t)bh * stored + t) * DV + c] = (T)((float)vcode * (float)v_scales[s] + (float)v_min[s]);
  }
"""

METAL_SOURCE = r"""
  const int stored = params[0];
  const int blocks = params[1];
  const int planes = params[2];
  const int heads = params[3];
  constexpr int DM = DK > DV ? DK : DV;
  const size_t i = size_t(threadgroup_position_in_grid.x) * NT + thread_position_in_threadgroup.x;
  if (i >= size_t(stored) * DM) return;
  const int bh = int(threadgroup_position_in_grid.y);
  const int b = bh / heads;
  const int t = int(i / DM);
  const int c = int(i - size_t(t) * DM);
  const int blk = t / G;
  const int row = t - blk * G;
  const size_t at = size_t(bh) * blocks + blk;
  const size_t bhs = size_t(threadgroups_per_grid.y);
  uint kcode = 0;
  uint vcode = 0;
  for (int k = 0; k < HI; ++k) {
    const int p = sources[size_t(k) * bhs * blocks + at];
    const uint w = weights[size_t(k) * bhs * blocks + at];
    const size_t plane = ((size_t(b) * planes + p) * blocks + blk) * G + row;
    if (c < DK) kcode += ((k_planes[plane * (DK / 32) + (c >> 5)] >> (c & 31)) & 1u) * w;
    if (c < DV) vcode += ((v_planes[plane * (DV / 32) + (c >> 5)] >> (c & 31)) & 1u) * w;
  }
  if (c < DK) {
    const size_t s = at * DK + c;
    keys[(size_t(bh) * stored + t) * DK + c] = T(float(kcode) * float(k_scales[s]) + float(k_min[s]));
  }
  if (c < DV) {
    const size_t s = (at * G + row) * (DV / GROUP) + c / GROUP;
    values[(size_t(bh) * stored + t) * DV + c] = T(float(vcode) * float(v_scales[s]) + float(v_min[s]));
  }
"""

_INPUTS = ["k_planes", "v_planes", "k_scales", "k_min", "v_scales", "v_min", "sources", "weights", "params"]


def _kernel(backend: str):
    return gpu_kernel(backend, "vq_adakv_plane_rows", tuple(_INPUTS), ("keys", "values"), (CUDA_SOURCE, METAL_SOURCE))


def stacked_maps(sources: list, weights: list) -> tuple[mx.array, mx.array]:
    """The per-bit plane maps as the kernel reads them: (HI, B, H, nb) int32 and uint32, from
    the store's per-bit (B, H, nb, 1, 1, 1) buffers (built once a flush, with the views)."""
    b, h, nb = sources[0].shape[:3]
    return (mx.stack([s.reshape(b, h, nb) for s in sources]).astype(mx.int32),
            mx.stack([w.reshape(b, h, nb) for w in weights]).astype(mx.uint32))


def launch_args(k_planes, v_planes, k_scales, k_min, v_scales, v_min, sources, weights, *, stored: int,
                group: int, dtype) -> dict:
    """The launch over the whole buffers (planes (B, P, nb, G, d/32, 1), keys' scales and minima
    (B, H, nb, 1, dk), values' (B, H, nb, G, dv/group), the stacked maps (HI, B, H, nb)):
    keys (B, H, stored, dk) and values (B, H, stored, dv) in ``dtype``."""
    b, p, nb, g = k_planes.shape[:4]
    h, dk, dv = k_scales.shape[1], k_scales.shape[-1], v_scales.shape[-1] * group
    params = mx.array([stored, nb, p, h], mx.int32)
    return dict(inputs=[k_planes, v_planes, k_scales, k_min, v_scales, v_min, sources, weights, params],
                template=[("T", dtype), ("DK", dk), ("DV", dv), ("G", g), ("GROUP", group),
                          ("HI", sources.shape[0]), ("NT", NT)],
                grid=(-(-stored * max(dk, dv) // NT) * NT, b * h, 1), threadgroup=(NT, 1, 1),
                output_shapes=[(b, h, stored, dk), (b, h, stored, dv)], output_dtypes=[dtype, dtype])


def plane_rows(inputs, *, stored: int, group: int, dtype) -> Optional[tuple[mx.array, mx.array]]:
    """The stored keys and values through the kernel on a GPU (``inputs()``: ``launch_args``'
    buffers and maps, asked only where the kernel runs); None where it does not (no GPU, a
    kernel that failed its check): the caller runs the MLX pass."""
    backend = kd.gpu_backend()
    if backend is None or not stored or not kernel_checked(backend, dtype):
        return None
    keys, values = _kernel(backend)(**launch_args(*inputs(), stored=stored, group=group, dtype=dtype))
    return keys, values


_CHECKED: dict = {}


def kernel_checked(backend: str, dtype) -> bool:
    """Whether the kernel passed its check for ``dtype`` (``checks.checked_once``): a store of
    random tokens at the defaults' widths (``heads.check_case``) against the MLX pass, within
    one float32 rounding."""
    return checked_once(_CHECKED, backend, (backend, str(dtype)), lambda: _check_problem(backend, dtype),
                        "AdaKV plane-rows kernel", "planes are dequantized through MLX's ops instead")


def _check_problem(backend: str, dtype) -> Optional[str]:
    from .heads import check_case

    store, reference = check_case(dtype)
    try:
        args, stored = store.plane_inputs(), store.stored
        keys, values = _kernel(backend)(**launch_args(*args, stored=stored, group=store.group, dtype=dtype))
        same = within_a_rounding(keys, reference[0]) and within_a_rounding(values, reference[1])
    except Exception as exc:  # a kernel that does not compile or launch fails its check
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None if same else "rows differ from the MLX pass's by more than a rounding"
