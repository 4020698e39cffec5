"""AMC: exact tier fractions at prefill, the tier treatments (uniform 8-bit at k_high=1,
all Low at zero fractions, error High < Mid < Low), the decode rule and the thresholds
(frozen, or the window's quantiles at gamma=1), saliency (alpha inert without query
saliency, query saliency ranks by attention, one variance weighs channels equally),
decode over the ragged tiers equal to attention over the reconstruction, memory."""

import math

import mlx.core as mx
import pytest

from test_kivi import feed
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.buffers import added_room
from veloxquant_mlx.cache.options import AMCOptions
from veloxquant_mlx.methods.amc.projection import pca_basis
from veloxquant_mlx.methods.amc.cache import AMCCache, low_rank, thresholds
from veloxquant_mlx.quant.packed import GROWTH_TOKENS
from veloxquant_mlx.quant.saliency import probe_attention_sums
from veloxquant_mlx.quant.token_rows import TokenGroups
from feeding import stored_decode_attention


def amc(**options):
    return AMCCache(KVCacheConfig(method="amc", options=AMCOptions(**options)), None, 0)


def kv(t, d=64, h=2, seed=0):
    k = mx.random.normal((1, h, t, d), key=mx.random.key(seed)) * (1 + mx.arange(d) % 3)
    v = mx.random.normal((1, h, t, d), key=mx.random.key(seed + 1))
    return k, v


def counts(cache):
    return [t.counts.tolist() if t.counts is not None else None for t in cache.store.k_tiers]


def rel(a, b):
    return float(mx.linalg.norm((a - b).flatten()) / mx.linalg.norm(b.flatten()))


@pytest.mark.parametrize("k_high, k_mid", [(0.2, 0.3), (0.25, 0.5), (0.0, 0.6), (0.5, 0.5)])
def test_prefill_tier_fractions_are_exact_per_head(k_high, k_mid):
    t = 203
    cache = amc(amc_k_high=k_high, amc_k_mid=k_mid)
    feed(cache, *kv(t), t)
    n_hi = math.floor(k_high * t + 0.5)
    n_mid = min(t - n_hi, math.floor(k_mid * t + 0.5))
    got = [c or [[0, 0]] for c in counts(cache)]
    assert got == [[[n_hi] * 2], [[n_mid] * 2], [[t - n_hi - n_mid] * 2]]
    flags = cache.store.flags.view()
    assert [int((flags[0, 0] == i).sum()) for i in range(3)] == [n_hi, n_mid, t - n_hi - n_mid]


def test_k_high_one_is_uniform_8_bit_quantization_and_zero_fractions_are_all_low():
    k, v = kv(100)
    high = amc(amc_k_high=1.0, amc_k_mid=0.0)
    feed(high, k, v, 100)
    codec = TokenGroups(8, 32)
    k_hat, v_hat = high.dequantized(mx.float32)
    assert mx.array_equal(k_hat, codec.decode(*codec.encode(k), mx.float32))
    assert mx.array_equal(v_hat, codec.decode(*codec.encode(v), mx.float32))
    low = amc(amc_k_high=0.0, amc_k_mid=0.0)
    feed(low, k, v, 100)
    assert counts(low)[:2] == [None, None] and counts(low)[2] == [[100, 100]]
    r = low_rank(64)
    mean, basis = (a.astype(mx.float16).astype(mx.float32) for a in pca_basis(k, r))
    coeff = (k - mean[:, :, None]) @ basis
    lo_codec = TokenGroups(2, math.gcd(32, r))
    want = lo_codec.decode(*lo_codec.encode(coeff), mx.float32) @ basis.swapaxes(-1, -2) + mean[:, :, None]
    assert mx.allclose(low.dequantized(mx.float32)[0], want, atol=1e-5)


def test_error_ordering_is_high_then_mid_then_low():
    k, v = kv(200, seed=3)
    errors = []
    for k_high, k_mid in ((1.0, 0.0), (0.0, 1.0), (0.0, 0.0)):
        cache = amc(amc_k_high=k_high, amc_k_mid=k_mid)
        feed(cache, k, v, 200)
        errors.append(rel(cache.dequantized(mx.float32)[0], k))
    assert errors[0] < errors[1] < errors[2], errors


