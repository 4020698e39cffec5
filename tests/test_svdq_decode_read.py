"""SVDq's decode read (``lowrank/latent.py``: the query folded onto each run's basis and
scored span by span against the packed latents, the spans' valid tokens kept as views
between flushes, 1-bit words unpacked in one fused pass on a GPU's path, the runs of a
store with exact values read as one part) against attention over the reconstructed
history computed the straightforward way, over 40 decode steps that flush and refit.

Tolerance: both sides are evaluations of the same function over the same stored numbers
(the latents as ``LatentTokens.dense`` dequantizes them, the bases, the means), the
reference in float64, so they differ by the read's float32 rounding only (``gamma(n) =
n u / (1 - n u)``, u = 2^-24, bounds any order of summing n terms). A key's score on the
read is ``(q V^(h)) . l_t`` (d then r terms, the mean term ``q . μ_h`` one more product
and sum where it is not left out) after the query's scaling: off by at most ``delta =
gamma(d + r + 4) (|q| |V^(h)| |l_t| + |q| |μ_h|)``, the row's largest over its tokens. Scores
off by at most delta move each softmax weight by a factor within ``exp(+-2 delta)``, and
the softmax and the weighted sum of N rows round ``gamma(N + 3)``: the output by at most
``(exp(2 delta) - 1 + gamma(N + 3)) sum_t p_t |v_t|``. Latent values add the lift's rounding
(``p L`` then ``V^(h)ᵀ`` and the mean: ``gamma(N + r + 3 + runs) (p |L| |V^(h)|ᵀ + |μ_h|)``).
Taken per query row and channel against float64: only the read's float32 rounding remains.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import SVDqOptions
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.lowrank import latent
from veloxquant_mlx.methods.svdq import SVDqCache

U = 2.0**-24
STEPS, GQA, D = 40, 2, 32


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def svdq(**options):
    return SVDqCache(KVCacheConfig(method="svdq", options=SVDqOptions(**options)), None, 0)


def rows(shape, seed):
    """Keys of a decaying spectrum (what a low-rank basis keeps most of) plus an offset."""
    b, h, t, d = shape
    x = mx.random.normal(shape, key=mx.random.key(seed)) * mx.power(0.8, mx.arange(d))
    return x + mx.random.normal((b, h, 1, d), key=mx.random.key(seed + 1))


def call(cache, q, k, v, scale):
    cache.update_and_fetch(k, v)
    return cache.attend(q, k, v, scale=scale, mask="causal" if k.shape[2] > 1 else None)


def _f64(x):
    return np.array(x.astype(mx.float32), dtype=np.float64)


def _per_head(latent_runs, g):
    """Per run (float64): the latents a KV head reads (B, H, T, r), its basis rows
    (B, H, d, r) and mean (B, H, 1, d): what the read folds, straight from the store."""
    out = []
    for run in latent_runs:
        if not run.tokens.count:
            continue
        lat = _f64(run.tokens.dense())
        basis, mean = _f64(run.basis), _f64(run.mean)
        b, groups, n, r = basis.shape
        h, d = groups * g, n // g
        out.append((np.repeat(lat, g, axis=1), basis.reshape(b, h, d, r), mean.reshape(b, h, 1, d)))
    return out


def reference_and_bound(cache, q, scale):
    """Attention of ``q`` (B, Hq, 1, D) over what the store holds (the history rebuilt from
    its stored latents, bases and means, in float64), and per output element the most the
    read's float32 evaluation may differ from it (the module's docstring)."""
    store = cache.store
    g = store.heads_per_group
    b, hq, _, d = q.shape
    keys = _per_head(store.keys.runs, g)
    h = keys[0][1].shape[1]
    qs = _f64(q).reshape(b, h, hq // h, d) * scale
    k_hat = np.concatenate([lat @ basis.swapaxes(-1, -2) + mean for lat, basis, mean in keys], axis=2)
    mag = np.concatenate([(np.abs(qs) @ np.abs(basis)) @ np.abs(lat).swapaxes(-1, -2)
                          + np.abs(qs) @ np.abs(mean).swapaxes(-1, -2) for lat, basis, mean in keys], axis=-1)
    r = max(lat.shape[-1] for lat, _, _ in keys)
    n = k_hat.shape[2]
    delta = gamma(d + r + 4) * mag.max(axis=-1, keepdims=True)
    s = qs @ k_hat.swapaxes(-1, -2)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    lift = 0.0
    if store.values is None:
        v_hat = _f64(store.v_exact.view())
    else:
        values = _per_head(store.values.runs, g)
        v_hat = np.concatenate([lat @ basis.swapaxes(-1, -2) + mean for lat, basis, mean in values], axis=2)
        cuts = np.cumsum([lat.shape[2] for lat, _, _ in values])[:-1]
        lift = sum((pr @ np.abs(lat)) @ np.abs(basis).swapaxes(-1, -2) + np.abs(mean)
                   for pr, (lat, basis, mean) in zip(np.split(p, cuts, axis=-1), values))
        lift = gamma(n + r + 3 + len(values)) * lift
    bound = (np.expm1(2 * delta) + gamma(n + 3)) * (p @ np.abs(v_hat)) + lift
    return (p @ v_hat).reshape(b, hq, 1, -1), bound.reshape(b, hq, 1, -1)


def decode_against_reference(cache, monkeypatch, pure_path, *, heads=2, prompt=40, batch=2, seed=3, dv=D, d=D):
    """A chunked prompt, then STEPS decode steps, each step's output against the reference
    over what the store holds after it (the step reads its own token as stored). Returns
    the largest error as a fraction of its bound, and the flushes and runs seen."""
    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", pure_path)
    total = prompt + STEPS
    keys = rows((batch, heads, total, d), seed)
    values = rows((batch, heads, total, dv), seed + 2) * 0.5
    scale = d**-0.5
    for start, stop in ((0, prompt // 2), (prompt // 2, prompt)):
        q = mx.random.normal((batch, heads * GQA, stop - start, d), key=mx.random.key(seed + start))
        call(cache, q, keys[:, :, start:stop], values[:, :, start:stop], scale)
    assert cache.store.fitted
    worst, flushes = 0.0, 0
    for t in range(prompt, total):
        q = mx.random.normal((batch, heads * GQA, 1, d), key=mx.random.key(100 + t))
        before = sum(r.tokens.flushed for r in cache.store.keys.runs)
        out = call(cache, q, keys[:, :, t : t + 1], values[:, :, t : t + 1], scale)
        flushes += sum(r.tokens.flushed for r in cache.store.keys.runs) > before
        ref, bound = reference_and_bound(cache, q, scale)
        err = np.abs(np.array(out, dtype=np.float64) - ref)
        assert (err <= bound).all(), (t, (err - bound).max(), bound.max())
        worst = max(worst, (err / bound).max())
    return worst, flushes, len(cache.store.keys.runs)


SCHEDULES = [(8, 4, 2, 1, 1, 0, 0, 0), (4, 16, 1, 3, 0, 2)]  # the default; unquantized and 3-bit spans among them


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("group", [32, 64])  # a 1-bit word a group, or two
@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's read, and a GPU's
def test_decode_read_matches_attention_over_the_reconstruction(schedule, group, pure_path, monkeypatch):
    # a 40-token prompt (fitted at 32): its refit falls at 80 tokens, in the 40th step;
    # the newest run then holds no tokens; a flush every ``group`` tokens before it
    cache = svdq(svdq_bit_schedule=schedule, svdq_group_size=group)
    worst, flushes, runs = decode_against_reference(cache, monkeypatch, pure_path)
    assert flushes >= 1 and runs == 2 and worst < 1


@pytest.mark.parametrize("pure_path", ["qmm", "reference"])
def test_several_runs_read_as_one_part(pure_path, monkeypatch):
    """A short prompt refits early: the later steps read two runs with data (one part:
    every run's keys, the exact values in one product)."""
    cache = svdq(svdq_group_size=32)
    worst, _, runs = decode_against_reference(cache, monkeypatch, pure_path, prompt=33)
    assert runs == 2 and cache.store.keys.runs[1].tokens.count == 33 + STEPS - 66 and worst < 1
    (part,) = cache.store.decode_parts(mx.zeros((0,)))
    assert isinstance(part.keys, latent._RunKeys) and part.value_tail.shape[2] == 33 + STEPS


def test_views_are_kept_between_flushes_and_a_copy_builds_its_own(monkeypatch):
    cache = svdq(svdq_group_size=32)
    decode_against_reference(cache, monkeypatch, "reference", batch=1, prompt=64)
    tokens = cache.store.keys.tokens
    first = tokens._span_views()
    assert tokens._span_views() is first  # no step slices the history again
    k = rows((1, 2, 1, D), 50)
    q = mx.random.normal((1, 4, 1, D), key=mx.random.key(51))
    clone = copy.deepcopy(cache)
    assert clone.store.keys.tokens._views.value is None
    a, b = call(cache, q, k, k, D**-0.5), call(clone, q, k, k, D**-0.5)
    assert mx.array_equal(a, b).item()
    assert clone.store.keys.tokens._views.owner() is clone.store.keys.tokens
    if tokens.buf.length:  # not a flush: the same views
        assert tokens._span_views() is first


def test_the_fused_one_bit_reading_is_the_dequantization_bit_for_bit():
    tokens = latent.LatentTokens([latent.ChannelSegment(0, 5, 1)], 64, 256, (2, 3))
    x = mx.random.normal((2, 3, 64 * 5, 5), key=mx.random.key(0))
    tokens.append(x)  # 320 tokens: buffers of 512 (room past the valid words)
    (span,) = latent._SpanRead.of(tokens, 0, tokens.spans[0][1], "reference"),
    assert span.unpacked and tokens.packed[0].codes.buffer.shape[-1] > 10
    codes, scales, biases = (g.view() for g in (tokens.packed[0].codes, tokens.packed[0].scales, tokens.packed[0].biases))
    assert mx.array_equal(span._dequantized(None, 64), kd.dequantize(codes, scales, biases, 64, 1)).item()
    assert mx.array_equal(span._dequantized(None, 64).swapaxes(-1, -2), tokens.dense()).item()
