"""xKV's decode read (``XKVCache._decode_read``: the queries folded into the shared latent
through this layer's basis ``b``, the latent's packed and tail tokens and the exact keys
under one softmax; ``b`` in the heads' layout, the latent tail transposed and the scale
broadcast over the queries kept as views between SVDs) against attention over the keys
the latent stands for (``A B_l``) and the exact keys, computed the straightforward way
in float64, over 40 decode steps of a two-layer group.

Tolerance: the reference is exact (float64) attention over the float32 latent ``A`` as
the codec decodes it, times ``b``, then the exact keys. The read computes each latent
score as ``sum_j (sum_i q_i B_ji) a_j`` in float32 (d then r terms, a dequantized in the
product on the CPU's ``quantized_matmul``: ``|s| c + |bias|`` bounds what it sums), so a
score is off by at most ``gamma(d + r + 6) sum_j sum_i |q_i| |B_ji| m_j`` (m the
dequantization's magnitude), an exact key's by ``gamma(d + 3) sum |q_i k_i|``. Scores
off by at most delta (the row's largest) move each weight by a factor within
``exp(+-2 delta)``; the weighted sum of N value rows adds ``gamma(N + 3)``: the output
element is within ``(exp(2 delta) - 1 + gamma(N + 3)) sum_t p_t |v_t|`` of the reference.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from cross_layer_util import kv, layered
from float64_attention import gamma
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.quant.affine import dequantize_per_channel

T, STEPS, H, D, GQA = 150, 40, 2, 32, 2


def _latent_and_magnitude(cache):
    """The latent (T, r) as the codec decodes it and the magnitude the read's product sums
    (``|s| c + |bias|`` for packed tokens, |a| for the tail), float64."""
    kept, codec = cache.group_shared.items, cache.codec
    parts, mags = [], []
    if kept.get("latent_codes") is not None:
        args = (kept["latent_codes"], kept["latent_scales"], kept["latent_biases"])
        parts.append(dequantize_per_channel(*args, codec.group, codec.bits, mx.float32))
        mags.append(dequantize_per_channel(args[0], mx.abs(args[1]), mx.abs(args[2]),
                                           codec.group, codec.bits, mx.float32))
    if kept.get("latent_tail") is not None:
        parts.append(kept["latent_tail"].astype(mx.float32))
        mags.append(mx.abs(parts[-1]))
    a, m = (mx.concatenate(x, axis=2)[0, 0] for x in (parts, mags))
    return np.array(a, np.float64), np.array(m, np.float64)


def reference_and_bound(cache, q, scale):
    """Attention of q over the latent's keys (A B_l) then the exact keys, in float64, and
    the most the float32 read may differ from it (the module's docstring)."""
    a, m = _latent_and_magnitude(cache)
    r = a.shape[1]
    basis = np.array(cache.b.astype(mx.float32), np.float64)[0].reshape(r, H, D).transpose(1, 2, 0)  # (H, D, r)
    latent_keys = np.einsum("tr,hdr->htd", a, basis)
    exact = np.array(cache.keys.view().astype(mx.float32), np.float64)[0]
    keys = np.concatenate([latent_keys, exact], axis=1)  # (H, N, D)
    values = np.array(cache.values.view().astype(mx.float32), np.float64)[0]
    qs = np.array(q.astype(mx.float32), np.float64).reshape(H, GQA, D) * scale
    s = qs @ keys.swapaxes(-1, -2)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    d_latent = gamma(D + r + 6) * ((np.abs(qs) @ np.abs(basis)) @ m.T)
    d_exact = gamma(D + 3) * (np.abs(qs) @ np.abs(exact).swapaxes(-1, -2))
    delta = np.maximum(d_latent.max(-1, keepdims=True), d_exact.max(-1, keepdims=True, initial=0.0))
    bound = (np.expm1(2 * delta) + gamma(keys.shape[1] + 3)) * (p @ np.abs(values))
    return (p @ values).reshape(1, H * GQA, 1, D), bound.reshape(1, H * GQA, 1, D)


def decode_against_reference(caches, monkeypatch, pure_path, seed=0):
    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", pure_path)
    monkeypatch.setattr(kd, "_pure_path", lambda: pure_path)
    ks, vs = kv(T + STEPS, len(caches), h=H, d=D, seed=seed)
    scale = D**-0.5
    for start in range(0, T, 64):  # a chunked prompt
        stop = min(start + 64, T)
        for layer, c in enumerate(caches):
            c.update_and_fetch(ks[layer][:, :, start:stop], vs[layer][:, :, start:stop])
            q = mx.random.normal((1, H * GQA, stop - start, D), key=mx.random.key(start + layer))
            c.attend(q, ks[layer][:, :, start:stop], vs[layer][:, :, start:stop], scale=scale, mask="causal")
    worst, latent_steps = 0.0, 0
    for t in range(T, T + STEPS):
        for layer, c in enumerate(caches):
            k, v = ks[layer][:, :, t : t + 1], vs[layer][:, :, t : t + 1]
            c.update_and_fetch(k, v)
            q = mx.random.normal((1, H * GQA, 1, D), key=mx.random.key(1000 + t + 100 * layer))
            out = c.attend(q, k, v, scale=scale, mask=None)
            if not c.n_latent:
                continue  # the group's first members attend over their own keys this once
            latent_steps += 1
            ref, bound = reference_and_bound(c, q, scale)
            err = np.abs(np.array(out, np.float64) - ref)
            assert (err <= bound).all(), (t, layer, (err - bound).max(), bound.max())
            worst = max(worst, float((err / bound).max()))
    assert latent_steps >= len(caches) * (STEPS - 1)
    return worst


SETTINGS = {
    "4-bit latent with a tail": dict(xkv_rank=24, xkv_latent_bits=4),
    "2-bit latent, energy rule": dict(xkv_latent_bits=2),
    "latent in the model dtype": dict(xkv_rank=40, xkv_latent_bits=16),
}


@pytest.mark.parametrize("options", SETTINGS.values(), ids=SETTINGS.keys())
@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's read, and a GPU's
def test_forty_decode_steps_match_attention_over_the_latent_keys(options, pure_path, monkeypatch):
    decode_against_reference(layered("xkv", 2, **options), monkeypatch, pure_path)


def test_the_views_follow_b_and_a_copy_builds_its_own(monkeypatch):
    """The read's views are kept between steps (the same objects), rebuilt when b is
    replaced (a restore), and a deep copy starts without them and reads as the original."""
    caches = layered("xkv", 2, xkv_rank=24, xkv_latent_bits=4)
    decode_against_reference(caches, monkeypatch, "reference")
    c = caches[1]
    views = c._views.value
    k = mx.random.normal((1, H, 1, D))
    q = mx.random.normal((1, H * GQA, 1, D))
    c.update_and_fetch(k, k)
    c.attend(q, k, k, scale=D**-0.5, mask=None)
    assert c._views.value is views
    clone = copy.deepcopy(c)
    assert clone._views.value is None
    k2 = mx.random.normal((1, H, 1, D), key=mx.random.key(7))
    a = (c.update_and_fetch(k2, k2), c.attend(q, k2, k2, scale=D**-0.5, mask=None))[1]
    b = (clone.update_and_fetch(k2, k2), clone.attend(q, k2, k2, scale=D**-0.5, mask=None))[1]
    assert mx.array_equal(a, b).item()
    assert clone._views.owner() is clone
    c.b = c.b * 2  # a new basis (as a restore brings): the views follow it
    ref, bound = reference_and_bound(c, q, D**-0.5)
    out = c.attend(q, k2, k2, scale=D**-0.5, mask=None)
    assert (np.abs(np.array(out, np.float64) - ref) <= bound).all()
