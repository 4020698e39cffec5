"""Keyformer's card invariants, by brute force on synthetic K/V/Q.

Caches are driven the way mlx-lm drives them: update_and_fetch, then attention through
the cache (the hook's job); the last prompt token comes alone.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from feeding import feed, prompt_then_steps, synthetic_kvq
from paper_rule import evict_every_step, no_recent_floor  # noqa: F401  (fixtures)
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import H2OOptions, KeyformerOptions
from veloxquant_mlx.evict.prng import MASK64, mix64
from veloxquant_mlx.methods import keyformer as keyformer_module
from veloxquant_mlx.methods.h2o import H2OCache
from veloxquant_mlx.methods.keyformer import KeyformerCache, gumbel_noise, noise_stream

# these tests replay the papers' rules: a token leaves at every decode step
pytestmark = pytest.mark.usefixtures("evict_every_step")

HKV, GROUP, D = 2, 3, 16
SCALE = D**-0.5


def synthetic(n, seed=0):
    return synthetic_kvq(n, HKV, GROUP, D, q_scale=2.0, norm_range=(0.2, 3.0), seed=seed)


def run(cache, k, v, q, n_prompt, chunk, stop=None, after_each=None):
    """``prompt_then_steps``; the cache."""
    prompt_then_steps(cache, k, v, q, n_prompt, chunk, stop, after_each)
    return cache


def kept_sets(cache):
    return [set(cache.kept_positions[0, h].tolist()) for h in range(HKV)]


def keyformer(noise=True, **options):
    cache = KeyformerCache(KVCacheConfig(options=KeyformerOptions(**options)))
    cache.gumbel_noise = noise
    return cache


def _softmax_mass(k, q, n, tau):
    """sum over queries and a group's heads of softmax(x / tau), causal: (H, n) float32."""
    qh = q[:, :, :n].reshape(1, HKV, GROUP, n, D)
    x = (qh * SCALE) @ k[:, :, None, :n].swapaxes(-1, -2)
    x = mx.where(mx.arange(n)[None] <= mx.arange(n)[:, None], x / tau, -float("inf"))
    return mx.softmax(x, axis=-1).sum(axis=(2, 3))[0]


