"""AdaKV-proxy: the card's allocation invariants, epochs of per-head widths, memory at 4k."""

import itertools
import random

import mlx.core as mx
import pytest

from test_kivi import feed
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.buffers import GrowingArray
from veloxquant_mlx.cache.options import AdaKVOptions
from veloxquant_mlx.methods.adakv.cache import AdaKVCache, allocate_bits
from veloxquant_mlx.methods.adakv.heads import AffineCodecs, HeadWiseStore, RecentNorms
from veloxquant_mlx.quant.packed import GROWTH_TOKENS, AffineLayout
from feeding import stored_decode_attention

LEVELS = (2, 3, 4)


def adakv(residual=32, **options):
    config = KVCacheConfig(method="adakv", options=AdaKVOptions(**options), residual_window=residual)
    return AdaKVCache(config, None, 0)


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
    assert cache.updates == 1 and len(cache.store.epochs) == 1
    feed(cache, keys[:, :, 32:63], values[:, :, 32:63], 1)
    assert cache.store.length == 63 and cache.store.k_win.length == 31  # nothing flushed yet
    assert cache.updates == 1 + 2 and cache.since_update == 31 - 24  # steps 12 and 24
    feed(cache, keys[:, :, 63:], values[:, :, 63:], 1)
    assert cache.updates == 3 and cache.store.k_win.length == 0
    assert cache.store.epochs[-1].widths == (2, 2, 4, 2)  # head 2 at hi, from tokens 48..55
    assert cache.store.epochs[-1].count == 32
    # With every step an update, the same flush would see head 3's noise instead.
    every = adakv(residual=0, adakv_update_interval=1, adakv_obs_window=8)
    feed(every, keys[:, :, :32], values[:, :, :32], 32)
    feed(every, keys[:, :, 32:], values[:, :, 32:], 1)
    assert every.updates == 1 + 32 and every.store.epochs[-1].widths == (2, 2, 2, 4)


def test_the_importance_is_the_variance_of_the_newest_key_norms():
    keys = mx.random.normal((2, 3, 50, 16), key=mx.random.key(11)) * mx.arange(1, 51)[None, None, :, None]
    norms = mx.linalg.norm(keys, axis=-1)
    ring = RecentNorms(window=8)
    assert ring.variance() is None
    ring.observe(keys[:, :, :1])
    assert mx.array_equal(ring.variance(), mx.zeros((3,)))  # one key: no variance
    for stop, chunk in ((5, 4), (11, 6), (12, 1), (13, 1), (50, 37)):  # filling, wrapping, a long chunk
        ring.observe(keys[:, :, stop - chunk : stop])
        expected = mx.var(norms[:, :, max(0, stop - 8) : stop], axis=-1).mean(axis=0)
        assert mx.allclose(ring.variance(), expected, rtol=1e-5), stop


def test_every_prefill_chunk_makes_an_estimate():
    h, d = 4, 64
    cache = adakv(residual=0, adakv_update_interval=1000, adakv_obs_window=16)
    values = mx.random.normal((1, h, 128, d))
    feed(cache, norm_controlled(h, 64, d, 0, 0, 64, seed=12), values[:, :, :64], 64)
    feed(cache, norm_controlled(h, 64, d, 1, 0, 64, seed=13), values[:, :, 64:], 64)
    assert cache.updates == 2 and [e.widths for e in cache.store.epochs] == [(4, 2, 2, 2), (2, 4, 2, 2)]


def test_a_new_allocation_opens_an_epoch_and_stored_tokens_keep_their_widths():
    h, d = 4, 64
    first = norm_controlled(h, 64, d, 0, 0, 64, seed=3)
    second = norm_controlled(h, 64, d, 1, 0, 64, seed=4)
    values = mx.random.normal((1, h, 128, d))
    cache = adakv(residual=0, adakv_obs_window=16)
    feed(cache, first, values[:, :, :64], 64)
    e0 = cache.store.epochs[0]
    assert e0.widths == (4, 2, 2, 2) and e0.count == 64
    saved = {n: mx.array(a.view()) for n, a in e0.arrays("e0").items() if isinstance(a, GrowingArray)}
    old_k, old_v = cache.dequantized(mx.float32)
    feed(cache, second, values[:, :, 64:], 1)
    assert [e.widths for e in cache.store.epochs] == [(4, 2, 2, 2), (2, 4, 2, 2)]
    after = {n: a.view() for n, a in cache.store.epochs[0].arrays("e0").items() if isinstance(a, GrowingArray)}
    assert len(saved) == 12  # codes, scales, biases of K and V, at two widths
    assert all(mx.array_equal(saved[n], after[n]) for n in saved)  # bit-identical, never re-quantized
    new_k, new_v = cache.dequantized(mx.float32)
    assert mx.array_equal(new_k[:, :, :64], old_k) and mx.array_equal(new_v[:, :, :64], old_v)


