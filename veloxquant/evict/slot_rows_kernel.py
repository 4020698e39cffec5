"""Packed slots' keys and values in one launch (the CUDA read of ``QuantizedSlots``).

``QuantizedSlots._attend_rows`` decodes every slot's rows in the queries' dtype and takes
the ring's tokens from the ring, then calls one fused attention. In MLX ops that is a
dequantization, a gather from the ring and a select for the keys and again for the values,
then a cut to the slots held: small launches that a composed step waits on
(``benchmarks/notes/cuda_dense_reads.md``). This kernel writes both in one:

- a thread owns channel c of slot t of one KV head, of the keys (grid row ``y < B H``) or
  of the values (the rest);
- a slot whose position is at or past the ring's start reads its token's row from the ring,
  at ring row ``(position - base) mod W`` (``base``: the position at ring row 0);
- any other slot reads its code from the row's little-endian bit stream of words
  (``codebook_rows.PACKED_INDEX_CUDA``), then ``code * scale + min`` with its group's scale
  and minimum, in float32, then the output dtype (the float32 read's values, rounded once;
  the MLX pass in float16 rounds the product and the sum each);
- ``count`` slots are written: the slots held (or the buffers' room, where H2O's weights are
  taken over it).

CUDA may fuse ``code * scale + min``, so a value may differ from the float32 pass by one
float32 rounding before the cast (``kernels/checks.within_a_rounding`` allows that). The first
use checks the kernel against that pass once a process and dtype; a failure keeps MLX's ops.
The CUDA source is run on the CPU by emulation (tests). The Metal twin mirrors it line for
line: UNTESTED ON HARDWARE.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..kernels import kivi_decode as kd
from ..kernels.checks import checked_once, gpu_kernel, within_a_rounding
from ..kernels.codebook_rows import PACKED_INDEX_CUDA, PACKED_INDEX_METAL

NT = 256

CUDA_SOURCE = r"""
  const int count = params[0];
  const int room = params[1];
  const int heads = params[2];
  const int ring_start = params[3];
  const int base = params[4];
  const size_t i = (size_t)blockIdx.x * NT + threadIdx.x;
  if (i >= (size_t)count * D) return;
  const int values = (int)blockIdx.y >= heads;
  const int bh = (int)blockIdx.y - (values ? heads : 0);
  const int t = (int)(i / D);
  const int c = (int)(i - (size_t)t * D);
  const size_t row = (size_t)bh * room + t;
  const int p = positions[row];
  T out;
  if (W > 0 && p >= ring_start) {
    const int w = W > 0 ? W : 1;  // no modulo by a zero constant where the branch is dead
    int r = (p - base) % w;
    if (r < 0) r += w;
    out = (values ? v_ring : k_ring)[((size_t)bh * W + r) * D + c];
  } else {
    const unsigned int* codes = (values ? v_codes : k_codes) + row * (D * BITS / 32);
    const size_t s = row * (D / GROUP) + c / GROUP;
    const float scale = (float)(values ? v_scales : k_scales)[s];
    const float low = (float)(values ? v_biases : k_biases)[s];
    out = (T)((float)vq_packed_index(codes, c, BITS) * scale + low);
  }
  (values ? out_v : out_k)[((size_t)bh * count + t) * D + c] = out;
"""

METAL_SOURCE = r"""
  const int count = params[0];
  const int room = params[1];
  const int heads = params[2];
  const int ring_start = params[3];
  const int base = params[4];
  const size_t i = size_t(threadgroup_position_in_grid.x) * NT + thread_position_in_threadgroup.x;
  if (i >= size_t(count) * D) return;
  const int values = int(threadgroup_position_in_grid.y) >= heads;
  const int bh = int(threadgroup_position_in_grid.y) - (values ? heads : 0);
  const int t = int(i / D);
  const int c = int(i - size_t(t) * D);
  const size_t row = size_t(bh) * room + t;
  const int p = positions[row];
  T out;
  if (W > 0 && p >= ring_start) {
    const int w = W > 0 ? W : 1;  // no modulo by a zero constant where the branch is dead
    int r = (p - base) % w;
    if (r < 0) r += w;
    out = (values ? v_ring : k_ring)[(size_t(bh) * W + r) * D + c];
  } else {
    const device uint* codes = (values ? v_codes : k_codes) + row * (D * BITS / 32);
    const size_t s = row * (D / GROUP) + c / GROUP;
    const float scale = float((values ? v_scales : k_scales)[s]);
    const float low = float((values ? v_biases : k_biases)[s]);
    out = T(float(vq_packed_index(codes, c, BITS)) * scale + low);
  }
  (values ? out_v : out_k)[(size_t(bh) * count + t) * D + c] = out;
