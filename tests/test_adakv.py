"""AdaKV-proxy: the card's allocation invariants (on the host and the device), per-head widths
in bit planes, memory at 4k."""

import itertools
import random

import mlx.core as mx
import pytest

from test_kivi import feed
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.buffers import GrowingArray
from veloxquant_mlx.cache.options import AdaKVOptions
from veloxquant_mlx.methods.adakv.cache import AdaKVCache, allocate_bits
from veloxquant_mlx.methods.adakv.heads import PlaneStore, RecentNorms, greedy_on_device, spare_bits
from veloxquant_mlx.quant.packed import GROWTH_TOKENS
from feeding import stored_decode_attention

LEVELS = (2, 3, 4)


def adakv(residual=32, **options):
    config = KVCacheConfig(method="adakv", options=AdaKVOptions(**options), residual_window=residual)
    return AdaKVCache(config, None, 0)


def widths_of(cache, block=-1):
    return tuple(cache.store.block_widths()[0, block].tolist())


def error(importance, widths):
    return sum(i * 4.0 ** -b for i, b in zip(importance, widths))


# -- the allocation (card §3.2, §7) ----------------------------------------------------------
@pytest.mark.parametrize("levels", [(2, 3, 4), (1, 2, 3), (2, 4, 6)])
def test_allocation_is_the_brute_force_optimum_when_steps_are_equal(levels):
    """Equal steps and a convex error model: the greedy is the optimum of the budget."""
    rng = random.Random(sum(levels))
    for _ in range(60):
        h = rng.randint(1, 5)
        target = rng.uniform(levels[0], levels[2])
        imp = [rng.lognormvariate(0, 2) for _ in range(h)]
        got = allocate_bits(imp, levels, target)
        fits = [w for w in itertools.product(levels, repeat=h) if sum(w) <= target * h]
        best = min(fits, key=lambda w: error(imp, w))
        assert got == best, (imp, target, got, best)


def naive_greedy(imp, levels, target):
    """The card's greedy written out: all upgrades that fit, the best per bit, lower head on ties."""
    h = len(imp)
    widths = [levels[0]] * h
    while True:
        options = []
        for i in range(h):
            at = levels.index(widths[i])
            if at < 2 and sum(widths) - widths[i] + levels[at + 1] <= levels[0] * h + int((target - levels[0]) * h + 1e-9):
                gain = imp[i] * (4.0 ** -widths[i] - 4.0 ** -levels[at + 1]) / (levels[at + 1] - widths[i])
                options.append((-gain, i, levels[at + 1]))
        if not options:
            return tuple(widths)
        _, i, b = min(options)
        widths[i] = b


@pytest.mark.parametrize("levels", [(2, 3, 8), (1, 4, 5), (2, 3, 4), (1, 2, 8)])
def test_allocation_is_the_cards_greedy_and_meets_the_budget(levels):
    lo, _, hi = levels
    rng = random.Random(levels[2] * 7 + levels[1])
    for _ in range(100):
        h = rng.randint(1, 8)
        target = rng.choice([rng.uniform(lo, hi), lo, hi, (lo + hi) / 2])
        imp = [rng.lognormvariate(0, 2) for _ in range(h)]
        got = allocate_bits(imp, levels, target)
        assert got == naive_greedy(imp, levels, target)
        assert all(b in levels for b in got)
        assert sum(got) <= target * h + 1e-9
        assert sum(got) / h > target - (hi - lo) / h or all(b == hi for b in got)
        for a, b in itertools.permutations(range(h), 2):
            if imp[a] > imp[b]:
                assert got[a] >= got[b], (imp, got)  # more important heads never get fewer bits


def test_budget_is_never_exceeded_where_rounding_would():
    """3 heads at 2.5 bits: round(0.5 * 3) = 2 extra bits would give a mean of 2.67."""
    assert sum(allocate_bits([1.0, 2.0, 3.0], LEVELS, 2.5)) == 7
    assert sum(allocate_bits([1.0] * 10, LEVELS, 2.3)) == 23  # 0.3 * 10 is 2.9999999999999996