@pytest.mark.parametrize("chunk,elements", [(1, None), (37, None), (300, None), (300, 3000)])
def test_without_noise_the_score_is_the_group_summed_softmax_column_sum(chunk, elements, monkeypatch):
    if elements:  # blocks of 3 queries: the prompt is scored block by block
        monkeypatch.setattr(keyformer_module, "SCORE_ELEMENTS", elements)
    n, tau = 150, 0.7
    k, v, q = synthetic(n, seed=1)
    cache = keyformer(noise=False, keyformer_budget=512, keyformer_tau=tau)
    for start in range(0, n, chunk):
        feed(cache, k, v, q, start, min(n, start + chunk))
    assert mx.allclose(cache.store.view("score")[0], _softmax_mass(k, q, n, tau), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("noise", [False, True])
def test_before_any_eviction_each_kv_head_scores_sum_to_group_times_queries(noise, monkeypatch):
    """Every query head's score row is a softmax over the keys it sees: it sums to one."""
    monkeypatch.setattr(keyformer_module, "SCORE_ELEMENTS", 2000)  # several blocks per chunk
    n = 120
    k, v, q = synthetic(n, seed=2)
    cache = keyformer(noise=noise, keyformer_budget=512, keyformer_tau_init=0.5,
                      keyformer_tau_end=3.0, keyformer_anneal_steps=20)
    run(cache, k, v, q, 80, chunk=33)
    score = cache.store.view("score")[0]
    assert mx.allclose(score.sum(-1), mx.full((HKV,), float(GROUP * n)), rtol=1e-5)
    assert bool((score > 0).all())
    if noise:  # the noise moved the scores away from the deterministic ones
        plain = run(keyformer(noise=False, keyformer_budget=512, keyformer_tau_init=0.5,
                              keyformer_tau_end=3.0, keyformer_anneal_steps=20), k, v, q, 80, chunk=33)
        assert float(mx.abs(score - plain.store.view("score")[0]).max()) > 0.1


@pytest.mark.usefixtures("no_recent_floor")
def test_without_noise_at_tau_1_the_selection_is_h2os_cumulative_softmax_top_k():
    """The card's deterministic limit: no noise, tau 1 gives H2O's plain column sums (times
    the group size, which leaves the ranking alone), so both keep the same tokens."""
    n, budget, sink, recent = 200, 30, 3, 5
    k, v, q = synthetic(n, seed=3)
    kf = keyformer(noise=False, keyformer_budget=budget, keyformer_n_sink=sink, keyformer_recent=recent)
    h2o = H2OCache(KVCacheConfig(options=H2OOptions(h2o_budget=budget, h2o_n_sink=sink,
                                                    h2o_grace=recent, h2o_decay=1.0)))
    checked = []

    def same(cache, seen):
        feed(h2o, k, v, q, seen - 1, seen)
        assert kept_sets(cache) == kept_sets(h2o)
        checked.append(seen)

    start = 0
    while start < 119:
        feed(h2o, k, v, q, start, min(start + 40, 119))
        start += 40
    run(kf, k, v, q, 120, chunk=40, after_each=same)
    assert len(checked) == n - 119 and kf.stored_length == budget


def _fmix32(h):
    """murmur3's 32-bit finaliser, in numpy (arrays: their products wrap silently)."""
    h = np.atleast_1d(np.asarray(h, np.uint32))
    h = (h ^ (h >> np.uint32(16))) * np.uint32(0x85EBCA6B)
    h = (h ^ (h >> np.uint32(13))) * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _zeta(seed, layer, head, q_position, k_positions):
    """The documented noise, in numpy: -log(-log(u)) for u from a hash of (seed, layer, query
    head, query position, key position), float32 as the cache computes it."""
    s = mix64(mix64(seed & MASK64) ^ layer)
    row = _fmix32(_fmix32(np.uint32(head) ^ np.uint32(s & 0xFFFFFFFF)) ^ np.uint32(q_position))
    col = _fmix32(np.asarray(k_positions).astype(np.uint32) ^ np.uint32(s >> 32))
    h = ((row ^ col) * np.uint32(0x85EBCA6B)) | np.uint32(1)
    e = np.log(np.float32(2.0**32 / (1 - 2.0**-24)) / h.astype(np.float32))  # -log(u), u = h / that
    return -np.log(np.maximum(e, np.float32(2.0**-25)))


def _simulate(k, q, n_prompt, chunk, budget, sink, recent, seed, layer, tau):
    """Naive Keyformer, per head, on the slot layout the cache uses (an evicted token's slot
    takes the next token; the prompt's end keeps the top tokens in position order). Noise is
    the documented formula per logit (``_zeta``): (seed, layer, query head, query position,
    key position), whatever the cache's blocks. Returns the kept positions per head after
    every step."""
    kn, qn = np.array(k[0], np.float32), np.array(q[0], np.float32)
    slots = [[] for _ in range(HKV)]
    score = [[] for _ in range(HKV)]
    free = [None] * HKV
    updates = [(s, min(s + chunk, n_prompt - 1)) for s in range(0, n_prompt - 1, chunk)]
    updates += [(t, t + 1) for t in range(n_prompt - 1, k.shape[2])]
    history, in_prompt, steps = [], True, 0
    for p0, p1 in updates:
        n = p1 - p0
        prefill_end, decode = n == 1 and in_prompt, n == 1 and not in_prompt
        step = steps + 1 if decode else 0
        for h in range(HKV):
            new = list(range(p0, p1))
            if free[h] is not None:
                slots[h][free[h]] = new.pop(0)
                score[h][free[h]] = 0.0
                free[h] = None
            slots[h] += new
            score[h] += [0.0] * len(new)
        rows = len(slots[0])
        for h in range(HKV):
            pos = np.array(slots[h])
            for g in range(GROUP):
                for i in range(n):
                    x = qn[h * GROUP + g, p0 + i] @ kn[h, pos].T * SCALE
                    zeta = _zeta(seed, layer, h * GROUP + g, p0 + i, pos)
                    z = np.where(pos <= p0 + i, (x + zeta) / tau(step), -np.inf)
                    e = np.exp(z - z.max())
                    for j, f in enumerate(e / e.sum()):
                        score[h][j] += f
            if rows > budget and (prefill_end or decode):
                guarded = [np.inf if (p < sink or p >= p1 - recent) else s for p, s in zip(slots[h], score[h])]
                if decode:
                    free[h] = int(np.argmin(guarded))
                else:
                    keep = sorted(np.argsort(-np.array(guarded), kind="stable")[:budget])
                    slots[h], score[h] = [slots[h][j] for j in keep], [score[h][j] for j in keep]
        if prefill_end or decode:
            history.append([set(s) - ({s[f]} if f is not None else set()) for s, f in zip(slots, free)])
        steps = 0 if prefill_end else steps + (1 if decode else 0)
        in_prompt = n > 1
    return history


@pytest.mark.usefixtures("no_recent_floor")
@pytest.mark.parametrize("sink,recent,seed,elements", [(0, 0, 0, 2**21), (3, 4, 11, 2**21), (2, 0, -5, 600)])
def test_accumulated_gumbel_scores_match_a_step_by_step_simulation(sink, recent, seed, elements, monkeypatch):
    """Noise on, tau annealed from 0.5 to 2 over 12 steps: the cache's kept tokens after the
    prompt and after every decode step equal the naive simulation's (600 logits a block:
    prompt chunks are scored a few queries at a time; the noise is per logit either way)."""
    monkeypatch.setattr(keyformer_module, "SCORE_ELEMENTS", elements)
    n_prompt, n, budget, layer = 60, 110, 24, 3
    k, v, q = synthetic(n, seed=4)
    opts = dict(keyformer_budget=budget, keyformer_n_sink=sink, keyformer_recent=recent,
                keyformer_seed=seed, keyformer_tau_init=0.5, keyformer_tau_end=2.0,
                keyformer_anneal_steps=12)
    cache = KeyformerCache(KVCacheConfig(options=KeyformerOptions(**opts)), layer=layer)
    expected = iter(_simulate(k, q, n_prompt, 25, budget, sink, recent, seed, layer, cache.tau))
    got = []
    run(cache, k, v, q, n_prompt, chunk=25, after_each=lambda c, seen: got.append(kept_sets(c)))
    for mine, naive in zip(got, expected):
        assert mine == naive
    assert len(got) == n - n_prompt + 1 and cache.stored_length == budget


def test_same_seed_same_selection_and_copies_or_reloads_continue_the_same_noise():
    n_prompt, n = 100, 160
    k, v, q = synthetic(n, seed=5)
    opts = dict(keyformer_budget=32, keyformer_n_sink=2, keyformer_tau=1.5)
    a = run(keyformer(keyformer_seed=7, **opts), k, v, q, n_prompt, chunk=40)
    b = run(keyformer(keyformer_seed=7, **opts), k, v, q, n_prompt, chunk=40)
    c = run(keyformer(keyformer_seed=8, **opts), k, v, q, n_prompt, chunk=40)
    assert kept_sets(a) == kept_sets(b)
    assert kept_sets(a) != kept_sets(c)
    # halfway: a deep copy and a state round trip continue exactly as the original does
    half = run(keyformer(keyformer_seed=7, **opts), k, v, q, n_prompt, chunk=40, stop=130)
    clone = copy.deepcopy(half)
    loaded = KeyformerCache.from_state(half.state)
    for cache in (half, clone, loaded):
        for t in range(130, n):
            feed(cache, k, v, q, t, t + 1)
        assert kept_sets(cache) == kept_sets(a)
        assert mx.array_equal(cache.store.view("score"), a.store.view("score"))


def test_the_noise_depends_on_the_layer():
    k, v, q = synthetic(140, seed=6)
    config = KVCacheConfig(options=KeyformerOptions(keyformer_budget=32, keyformer_n_sink=0))
    sets = [kept_sets(run(KeyformerCache(config, layer=i), k, v, q, 100, chunk=50)) for i in (0, 1)]
    assert sets[0] != sets[1]


def test_the_attention_output_carries_no_noise_and_under_budget_is_exact():
    n = 90
    k, v, q = synthetic(n, seed=7)
    outs = []
    for seed in (0, 1):
        cache = keyformer(keyformer_budget=n, keyformer_seed=seed, keyformer_tau=0.3)
        outs.append(mx.concatenate([feed(cache, k, v, q, 0, 50)] +
                                   [feed(cache, k, v, q, t, t + 1) for t in range(50, n)], axis=2))
        assert cache.kept_positions is None and cache.stored_length == n
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mx.arange(n)[None] <= mx.arange(n)[:, None])
    assert mx.array_equal(outs[0], outs[1])
    assert mx.allclose(outs[0], ref, atol=1e-5)


