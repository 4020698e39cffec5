"""Keyformer's decode step (``_decode_score``: the group's query heads as one product's
rows, no block axis; the query position built on the host in the head keys' shape; the
columns' hash over the slots before their axis is added) against the card's score
computed the straightforward way, over 45 decode steps that cross an eviction: each
kept token's score S (the prompt's, then + the column sums over the query heads of
softmax((x + zeta) / tau_t) at each step, zeta from ``gumbel_noise``, the test formula),
and the tokens each eviction keeps, identical to the top of the reference scores.

Tolerance: the reference adds each step's masses in float64 over the logits x = q.k *
scale (float32 keys and queries) and zeta (``gumbel_noise``, float32 as the card defines
it). The float32 step rounds each logit by at most ``gamma(D + 3) scale sum |q_i k_i|``
and the noise's sum and the division by ``gamma(3) (|x| + |zeta|) / tau``: with delta the
row's largest (over tau), each weight moves by a factor within exp(+-2 delta) and the
softmax's sum adds gamma(n + 3), so a slot's mass by at most ``sum_g p_g (exp(2 delta_g)
- 1 + gamma(n + 3))``; adding it to S rounds by ``u |S|``. The bounds add up over the
steps; an eviction's choice is compared where the reference's kept and evicted scores
are further apart than their bounds (it is asserted that the eviction was so checked).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from cross_layer_util import layered
from float64_attention import U, gamma
from veloxquant_mlx.evict.base import EVICT_EVERY
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods import keyformer
from veloxquant_mlx.methods.keyformer import gumbel_noise, noise_stream

PROMPT, STEPS, B, H, GQA, D = 90, 45, 2, 2, 3, 16


def _tau(o, step):
    if o.keyformer_tau is not None:
        return o.keyformer_tau
    if o.keyformer_anneal_steps:
        return o.keyformer_tau_init + (o.keyformer_tau_end - o.keyformer_tau_init) * min(step, o.keyformer_anneal_steps) / o.keyformer_anneal_steps
    return o.keyformer_tau_init


def _store(c):
    s = c.store
    assert s.free is None
    return tuple(np.array(s.view(n).astype(mx.float32) if n != "positions" else s.view(n), np.float64)
                 for n in ("keys", "positions", "score"))


def step_mass(c, q, keys, positions, step, scale):
    """The card's mass of one decode query over the slots (float64) and its bound."""
    o = c.options
    tau = _tau(o, step)
    qs = np.array(q.astype(mx.float32), np.float64).reshape(B, H, GQA, D)
    x = (qs * scale) @ keys.swapaxes(-1, -2)  # (B, H, G, n)
    k_pos = mx.array(np.repeat(positions, GQA, axis=1).astype(np.int32))  # (B, Hq, n)
    zeta = np.array(gumbel_noise(noise_stream(o.keyformer_seed, c.layer, B, H * GQA), mx.array([c.offset - 1]),
                                 k_pos), np.float64).reshape(B, H, GQA, -1)
    logits = (x + zeta) / tau
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    delta = (gamma(D + 3) * scale * (np.abs(qs) @ np.abs(keys).swapaxes(-1, -2))
             + gamma(3) * (np.abs(x) + np.abs(zeta))).max(-1, keepdims=True) / tau
    bound = (p * (np.expm1(2 * delta) + gamma(keys.shape[2] + 3))).sum(2)
    return p.sum(2), bound


def decode_against_reference(c, monkeypatch, pure_path, seed=0):
    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", pure_path)
    monkeypatch.setattr(kd, "_pure_path", lambda: pure_path)
    calls, real = [], keyformer._decode_score
    monkeypatch.setattr(keyformer, "_decode_score", lambda scale: calls.append(scale) or real(scale))
    key = mx.random.key(seed)
    keys = mx.random.normal((B, H, PROMPT + STEPS, D), key=key) * 2.0
    values = mx.random.normal((B, H, PROMPT + STEPS, D), key=mx.random.key(seed + 1))
    scale = D**-0.5
    for start, stop in ((0, 64), (64, PROMPT - 1)):
        q = mx.random.normal((B, H * GQA, stop - start, D), key=mx.random.key(seed + 2 + start))
        c.update_and_fetch(keys[:, :, start:stop], values[:, :, start:stop])
        c.attend(q, keys[:, :, start:stop], values[:, :, start:stop], scale=scale, mask="causal")
    ref, err = {}, {}  # (b, h, position) -> the reference S and its bound
    evictions = checked = 0
    for t in range(PROMPT - 1, PROMPT + STEPS):
        q = mx.random.normal((B, H * GQA, 1, D), key=mx.random.key(seed + 1000 + t))
        k, v = keys[:, :, t : t + 1], values[:, :, t : t + 1]
        c.update_and_fetch(k, v)
        decode = not c.in_prompt
        step = c.decode_steps + 1
        if decode:
            kept_k, pos, score = _store(c)
            mass, bound = step_mass(c, q, kept_k, pos, step, scale)
        c.attend(q, k, v, scale=scale, mask=None)
        if not decode:  # the prompt's last token: the scores start from what the prompt gave
            _, pos, score = _store(c)
            for (b, h, i), p in np.ndenumerate(pos):
                ref[b, h, int(p)], err[b, h, int(p)] = score[b, h, i], 0.0
            continue
        for (b, h, i), p in np.ndenumerate(pos):
            s = ref.get((b, h, int(p)), 0.0) + mass[b, h, i]
            ref[b, h, int(p)], err[b, h, int(p)] = s, err.get((b, h, int(p)), 0.0) + bound[b, h, i] + U * abs(s)
        _, new_pos, new_score = _store(c)
        for (b, h, i), p in np.ndenumerate(new_pos):
            assert abs(new_score[b, h, i] - ref[b, h, int(p)]) <= err[b, h, int(p)], (t, b, h, int(p))
        if new_pos.shape[2] < pos.shape[2]:  # an eviction: the reference's choice
            evictions += 1
            assert step % EVICT_EVERY == 0
            for b in range(B):
                for h in range(H):
                    cand = [int(p) for p in pos[b, h]]
                    protected = [p for p in cand if p < c.n_sink or p >= c.offset - c.recent]
                    rest = sorted((p for p in cand if p not in protected), key=lambda p: -ref[b, h, p])
                    n_keep = c.budget - len(protected)
                    kept, gone = rest[:n_keep], rest[n_keep:]
                    lo = min(ref[b, h, p] - err[b, h, p] for p in kept)
                    hi = max(ref[b, h, p] + err[b, h, p] for p in gone)
                    if lo > hi:  # no tie within the bounds: the choice is the reference's
                        checked += 1
                        assert set(new_pos[b, h].astype(int)) == set(protected) | set(kept), (t, b, h)
    assert evictions >= 1 and checked >= B * H * evictions - 1
    assert len(calls) == STEPS  # every decode step took the compiled pass
    return checked


SETTINGS = {
    "default": dict(keyformer_budget=60),
    "anneal, sinks, recent, seed": dict(keyformer_budget=56, keyformer_anneal_steps=30, keyformer_n_sink=2,
                                         keyformer_recent=6, keyformer_seed=7),
}


@pytest.mark.parametrize("options", SETTINGS.values(), ids=SETTINGS.keys())
@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's path, and a GPU's
@pytest.mark.parametrize("layer", [0, 1])
def test_forty_five_decode_steps_score_and_evict_as_the_card(options, pure_path, layer, monkeypatch):
    c = layered("keyformer", 2, **options)[layer]
    assert decode_against_reference(c, monkeypatch, pure_path) >= 1