def test_target_at_the_ends_gives_uniform_widths():
    imp = [5.0, 0.1, 3.0, 0.0]
    assert allocate_bits(imp, LEVELS, 2) == (2, 2, 2, 2)
    assert allocate_bits(imp, LEVELS, 4) == (4, 4, 4, 4)


@pytest.mark.parametrize("value", [1.0, 0.0])
def test_equal_importances_differ_by_one_level_at_most_lower_heads_first(value):
    for h, target, expected in [(4, 2.5, (3, 3, 2, 2)), (4, 3.5, (4, 4, 3, 3)), (3, 3.0, (3, 3, 3))]:
        assert allocate_bits([value] * h, LEVELS, target) == expected


def test_ties_between_heads_go_to_the_lower_index():
    # Two extra bits: the second upgrade is a tie, mid->hi of the head with I = 4 against
    # lo->mid of the head with I = 1 (3/256 * 4 = 3/64 * 1).
    assert allocate_bits([0.0, 4.0, 1.0], LEVELS, 8 / 3) == (2, 4, 2)
    assert allocate_bits([0.0, 1.0, 4.0], LEVELS, 8 / 3) == (2, 3, 3)
    assert allocate_bits([1.0, 4.0, 0.0], LEVELS, 8 / 3) == (3, 3, 2)


def test_nan_and_negative_importance_count_as_zero():
    # Head 1 takes two bits; heads 0 and 2 then tie at zero: the lower index wins.
    assert allocate_bits([float("nan"), 1.0, -3.0], LEVELS, 3.0) == (3, 4, 2)
    assert allocate_bits([0.0, 1.0, float("nan")], LEVELS, 3.0) == (3, 4, 2)


# -- the schedule (card §3.5, §7) ---------------------------------------------------------------
def norm_controlled(h, n, d, noisy_head, start, stop, seed):
    """Keys of constant norm, except ``noisy_head`` over tokens [start, stop)."""
    x = mx.random.normal((1, h, n, d), key=mx.random.key(seed))
    x = x / mx.linalg.norm(x, axis=-1, keepdims=True)
    t = mx.arange(n)[None, None, :, None]
    noisy = (mx.arange(h)[None, :, None, None] == noisy_head) & (t >= start) & (t < stop)
    return mx.where(noisy, x * (1 + 3 * mx.random.uniform(shape=(1, h, n, 1), key=mx.random.key(seed + 1))), x)


def test_each_flush_uses_the_estimate_of_the_last_scheduled_update():
    """Blocks of 32, no window, W = 8, every 12 steps: the flush at token 64 uses the
    estimate after step 24 (tokens 48..55, head 2 noisy), not the tokens after it (56..63,
    head 3 noisy)."""
    h, d = 4, 64
    before, after = norm_controlled(h, 64, d, 2, 48, 56, seed=1), norm_controlled(h, 64, d, 3, 56, 64, seed=2)
    keys = mx.where(mx.arange(64)[None, None, :, None] >= 56, after, before)
    values = mx.random.normal((1, h, 64, d))
    cache = adakv(residual=0, adakv_update_interval=12, adakv_obs_window=8)
    feed(cache, keys[:, :, :32], values[:, :, :32], 32)
    assert cache.updates == 1 and cache.store.stored == 32
    feed(cache, keys[:, :, 32:63], values[:, :, 32:63], 1)
    assert cache.store.length == 63 and cache.store.k_win.length == 31  # nothing flushed yet
    assert cache.updates == 1 + 2 and cache.since_update == 31 - 24  # steps 12 and 24
    feed(cache, keys[:, :, 63:], values[:, :, 63:], 1)
    assert cache.updates == 3 and cache.store.k_win.length == 0
    assert widths_of(cache) == (2, 2, 4, 2)  # head 2 at hi, from tokens 48..55
    assert cache.store.stored == 64
    # With every step an update, the same flush would see head 3's noise instead.
    every = adakv(residual=0, adakv_update_interval=1, adakv_obs_window=8)
    feed(every, keys[:, :, :32], values[:, :, :32], 32)
    feed(every, keys[:, :, 32:], values[:, :, 32:], 1)
    assert every.updates == 1 + 32 and widths_of(every) == (2, 2, 2, 4)