def test_temperature_schedule():
    def tau(**o):
        return keyformer(**o).tau

    t = tau(keyformer_tau_init=1.0, keyformer_tau_end=2.0, keyformer_anneal_steps=10)
    assert [t(0), t(5), t(10), t(11), t(1000)] == [1.0, 1.5, 2.0, 2.0, 2.0]
    fixed = tau(keyformer_tau=0.25, keyformer_tau_init=1.0, keyformer_tau_end=2.0, keyformer_anneal_steps=10)
    assert {fixed(s) for s in (0, 3, 50)} == {0.25}
    constant = tau(keyformer_tau_init=0.8, keyformer_tau_end=2.0, keyformer_anneal_steps=0)
    assert {constant(s) for s in (0, 3, 50)} == {0.8}


def test_the_decode_step_uses_the_annealed_temperature():
    """The same tokens and noise, two schedules that differ from step 1 on: the scores agree
    after the prompt (t = 0: tau_init for both) and differ after one decode step."""
    k, v, q = synthetic(80, seed=8)
    opts = dict(keyformer_budget=512, keyformer_tau_init=1.0, keyformer_tau_end=3.0)
    a, b = keyformer(keyformer_anneal_steps=3, **opts), keyformer(keyformer_anneal_steps=30, **opts)
    for cache in (a, b):
        run(cache, k, v, q, 60, chunk=30, stop=60)
    assert mx.array_equal(a.store.view("score"), b.store.view("score"))
    for cache in (a, b):
        feed(cache, k, v, q, 60, 61)
    diff = mx.abs(a.store.view("score") - b.store.view("score")).max()
    assert float(diff) > 1e-3  # tau_1 = 1 + 2/3 against 1 + 2/30


