"""AnchorKV's decode read (issue 30: ``anchors._AnchorRead``, the compressed prompt and the
exact rows after it under one softmax, one split of the probabilities, the per-anchor sums
from one cumulative sum, views of the part kept between restores) against attention over
the reconstructed history (``AnchorPart.dense`` plus the exact rows) in float64, over 40
decode steps: the step that compresses the prompt, the exact rows' growth past 32 rows, a
save and load and a deep copy half-way (the views rebuilt for the new arrays).

Tolerance, from float32 rounding (u = 2^-24, gamma(n) = n u / (1 - n u), as in
``tests/float64_attention.py``), per query row and output channel:

- scores: a dot product of D terms, ``γ_t (q . a)`` against ``q . fl(γ_t a)`` one rounding
  more: ``gamma(D + 3) sum |q| |k|``. A key residual is read as ``rotate(q) . c_t`` (c_t its
  rotated coordinates ``scale levels[code]``), the reference's ``q . unrotate(c_t)``; each
  Hadamard transform (log2 D stages, entries of size 1/sqrt(D)) rounds each coordinate by
  ``gamma(log2 D + 1) ||x||_1 / sqrt(D)``, so such a score moves by at most
  ``gamma(D + 2 log2 D + 4) ||q||_1 ||c_t||_1 / sqrt(D)`` more. Scores moved by delta (the
  row's largest) move each weight by a factor within exp(+-2 delta).
- values: every value is read in pieces (``γ_t anchor``, the residual), so the weights' move
  and the mix's rounding (N tokens) are taken on ``mag_t = |γ_t a| + |r_t|``:
  ``(exp(2 delta) - 1 + gamma(N + 3)) sum_t p_t mag_t``; the per-anchor sums are differences
  of a cumulative sum of X = sum_t p_t |γ_t| (M terms), each prefix off by ``gamma(M + 1) X``,
  so an anchor's weight by twice that: ``2 gamma(M + 1) X sum_a |anchor_v[a]|``; the value
  residuals are mixed in the rotated domain and rotated back once:
  ``gamma(N_v + 2 log2 D + 3) sum_t p_t ||c_t||_1 / sqrt(D)``.
"""

from __future__ import annotations

import copy
import math

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from float64_attention import gamma
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import AnchorKVOptions
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.anchorkv import anchors
from veloxquant_mlx.methods.anchorkv.cache import AnchorKVCache

PROMPT, STEPS, GQA, D, H = 200, 40, 2, 64, 2
SETTINGS = {  # (anchor_frac, theta): residuals none, keys' and values', every token an anchor
    "no residuals": dict(anchorkv_anchor_frac=0.08, anchorkv_window=4, anchorkv_theta=0.05),
    "residuals": dict(anchorkv_anchor_frac=0.05, anchorkv_window=4, anchorkv_theta=0.3),
    "all anchors": dict(anchorkv_anchor_frac=1.0),
}


def anchorkv(**options):
    return AnchorKVCache(KVCacheConfig(method="anchorkv", options=AnchorKVOptions(**options)), None, 0)


def keys_values(b, t, seed):
    """Keys near a few directions (what anchors capture), values normal."""
    base = mx.random.normal((b, H, 8, D), key=mx.random.key(seed))
    pick = mx.random.randint(0, 8, (b, H, t), key=mx.random.key(seed + 1))
    size = mx.random.uniform(0.5, 1.5, (b, H, t, 1), key=mx.random.key(seed + 2))
    k = mx.take_along_axis(base, pick[..., None], axis=2) * size
    k = k + 0.3 * mx.random.normal((b, H, t, D), key=mx.random.key(seed + 3))
    return k, mx.random.normal((b, H, t, D), key=mx.random.key(seed + 4))


def call(cache, q, k, v, scale):
    cache.update_and_fetch(k, v)
    return cache.attend(q, k, v, scale=scale, mask="causal" if k.shape[2] > 1 else None)


def f64(x) -> np.ndarray:
    return np.array(x.astype(mx.float32), dtype=np.float64)


