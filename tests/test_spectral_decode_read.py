"""SpectralQuant's decode read (``eigen_store.EigenRead``: the codes unpacked and looked up in
the per-channel layout from views kept between flushes, the QJL signs taken as D+1..D+e
coordinates of the rows and the basis extended by the sketch, ``[V, V_e Sᵀ]``, pre-RoPE keys
turned with their halves on an axis of their own) against attention computed the
straightforward way over the reconstructed history: each run's keys rebuilt with their QJL
correction (``_coordinates`` over the whole buffer, rotated out of the basis, RoPE'd again
at their positions), its values decoded, the rows held exactly and the step's own token,
over 40 decode steps that flush once (``DECODE_FLUSH`` = 32), on the CPU's path and the
GPU's pure path, post-RoPE keys and pre-RoPE keys (both rotary layouts), with and without
the sketch.

Tolerance (float32 rounding only, against a float64 reference over the float32
reconstruction): a score is a D-term dot product, off by at most ``gamma(D + 3) sum |q||k|``
(``float64_attention``); each key element is a sum of D + e products rotated by two more
terms, computed once by the reference and once by the read in another association, so the
two differ by at most ``4 gamma(D + e + 6) (|u| |M|ᵀ)_j`` (u the row's coordinates, M the
extended basis), i.e. ``4 gamma(D + e + 6) ||q||_1 max_j (|u| |M|ᵀ)_j`` in a score; the
values, ``(p z) Vᵀ`` against ``p (z Vᵀ)``, by ``2 gamma(N + 2D + 6) p (|z| |V|ᵀ)``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from float64_attention import gamma
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import SpectralQuantOptions
from veloxquant_mlx.cache.rope import Rotary
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.spectral import eigen_store as es
from veloxquant_mlx.methods.spectral.cache import SpectralQuantCache
from veloxquant_mlx.quant.prerope import from_pre_rope_channels

PROMPT, STEPS, GQA, D, H = 200, 40, 2, 64, 2


def spectral(qjl: bool, rotary):
    options = SpectralQuantOptions(spectral_apply_qjl=qjl)
    cache = SpectralQuantCache(KVCacheConfig(method="spectral", kv_bits=2, options=options), None, 0)
    cache.store.keys.rotary = rotary
    return cache


def structured(shape, seed):
    """Rows with a few strong directions over a weak tail (what the eigenbasis expects)."""
    scales = mx.concatenate([mx.array([8.0, 4.0, 3.0, 2.0]), mx.full((shape[-1] - 4,), 0.3)])
    return mx.random.normal(shape, key=mx.random.key(seed)) * scales


def call(cache, q, k, v, scale):
    cache.update_and_fetch(k, v)
    return cache.attend(q, k, v, scale=scale, mask="causal" if k.shape[2] > 1 else None)


def _f64(x):
    return np.array(x.astype(mx.float32), dtype=np.float64)


def reconstructed(store):
    """Per stored token (B, H, N, ·) float64: the keys with their QJL correction (post-RoPE),
    the values, a bound on each key's elements' size in the read (``max_j (|u| |M|ᵀ)_j``), and
    on each value's (``|z| |V|ᵀ``)."""
    keys, values, key_size, value_size = [], [], [], []
    for k, v in zip(store.key_runs, store.value_runs):
        if not k.count:
            continue
        u = es._coordinates_fn(k.codec, k.dim, True, k.codec.qjl)(
            k.words.view(), k.norms.view(), k.sigma, k.tables, k.sketch)[0]
        if k.rotary is None:
            rows = u @ k.basis.swapaxes(-1, -2)
        else:
            rows = from_pre_rope_channels(k.basis @ u.swapaxes(-1, -2), k.start, k.rotary).swapaxes(-1, -2)
        keys.append(_f64(rows))
        basis = np.abs(_f64(k.basis))
        if k.codec.qjl:  # the read's extended basis [V, V_e Sᵀ] on the signs' coordinates
            e = k.codec.widths(k.dim)[0]
            basis = np.concatenate([basis, np.abs(_f64(k.basis[..., :e])) @ np.abs(_f64(k.sketch)).T], -1)
            z = np.abs(_f64(u))  # the reference's rows: the correction folded into the first e
            key_size.append(np.maximum((z @ basis[..., : k.dim].swapaxes(-1, -2)).max(-1),
                                       2 * (z @ basis[..., : k.dim].swapaxes(-1, -2)).max(-1)))
        else:
            key_size.append((np.abs(_f64(u)) @ basis.swapaxes(-1, -2)).max(-1))
        values.append(_f64(v.decode(mx.float32)))
        zv = es._coordinates_fn(v.codec, v.dim, True, False)(v.words.view(), v.norms.view(), v.sigma, v.tables, None)[0]
        value_size.append(np.abs(_f64(zv)) @ np.abs(_f64(v.basis)).swapaxes(-1, -2))
    return [np.concatenate(x, axis=2) for x in (keys, values, key_size, value_size)]


