"""The dispatcher's cached launch plan issues exactly the launches the uncached path does.

No GPU here: ``gpu_backend`` answers "cuda" and ``mx.fast.cuda_kernel`` records each
launch's arguments instead of running it (what benchmarks/host_time.py times)."""

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.kernels import kivi_decode as kd


class _Recorder:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def __call__(self, *, inputs, output_shapes, output_dtypes, **kw):
        self.log.append((self.name, inputs, output_shapes, output_dtypes, kw))
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]


@pytest.fixture
def fake_cuda(monkeypatch):
    log = []
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda *, name, **_: _Recorder(log, name))
    monkeypatch.setattr(kd, "_KERNELS", {})
    monkeypatch.setattr(kd, "_STEP_PLANS", type(kd._STEP_PLANS)())
    # the recorded launches return zeros, which the kernels' self-check would refuse
    monkeypatch.setattr(kd, "kernel_self_check", lambda *key: True)
    return log


def _case(bits, n_kq, n_kres, n_vq, n_vres, dtype, H=2, R=4, D=128, G=32):
    rng = np.random.default_rng(0)
    pack = 32 // bits
    u = lambda *s: mx.array(rng.integers(0, 2**31, s, dtype=np.uint32))  # noqa: E731
    f = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)  # noqa: E731
    q = f(1, H * R, 1, D)
    kc, ks, kb = (u(1, H, D, 512 // pack), f(1, H, D, 512 // G), f(1, H, D, 512 // G)) if n_kq \
        else (mx.zeros((0,), dtype),) * 3
    vc, vs, vb = (u(1, H, n_vq + 7, D // pack), f(1, H, n_vq + 7, D // G), f(1, H, n_vq + 7, D // G)) \
        if n_vq else (mx.zeros((0,), dtype),) * 3
    kr = f(1, H, n_kres, D) if n_kres else None
    vr = f(1, H, n_vres, D) if n_vres else None
    return (q, kc, ks, kb, n_kq, kr, n_kres, vc, vs, vb, n_vq, vr, n_vres)


def _same(a, b):
    assert a[0] == b[0] and a[2] == b[2] and a[3] == b[3] and a[4] == b[4]
    assert len(a[1]) == len(b[1])
    for x, y in zip(a[1], b[1]):
        assert x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y)


@pytest.mark.parametrize("bits,n_kq,n_kres,n_vq,n_vres,dtype", [
    (4, 512, 37, 421, 128, mx.float16),   # frag
    (2, 256, 5, 133, 128, mx.float16),    # frag at 2 bits
    (4, 512, 37, 421, 128, mx.float32),   # simt
    (4, 0, 37, 0, 37, mx.float16),        # nothing quantized yet: stand-ins for the packed buffers
])
def test_cached_plan_launches_what_the_uncached_path_launches(fake_cuda, bits, n_kq, n_kres,
                                                               n_vq, n_vres, dtype):
    args = _case(bits, n_kq, n_kres, n_vq, n_vres, dtype)
    kw = dict(scale=0.088, bits=bits, group_size=32)
    H = 2
    algo = kd.kernel_algo("cuda", args[0], H, bits, 32)
    assert algo == ("frag" if dtype == mx.float16 else "simt")
    ref = kd._launch("cuda", *args, **kw, algo=algo)
    first = kd.kivi_decode_attention(*args, **kw)
    again = kd.kivi_decode_attention(*args, **kw)  # the cached plan
    assert len(kd._STEP_PLANS) == 1 and len(fake_cuda) == 6
    for i in range(2):
        _same(fake_cuda[i], fake_cuda[2 + i])
        _same(fake_cuda[i], fake_cuda[4 + i])
    assert ref.shape == first.shape == again.shape and ref.dtype == first.dtype


def test_plan_follows_the_counts(fake_cuda):
    kw = dict(scale=0.088, bits=4, group_size=32)
    a, b = _case(4, 512, 37, 421, 128, mx.float16), _case(4, 512, 38, 422, 128, mx.float16)
    kd.kivi_decode_attention(*a, **kw)
    kd.kivi_decode_attention(*b, **kw)
    kd._launch("cuda", *b, **kw, algo="frag")
    assert len(kd._STEP_PLANS) == 2
    _same(fake_cuda[2], fake_cuda[4])
    assert not mx.array_equal(fake_cuda[0][1][-1], fake_cuda[2][1][-1])  # params differ


def test_bad_layout_still_refused(fake_cuda):
    args = list(_case(4, 512, 37, 421, 128, mx.float16))
    args[6], args[10] = 38, 422  # n_kres past the 37 rows of k_res, the totals still equal
    with pytest.raises(ValueError, match="k_res"):
        kd.kivi_decode_attention(*args, scale=0.088, bits=4, group_size=32)


def test_plan_rebuilt_when_the_kernels_are_replaced(fake_cuda, monkeypatch):
    args = _case(4, 512, 37, 421, 128, mx.float16)
    kw = dict(scale=0.088, bits=4, group_size=32)
    kd.kivi_decode_attention(*args, **kw)
    other = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda *, name, **_: _Recorder(other, name))
    monkeypatch.setattr(kd, "_KERNELS", {})
    kd.kivi_decode_attention(*args, **kw)
    assert len(fake_cuda) == 2 and len(other) == 2  # the new kernels ran, not the cached ones


@pytest.mark.parametrize("bits,n_kq,n_kres,n_vq,n_vres,dtype", [
    (4, 512, 37, 421, 128, mx.float16),
    (2, 256, 0, 256, 0, mx.float16),      # a packed part without a window: stand-ins for the window
    (4, 512, 37, 421, 128, mx.float32),
])
def test_partials_of_a_part_launch_what_the_uncached_path_launches(fake_cuda, monkeypatch, bits, n_kq,
                                                                   n_kres, n_vq, n_vres, dtype):
    args = _case(bits, n_kq, n_kres, n_vq, n_vres, dtype)
    kw = dict(scale=0.088, bits=bits, group_size=32)
    ref = kd._partials("cuda", *args, **kw)
    planned = []
    real_plan = kd._main_plan
    monkeypatch.setattr(kd, "_main_plan", lambda *a, **k: planned.append(1) or real_plan(*a, **k))
    first = kd.decode_partials("cuda", *args, **kw)
    again = kd.decode_partials("cuda", *args, **kw)  # another layer of the step: the cached plan
    assert len(planned) == 1 and len(kd._STEP_PLANS) == 1 and len(fake_cuda) == 3
    _same(fake_cuda[0], fake_cuda[1])
    _same(fake_cuda[0], fake_cuda[2])
    for r, a, b in zip(ref, first, again):
        assert r.shape == a.shape == b.shape and r.dtype == a.dtype == b.dtype
