"""kvtc's decode step (``decode_step.py``: one compiled pass over the sinks, the coded middle
rebuilt channels first from views the store keeps between codings, and the window's rows,
masked once after they are joined, the probabilities cut once) against attention over the
reconstructed history computed the straightforward way (float64), over 40 decode steps
that code a batch of rows leaving the window and grow the coded room.

Tolerance: both sides are float32 evaluations of the same function. A coded key element is
a K-term dot product of coefficients and basis plus the mean, then (pre-RoPE) rotated with
its partner: off by at most ``gamma(K + 4) m'`` on either side (``gamma(n) = n u / (1 - n u)``,
u = 2^-24; ``m = sum_i |y_i V_i| + |mu|`` per channel, ``m'`` that plus its rotary
partner's), so a score is off by at most ``delta = gamma(D + 3) sum |q k| + 2 gamma(K + 4)
sum |q| m'`` (sinks and window rows: m' = |k|), which moves each softmax weight by a factor
within ``exp(+-2 delta)`` and the output by ``(exp(2 delta) - 1) sum_t p_t m_t``; the values'
sums over N rows and K components (mixed in the PCA domain) add ``gamma(N + 2K + 8) sum_t
p_t m_t`` (m_t: |v_t|, or a coded value's m). Taken per query row and channel.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from conformance import config
from veloxquant_mlx.cache.rope import Rotary
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.kvtc import decode_step
from veloxquant_mlx.methods.kvtc.cache import KVTCCache

U = 2.0**-24
PROMPT, STEPS, GQA, D, H, WINDOW = 270, 40, 2, 64, 2, 32


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def kvtc_store(rotary):
    cache = KVTCCache(config("kvtc", {"residual_window": WINDOW, "kvtc_bit_budget": 128}), None, 0)
    return cache.make_store(rotary)


def rows(shape, seed):
    """Rows with a few strong directions (what a PCA basis keeps) and noise."""
    basis = mx.random.normal((8, shape[-1]), key=mx.random.key(seed))
    z = mx.random.normal((*shape[:-1], 8), key=mx.random.key(seed + 1)) * mx.array([4, 3, 2, 2, 1, 1, 1, 1.0])
    return z @ basis + 0.1 * mx.random.normal(shape, key=mx.random.key(seed + 2))


def magnitudes(store, run, exact_rows, rotary) -> np.ndarray:
    """Per row and channel (B, H, N, d) what an element's rounding is relative to: |x| for the
    sinks' and window's rows, ``|y| |V|ᵀ + |mu|`` for coded rows (with the rotary partner's
    added when the keys are rotated)."""
    b, h, _, d = exact_rows.shape
    c = run.codec
    y = np.abs(np.array(c.coefficients(run.unpacked()), dtype=np.float64))  # (B, n, K)
    m = y @ np.abs(np.array(c.basis, dtype=np.float64)).T + np.abs(np.array(c.mean, dtype=np.float64))
    m = m.reshape(b, -1, h, d).transpose(0, 2, 1, 3)
    if rotary is not None:
        j = np.arange(d)
        m = m + m[..., j ^ 1 if rotary.traditional else (j + d // 2) % d]
    x = np.abs(np.array(exact_rows, dtype=np.float64))
    n_sink = store.sink_k.length
    return np.concatenate([x[:, :, :n_sink], m, x[:, :, n_sink + run.count :]], axis=2)


def exact_attention_and_bound(q, keys, values, mk, mv, n_components, scale):
    b, hq, _, d = q.shape
    h, n = keys.shape[1], keys.shape[2]
    qs = np.array(q.astype(mx.float32), dtype=np.float64).reshape(b, h, hq // h, d) * scale
    k, v = np.array(keys, dtype=np.float64), np.array(values, dtype=np.float64)
    s = qs @ k.swapaxes(-1, -2)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    aq = np.abs(qs)
    delta = (gamma(d + 3) * (aq @ np.abs(k).swapaxes(-1, -2)) + 2 * gamma(n_components + 4) * (aq @ mk.swapaxes(-1, -2)))
    delta = delta.max(axis=-1, keepdims=True)
    bound = (np.expm1(2 * delta) + gamma(n + 2 * n_components + 8)) * (p @ mv)
    return (p @ v).reshape(b, hq, 1, -1), bound.reshape(b, hq, 1, -1)


def decode_against_reference(store, monkeypatch, path, batch=2, seed=5):
    """A chunked prompt, then STEPS decode steps through the store, each against attention
    over the history after its own token is stored. Returns the worst |error| / bound, the
    rows coded meanwhile and the steps the compiled pass served."""
    if path == "gpu":  # a GPU's reading: the pure path, token_mix cut along the tokens (CUDA)
        monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", "reference")
        monkeypatch.setattr(kd, "_splits_tokens", lambda: True)
        monkeypatch.setattr(kd, "SPLIT_TOKENS", 64)
    decode_step._step_fn.cache_clear()  # a pass traced under the other path's token_mix
    served = []
    real = decode_step.decode_attention

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        served.append(out is not None)
        return out

    monkeypatch.setattr(decode_step, "decode_attention", spy)
    total = PROMPT + STEPS
    keys, values = rows((batch, H, total, D), seed), rows((batch, H, total, D), seed + 7) * 0.5
    scale = D**-0.5
    for start, stop in ((0, 150), (150, PROMPT)):
        store.commit(keys[:, :, start:stop], values[:, :, start:stop])
    worst, coded = 0.0, store.keys.count
    for t in range(PROMPT, total):
        q = mx.random.normal((batch, H * GQA, 1, D), key=mx.random.key(300 + t))
        out = store.decode_attention(q, keys[:, :, t : t + 1], values[:, :, t : t + 1], scale=scale, use_kernel=True)
        ref_k, ref_v = store.history(mx.float32)
        mk = magnitudes(store, store.keys, ref_k, store.keys.rotary)
        mv = magnitudes(store, store.values, ref_v, None)
        ref, bound = exact_attention_and_bound(q, ref_k, ref_v, mk, mv, store.keys.codec.bits.size, scale)
        err = np.abs(np.array(out, dtype=np.float64) - ref)
        assert (err <= bound).all(), (t, (err - bound).max(), bound.max())
        worst = max(worst, (err / bound).max())
    return worst, store.keys.count - coded, served


@pytest.fixture(autouse=True)
def _fresh_passes():
    """No pass traced here (under a patched ``token_mix``) serves a later test."""
    yield
    decode_step._step_fn.cache_clear()


ROTARIES = [None, Rotary(10000.0), Rotary(500000.0, traditional=True)]


@pytest.mark.parametrize("rotary", ROTARIES, ids=["post-rope", "halves", "pairs"])
@pytest.mark.parametrize("path", ["cpu", "gpu"])
def test_decode_steps_match_attention_over_the_reconstructed_history(rotary, path, monkeypatch):
    store = kvtc_store(rotary)
    worst, coded, served = decode_against_reference(store, monkeypatch, path)
    assert coded == 32 and store.keys.count > 256  # a batch left the window; the room grew
    assert all(served) and len(served) == STEPS
    assert 0 < worst <= 1


def test_the_views_are_kept_between_codings_and_dropped_before_one(monkeypatch):
    """A step between codings reads the views the last one built; coding rows (which
    writes into the viewed buffers in place) drops them first."""
    store = kvtc_store(Rotary(10000.0))
    decode_against_reference(store, monkeypatch, "cpu", batch=1)
    built, sinks = store._code_views.value, store._sink_views.value
    assert built is not None and sinks is not None and store._code_views.owner() is store
    x = rows((1, H, 1, D), 60)
    q = mx.random.normal((1, H * GQA, 1, D), key=mx.random.key(61))
    steps = 0
    while store.k_win.held + 1 < WINDOW + 32:  # steps that code nothing
        mx.eval(store.decode_attention(q, x, x, scale=0.125, use_kernel=True))
        assert store._code_views.value is built and store._sink_views.value is sinks
        steps += 1
    assert steps > 10
    store._code(store.k_win.pop_front(1), store.v_win.pop_front(1))
    assert store._code_views.value is None


def test_a_copy_reads_as_the_original(monkeypatch):
    store = kvtc_store(Rotary(10000.0))
    decode_against_reference(store, monkeypatch, "cpu", batch=1)
    clone = copy.deepcopy(store)
    assert clone._code_views.value is None and clone._sink_views.value is None
    x = rows((1, H, 1, D), 70)
    q = mx.random.normal((1, H * GQA, 1, D), key=mx.random.key(71))
    a = store.decode_attention(q, x, x, scale=0.125, use_kernel=True)
    b = clone.decode_attention(q, x, x, scale=0.125, use_kernel=True)
    assert mx.array_equal(a, b).item()
    assert clone._code_views.owner() is clone
