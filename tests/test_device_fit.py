"""Subspace iteration on a GPU (``lowrank/factors.device_leading``, issue 31): kvtc's fit of the
k leading components of a 1,024-channel covariance in matrix products on the device, the
only decomposition the Rayleigh-Ritz step's (k + 8) x (k + 8) eigenproblem.

MLX multiplies float32 on CUDA with TF32 operands unless ``MLX_ENABLE_TF32=0``: 10 mantissa
bits, a relative rounding of 2^-11 per operand. The tests emulate that rounding on the CPU
(``tf32_product``) and check that the split products keep the fit as good as the CPU
streams' Householder iteration."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.lowrank import factors
from veloxquant_mlx.methods.kvtc.transform import fit_codec

CHOICES = (0, 1, 2, 3, 4, 6, 8)


def tf32(a: mx.array) -> mx.array:
    """``a`` (float32) rounded to nearest on 10 mantissa bits, as a TF32 operand."""
    return ((a.view(mx.uint32) + 0x1000) & 0xFFFFE000).view(mx.float32)


def tf32_product(a: mx.array, b: mx.array) -> mx.array:
    return tf32(a) @ tf32(b)


split_tf32 = functools.partial(factors.split_product, product=tf32_product)


def test_a_split_product_keeps_float32_precision_through_tf32_operands():
    """TF32 operands cost each term of the product up to 2^-11 of its size (measured: 8.7e-5 of
    the sum of the terms' sizes, worst entry); split in the part TF32 keeps and the rest, each
    term's operands lose at most 2^-22 (the rest has at most 13 significant bits, rounded to
    11): the product as good as float32's own (measured 2.3e-7 against 2.2e-7)."""
    r = np.random.default_rng(0)
    a = r.standard_normal((256, 512)) * np.exp(r.uniform(-6, 6, (256, 1)))
    b = r.standard_normal((512, 128))
    exact = a @ b
    size = np.abs(a) @ np.abs(b)
    error = lambda got: float((np.abs(np.array(got, np.float64) - exact) / size).max())
    am, bm = mx.array(a, mx.float32), mx.array(b, mx.float32)
    assert error(tf32_product(am, bm)) > 3e-5
    assert error(split_tf32(am, bm)) < 1e-6
    assert error(factors.split_product(am, bm)) < 1e-6  # plain float32 operands: no loss


def _ill_conditioned(d: int, w: int, decades: float, seed: int = 0) -> np.ndarray:
    r = np.random.default_rng(seed)
    left = np.linalg.qr(r.standard_normal((d, w)))[0]
    right = np.linalg.qr(r.standard_normal((w, w)))[0]
    return (left * np.logspace(0, -decades, w)) @ right.T


@pytest.mark.parametrize("product", [mx.matmul, split_tf32], ids=["float32", "tf32 split"])
def test_the_polar_steps_orthonormalise_a_block_of_condition_1e6_and_keep_its_span(product):
    """Singular values over 6 decades (a power iteration's block): 14 quintic steps lift the
    smallest (1e-6 / sqrt(64) after the scaling) by 3.44^14 = 3.3e7 into the cubic's basin,
    whose 4 steps converge quadratically: orthonormal columns to float32 rounding, and the
    block lies in their span."""
    y = _ill_conditioned(512, 64, 6)
    v = np.array(factors.device_polar(mx.array(y, mx.float32), product), np.float64)
    assert np.abs(v.T @ v - np.eye(64)).max() < 2e-5
    assert np.linalg.norm(y - v @ (v.T @ y)) / np.linalg.norm(y) < 1e-5


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="a GPU's fused kernels may round the fused steps otherwise")
def test_the_compiled_polar_steps_equal_the_plain_ones():
    y = mx.array(_ill_conditioned(512, 40, 4, seed=1), mx.float32)
    assert mx.array_equal(factors.compiled_polar(mx.matmul)(y), factors.device_polar(y))


def _rows(spectrum: str, n: int, p: int) -> mx.array:
    r = np.random.default_rng(3)
    if spectrum == "random projection":  # the random-weight device model's keys
        x = r.standard_normal((n, 2048)) @ (r.standard_normal((2048, p)) / 45)
    else:
        scale = {"power law 0.7": (1 + np.arange(p)) ** -0.7, "power law 1.5": (1 + np.arange(p)) ** -1.5,
                 "flat": np.ones(p)}[spectrum]
        x = (r.standard_normal((n, p)) * scale) @ np.linalg.qr(r.standard_normal((p, p)))[0].T
    return mx.array(x.astype(np.float32)) + 0.5