def test_decode_tiers_follow_the_thresholds_which_stay_frozen_without_adaptation():
    k, v = kv(160, seed=5)
    cache = amc()
    feed(cache, k[:, :, :128], v[:, :, :128], 128)
    theta = cache.theta
    s = cache._intrinsic(k[:, :, 128:160])
    want = mx.where(s >= theta[..., :1], 0, mx.where(s >= theta[..., 1:], 1, 2)).astype(mx.uint8)
    for i in range(128, 160):  # one window: tiered at its flush, after the 32nd token
        assert cache.store.length == 128
        feed(cache, k[:, :, i : i + 1], v[:, :, i : i + 1], 1)
        assert mx.array_equal(cache.theta, theta)
    assert cache.store.length == 160
    assert mx.array_equal(cache.store.flags.view()[..., 128:], want)


def test_adaptive_thresholds_at_gamma_one_are_the_window_quantiles_and_move_by_gamma_otherwise():
    k, v = kv(164, seed=6)
    full, ema = amc(amc_adaptive_thresholds=True, amc_gamma=1.0, amc_threshold_window=16), \
        amc(amc_adaptive_thresholds=True, amc_gamma=0.25, amc_threshold_window=16)
    for cache in (full, ema):
        feed(cache, k[:, :, :100], v[:, :, :100], 100)
    theta = ema.theta
    for i in range(100, 164):
        for cache in (full, ema):
            feed(cache, k[:, :, i : i + 1], v[:, :, i : i + 1], 1)
        window = full._intrinsic(k[:, :, i - 15 : i + 1])
        theta = 0.75 * theta + 0.25 * thresholds(window, 0.2, 0.3)  # as each token moves them
        if (i + 1 - 100) % 32 == 0:  # a flush: the window's tokens moved them in order
            assert mx.allclose(full.theta, thresholds(window, 0.2, 0.3))
            assert mx.allclose(ema.theta, theta, rtol=1e-5)


def test_alpha_has_no_effect_without_query_saliency_and_query_saliency_ranks_by_attention():
    k, v = kv(96, seed=7)
    flags = []
    for alpha in (0.1, 0.9):
        cache = amc(amc_query_alpha=alpha)
        feed(cache, k, v, 96)
        flags.append(cache.store.flags.view())
    assert mx.array_equal(*flags)
    cache = amc(amc_use_query_saliency=True, amc_query_alpha=1.0, amc_threshold_window=8)
    q = mx.random.normal((1, 4, 96, 64), key=mx.random.key(8))
    cache.update_and_fetch(k, v)
    cache.attend(q, k, v, scale=0.125, mask="causal")
    mass = probe_attention_sums(q[:, :, 88:], k, 0.125, mx.arange(88, 96))  # (1, 2, 96)
    top = mx.sort(mx.argsort(-mass, axis=-1)[..., :19], axis=-1)  # round(0.2 * 96) = 19
    high = mx.sort(mx.argsort(-(cache.store.flags.view() == 0).astype(mx.int32), axis=-1)[..., :19], axis=-1)
    assert mx.array_equal(top, high)
    assert not mx.array_equal(cache.store.flags.view(), flags[0])


def test_one_calibrated_variance_weighs_every_channel_equally():
    k, v = kv(120, seed=9)
    cache = amc(amc_calib_variance=2.5)
    feed(cache, k, v, 120)
    s = ((k - k.mean(axis=2, keepdims=True)) ** 2).sum(-1)  # distance from the mean, unweighted
    top = mx.sort(mx.argsort(-s, axis=-1)[..., :24], axis=-1)
    high = mx.sort(mx.argsort(-(cache.store.flags.view() == 0).astype(mx.int32), axis=-1)[..., :24], axis=-1)
    assert mx.array_equal(top, high)
    whitened = amc()
    feed(whitened, k, v, 120)
    assert not mx.array_equal(whitened.store.flags.view(), cache.store.flags.view())


