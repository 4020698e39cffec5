"""NestedKV's decode read over padded heads (the eviction base's
``kernels/decode.held_rows_decode_attention``: the query scale and the padding's mask with
the softmax each one compiled kernel) against attention over each head's kept rows
(position >= 0) computed the straightforward way in float64, over 40 decode steps after a
prompt whose head-adaptive split pads some heads.

Tolerance (``float64_attention``'s): a score is a dot product of D terms, scaled, so it
is off by at most ``gamma(D + 3) scale sum |q_i k_i|``; scores off by at most delta (the
row's largest over the kept rows) move each weight by a factor within exp(+-2 delta),
and the weighted sum of N rows adds gamma(N + 3): each output element is within
``(exp(2 delta) - 1 + gamma(N + 3)) sum_t p_t |v_t|`` of the reference.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from cross_layer_util import layered
from float64_attention import gamma
from veloxquant_mlx.evict import base
from veloxquant_mlx.kernels import kivi_decode as kd

PROMPT, STEPS, B, H, GQA, D = 120, 40, 2, 4, 2, 16


def reference_and_bound(c, q, scale):
    """Attention over each head's kept rows (position >= 0), float64, and its bound."""
    keys = np.array(c.store.view("keys").astype(mx.float32), np.float64)
    values = np.array(c.store.view("values").astype(mx.float32), np.float64)
    kept = np.array(c.store.view("positions")) >= 0  # (B, H, N)
    qs = np.array(q.astype(mx.float32), np.float64).reshape(B, H, GQA, D) * scale
    s = np.where(kept[:, :, None], qs @ keys.swapaxes(-1, -2), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    mag = np.where(kept[:, :, None], np.abs(qs) @ np.abs(keys).swapaxes(-1, -2), 0.0)
    delta = gamma(D + 3) * mag.max(-1, keepdims=True)
    bound = (np.expm1(2 * delta) + gamma(keys.shape[2] + 3)) * (p @ np.abs(values))
    return (p @ values).reshape(B, H * GQA, 1, D), bound.reshape(B, H * GQA, 1, D)


def decode_against_reference(c, monkeypatch, pure_path, seed=0):
    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", pure_path)
    monkeypatch.setattr(kd, "_pure_path", lambda: pure_path)
    calls, real = [], base.held_rows_decode_attention
    monkeypatch.setattr(base, "held_rows_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    keys = mx.random.normal((B, H, PROMPT + STEPS, D), key=mx.random.key(seed)) * (1 + mx.arange(D) % 4)
    values = mx.random.normal((B, H, PROMPT + STEPS, D), key=mx.random.key(seed + 1))
    scale = D**-0.5
    for start, stop in ((0, 64), (64, PROMPT - 1), (PROMPT - 1, PROMPT)):  # the last token alone
        q = mx.random.normal((B, H * GQA, stop - start, D), key=mx.random.key(seed + 2 + start))
        c.update_and_fetch(keys[:, :, start:stop], values[:, :, start:stop])
        c.attend(q, keys[:, :, start:stop], values[:, :, start:stop], scale=scale,
                 mask="causal" if stop - start > 1 else None)
    assert c.padded and (np.array(c.store.view("positions")) < 0).any()
    outs = []
    for t in range(PROMPT, PROMPT + STEPS):
        q = mx.random.normal((B, H * GQA, 1, D), key=mx.random.key(seed + 1000 + t))
        k, v = keys[:, :, t : t + 1], values[:, :, t : t + 1]
        kk, vv = c.update_and_fetch(k, v)
        ref, bound = reference_and_bound(c, q, scale)
        before = c.decode_steps
        out = c.attend(q, kk, vv, scale=scale, mask=None)
        assert c.decode_steps == before + 1 and not c.in_prompt
        err = np.abs(np.array(out, np.float64) - ref)
        assert (err <= bound).all(), (t, (err - bound).max())
        outs.append(out)
    assert len(calls) == STEPS
    return outs


OPTIONS = dict(nestedkv_budget=48, nestedkv_window=8, nestedkv_safeguard_alpha=0.5)


@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's path, and a GPU's
def test_forty_decode_steps_match_attention_over_the_kept_rows(pure_path, monkeypatch):
    decode_against_reference(layered("nestedkv", 1, **OPTIONS)[0], monkeypatch, pure_path)
