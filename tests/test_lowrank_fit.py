"""The basis fit of the latent methods (svdq, palu): float32 whatever the model's dtype,
no SVD over the tokens (one Gram matrix product, a d x d eigenproblem), bounded to a
sample of tokens, and as good as the exact SVD's fit."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from test_svdq import kv, rel_err
from veloxquant_mlx.lowrank import factors
from veloxquant_mlx.lowrank.latent import fit_basis


def _projection_error(x: np.ndarray, basis: np.ndarray, mean: np.ndarray) -> float:
    """Relative Frobenius error of x projected on the basis columns (float64)."""
    c = x - mean
    return float(np.linalg.norm(c - c @ basis @ basis.swapaxes(-1, -2)) / np.linalg.norm(c))


def _exact(x: np.ndarray, r: int):
    mean = x.mean(axis=2, keepdims=True)
    _, _, vt = np.linalg.svd(x - mean, full_matrices=False)
    return vt[..., :r, :].swapaxes(-1, -2), mean


@pytest.mark.parametrize("rank", [4, 16, 48])
def test_the_fit_reaches_the_exact_svds_error(rank):
    """Within 4e-4 of the exact rank-r fit's relative error (Eckart-Young's optimum), with
    every token read: a float32 Gram matrix resolves directions down to about
    sqrt(float32 eps) = 3.5e-4 of the largest singular value (this data's tail is 1e-7
    of it: at rank 48 the exact error is 8e-8, the fit's 1.3e-4); orthonormal columns."""
    keys, _ = kv(300)
    x = np.array(keys, dtype=np.float64)
    mean, basis = fit_basis(keys, rank, 1.0)
    b = np.array(basis, dtype=np.float64)
    exact_basis, exact_mean = _exact(x, rank)
    assert _projection_error(x, b, np.array(mean)) <= _projection_error(x, exact_basis, exact_mean) + 4e-4
    assert np.abs(b.swapaxes(-1, -2) @ b - np.eye(rank)).max() < 1e-5


def test_a_float16_model_fits_in_float32_and_as_well_as_from_float32_keys():
    keys, _ = kv(300)
    half = keys.astype(mx.float16)
    mean, basis = fit_basis(half, 16, 1.0)
    assert mean.dtype == mx.float32 and basis.dtype == mx.float32
    x = np.array(half.astype(mx.float32), dtype=np.float64)
    exact_basis, exact_mean = _exact(x, 16)
    assert _projection_error(x, np.array(basis), np.array(mean)) <= _projection_error(x, exact_basis, exact_mean) + 4e-4
    inf = mx.concatenate([half[:, :, :-1], mx.full(half[:, :, -1:].shape, mx.inf, mx.float16)], axis=2)
    _, basis = fit_basis(inf, 16, 1.0)  # an overflowed row: a basis still, no LAPACK error
    assert bool(mx.all(mx.isfinite(basis)))


def test_past_the_sample_the_fit_reads_a_sample_and_stays_within_2_percent(monkeypatch):
    """A fit reads at most FIT_SAMPLE_TOKENS evenly spaced rows: on 2,000 rows of which it
    reads 250, its error on all rows stays within 5% of the exact fit's (measured 2.3%)."""
    read = []
    original = mx.linalg.eigh

    def recording(a, **kwargs):
        read.append(a.shape)
        return original(a, **kwargs)

    monkeypatch.setattr(factors, "FIT_SAMPLE_TOKENS", 250)
    monkeypatch.setattr(mx.linalg, "eigh", recording)
    keys, _ = kv(2000, seed=3)
    x = np.array(keys, dtype=np.float64)
    basis, sigma = factors.gram_basis(keys - keys.mean(axis=2, keepdims=True), sample=factors.FIT_SAMPLE_TOKENS)
    assert read == [(1, 2, 64, 64)]
    exact_basis, exact_mean = _exact(x, 16)
    e_exact = _projection_error(x, exact_basis, exact_mean)
    e_fit = _projection_error(x, np.array(basis[..., :16], dtype=np.float64), x.mean(axis=2, keepdims=True))
    assert e_fit <= 1.05 * e_exact, (e_fit, e_exact)
    exact_sigma = np.linalg.svd(x - x.mean(axis=2, keepdims=True), compute_uv=False)[..., :8]
    assert np.allclose(np.array(sigma[..., :8]), exact_sigma, rtol=0.1)  # rescaled to all rows


@pytest.mark.parametrize("method, options", [("svdq", {}), ("palu", {}), ("gear", {}), ("gear", {"gear_rank": 4}),
                                             ("spectral", {})])
def test_prefill_takes_no_qr_or_svd_over_the_tokens(method, options, monkeypatch):
    """Their fits run through one Gram matrix product, then small problems of at most d rows
    (a d x d eigh; gear's QRs of d x (k + p) in ``leading_basis``): MLX's QR and SVD run on
    the CPU stream only, so one over a chunk's tokens would be a pass over every token on
    the host."""
    import importlib

    from feeding import feed_chunks
    from veloxquant_mlx import KVCacheConfig
    from veloxquant_mlx.registry import METHODS

    def small_only(op):
        def guarded(a, *args, **kwargs):
            if a.shape[-2] > 64:  # the head dim of kv(); a chunk has 128 or more rows
                raise AssertionError(f"{op.__name__} over {a.shape[-2]} rows on the prefill path")
            return op(a, *args, **kwargs)

        return guarded

    monkeypatch.setattr(mx.linalg, "qr", small_only(mx.linalg.qr))
    monkeypatch.setattr(mx.linalg, "svd", small_only(mx.linalg.svd))
    module, name = METHODS[method].implementation.split(":")
    cache = getattr(importlib.import_module(module), name)(
        KVCacheConfig.from_dict({"method": method, "options": options}), None, 0)
    keys, values = kv(300)
    feed_chunks(cache, keys, values, 128)
    k_hat, _ = cache.dequantized(mx.float32)
    assert k_hat.shape == keys.shape and 0 < rel_err(k_hat, keys) < 0.5


def test_spectral_fits_on_a_bounded_sample_and_captures_the_exact_fits_energy(monkeypatch):
    """The eigenbasis reads at most FIT_SAMPLE_TOKENS evenly spaced rows (issue 31): on
    2,000 rows of which it reads 250, the energy its leading 8 directions hold of every
    row's second moment is within 2% of the exact (all-rows) basis's; a non-finite row
    leaves the basis finite."""
    from veloxquant_mlx.methods.spectral.eigen_store import eigenbasis

    keys, _ = kv(2000, seed=3)
    x = np.array(keys, dtype=np.float64)
    unit = x / np.linalg.norm(x, axis=-1, keepdims=True)
    second = unit.swapaxes(-1, -2) @ unit / unit.shape[2]
    exact = np.linalg.eigh(second)[1][..., ::-1][..., :8]
    monkeypatch.setattr(factors, "FIT_SAMPLE_TOKENS", 250)
    read = []
    original = mx.linalg.eigh
    monkeypatch.setattr(mx.linalg, "eigh", lambda a, **kw: (read.append(a.shape), original(a, **kw))[1])
    v, _ = eigenbasis(keys)
    v = np.array(v, dtype=np.float64)[..., :8]
    held = lambda b: np.trace(b.swapaxes(-1, -2) @ second @ b, axis1=-2, axis2=-1)
    assert np.all(held(v) >= 0.98 * held(exact)), (held(v), held(exact))
    assert read == [(1, 2, 64, 64)]
    bad = mx.concatenate([keys[:, :, :-1], mx.full(keys[:, :, -1:].shape, mx.nan)], axis=2)
    assert bool(mx.all(mx.isfinite(eigenbasis(bad)[0])))


@pytest.mark.parametrize("decay", [1.0, 0.97, 0.9, 0.7])
@pytest.mark.parametrize("k", [4, 7, 16])
def test_the_leading_basis_reaches_the_exact_rank_k_error_within_2_percent(decay, k):
    """GEAR's fit (issue 31): subspace iteration on the d x d Gram matrix, 3 products of
    k + 8 columns and a Rayleigh-Ritz step. Its rank-k projection error is within 2% of
    Eckart-Young's optimum on spectra from white (measured up to 1.011 at k = 16: every basis
    is near the optimum there) to steep (1 + 3e-6); its values are Ritz values, never above
    the exact ones but for the float32 Gram's rounding (1e-6 of sigma_1²); the energy is
    ‖x‖²; the same input gives the same basis."""
    rng = np.random.default_rng(k)
    x = rng.standard_normal((1, 4, 1024, 128)) * decay ** np.arange(128)
    xm = mx.array(x, mx.float32)
    v, sigma, energy = factors.leading_basis(xm, k)
    assert v.shape == (1, 4, 128, k) and sigma.shape == (1, 4, k) and energy.shape == (1, 4)
    _, exact_sigma, vt = np.linalg.svd(x, full_matrices=False)
    error = lambda b: np.linalg.norm(x - x @ b @ b.swapaxes(-1, -2), axis=(-2, -1))
    v64 = np.array(v, np.float64)
    assert np.all(error(v64) <= 1.02 * error(vt[..., :k, :].swapaxes(-1, -2)))
    assert np.abs(v64.swapaxes(-1, -2) @ v64 - np.eye(k)).max() < 1e-5
    above = (np.array(sigma, np.float64) ** 2 - exact_sigma[..., :k] ** 2) / exact_sigma[..., :1] ** 2
    assert above.max() < 1e-6
    assert np.allclose(np.array(energy), (x**2).sum(axis=(-2, -1)), rtol=1e-5)
    again, _, _ = factors.leading_basis(xm, k)
    assert mx.array_equal(again, v)


def test_gears_fit_takes_no_head_dim_eigenproblem(monkeypatch):
    """GEAR's energy rule at the 8B head dim (128, cap 7) and its fixed rank take their
    directions through ``leading_basis``: eigenproblems of (k + 8) x (k + 8) only, where
    ``gram_basis`` took a 128 x 128 one per head (1.6 ms each on the H200's host: 72 of
    gear's 83 ms per 4k layer, ``benchmarks/notes/fits.md``)."""
    from veloxquant_mlx.methods.gear.error_feedback import ErrorFeedback
    from veloxquant_mlx.quant.packed import GroupAffine

    sizes = []
    original = mx.linalg.eigh
    monkeypatch.setattr(mx.linalg, "eigh", lambda a, **kw: (sizes.append(a.shape[-1]), original(a, **kw))[1])
    x = mx.random.normal((1, 2, 512, 128), key=mx.random.key(4))
    for rank in (None, 4):
        mx.eval(ErrorFeedback(GroupAffine(2, 32, "channel"), rank, 0.9, 0.01).encode(x))
    assert sizes and max(sizes) <= 7 + factors.OVERSAMPLE, sizes