def reference(cache, q, scale, e):
    """Attention over what the store holds after the step (its token held exactly, or coded
    with the rows held when it filled the window): the reconstructed history and the rows
    held exactly, in float64, and the bound per output element (the module's docstring)."""
    store = cache.store
    keys, values, key_size, value_size = reconstructed(store)
    exact = [(_f64(store.k_pend.view()), _f64(store.v_pend.view()))] if store.k_pend.length else []
    for ke, ve in exact:
        keys, values = np.concatenate([keys, ke], 2), np.concatenate([values, ve], 2)
        key_size = np.concatenate([key_size, np.zeros(ke.shape[:3])], 2)
        value_size = np.concatenate([value_size, np.abs(ve)], 2)
    b, hq, _, d = q.shape
    n = keys.shape[2]
    qs = _f64(q).reshape(b, H, hq // H, d) * scale
    s = qs @ keys.swapaxes(-1, -2)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    delta = (gamma(d + 3) * (np.abs(qs) @ np.abs(keys).swapaxes(-1, -2))
             + 4 * gamma(d + e + 6) * np.abs(qs).sum(-1, keepdims=True) * key_size[:, :, None, :]).max(-1, keepdims=True)
    bound = (np.expm1(2 * delta) + gamma(n + 3)) * (p @ np.abs(values)) + 2 * gamma(n + 2 * d + 6) * (p @ value_size)
    return (p @ values).reshape(b, hq, 1, -1), bound.reshape(b, hq, 1, -1)


@pytest.mark.parametrize("pure_path", ["qmm", "reference"])
@pytest.mark.parametrize("qjl", [True, False], ids=["qjl", "no-qjl"])
@pytest.mark.parametrize("rotary", [None, Rotary(10000.0, False), Rotary(10000.0, True)],
                         ids=["post-rope", "pre-rope", "pre-rope-traditional"])
def test_decode_steps_equal_attention_over_the_reconstructed_history(rotary, qjl, pure_path, monkeypatch):
    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", pure_path)
    if pure_path == "reference":  # the GPU's pure path
        monkeypatch.setattr(kd, "_pure_path", lambda: "reference")
    batch, total, scale = 2, PROMPT + STEPS, D**-0.5
    cache = spectral(qjl, rotary)
    keys, values = structured((batch, H, total, D), 1), structured((batch, H, total, D), 2) * 0.5
    for start, stop in ((0, 120), (120, PROMPT)):
        q = mx.random.normal((batch, H * GQA, stop - start, D), key=mx.random.key(start))
        call(cache, q, keys[:, :, start:stop], values[:, :, start:stop], scale)
    e = cache.store.keys.codec.widths(D)[0] if qjl else 0
    coded, worst = [], 0.0
    for t in range(PROMPT, total):
        q = mx.random.normal((batch, H * GQA, 1, D), key=mx.random.key(100 + t))
        out = _f64(call(cache, q, keys[:, :, t : t + 1], values[:, :, t : t + 1], scale))
        ref, bound = reference(cache, q, scale, e)
        gap = np.abs(out - ref) - bound
        assert gap.max() <= 0, (t, gap.max(), bound.max())
        worst = max(worst, (np.abs(out - ref) / bound).max())
        coded.append(cache.store.coded)
    assert len(set(coded)) > 1, coded  # a flush fell in the steps
    assert cache.store.keys._views.value is not None  # the read's views are kept
