"""1-bit group-affine words are unpacked by our own code on every device.

MLX 0.32.4's CUDA back-end quantizes and dequantizes 1-bit groups wrongly (relative error
about 1.5 against the CPU; benchmarks/results/affine_widths_h200.md), while 2-8 bits agree
to the dtype's rounding. svdq's default bit schedule (8, 4, 2, 1, 1, 0, 0, 0) keeps 1-bit
latent channels, and its logits on the H200 left the CPU run's (cuda_paths.md). Here the
GPU's route is emulated on the CPU: the pure path a GPU takes (dequantize, then a float32
product) with ``mx.dequantize`` refusing 1-bit words, as it must never be asked for them.
"""

import mlx.core as mx
import pytest

from feeding import synthetic_kvq
from test_svdq import svdq
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.quant import affine


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_one_bit_words_read_back_as_mlx_reads_them_on_the_cpu(dtype, group):
    x = (mx.random.normal((2, 3, 8, 256), key=mx.random.key(group)) * 3).astype(dtype)
    codes, scales, minima = affine.quantize(x, group, 1)
    ours = affine.dequantize(codes, scales, minima, group, 1)
    assert ours.dtype == dtype
    assert mx.array_equal(ours, mx.dequantize(codes, scales, minima, group_size=group, bits=1))


def _decode(cache, k, v, q, n_prompt, steps):
    from feeding import feed

    for s in range(0, n_prompt - 1, 128):
        feed(cache, k, v, q, s, min(s + 128, n_prompt - 1))
    return [feed(cache, k, v, q, t, t + 1) for t in range(n_prompt - 1, n_prompt + steps)]


def test_svdq_at_its_defaults_decodes_on_the_gpus_route_as_on_the_cpus(monkeypatch):
    k, v, q = synthetic_kvq(400, 2, 2, 128, seed=3)
    cpu = _decode(svdq(), k, v, q, 384, 12)
    assert 1 in svdq().config.options.svdq_bit_schedule  # the defaults keep 1-bit channels

    dequantize, ours, one_bit_reads = mx.dequantize, affine.dequantize, []

    def refusing_one_bit(*args, bits, **kw):
        if bits == 1:
            raise AssertionError("mx.dequantize asked for 1-bit words (wrong on MLX's CUDA back-end)")
        return dequantize(*args, bits=bits, **kw)

    def counting(codes, scales, minima, group_size, bits, dtype=None):
        one_bit_reads.append(bits == 1)
        return ours(codes, scales, minima, group_size, bits, dtype)

    monkeypatch.setattr(kd, "_pure_path", lambda: "reference")
    monkeypatch.setattr(mx, "dequantize", refusing_one_bit)
    monkeypatch.setattr(affine, "dequantize", counting)
    gpu_route = _decode(svdq(), k, v, q, 384, 12)
    assert any(one_bit_reads)  # the route did read 1-bit latents
    for a, b in zip(gpu_route, cpu):
        # quantized_matmul (the CPU's) and a float32 product over the dequantized latents
        # differ only in summation order: float32 rounding of 128-term sums
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-4), float(mx.abs(a - b).max())
