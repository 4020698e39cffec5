"""The fused prompt-mass kernels on the device, reading the keys through their strides: the
self-check (float16, bfloat16), then keys given as rows of a larger buffer (a store's), as a
transposed buffer and as rows off 16 bytes, each against the same keys made contiguous (equal
bit for bit: the same products in the same order) and against MLX's float32 masses."""

import veloxquant_mlx  # noqa: F401

import mlx.core as mx

from veloxquant_mlx.evict import fused_mass_kernel as fk
from veloxquant_mlx.kernels import kivi_decode as kd

backend = kd.gpu_backend()
print("backend", backend, mx.default_device())
for dtype in (mx.float16, mx.bfloat16):
    print(dtype, "self-check passed:", fk.kernel_checked(backend, dtype), fk._CHECKED)
    q, k, scale, q_pos, k_pos, w = fk.check_case(dtype, b=2, nq=300, n=3000, d=128)
    b, h, n, d = k.shape
    layouts = {
        "rows of a larger buffer": fk.in_a_larger_buffer(k, 77),
        "transposed": mx.contiguous(k.swapaxes(2, 3)).swapaxes(2, 3),
        "rows off 16 bytes": mx.concatenate([mx.full((b, h, n, 3), float("inf"), dtype), k], axis=3)[..., 3:],
    }
    want = fk.fused_mass(backend, q, mx.contiguous(k), scale, q_pos, k_pos, w)
    ref = fk.reference_mass(q, k, scale, q_pos, k_pos, w)
    for name, keys in layouts.items():
        got = fk.fused_mass(backend, q, keys, scale, q_pos, k_pos, w)
        err = (mx.abs(got - ref).max() / mx.abs(ref).max()).item()
        print(f"  {name}: equal to contiguous: {mx.array_equal(got, want).item()}, max err {err:.2e} of the"
              f" largest mass, within {fk.CHECK_RTOL:g}: {err <= fk.CHECK_RTOL}")