@pytest.mark.parametrize("spectrum", ["random projection", "power law 0.7", "power law 1.5", "flat"])
def test_kvtcs_fit_iterated_on_a_gpu_with_tf32_operands_is_within_one_percent_of_the_exact_fit(spectrum, monkeypatch):
    """kvtc's prompt fit (p = 512, 256 bits: k = 128 of 512, as the 8B shape's 256 of 1,024)
    with its subspace iteration as a GPU runs it: products with TF32 operands, split.
    Measured at 1,024 channels: 0.996-1.008 of the exact fit's error, as the CPU streams'
    iteration. Unsplit, the power law's fit is 1.33x the exact one's at 512 channels (1.77x at
    1,024): a TF32 product with the covariance loses the directions 1e-4 below the first."""
    x = _rows(spectrum, 2048, 512)
    device = functools.partial(factors.device_leading, product=split_tf32,
                               polar=functools.partial(factors.device_polar, product=split_tf32))
    errors = []
    for exact in (True, False):
        if not exact:
            monkeypatch.setattr(factors, "gram_leading", device)
        codec, lam, bits = fit_codec(x, 256, CHOICES, 3.5, exact=exact)
        assert lam.size == (512 if exact else 128) and bits.sum() == 256
        errors.append(float(mx.linalg.norm(codec.decode(codec.encode(x)) - x) / mx.linalg.norm(x - x.mean(axis=0))))
    assert errors[1] <= 1.01 * errors[0], errors
    v = np.array(codec.basis, np.float64)
    assert np.abs(v.T @ v - np.eye(v.shape[1])).max() < 2e-3  # orthonormal to float16 rounding


def test_the_device_iteration_finds_the_cpu_streams_leading_values():
    """Same start, same iterations: the Ritz values of the two routes agree to float32's
    rounding of the covariance, the bases span the same leading directions."""
    x = _rows("power law 0.7", 2048, 512)
    xc = x - x.mean(axis=0)
    gram = xc.T @ xc
    v_cpu, w_cpu, t_cpu = factors.stream_leading(gram, 64)
    v_dev, w_dev, t_dev = factors.device_leading(gram, 64, product=split_tf32,
                                                 polar=functools.partial(factors.device_polar, product=split_tf32))
    assert float(mx.abs(w_dev - w_cpu).max() / w_cpu[0]) < 1e-5
    assert float(mx.abs(t_dev - t_cpu) / t_cpu) < 1e-6
    overlap = np.linalg.svd(np.array(v_cpu[:, :32]).T @ np.array(v_dev[:, :32]), compute_uv=False)
    assert overlap.min() > 1 - 1e-4


class _Recorded:
    def __init__(self):
        self.calls = []

    def __call__(self, route):
        def record(gram, k, iterations=3, seed=0, product=None, polar=None):
            self.calls.append((route, product))
            return route
        return record


@pytest.mark.parametrize("device, env, d, k, expected", [
    ("gpu", {}, 1024, 256, ("device", factors.split_product)),
    ("gpu", {"MLX_ENABLE_TF32": "0"}, 1024, 256, ("device", mx.matmul)),
    ("gpu", {"VQ_DEVICE_FIT": "0"}, 1024, 256, ("streams", None)),
    ("gpu", {}, 256, 32, ("streams", None)),  # narrower than DEVICE_FIT_MIN_DIM: GEAR's heads
    ("gpu", {}, 1024, 400, ("streams", None)),  # 3 (k + 8) >= d: one d x d eigenproblem
    ("cpu", {}, 1024, 256, ("streams", None)),
])
def test_which_route_a_fit_takes(device, env, d, k, expected, monkeypatch):
    recorded = _Recorded()
    monkeypatch.setattr(factors, "device_leading", recorded("device"))
    monkeypatch.setattr(factors, "stream_leading", recorded("streams"))
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(getattr(mx, device)))
    for name in ("MLX_ENABLE_TF32", "VQ_DEVICE_FIT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert factors.gram_leading(mx.eye(d), k) == expected[0]
    assert recorded.calls == [expected]