def test_decode_over_the_ragged_tiers_equals_attention_over_the_reconstruction():
    """Decode tokens land in different tiers per head, so the heads
    hold different numbers of rows per tier; each still attends to exactly its own."""
    k, v = kv(216, seed=10)
    cache = amc(amc_threshold_window=8)
    feed(cache, k[:, :, :120], v[:, :, :120], 64)
    feed(cache, k[:, :, 120:], v[:, :, 120:], 1)  # three windows' flushes
    assert cache.pending_k.length == 0
    assert any(c is not None and c[0][0] != c[0][1] for c in counts(cache))  # ragged
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(11))
    k_hat, v_hat = cache.dequantized(mx.float32)
    want = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=0.125, mask=None)
    assert mx.allclose(stored_decode_attention(cache, q, 0.125), want, atol=1e-5)
    assert rel(k_hat, k) < 0.5  # the tokens are in order, each near its original


def test_fractions_over_one_are_refused_by_the_spec_check():
    with pytest.raises(ValueError, match="amc_k_high \\+ amc_k_mid must not exceed 1"):
        KVCacheConfig(method="amc", options=AMCOptions(amc_k_high=0.7, amc_k_mid=0.4))


def _tier_rows(chunks: list[int]) -> int:
    """A tier's capacity after prompt chunks that bring it ``chunks`` rows a head: the rows
    plus one spare, grown by the geometric rule (``added_room``) when they do not fit."""
    capacity = held = 0
    for n in chunks:
        need = held + n + 1
        if need > capacity:
            capacity += added_room(capacity, need - capacity, GROWTH_TOKENS, None, geometric=True)
        held += n
    return capacity


def test_nbytes_after_a_long_prompt_is_the_card_formula_within_the_growth_step():
    t, d, h, g = 1000, 64, 2, 32
    cache = amc()
    feed(cache, *(x.astype(mx.float16) for x in kv(t, seed=12)), 500)  # 16-bit scales, as the card
    r = low_rank(d)
    per_tier = [d * 8 // 8 + 4 * d // g, d * 4 // 8 + 4 * d // g, r * 2 // 8 + 4 * r // math.gcd(g, r)]
    n = [math.floor(0.2 * 500 + 0.5) * 2, math.floor(0.3 * 500 + 0.5) * 2]
    n.append(t - n[0] - n[1])
    rows = [_tier_rows([x // 2] * 2) for x in n]  # each 500-token chunk brings half of them
    tiers = 2 * h * sum(c * x for c, x in zip(per_tier, rows)) + 3 * 2 * 4 * h  # K and V; int32 counts
    flags = cache.store.flags.nbytes  # one uint8 per token and head, and the room
    assert t * h <= flags < (t + GROWTH_TOKENS) * h
    side = 2 * h * (d + d * r) * 2 + 2 * h * d * 4 + h * 2 * 4 + h * 64 * 4  # bases, mu/var, theta, window
    assert cache.nbytes == tiers + flags + side
    card = t * h * 2 * (0.2 * per_tier[0] + 0.3 * per_tier[1] + 0.5 * per_tier[2])
    assert 0 <= tiers - card < 2 * h * sum(per_tier) * GROWTH_TOKENS


def test_a_saved_and_loaded_cache_continues_token_for_token(tmp_path):
    """The tiers' room for a decode step comes from host counters (each tier's bound and the
    rows it is expected to hold), and a token whose tier is full goes to the nearest one with
    room: a loaded cache that rebuilt those counters from the counts placed tokens elsewhere
    (logits 5e-4 apart 17 steps after loading, 0.026 after 36, conformance settings). Saved,
    the continuation is the same, bit for bit."""
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    import test_conformance as tc
    from conformance import PROMPT
    from tiny_models import prompt, tiny_model

    model = tiny_model("llama")
    tokens = prompt(PROMPT + 64)
    head, tail = tokens[: PROMPT + 4], tokens[PROMPT + 4:]
    cache = tc.compressing("amc", model)
    tc.drive(model, cache, head, decode=4)
    path = str(tmp_path / "amc.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    for t in tail:
        a = model(t.reshape(1, 1), cache=cache)[:, -1]
        b = model(t.reshape(1, 1), cache=loaded)[:, -1]
        assert mx.array_equal(a, b)
    assert [[t.bound for t in c.store.k_tiers] for c in cache] == [[t.bound for t in c.store.k_tiers] for c in loaded]
