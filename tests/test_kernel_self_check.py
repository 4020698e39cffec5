"""Each fused decode kernel checks itself once per process against its pure-MLX reference.

No GPU here: ``gpu_backend`` answers "cuda" and the kernel builder (``_get_kernels``)
returns stand-ins, one wrong, one that computes the reference's answer."""

import warnings

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.kernels import decode as dec
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.quant.packed import AffineLayout

BITS, GROUP = 4, 32


class _Builder:
    """Stands in for ``_get_kernels``: counts the launches of the kernels it builds."""

    def __init__(self, correct: bool, fail_to_build: bool = False):
        self.correct, self.fail_to_build, self.launches = correct, fail_to_build, []

    def __call__(self, backend, algo="simt", min_blocks=0):
        if self.fail_to_build:
            raise RuntimeError("nvrtc: error: identifier 'half2' is undefined\nmore detail")
        return self._main, self._merge

    def _main(self, *, inputs, template, output_shapes, output_dtypes, **_):
        self.launches.append("main")
        (rows, splits, d), _ = output_shapes
        if not self.correct:
            return [mx.zeros(s, t) for s, t in zip(output_shapes, output_dtypes)]
        q, kc, ks, kb, kr, vc, vs, vb, vr, params = inputs
        n_kq, n_kres, n_vq, n_vres, scale_bits = np.array(params)[:5].tolist()
        scale = float(np.array([scale_bits], np.int32).view(np.float32)[0]) / kd._LOG2E
        t = dict(template)
        ref = kd.kivi_decode_attention_reference(
            q, kc, ks, kb, n_kq, kr, n_kres, vc, vs, vb, n_vq, vr, n_vres, scale=scale,
            bits=t["BITS"], group_size=t["GROUP"]).astype(mx.float32).reshape(rows, 1, d)
        o = mx.concatenate([ref, mx.zeros((rows, splits - 1, d))], axis=1)
        first = mx.broadcast_to(mx.array([0.0, 1.0]), (rows, 1, 2))
        empty = mx.broadcast_to(mx.array([-float("inf"), 0.0]), (rows, splits - 1, 2))
        return [o, mx.concatenate([first, empty], axis=1)]

    def _merge(self, *, inputs, output_shapes, output_dtypes, **_):
        self.launches.append("merge")
        if not self.correct:
            return [mx.ones(output_shapes[0], output_dtypes[0])]
        return [dec.merge_partials_mlx(*inputs, output_shapes[0], output_dtypes[0])]


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(kd, "_SELF_CHECKS", {}, raising=False)
    monkeypatch.setattr(kd, "_STEP_PLANS", type(kd._STEP_PLANS)())

    def install(builder):
        monkeypatch.setattr(kd, "_get_kernels", builder)
        return builder
    return install


def _cache(dtype, H=2, R=2, D=64, n_kq=64, n_kres=9, n_vq=70, n_vres=3, seed=1):
    rng = np.random.default_rng(seed)
    f = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)  # noqa: E731
    T = n_kq + n_kres
    keys, values = f(1, H, T, D), f(1, H, T, D)
    kc, ks, kb = mx.quantize(keys[:, :, :n_kq].swapaxes(-1, -2), group_size=GROUP, bits=BITS)
    vc, vs, vb = mx.quantize(values[:, :, :n_vq], group_size=GROUP, bits=BITS)
    return (f(1, H * R, 1, D), kc, ks, kb, n_kq, keys[:, :, n_kq:], n_kres, vc, vs, vb, n_vq,
            values[:, :, n_vq:], n_vres)


KW = dict(scale=0.125, bits=BITS, group_size=GROUP)


