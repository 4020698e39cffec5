"""A decode step's peak through chained cache layers (each layer's queries are the output
of the layer before), as the CUDA reads run it: for the reads that decode a layer's kept
rows in one piece, whose decode must wait for its queries."""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.kernels import kivi_decode as kd


def step_peak(make_cache, n_layers: int, monkeypatch, t: int = 4096, h: int = 2, d: int = 128) -> float:
    """Bytes a decode step through ``n_layers`` caches from ``make_cache()``, each given the
    same ``t``-token prompt, holds above what the caches keep, on the CUDA read, run on the
    CPU: what order MLX's scheduler evaluates a step in. On CUDA a buffer is allocated when
    the host encodes its kernel, ahead of the device, so the peak there counts layers the
    gate keeps apart in time: +45 MiB for zipcache and +53 MiB for cachegen from 1 to 4
    layers on an H100 (benchmarks/results/h200_s67); their whole-model peaks over prefill and
    decode at 4k stay at 0.13-0.16x fp16's there."""
    if mx.default_device() != mx.cpu:
        import pytest

        pytest.skip("the scheduler's order, measured on the CPU")
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    caches = [make_cache() for _ in range(n_layers)]
    k = mx.random.normal((1, h, t, d), key=mx.random.key(5)) * (1 + 6 * (mx.arange(d) % 9 == 0))
    v = mx.random.normal((1, h, t, d), key=mx.random.key(6))
    for cache in caches:
        cache.update_and_fetch(k, v)
        cache.attend(k, k, v, scale=d**-0.5, mask="causal")

    def step(x):
        for cache in caches:
            kn, vn = x * 0.5, x * 0.25
            cache.update_and_fetch(kn, vn)
            x = cache.attend(x, kn, vn, scale=d**-0.5, mask=None)
        return x

    x = mx.random.normal((1, h, 1, d), key=mx.random.key(2))
    for _ in range(3):  # past the first steps' one-time work
        x = step(x)
        mx.eval(x, [cache.state for cache in caches])
    mx.clear_cache()
    mx.reset_peak_memory()
    held = mx.get_active_memory()
    mx.eval(step(x), [cache.state for cache in caches])
    return mx.get_peak_memory() - held


def layer_rows(t: int = 4096, h: int = 2, d: int = 128) -> int:
    """Bytes of one layer's decoded keys and values at ``step_peak``'s sizes (float32)."""
    return 2 * h * t * d * 4


def peak_growth(make_cache, fewer: int, more: int, monkeypatch, t: int = 4096) -> float:
    """How much a step's peak grows from ``fewer`` to ``more`` chained layers (``step_peak``)."""
    return step_peak(make_cache, more, monkeypatch, t=t) - step_peak(make_cache, fewer, monkeypatch, t=t)