def _noise(seed=0, layer=0, heads=4, n=512):
    """The noise of ``heads`` query heads x n queries x n keys at positions 0 .. n - 1, float64."""
    positions = mx.arange(n)
    z = gumbel_noise(noise_stream(seed, layer, 1, heads), positions, positions[None, None])
    return np.array(z[0], np.float64)


def test_the_noise_is_standard_gumbel_and_uncorrelated_between_neighbours():
    """2**20 draws (4 heads x 512 queries x 512 keys): mean, variance, Kolmogorov-Smirnov
    distance and neighbour correlations within what that many i.i.d. Gumbel(0, 1) draws give
    (6 standard errors; KS at its 1% critical value)."""
    z = _noise()
    n = z.size
    assert n >= 1_000_000 and np.isfinite(z).all()
    euler, var = 0.5772156649, np.pi**2 / 6
    assert abs(z.mean() - euler) < 6 * np.sqrt(var / n)
    # the sample variance's standard error: sigma^2 sqrt((kurtosis - 1) / n), Gumbel's kurtosis 5.4
    assert abs(z.var() - var) < 6 * var * np.sqrt(4.4 / n)
    x = np.sort(z.ravel())
    cdf = np.exp(-np.exp(-x))
    ks = max((np.arange(1, n + 1) / n - cdf).max(), (cdf - np.arange(n) / n).max())
    assert ks < 1.63 / np.sqrt(n)
    bound = 6 / np.sqrt(n)
    for a, b in [(z[:, :, :-1], z[:, :, 1:]),  # (q, k) against (q, k + 1)
                 (z[:, :-1, :], z[:, 1:, :]),  # (q, k) against (q + 1, k)
                 (z[:, :-1, :-1], z[:, 1:, 1:]),  # (q, k) against (q + 1, k + 1)
                 (z[:-1], z[1:])]:  # neighbouring heads
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < bound


def test_the_seed_and_the_layer_change_the_noise_and_nothing_else_does():
    base = _noise(seed=0, layer=0, heads=2, n=256)
    assert np.array_equal(base, _noise(seed=0, layer=0, heads=2, n=256))
    for other in (_noise(seed=1, layer=0, heads=2, n=256), _noise(seed=-1, layer=0, heads=2, n=256),
                  _noise(seed=0, layer=1, heads=2, n=256)):
        assert (base != other).mean() > 0.999
        assert abs(np.corrcoef(base.ravel(), other.ravel())[0, 1]) < 6 / np.sqrt(base.size)
    # a logit's noise is its own, whatever else is asked for at the same time
    part = gumbel_noise(noise_stream(0, 0, 1, 2), mx.arange(100, 110), mx.array([[[3, 200, 7]]]))
    assert np.array_equal(np.array(part[0], np.float64), base[:, 100:110][:, :, [3, 200, 7]])