@pytest.mark.parametrize("dtype,algo", [(mx.float32, "simt"), (mx.float16, "frag")])
def test_a_wrong_kernel_warns_once_and_the_reference_path_answers(fake_cuda, dtype, algo):
    builder = fake_cuda(_Builder(correct=False))
    args = _cache(dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = kd.kivi_decode_attention(*args, **KW)
        again = kd.kivi_decode_attention(*args, **KW)
        other_counts = kd.kivi_decode_attention(*_cache(dtype, n_kres=10, n_vres=4), **KW)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert f"cuda decode kernel '{algo}'" in messages[0]
    assert "max relative error" in messages[0] and "reference path" in messages[0]
    assert builder.launches == ["main", "merge"]  # the check's launches, once
    pure = kd.kivi_decode_attention(*args, **KW, use_kernel=False)
    assert mx.array_equal(first, pure) and mx.array_equal(again, pure)
    assert other_counts.shape == first.shape
    assert kd._SELF_CHECKS[("cuda", algo, 64, 2, BITS, GROUP, dtype)] is not None


def test_a_kernel_that_does_not_build_fails_its_check_with_the_error(fake_cuda):
    fake_cuda(_Builder(correct=True, fail_to_build=True))
    args = _cache(mx.float32)
    with pytest.warns(RuntimeWarning, match="RuntimeError: nvrtc: error: identifier 'half2'"):
        out = kd.kivi_decode_attention(*args, **KW)
    assert mx.array_equal(out, kd.kivi_decode_attention(*args, **KW, use_kernel=False))


def test_a_correct_kernel_passes_once_and_serves_every_call(fake_cuda):
    builder = fake_cuda(_Builder(correct=True))
    args = _cache(mx.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            out = kd.kivi_decode_attention(*args, **KW)
    # one check (main + merge), then the three calls' launches
    assert builder.launches == ["main", "merge"] * 4
    ref = kd.kivi_decode_attention_reference(*args, **KW)
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=1e-5, atol=1e-6)
    assert kd._SELF_CHECKS == {("cuda", "simt", 64, 2, BITS, GROUP, mx.float32): None}


def test_several_parts_fall_back_to_the_pure_merge_when_the_kernel_failed(fake_cuda):
    """decode.py's multi-part path: no kernel partials and no merge kernel after a failed
    check, so the answer is the pure-MLX one exactly."""
    builder = fake_cuda(_Builder(correct=False))
    a, b = _cache(mx.float32, seed=2), _cache(mx.float32, seed=3)

    def part(c):
        return dec.DecodePart(AffineLayout(c[1], c[2], c[3], c[4], BITS, GROUP, "channel"), c[5],
                              AffineLayout(c[7], c[8], c[9], c[10], BITS, GROUP, "token"), c[11])
    with pytest.warns(RuntimeWarning, match="'simt'"):
        out = dec.decode_attention(a[0], [part(a), part(b)], scale=0.125)
    pure = dec.decode_attention(a[0], [part(a), part(b)], scale=0.125, use_kernel=False)
    assert mx.array_equal(out, pure)
    assert builder.launches == ["main", "merge"]


def test_the_check_input_is_of_the_real_shape_class():
    """The check's cache covers several frag tiles at every width and both residual
    windows, and keys and values split at different tokens (the kernels' harder case)."""
    n_kq, n_kres, n_vq, n_vres = kd._CHECK_COUNTS
    assert n_kq + n_kres == n_vq + n_vres and n_kq != n_vq and n_kres and n_vres
    for bits in kd.SUPPORTED_BITS:
        assert min(n_kq, n_vq) >= 2 * kd._frag_tile(bits)
    for group in kd.SUPPORTED_GROUP_SIZES:
        assert n_kq % group == 0


def test_the_packed_launchs_self_check_passes_a_right_kernel_and_warns_once_for_a_wrong_one(monkeypatch):
    """``rows_self_check`` (the packed launch's), with the launch replaced here (no GPU): one
    that equals the reference passes; one that is off warns once and fails from then on."""
    monkeypatch.setattr(kd, "_ROWS_SELF_CHECKS", {})
    right = lambda q, bufs, rows, **kw: kd.kivi_decode_attention_rows_reference(q, *bufs, rows, **kw)  # noqa: E731
    monkeypatch.setattr(kd, "_rows_launch", right)
    assert kd.rows_self_check(64, 2, 4, 32, mx.float16)
    monkeypatch.setattr(kd, "_rows_launch", lambda *a, **kw: right(*a, **kw) * 1.5)
    with pytest.warns(RuntimeWarning, match="'frag' over a packed batch.*max relative error"):
        assert not kd.rows_self_check(64, 4, 4, 32, mx.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not kd.rows_self_check(64, 4, 4, 32, mx.float16)