def reference_and_bound(cache, q, scale):
    """Attention of ``q`` over the reconstructed history (the step's token in it) in
    float64, and the module docstring's bound per output element."""
    codec, part = cache.store.codec, cache.store.part
    b, hq, _, d = q.shape
    h = part.anchor_k.shape[1]
    k, m, log_d = part.anchor_k.shape[2], part.key_ref.shape[2], math.log2(d)
    keys, values = (f64(x) for x in cache.dequantized(mx.float32))  # stored order, then the exact rows
    n = keys.shape[2]
    qs = f64(q).reshape(b, h, hq // h, d) * scale
    s = qs @ keys.swapaxes(-1, -2)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    delta = gamma(d + 3) * (np.abs(qs) @ np.abs(keys).swapaxes(-1, -2))  # (B, H, R, N)
    mag = np.abs(values)  # the anchors and the exact rows
    extra = np.zeros(qs.shape)
    if m:
        va = f64(part.anchor_v)
        run = (np.arange(m)[None, None, :, None] >= np.array(part.value_ends)[:, :, None, :]).sum(-1)
        gamma_v = f64(part.value_coef)
        mag[:, :, k : k + m] = np.abs(gamma_v[..., None] * np.take_along_axis(va, run[..., None], axis=2))
        slots = np.array(part.key_slot).astype(np.int64)  # (B, H, M): 0, or 1 + the residual's row
        if part.key_codes.shape[2]:
            c1 = f64(mx.abs(codec.coordinates(part.key_codes, part.key_scales)).sum(-1))  # (B, H, N_k)
            c1 = np.take_along_axis(np.pad(c1, [(0, 0), (0, 0), (1, 0)]), slots, axis=2)  # (B, H, M)
            q1 = np.abs(qs).sum(-1, keepdims=True)  # (B, H, R, 1)
            delta[..., k : k + m] += gamma(d + 2 * log_d + 4) * q1 * c1[:, :, None] / math.sqrt(d)
        x = p[..., k : k + m] @ np.abs(gamma_v)[..., None]  # (B, H, R, 1)
        extra += 2 * gamma(m + 1) * x * np.abs(va).sum(axis=2)[:, :, None]
        if part.value_codes.shape[2]:
            coords = codec.coordinates(part.value_codes, part.value_scales)
            pos = k + np.array(part.value_pos).astype(np.int64)  # (B, H, N_v)
            mag_r = np.zeros(values.shape)
            np.put_along_axis(mag_r, pos[..., None], np.abs(f64(codec.unrotate(coords))), axis=2)
            mag += mag_r
            c1 = f64(mx.abs(coords).sum(-1))  # (B, H, N_v)
            p_res = np.take_along_axis(p, np.broadcast_to(pos[:, :, None], (*p.shape[:3], pos.shape[2])), axis=-1)
            n_v = pos.shape[2]
            extra += gamma(n_v + 2 * log_d + 3) * (p_res * c1[:, :, None]).sum(-1, keepdims=True) / math.sqrt(d)
    delta = delta.max(axis=-1, keepdims=True)
    bound = (np.expm1(2 * delta) + gamma(n + 3)) * (p @ mag) + extra
    return (p @ values).reshape(b, hq, 1, d), bound.reshape(b, hq, 1, d)


def prefilled(settings, batch, seed, keys, values):
    """A cache holding the prompt (two chunks) of ``keys``, ``values``."""
    cache = anchorkv(**settings)
    for start, stop in ((0, 120), (120, PROMPT)):
        q = mx.random.normal((batch, H * GQA, stop - start, D), key=mx.random.key(seed + start))
        call(cache, q, keys[:, :, start:stop], values[:, :, start:stop], D**-0.5)
    return cache


def decode_against_reference(settings, monkeypatch, path, tmp_path, batch=2, seed=5):
    """Prefill, then STEPS decode steps, each against the reference. Half-way the cache is
    restored in place from another sequence's cache (its views must not serve the new
    arrays); later it is saved and loaded, then deep-copied (each reads through views of
    its own)."""
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    monkeypatch.setattr(kd, "_pure_path", lambda: "qmm" if path == "cpu" else "reference")
    if path == "gpu":  # CUDA's read of the exact rows: the token axis cut (here from 16 rows)
        monkeypatch.setattr(kd, "_splits_tokens", lambda: True)
        monkeypatch.setattr(kd, "SPLIT_TOKENS", 8)
    total, half, scale = PROMPT + STEPS, PROMPT + STEPS // 2, D**-0.5
    keys, values = keys_values(batch, total, seed)
    cache = prefilled(settings, batch, seed, keys, values)
    worst = 0.0
    for t in range(PROMPT, total):
        if t == half:
            other_k, other_v = keys_values(batch, half, seed + 50)
            other = prefilled(settings, batch, seed, other_k, other_v)
            for i in range(PROMPT, half):
                call(other, mx.zeros((batch, H * GQA, 1, D)), other_k[:, :, i : i + 1], other_v[:, :, i : i + 1], scale)
            assert cache.store._views.value is not None
            store = cache.store
            cache.state = other.state  # in place: the same store, new arrays
            assert cache.store is store
        if t == half + STEPS // 4:
            save_prompt_cache(str(tmp_path / "anchorkv.safetensors"), [cache])
            (loaded,) = load_prompt_cache(str(tmp_path / "anchorkv.safetensors"))
            assert loaded.store._views.value is None
            cache = copy.deepcopy(loaded)
            assert cache.store._views.value is None
        q = mx.random.normal((batch, H * GQA, 1, D), key=mx.random.key(100 + t))
        out = call(cache, q, keys[:, :, t : t + 1], values[:, :, t : t + 1], scale)
        ref, bound = reference_and_bound(cache, q, scale)
        err = np.abs(np.array(out, dtype=np.float64) - ref)
        assert (err <= bound).all(), (t, (err - bound).max(), bound.max())
        worst = max(worst, (err / bound).max())
    assert cache.store.part.count == PROMPT and cache.store.k_tail.length == STEPS
    assert cache.store._views.owner() is cache.store
    return cache, worst


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("path", ["cpu", "gpu"])  # the CPU's read, and a GPU's
def test_forty_decode_steps_match_attention_over_the_reconstruction(setting, path, monkeypatch, tmp_path):
    cache, _ = decode_against_reference(SETTINGS[setting], monkeypatch, path, tmp_path)
    part = cache.store.part
    if setting == "residuals":
        assert part.key_codes.shape[2] > 0 and part.value_codes.shape[2] > 0
    if setting == "no residuals":
        assert part.key_codes.shape[2] == 0 and part.key_ref.shape[2] > 0
    if setting == "all anchors":
        assert part.key_ref.shape[2] == 0


def test_a_step_reads_the_views_kept_since_the_prompt_was_compressed(monkeypatch):
    """The views are built once, at the step that compresses the prompt, and read by every
    later step (none rebuilt, none sliced from the part again); a query of another GQA
    width gets views of its own."""
    cache = anchorkv(**SETTINGS["residuals"])
    keys, values = keys_values(1, PROMPT + 5, 9)
    scale = D**-0.5
    call(cache, mx.zeros((1, H * GQA, PROMPT, D)), keys[:, :, :PROMPT], values[:, :, :PROMPT], scale)
    built = []
    of = anchors._Views.of
    monkeypatch.setattr(anchors._Views, "of", classmethod(lambda cls, p, r: built.append(r) or of(p, r)))
    for t in range(PROMPT, PROMPT + 5):
        q = mx.random.normal((1, H * GQA, 1, D), key=mx.random.key(t))
        mx.eval(call(cache, q, keys[:, :, t : t + 1], values[:, :, t : t + 1], scale))
    assert built == [GQA]
    q = mx.random.normal((1, H, 1, D), key=mx.random.key(0))
    cache.store.attend(q, scale=scale, use_kernel=False, n_kv_heads=H)
    assert built == [GQA, 1]