def test_the_importance_is_the_variance_of_the_newest_key_norms():
    keys = mx.random.normal((2, 3, 50, 16), key=mx.random.key(11)) * mx.arange(1, 51)[None, None, :, None]
    norms = mx.linalg.norm(keys, axis=-1)
    ring = RecentNorms(window=8)
    assert ring.variance() is None
    ring.observe(keys[:, :, :1])
    assert mx.array_equal(ring.variance(), mx.zeros((2, 3)))  # one key: no variance
    for stop, chunk in ((5, 4), (11, 6), (12, 1), (13, 1), (50, 37)):  # filling, wrapping, a long chunk
        ring.observe(keys[:, :, stop - chunk : stop])
        expected = mx.var(norms[:, :, max(0, stop - 8) : stop], axis=-1)  # each sequence its own
        assert mx.allclose(ring.variance(), expected, rtol=1e-5), stop


def test_every_prefill_chunk_makes_an_estimate():
    h, d = 4, 64
    cache = adakv(residual=0, adakv_update_interval=1000, adakv_obs_window=16)
    values = mx.random.normal((1, h, 128, d))
    feed(cache, norm_controlled(h, 64, d, 0, 0, 64, seed=12), values[:, :, :64], 64)
    feed(cache, norm_controlled(h, 64, d, 1, 0, 64, seed=13), values[:, :, 64:], 64)
    assert cache.updates == 2 and [widths_of(cache, b) for b in range(4)] == [(4, 2, 2, 2)] * 2 + [(2, 4, 2, 2)] * 2


def test_a_new_allocation_applies_to_new_blocks_and_stored_tokens_keep_their_widths():
    h, d = 4, 64
    first = norm_controlled(h, 64, d, 0, 0, 64, seed=3)
    second = norm_controlled(h, 64, d, 1, 0, 64, seed=4)
    values = mx.random.normal((1, h, 128, d))
    cache = adakv(residual=0, adakv_obs_window=16)
    feed(cache, first, values[:, :, :64], 64)
    assert widths_of(cache) == (4, 2, 2, 2) and cache.store.stored == 64
    kept = {n: mx.array(a.view()) for n, a in cache.store.arrays().items() if n not in ("k_win", "v_win")}
    old_k, old_v = cache.dequantized(mx.float32)
    feed(cache, second, values[:, :, 64:], 1)
    assert [widths_of(cache, b) for b in range(4)] == [(4, 2, 2, 2)] * 2 + [(2, 4, 2, 2)] * 2
    now = {n: cache.store.arrays()[n] for n in kept}
    for n, x in kept.items():  # the first two blocks, bit-identical: never re-quantized
        buf = now[n]
        first_two = buf.buffer[(slice(None),) * buf.axis + (slice(0, 2),)] if buf.axis >= 0 else buf.buffer[..., :2]
        assert mx.array_equal(first_two, x), n
    new_k, new_v = cache.dequantized(mx.float32)
    assert mx.array_equal(new_k[:, :, :64], old_k) and mx.array_equal(new_v[:, :, :64], old_v)


def test_the_device_greedy_is_the_cards():
    """``greedy_on_device`` against ``allocate_bits`` on random importances (gains apart by
    more than float32's rounding), zeros and NaN included, at several levels and targets."""
    rnd = random.Random(5)
    for levels in ((2, 3, 4), (2, 4, 8), (1, 2, 3)):
        for h in (1, 3, 4, 8):
            for _ in range(12):
                target = rnd.uniform(levels[0], levels[2])
                imp = [rnd.choice([0.0, float("nan"), rnd.lognormvariate(0, 2)]) if rnd.random() < 0.2
                       else rnd.lognormvariate(0, 2) for _ in range(h)]
                device = greedy_on_device(levels, spare_bits(levels, target, h), h)(mx.array(imp))
                assert tuple(device.tolist()) == allocate_bits(imp, levels, target), (levels, target, imp)