def test_the_scores_are_the_noisy_softmax_of_the_documented_noise(monkeypatch):
    """The fused pass adds ``gumbel_noise`` to every logit: the scores after a chunked prompt
    (a few queries a block) equal sum softmax((x + zeta) / tau) with that noise."""
    monkeypatch.setattr(keyformer_module, "SCORE_ELEMENTS", 600)
    n, tau, seed, layer = 90, 0.7, 5, 2
    k, v, q = synthetic(n, seed=9)
    cache = KeyformerCache(KVCacheConfig(options=KeyformerOptions(
        keyformer_budget=512, keyformer_tau=tau, keyformer_seed=seed)), layer=layer)
    for start in range(0, n, 40):
        feed(cache, k, v, q, start, min(n, start + 40))
    positions = mx.arange(n)
    zeta = gumbel_noise(noise_stream(seed, layer, 1, HKV * GROUP), positions, positions[None, None])
    x = (q * SCALE) @ mx.repeat(k, GROUP, axis=1).swapaxes(-1, -2)  # (1, Hq, n, n)
    x = mx.where(positions[None] <= positions[:, None], (x + zeta) / tau, -float("inf"))
    expected = mx.softmax(x, axis=-1).reshape(1, HKV, GROUP, n, n).sum(axis=(2, 3))[0]
    assert mx.allclose(cache.store.view("score")[0], expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("elements", [2**21, 600])
@pytest.mark.parametrize("chunk", [47, 13])
def test_the_scores_do_not_depend_on_the_block_size_or_the_chunking(chunk, elements, monkeypatch):
    """Noise on, evictions on: two block sizes and two prompt chunkings against one chunk in
    big blocks give the same scores (to float rounding: the sums run in another order) and
    the same kept tokens after the prompt and after every decode step."""
    n_prompt, n = 94, 130
    k, v, q = synthetic(n, seed=10)
    opts = KeyformerOptions(keyformer_budget=40, keyformer_n_sink=2, keyformer_seed=3, keyformer_tau=0.8)
    history = {}
    for key in ("reference", "other"):
        if key == "other":
            monkeypatch.setattr(keyformer_module, "SCORE_ELEMENTS", elements)
        cache = KeyformerCache(KVCacheConfig(options=opts), layer=1)
        seen = history[key] = []
        run(cache, k, v, q, n_prompt, chunk=n_prompt if key == "reference" else chunk,
            after_each=lambda c, _: seen.append((kept_sets(c), np.array(c.store.view("score")[0]))))
    assert len(history["reference"]) == len(history["other"]) == n - n_prompt + 1
    for (kept_a, score_a), (kept_b, score_b) in zip(history["reference"], history["other"]):
        assert kept_a == kept_b
        np.testing.assert_allclose(score_a, score_b, atol=1e-5, rtol=1e-5)


def test_the_uniform_is_never_0_or_1_and_the_noise_is_finite_at_the_hash_extremes():
    """u = float32(h | 1) / float32(2**32 / (1 - 2**-24)) for h = (row ^ column) * M, the
    divisor 2**32 (1 + 2**-23): h = 0 and h = 2**32 - 1 (the row ^ column that M maps there)
    give finite noise at Gumbel's two ends, -log(-log(u)) for u = 1 / divisor and
    u = 2**32 / divisor (float32 rounds 2**32 - 1 up to 2**32)."""
    m_inverse = pow(0x85EBCA6B, -1, 2**32)
    rows = mx.array([0, 0, 0, 7], mx.uint32)
    cols = mx.array([0, m_inverse * 0xFFFFFFFF % 2**32, m_inverse * 0x80000000 % 2**32, 7], mx.uint32)
    zeta = np.array(keyformer_module._zeta(rows, cols), np.float64)
    divisor = 2.0**32 * (1 + 2.0**-23)
    u = np.array([1, 2.0**32, 2.0**31, 1]) / divisor
    np.testing.assert_allclose(zeta, -np.log(-np.log(u)), rtol=1e-5)
    assert np.isfinite(zeta).all() and zeta.min() > -3.2 and zeta.max() < 16.7


def test_a_prompt_blocks_noise_is_one_fused_kernel_over_the_logits():
    """The noisy, scaled, masked logits of a prompt block come from one compiled kernel (MLX
    fuses at most 11 chained ops): no full-size intermediate besides the logits."""
    import io
    import re

    n = 64
    k, v, q = synthetic(n, seed=11)
    positions = mx.broadcast_to(mx.arange(n)[None, None], (1, HKV, n))
    mass = keyformer_module.gumbel_mass(q, k, SCALE, 0, positions, 0.7, noise_stream(0, 0, 1, HKV * GROUP, HKV))
    dot = io.StringIO()
    mx.export_to_dot(dot, mass)
    kernels = [name for name in re.findall(r'label ="([A-Za-z]+)', dot.getvalue()) if name.startswith("Compiled")]
    with_logs = [name for name in kernels if "Log" in name]
    assert len(with_logs) == 1 and "Select" in with_logs[0] and "Divide" in with_logs[0], kernels
