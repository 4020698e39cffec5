"""The fused prompt-mass kernels on the device: their self-check for float16 and bfloat16 (and
keyformer's noise check),
then the GPU test's cases (tests/test_fused_mass_kernel.py, without pytest), each case's
largest error relative to the largest mass printed."""

import veloxquant_mlx  # noqa: F401

import mlx.core as mx

from veloxquant_mlx.evict import fused_mass_kernel as fk
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods import keyformer

backend = kd.gpu_backend()
print("backend", backend, mx.default_device())
for dtype in (mx.float16, mx.bfloat16):
    print(dtype, "self-check passed:", fk.kernel_checked(backend, dtype), fk._CHECKED)
    print(dtype, "keyformer's noise check:", keyformer._noise_problem(backend, dtype) or "passed")
    for masked, per_head, nq in ((True, False, 200), (True, True, 5), (False, False, 64), (True, False, 2048)):
        case = fk.check_case(dtype, masked, per_head, nq=nq, n=3000 if nq < 2048 else 4096, d=128)
        got, ref = fk.fused_mass(backend, *case), fk.reference_mass(*case)
        err = (mx.abs(got - ref).max() / mx.abs(ref).max()).item()
        print(f"  masked={masked} per_head={per_head} queries={nq}: max err {err:.2e} of the largest mass,"
              f" within {fk.CHECK_RTOL:g}: {err <= fk.CHECK_RTOL}")