def test_blocks_grow_their_buffers_in_lockstep():
    h, d = 4, 64
    keys = norm_controlled(h, 320, d, 2, 0, 320, seed=5)
    cache = adakv(residual=0)
    feed(cache, keys[:, :, :100], keys[:, :, :100], 100)
    feed(cache, keys[:, :, 100:], keys[:, :, 100:], 1)
    assert cache.store.block_widths()[0].tolist() == [[2, 2, 4, 2]] * 10  # 10 flushes, one allocation
    blocks = 2 * GROWTH_TOKENS // 32  # grown twice by 256 tokens
    assert all(a.capacity == blocks for n, a in cache.store.arrays().items() if n not in ("k_win", "v_win"))
    assert cache.store.k_planes.buffer.shape[1] == 2 * h + 2  # lo H + spare planes a token

# -- attention, storage, memory ---------------------------------------------------------------
def test_decode_attention_over_mixed_blocks_matches_the_dequantized_reference():
    """GQA 2:1, blocks at different allocations of 2/3/4 bits, and the window."""
    h, d = 4, 64
    mx.random.seed(6)
    cache = adakv(residual=40, adakv_target_avg_bits=3.0, adakv_obs_window=16)
    for seed, noisy in ((7, 0), (8, 3), (9, 1)):
        keys = norm_controlled(h, 70, d, noisy, 0, 70, seed)
        feed(cache, keys, mx.random.normal((1, h, 70, d)), 1 if noisy == 1 else 70)
    assert len({tuple(w) for w in cache.store.block_widths()[0].tolist()}) >= 3
    assert cache.store.k_win.length == 40 + (210 - 40) % 32
    q = mx.random.normal((1, 2 * h, 1, d))
    out = stored_decode_attention(cache, q, d**-0.5)
    k_hat, v_hat = cache.dequantized(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=d**-0.5)
    assert mx.allclose(out, ref, atol=1e-5, rtol=1e-5)

def test_quantization_error_falls_with_each_heads_width():
    h, d = 3, 64
    keys = mx.random.normal((1, h, 256, d), key=mx.random.key(10))
    store = PlaneStore(LEVELS, 3.0, block=32, group=32, widths=lambda: mx.array([2, 3, 4]))
    store.commit(keys, keys)
    k_hat, v_hat = store.history(mx.float32)
    k_err = [float(mx.abs(k_hat - keys)[:, i].mean()) for i in range(h)]
    v_err = [float(mx.abs(v_hat - keys)[:, i].mean()) for i in range(h)]
    assert k_err[0] > 1.8 * k_err[1] > 3.2 * k_err[2] and v_err[0] > 1.8 * v_err[1] > 3.2 * v_err[2]