def test_flushes_under_one_allocation_extend_one_epoch_in_place():
    h, d = 4, 64
    keys = norm_controlled(h, 320, d, 2, 0, 320, seed=5)
    cache = adakv(residual=0)
    feed(cache, keys[:, :, :100], keys[:, :, :100], 100)
    feed(cache, keys[:, :, 100:], keys[:, :, 100:], 1)
    assert [e.widths for e in cache.store.epochs] == [(2, 2, 4, 2)]  # 10 flushes, one epoch
    assert cache.store.epochs[0].count == 320
    hi = cache.store.epochs[0].groups[-1]
    assert hi.bits == 4 and hi.keys.codes.capacity == 2 * 256 * 4 // 32  # grown twice by 256 tokens
    parts = cache.store.decode_parts(mx.zeros((0,)))
    assert len(parts) == 2  # one part per width; the window is empty at 320 tokens


# -- attention, storage, memory ---------------------------------------------------------------
def test_decode_attention_over_epochs_matches_the_dequantized_reference():
    """GQA 2:1, epochs of 2/3/4-bit parts holding some heads each, and the window."""
    h, d = 4, 64
    mx.random.seed(6)
    cache = adakv(residual=40, adakv_target_avg_bits=3.0, adakv_obs_window=16)
    for seed, noisy in ((7, 0), (8, 3), (9, 1)):
        keys = norm_controlled(h, 70, d, noisy, 0, 70, seed)
        feed(cache, keys, mx.random.normal((1, h, 70, d)), 1 if noisy == 1 else 70)
    assert len(cache.store.epochs) >= 3 and cache.store.k_win.length == 40 + (210 - 40) % 32
    parts = cache.store.decode_parts(mx.zeros((0,)))
    served = {p.keys.bits: p.affine for p in parts[:-1]}  # the kernels read 2 and 4 bits, not 3
    assert served == {2: True, 3: False, 4: True} and all(isinstance(p.keys, AffineLayout) for p in parts[:-1])
    q = mx.random.normal((1, 2 * h, 1, d))
    out = stored_decode_attention(cache, q, d**-0.5)
    k_hat, v_hat = cache.dequantized(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=d**-0.5)
    assert mx.allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_quantization_error_falls_with_each_heads_width():
    h, d = 3, 64
    keys = mx.random.normal((1, h, 256, d), key=mx.random.key(10))
    store = HeadWiseStore(AffineCodecs(32), block=32, widths=lambda: (2, 3, 4))
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
    formula = room = 0
    for e in cache.store.epochs:
        formula += 2 * e.count * sum(b * d / 8 + 4 * d / g for b in e.widths)
        room += 2 * GROWTH_TOKENS * sum(b * d / 8 + 4 * d / g for b in e.widths)
    assert sum(e.count for e in cache.store.epochs) == 4096 + 40 - r - 8 == 4000  # 125 groups of 32
    assert all(sum(e.widths) == 2.5 * h for e in cache.store.epochs)  # the budget, spent
    window = 2 * cache.store.k_win.capacity * h * d * 2
    side = sum(a.nbytes for a in (cache.norms.norms, cache.importance))
    side += sum(grp.heads.nbytes for e in cache.store.epochs for grp in e.groups if grp.heads is not None)
    packed = cache.nbytes - window - side
    assert formula <= packed <= formula + room
    assert cache.store.k_win.capacity == r + g and cache.store.k_win.length == r + 8
    assert formula == 4000 * 2 * h * (2.5 * d / 8 + 4 * d / g)  # the card's 56 B a head, K and V each


def test_parts_hold_their_heads_and_the_window_rides_a_uniform_epoch():
    h, d = 2, 64
    keys = mx.random.normal((1, h, 80, d))
    uniform = adakv(residual=32, adakv_target_avg_bits=2.0)
    feed(uniform, keys, keys, 80)
    parts = uniform.store.decode_parts(mx.zeros((0,)))
    assert len(parts) == 1 and parts[0].heads is None and parts[0].keys.count == 32
    assert parts[0].key_tail.shape[2] == parts[0].value_tail.shape[2] == 48
    mixed = adakv(residual=32)
    feed(mixed, keys, keys, 80)
    parts = mixed.store.decode_parts(mx.zeros((0,)))
    assert [None if p.heads is None else p.heads.tolist() for p in parts] in ([[1], [0], None], [[0], [1], None])
    assert parts[-1].keys.count == 0 and parts[-1].keys.bits == 2  # the window, kernel-readable


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