"""

_INPUTS = ["k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases", "positions", "k_ring", "v_ring",
           "params"]
_OUTPUTS = ["out_k", "out_v"]


def _kernel(backend: str):
    return gpu_kernel(backend, "vq_slot_rows", tuple(_INPUTS), tuple(_OUTPUTS), (CUDA_SOURCE, METAL_SOURCE),
                      (PACKED_INDEX_CUDA, PACKED_INDEX_METAL))


def launch_args(packed, positions, k_ring, v_ring, *, count: int, ring_start: int, base: int, bits: int,
                group: int, dtype) -> dict:
    """The launch over the slot buffers (``packed``: k codes, scales, minima, v codes, scales,
    minima, each (B, H, room, ...); positions (B, H, room)) and the rings (B, H, W, D), or None
    for both without one: keys and values (B, H, count, D) in ``dtype``."""
    b, h, room, words = packed[0].shape
    d = words * 32 // bits
    window = 0 if k_ring is None else k_ring.shape[2]
    if k_ring is None:
        k_ring = v_ring = mx.zeros((1,), dtype)
    params = mx.array([count, room, b * h, ring_start, base], mx.int32)
    return dict(inputs=[*packed, positions, k_ring, v_ring, params],
                template=[("T", dtype), ("D", d), ("BITS", bits), ("GROUP", group), ("W", window), ("NT", NT)],
                grid=(-(-count * d // NT) * NT, 2 * b * h, 1), threadgroup=(NT, 1, 1),
                output_shapes=[(b, h, count, d)] * 2, output_dtypes=[dtype] * 2)


def takes(packed, k_ring, v_ring, bits: int, dtype) -> bool:
    """Whether the kernel reads this layout: keys and values of one width in whole words,
    scales, minima and rings in the output dtype."""
    kc, ks, kb, vc, vs, vb = packed
    same = kc.shape == vc.shape and all(x.dtype == dtype for x in (ks, kb, vs, vb))
    rings = k_ring is None or (k_ring.dtype == v_ring.dtype == dtype and k_ring.shape == v_ring.shape)
    return same and rings and kc.shape[-1] * 32 % bits == 0


def kernel_backend(dtype) -> Optional[str]:
    """The GPU back-end the kernel runs on for rows in ``dtype``; None where it does not (no
    GPU, a kernel that failed its check): the caller runs the MLX pass."""
    backend = kd.gpu_backend()
    return backend if backend is not None and kernel_checked(backend, dtype) else None


def slot_rows(backend: str, packed, positions, k_ring, v_ring, **kw) -> tuple[mx.array, mx.array]:
    """Keys and values (B, H, count, D) through the kernel (``launch_args``' buffers)."""
    out = _kernel(backend)(**launch_args(packed, positions, k_ring, v_ring, **kw))
    return out[0], out[1]


_CHECKED: dict = {}


def kernel_checked(backend: str, dtype) -> bool:
    """Whether the kernel passed its check for ``dtype`` (``checks.checked_once``): random
    slots with a ring (``check_case``) against the MLX pass, within one float32 rounding."""
    return checked_once(_CHECKED, backend, (backend, str(dtype)), lambda: _check_problem(backend, dtype),
                        "slot-rows kernel", "packed slots are decoded through MLX's ops instead")


def check_case(dtype, bits: int = 4, group: int = 32, room: int = 96, count: int = 80, window: int = 16):
    """Random packed slots (B=2, H=2, D=64) whose newest ``window`` positions are in a ring
    written from row 5 on, shuffled over the slots, and the MLX pass's rows cut to ``count``
    (``launch_args``' keywords, reference keys, reference values). The pass runs in float32,
    then rounds once to ``dtype``, as the kernel does: MLX's own dequantization in float16
    rounds the product and the sum each, up to 4 units in the last place apart on this case."""
    from ..quant.token_rows import quantize_rows

    b, h, d = 2, 2, 64
    x = mx.random.normal((b, h, 2 * room, d), key=mx.random.key(11)) * (1 + 6 * (mx.arange(d) % 9 == 0))
    keys, values = x[:, :, :room].astype(dtype), x[:, :, room:].astype(dtype)
    packed = [a for y in (keys, values) for a in quantize_rows(y, group, bits)]
    positions = mx.argsort(mx.random.uniform(shape=(b, h, room), key=mx.random.key(12)), axis=-1).astype(mx.int32)
    offset = room  # positions 0 .. room - 1; the newest ``window`` are in the ring
    ring_next = 5
    base = offset - ring_next  # the position at ring row 0 (mod window)
    rows = mx.random.normal((b, h, 2 * window, d), key=mx.random.key(13)).astype(dtype)
    k_ring, v_ring = rows[:, :, :window], rows[:, :, window:]
    ring_start = offset - window
    args = dict(packed=packed, positions=positions, k_ring=k_ring, v_ring=v_ring, count=count,
                ring_start=ring_start, base=base, bits=bits, group=group, dtype=dtype)
    return (args, *reference_rows(**args))


def reference_rows(packed, positions, k_ring, v_ring, *, count: int, ring_start: int, base: int, bits: int,
                   group: int, dtype) -> tuple[mx.array, mx.array]:
    """What the kernel computes from ``launch_args``' keywords, through MLX's ops: the float32
    pass (``quantized_slots._rows_pass``) rounded once to ``dtype``, cut to ``count``."""
    from .quantized_slots import _rows_pass

    rings = (positions, mx.array(ring_start, mx.int32), mx.array(base, mx.int32), k_ring, v_ring) \
        if k_ring is not None else ()
    k, v = _rows_pass(bits, group, mx.float32, bool(rings))(*packed, *rings)
    return k[:, :, :count].astype(dtype), v[:, :, :count].astype(dtype)


def _check_problem(backend: str, dtype) -> Optional[str]:
    args, ref_k, ref_v = check_case(dtype)
    try:
        out_k, out_v = slot_rows(backend, **args)
        same = within_a_rounding(out_k, ref_k) and within_a_rounding(out_v, ref_v)
    except Exception as exc:  # a kernel that does not compile or launch fails its check
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None if same else "rows differ from the MLX pass's by more than a rounding"