def test_memory_at_4k_is_the_cards_formula_within_the_growth_step():
    """Per token, KV head and K or V: b_h d/8 + 4 d/G bytes at the token's own width."""
    h, d, g, r = 4, 128, 32, 128  # the newest 128 to 159 tokens stay exact
    keys = mx.random.normal((1, h, 4096 + 40, d)).astype(mx.float16)
    keys = keys * (1 + mx.arange(4096 + 40)[None, None, :, None] % 7 * (mx.arange(h) == 1)[None, :, None, None])
    cache = adakv(residual=r, adakv_group_size=g)
    feed(cache, keys[:, :, :4096], keys[:, :, :4096], 2048)
    feed(cache, keys[:, :, 4096:], keys[:, :, 4096:], 1)
    widths = cache.store.block_widths()[0].tolist()
    assert len(widths) == (4096 + 40 - r - 8) // g == 125  # 125 blocks of 32
    assert all(sum(w) == 2.5 * h for w in widths)  # the budget, spent
    formula = sum(2 * g * sum(b * d / 8 + 4 * d / g for b in w) for w in widths)
    s = cache.store
    packed = sum(a.view().nbytes for a in (s.k_planes, s.v_planes, s.k_scales, s.k_min, s.v_scales, s.v_min))
    assert packed == formula == 4000 * 2 * h * (2.5 * d / 8 + 4 * d / g)  # the card's 56 B a head, K and V each
    map_bytes = sum(x.view().nbytes for x in (*s.sources, *s.weights))
    assert map_bytes == 125 * h * 4 * 8  # the plane map: 8 bytes a head and bit a block
    room = sum(a.nbytes for n, a in s.arrays().items() if n not in ("k_win", "v_win")) - packed - map_bytes
    assert 0 <= room <= GROWTH_TOKENS / g * (2 * h * g * (2.5 * d / 8 + 4 * d / g) + h * 4 * 8)  # one growth step
    assert cache.store.k_win.capacity == r + g and cache.store.k_win.length == r + 8

def test_a_target_at_lo_stores_lo_planes_a_head():
    h, d = 2, 64
    keys = mx.random.normal((1, h, 80, d))
    uniform = adakv(residual=32, adakv_target_avg_bits=2.0)
    feed(uniform, keys, keys, 80)
    assert uniform.store.k_planes.buffer.shape[1] == 2 * h and widths_of(uniform) == (2, 2)
    assert uniform.store.stored == 32 and uniform.store.k_win.length == 48

def test_group_size_must_divide_head_dim():
    cache = adakv(residual=64, adakv_group_size=64)
    keys = mx.zeros((1, 2, 4, 32))
    with pytest.raises(ValueError, match="adakv_group_size=64 must divide head_dim=32"):
        cache.update_and_fetch(keys, keys)


@pytest.mark.parametrize("t, chunk", [(30, 30), (100, 100), (100, 1), (333, 64), (333, 1)])
def test_the_newest_residual_window_tokens_stay_exact(t, chunk):
    """R = 40 (not a multiple of the group): keys and values of the newest 40 tokens are
    the model's own; older ones flush in groups of 32, never more than 71 wait."""
    keys = mx.random.normal((1, 2, t, 64), key=mx.random.key(t)).astype(mx.float16)
    values = mx.random.normal((1, 2, t, 64), key=mx.random.key(t + 1)).astype(mx.float16)
    cache = adakv(residual=40)
    feed(cache, keys, values, chunk)
    held = cache.store.k_win.length
    assert min(t, 40) <= held < 72 and (t - held) % 32 == 0 and cache.stored_length == t
    k_hat, v_hat = cache.dequantized(mx.float16)
    assert k_hat.shape == keys.shape and v_hat.shape == values.shape
    assert mx.array_equal(k_hat[:, :, t - held :], keys[:, :, t - held :])
    assert mx.array_equal(v_hat[:, :, t - held :], values[:, :, t - held :])
    assert held == t or not mx.array_equal(k_hat[:, :, : t - held], keys[:, :, : t - held])


def test_a_decode_step_flushes_from_the_window_in_place():
    keys = mx.random.normal((1, 2, 72, 64), key=mx.random.key(14))
    cache = adakv(residual=40)
    feed(cache, keys[:, :, :71], keys[:, :, :71], 71)
    buffer = cache.store.k_win.buffer
    assert cache.store.k_win.capacity == 72 and cache.store.k_win.length == 71
    feed(cache, keys[:, :, 71:], keys[:, :, 71:], 1)  # the 72nd token: the oldest 32 flush
    assert cache.store.k_win.buffer is buffer and cache.store.k_win.length == 40  # same buffer, moved rows
    assert mx.array_equal(cache.store.k_win.view(), keys[:, :, 32:])
