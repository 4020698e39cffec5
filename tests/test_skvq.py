"""SKVQ: a channel order undone on read, a searched clip ratio, exact sinks and window,
per-token codes that never change, attention in the reordered space, real memory."""

import functools

import mlx.core as mx
import pytest

from feeding import feed_chunks, stored_decode_attention
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import SKVQOptions
from veloxquant_mlx.kernels.decode import DecodePart
from veloxquant_mlx.methods.skvq import SKVQCache
from veloxquant_mlx.quant.affine import quantize_per_token
from veloxquant_mlx.methods.skvq.clip import CLIP_GRID, clip_errors, quantize_clipped, search_clip
from veloxquant_mlx.quant.packed import GROWTH_TOKENS, AffineLayout
from veloxquant_mlx.methods.skvq.sliding_store import FLUSH
from veloxquant_mlx.methods.skvq.reorder import RangeOrder, inverse, is_permutation, permute, permute_heads
from veloxquant_mlx.quant.token_rows import TokenRows, dequantize_rows


# queries from MLX's global generator, as these tests always drew them
feed = functools.partial(feed_chunks, seed=None)


def skvq(**kw):
    return SKVQCache(KVCacheConfig(method="skvq", options=SKVQOptions(**kw)), None, 0)


def spread_channels(shape, seed, span=100.0, rotary=False):
    """Normal rows whose channels' scales span ``span``x, in a shuffled channel order;
    ``rotary``: channels i and i + d/2 share a scale, as post-RoPE key pairs do."""
    x = mx.random.normal(shape, key=mx.random.key(seed))
    d = shape[-1] // 2 if rotary else shape[-1]
    scales = mx.power(span, mx.arange(d) / (d - 1))[mx.random.permutation(d, key=mx.random.key(seed + 1))]
    return x * (mx.concatenate([scales, scales]) if rotary else scales)


def rel_err(x_hat, x):
    return float(mx.linalg.norm((x_hat - x).flatten()) / mx.linalg.norm(x.flatten()))


# -- the channel order -------------------------------------------------------------------------
@pytest.mark.parametrize("pairs", [None, "half", "adjacent"])
def test_the_order_is_a_permutation_and_its_inverse_restores_rows_bit_for_bit(pairs):
    x = spread_channels((2, 3, 50, 64), seed=1).astype(mx.float16)
    perm = RangeOrder(pairs).fit(x)
    assert perm.shape == (2, 3, 1, 64) and is_permutation(perm)
    assert not mx.array_equal(perm, mx.broadcast_to(mx.arange(64), perm.shape))
    moved = permute(x, perm)
    assert not mx.array_equal(moved, x)
    assert mx.array_equal(permute(moved, inverse(perm)), x)  # bit-exact round trip
    assert mx.array_equal(moved[1, 2, :, 5], x[1, 2, :, int(perm[1, 2, 0, 5])])
    q = mx.random.normal((2, 6, 1, 64))  # GQA: query head h reads KV head h // 2
    assert mx.array_equal(permute_heads(q, perm)[:, 4], permute(q[:, 4:5], perm[:, 2:3])[:, 0])
    assert mx.array_equal(permute_heads(permute_heads(q, perm), inverse(perm)), q)


def test_channels_are_sorted_by_range_and_rotary_pairs_share_a_group():
    x = spread_channels((1, 2, 80, 64), seed=2)
    spread = lambda y: y.max(axis=2) - y.min(axis=2)  # noqa: E731
    r = spread(permute(x, RangeOrder().fit(x)))
    assert mx.all(r[..., 1:] >= r[..., :-1])
    for pairs, partner in (("half", lambda c: (c + 32) % 64), ("adjacent", lambda c: c ^ 1)):
        perm = RangeOrder(pairs).fit(x)
        first, second = perm[..., 0::2], perm[..., 1::2]  # positions 2j, 2j+1: one group
        assert mx.array_equal(second, partner(first).astype(mx.uint32))
        y = permute(x, perm).reshape(1, 2, 80, 32, 2)  # both channels of a pair, all tokens
        pair_spread = y.max(axis=(2, 4)) - y.min(axis=(2, 4))
        assert mx.all(pair_spread[..., 1:] >= pair_spread[..., :-1])


def test_reordering_lowers_the_error_when_channel_scales_span_100x():
    keys = spread_channels((1, 2, 400, 128), seed=3, rotary=True)
    values = spread_channels((1, 2, 400, 128), seed=4)
    scale = lambda x: mx.abs(x).mean(axis=2, keepdims=True)  # noqa: E731 - each channel's own
    errors = {}
    for reorder in (True, False):
        cache = skvq(skvq_reorder=reorder, skvq_clip_search=False, skvq_window=16, skvq_n_sink=0)
        feed(cache, keys, values, 400)
        k_hat, v_hat = cache.dequantized(mx.float32)
        errors[reorder] = [rel_err(k_hat, keys), rel_err(v_hat, values),  # and relative to each channel:
                           rel_err(k_hat / scale(keys), keys / scale(keys)),
                           rel_err(v_hat / scale(values), values / scale(values))]
    assert all(a <= 0.9 * b for a, b in zip(errors[True][:2], errors[False][:2]))
    assert all(a <= 0.2 * b for a, b in zip(errors[True][2:], errors[False][2:]))


def _lossless_rows(seed, n_sink=4, n_q=60, window=24, d=64, levels=255):
    """Sinks and a window of normal rows, in between rows of 0 and ``levels`` only: exact at
    8 bits in groups of any channels (a group is {0}, {levels} or {0, levels}: scale 1 or
    none). The window's channel extents differ, so the fitted order is not the identity."""
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    binary = levels * (mx.random.uniform(shape=(1, 2, n_q, d), key=k1) < 0.5)
    extent = levels * (1 + mx.random.uniform(shape=(1, 2, 1, d), key=k2) * 4)
    win = mx.random.uniform(shape=(1, 2, window, d), key=k3) * extent
    return mx.concatenate([mx.random.normal((1, 2, n_sink, d), key=k2), binary, win], axis=2)


def test_attention_in_the_reordered_space_equals_attention_without_reordering_when_lossless():
    keys, values = _lossless_rows(4), _lossless_rows(5)
    q = mx.random.normal((1, 6, 1, 64), key=mx.random.key(6))  # GQA 3:1
    outs = {}
    for reorder in (True, False):
        cache = skvq(skvq_reorder=reorder, skvq_clip_search=False, skvq_bits_key=8, skvq_bits_value=8,
                     skvq_window=24, skvq_n_sink=4)
        feed(cache, keys, values, 88, gqa=3)
        assert cache.n_quantized == 60
        k_hat, v_hat = cache.dequantized(mx.float32)
        assert mx.array_equal(k_hat, keys) and mx.array_equal(v_hat, values)  # order undone on read
        if reorder:
            s = cache.store
            identity = mx.broadcast_to(mx.arange(64), s.perm_k.shape)
            assert not mx.array_equal(s.perm_k, identity) and not mx.array_equal(s.perm_v, identity)
            assert not mx.array_equal(s.k_res, keys[:, :, -24:])  # stored reordered
        outs[reorder] = stored_decode_attention(cache, q, 64**-0.5)
    ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=64**-0.5)
    assert mx.allclose(outs[True], outs[False], atol=1e-5, rtol=1e-5)
    assert mx.allclose(outs[True], ref, atol=1e-5, rtol=1e-5)


# -- clipping ------------------------------------------------------------------------------------
def _with_outliers(shape, seed, every=32, size=4.0):
    """Uniform [-1, 1] rows with one element of +-``size`` in each run of ``every``."""
    k1, k2 = mx.random.split(mx.random.key(seed))
    x = mx.random.uniform(-1, 1, shape, key=k1)
    spike = (mx.arange(shape[-1]) % every) == (mx.random.randint(0, every, shape, key=k2))
    return mx.where(spike, size * mx.sign(x), x)


def test_the_clip_search_beats_no_clipping_on_outliers():
    x = _with_outliers((1, 2, 200, 64), seed=7)
    errors = clip_errors(x, 32, 2)
    alpha = search_clip(x, 32, 2)
    grid = mx.array(CLIP_GRID)
    assert mx.array_equal(alpha, grid[mx.argmin(errors, axis=0)])  # the brute-force optimum
    assert mx.all(alpha < 1.0)
    chosen = mx.take_along_axis(errors, mx.argmin(errors, axis=0)[None], axis=0)[0]
    assert mx.all(chosen < 0.9 * errors[0])  # errors[0]: alpha = 1.0
    # Through the cache: the searched ratio against clip_alpha = 1.0 on the quantized tokens.
    err = {}
    for search in (True, False):
        cache = skvq(skvq_clip_search=search, skvq_window=8, skvq_n_sink=0)
        feed(cache, x, x, 200)
        k_hat, v_hat = cache.dequantized(mx.float32)
        err[search] = rel_err(k_hat[:, :, :192], x[:, :, :192]) + rel_err(v_hat[:, :, :192], x[:, :, :192])
        if search:
            assert mx.all(cache.store.alpha_k < 1.0) and mx.all(cache.store.alpha_v < 1.0)
    assert err[True] < 0.9 * err[False]


def test_the_chosen_ratio_is_in_the_grid_and_never_worse_than_none():
    x = mx.random.normal((2, 3, 64, 64), key=mx.random.key(8))
    for bits in (2, 4, 8):
        errors = clip_errors(x, 32, bits)
        alpha = search_clip(x, 32, bits)
        assert mx.all(mx.any(alpha[..., None] == mx.array(CLIP_GRID), axis=-1))
        best = mx.take_along_axis(errors, mx.argmin(errors, axis=0)[None], axis=0)[0]
        assert mx.all(best <= errors[0])


def test_each_ratios_error_is_the_stored_reconstructions():
    """``clip_errors`` (every ratio at once) at each alpha of the grid: the squared error of the
    rows ``quantize_clipped`` stores at that alpha, decoded, per (batch row, KV head); float32
    sums over 6,400 terms taken in another order, so to a relative 1e-5."""
    from veloxquant_mlx.quant.token_rows import dequantize_rows

    x = _with_outliers((2, 2, 100, 64), seed=9)
    errors = clip_errors(x, 32, 2)
    for i, a in enumerate(CLIP_GRID):
        stored = quantize_clipped(x, mx.full((2, 2), a, mx.float32), 32, 2)
        want = mx.square(dequantize_rows(*stored, 32, 2, mx.float32) - x).sum(axis=(2, 3))
        assert mx.allclose(errors[i], want, rtol=1e-5, atol=0), (a, errors[i], want)


def test_a_long_fit_searches_on_evenly_strided_rows():
    clean = 3.0 * (mx.random.uniform(shape=(1, 2, 2000, 64), key=mx.random.key(10)) < 0.5)  # exact at 2 bits
    x = mx.where((mx.arange(2000) % 4 == 0)[:, None], clean, _with_outliers(clean.shape, seed=11))
    assert mx.all(search_clip(x, 32, 2) == 1.0)  # rows 0, 4, 8, ...: the clean ones
    assert mx.all(search_clip(x, 32, 2, max_rows=2000) < 1.0)  # every row: outliers seen


def test_clipping_scales_min_and_max_towards_zero_and_alpha_one_is_the_plain_quantizer():
    x = mx.random.normal((1, 2, 8, 64), key=mx.random.key(9)).astype(mx.float16)
    ones = mx.ones((1, 2))
    for got, want in zip(quantize_clipped(x, ones, 32, 3), quantize_per_token(x, 32, 3)):
        assert mx.array_equal(got, want)
    alpha = mx.array([[0.9, 0.85]])
    _, scales, minima = quantize_clipped(x, alpha, 32, 2)
    groups = x.reshape(1, 2, 8, 2, 32).astype(mx.float32)
    a = alpha[:, :, None, None]
    assert mx.allclose(minima.astype(mx.float32), groups.min(-1) * a, atol=1e-3)
    assert mx.allclose(scales.astype(mx.float32), (groups.max(-1) - groups.min(-1)) * a / 3, atol=1e-3)


@pytest.mark.parametrize("bits", [3, 7])
def test_every_width_round_trips_within_half_a_step(bits):
    x = mx.random.normal((1, 2, 16, 64), key=mx.random.key(bits))
    codes, scales, minima = quantize_clipped(x, mx.ones((1, 2)), 32, bits)
    x_hat = dequantize_rows(codes, scales, minima, 32, bits)
    step = mx.repeat(scales, 32, axis=-1)
    assert mx.all(mx.abs(x_hat - x) <= step / 2 + 1e-5)


# -- the card's invariants ---------------------------------------------------------------------------
def test_a_prompt_within_sinks_and_window_is_kept_exactly():
    x = mx.random.normal((1, 2, 133, 64)).astype(mx.float16)
    cache = skvq()  # 5 sinks + 128 window
    feed(cache, x, x[:, :, ::-1], 60)
    k_hat, v_hat = cache.dequantized(mx.float16)
    assert cache.n_quantized == 0 and not cache.store.fitted
    assert mx.array_equal(k_hat, x) and mx.array_equal(v_hat, x[:, :, ::-1])


@pytest.mark.parametrize("t, chunk", [(300, 300), (300, 64), (517, 200), (180, 1)])
def test_sinks_and_window_are_exact_in_the_models_order(t, chunk):
    keys = spread_channels((1, 2, t, 64), seed=t).astype(mx.float16)
    values = spread_channels((1, 2, t, 64), seed=t + 7).astype(mx.float16)
    cache = skvq(skvq_window=32, skvq_n_sink=5)
    feed(cache, keys, values, chunk)
    # one token at a time: the first past the window fits and is quantized alone, then
    # decode steps quantize FLUSH at a time, the window holding up to FLUSH - 1 more
    held = 32 if chunk > 1 else 32 + (t - 5 - 33) % FLUSH
    assert cache.store.k_win.held == held
    assert cache.n_quantized == t - 5 - held and cache.stored_length == t
    k_hat, v_hat = cache.dequantized(mx.float16)
    for hat, x in ((k_hat, keys), (v_hat, values)):
        assert mx.array_equal(hat[:, :, :5], x[:, :, :5]) and mx.array_equal(hat[:, :, -32:], x[:, :, -32:])
        assert not mx.array_equal(hat[:, :, 5:-32], x[:, :, 5:-32])


def test_quantized_rows_are_the_clipped_codes_of_the_reordered_tokens():
    x = spread_channels((1, 2, 300, 64), seed=10)
    cache = skvq(skvq_window=32, skvq_n_sink=5)
    feed(cache, x, x, 300)
    s = cache.store
    fit = x[:, :, 5:]  # every full-precision row past the sinks at the first quantization
    assert mx.array_equal(s.perm_k, RangeOrder("half").fit(fit)) and mx.array_equal(s.perm_v, RangeOrder().fit(fit))
    assert mx.array_equal(s.alpha_k, search_clip(permute(fit, s.perm_k), 32, 2))
    codes, scales, _ = quantize_clipped(permute(x[:, :, 5:268], s.perm_v), s.alpha_v, 32, 2)
    assert mx.array_equal(s.values.codes.view(), codes) and mx.array_equal(s.values.scales.view(), scales)


def test_decode_steps_quantize_a_flush_of_tokens_at_once_and_packed_rows_never_change():
    x = mx.random.normal((1, 2, 300, 64))
    cache = skvq(skvq_window=32, skvq_n_sink=5)
    feed(cache, x[:, :, :200], x[:, :, :200], 100)
    s = cache.store
    frozen = [mx.array(a) for a in (s.perm_k, s.perm_v, s.alpha_k, s.alpha_v)]
    before = [mx.array(a) for a in (s.keys.codes.view(), s.values.codes.view(), s.keys.scales.view())]
    for step in range(100):
        n = cache.n_quantized
        feed(cache, x[:, :, 200 + step : 201 + step], x[:, :, 200 + step : 201 + step], 1)
        flushed = step % FLUSH == FLUSH - 1
        assert cache.n_quantized == n + FLUSH * flushed and s.k_win.held == 32 + (step + 1) % FLUSH
    assert all(mx.array_equal(a, b) for a, b in zip(frozen, (s.perm_k, s.perm_v, s.alpha_k, s.alpha_v)))
    for a, b in zip(before, (s.keys.codes.view(), s.values.codes.view(), s.keys.scales.view())):
        assert mx.array_equal(b[:, :, : a.shape[2]], a)
    # a flush packs each token as packing it alone would (per-token groups)
    n = cache.n_quantized
    for packed, perm, alpha in ((s.keys, s.perm_k, s.alpha_k), (s.values, s.perm_v, s.alpha_v)):
        one_by_one = [quantize_clipped(permute(x[:, :, 5 + i : 6 + i], perm), alpha, 32, 2) for i in range(n)]
        for got, want in zip((packed.codes.view(), packed.scales.view(), packed.biases.view()), zip(*one_by_one)):
            assert mx.array_equal(got, mx.concatenate(want, axis=2))


def test_window_zero_quantizes_every_token_past_the_sinks():
    x = mx.random.normal((1, 2, 70, 64))
    cache = skvq(skvq_window=0, skvq_n_sink=2)
    feed(cache, x[:, :, :40], x[:, :, :40], 40)
    feed(cache, x[:, :, 40:], x[:, :, 40:], 1)
    assert cache.n_quantized == 68 and cache.store.k_res is None and cache.stored_length == 70


def test_eight_bits_on_normal_data_err_below_one_percent():
    x = mx.random.normal((1, 2, 512, 128), key=mx.random.key(11))
    cache = skvq(skvq_bits_key=8, skvq_bits_value=8, skvq_clip_search=False, skvq_window=0, skvq_n_sink=0)
    feed(cache, x, x, 512)
    k_hat, v_hat = cache.dequantized(mx.float32)
    assert rel_err(k_hat, x) < 1e-2 and rel_err(v_hat, x) < 1e-2


# -- attention ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits, path", [((2, 2), "qmm"), ((4, 3), "qmm"), ((7, 7), "qmm"), ((2, 4), "reference")])
def test_decode_attention_matches_the_dequantized_reference(bits, path, monkeypatch):
    import veloxquant_mlx.kernels.kivi_decode as kd

    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", path)
    x, y = spread_channels((1, 2, 260, 64), seed=12, span=10.0), mx.random.normal((1, 2, 260, 64))
    cache = skvq(skvq_bits_key=bits[0], skvq_bits_value=bits[1], skvq_window=32, skvq_n_sink=5)
    feed(cache, x[:, :, :250], y[:, :, :250], 100, gqa=4)
    feed(cache, x[:, :, 250:], y[:, :, 250:], 1, gqa=4)
    q = mx.random.normal((1, 8, 1, 64))
    k_hat, v_hat = cache.dequantized(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=0.125)
    assert mx.allclose(stored_decode_attention(cache, q, 0.125), ref, atol=1e-5, rtol=1e-5)


def test_token_rows_read_the_packed_form_as_keys_and_values():
    x = mx.random.normal((1, 2, 40, 64))
    codes, scales, minima = quantize_clipped(x, mx.ones((1, 2)), 32, 4)
    pad = lambda a: mx.concatenate([a, mx.zeros_like(a[:, :, :8])], axis=2)  # noqa: E731 - spare room
    rows = TokenRows(AffineLayout(pad(codes), pad(scales), pad(minima), 40, 4, 32, "token"))
    k = mx.dequantize(codes, scales, minima, group_size=32, bits=4)
    q, p = mx.random.normal((1, 2, 3, 64)), mx.random.uniform(shape=(1, 2, 3, 40))
    assert mx.allclose(rows.scores(q), q @ k.swapaxes(-1, -2), atol=1e-4)
    assert mx.allclose(rows.mix(p), p @ k, atol=1e-4)


def test_which_parts_the_fused_kernel_could_serve():
    x = mx.random.normal((1, 2, 100, 64))
    cache = skvq(skvq_window=16, skvq_n_sink=4)
    feed(cache, x, x, 100)
    sinks, packed = cache.store.decode_parts(mx.zeros((0,)))
    assert sinks.keys is None and sinks.key_tail.shape[2] == 4
    assert isinstance(packed.values, AffineLayout) and packed.values.axis == "token"  # the kernels' layout
    assert isinstance(packed.keys, TokenRows) and not packed.affine  # per-token keys: pure MLX
    assert packed.length == 96 and isinstance(packed, DecodePart)


@pytest.mark.parametrize("fused", [True, False])
def test_fused_attention_option_reaches_the_decode_entry_point(fused, monkeypatch):
    import veloxquant_mlx.methods.skvq.sliding_store as ss

    seen, real = [], ss.decode_attention
    monkeypatch.setattr(ss, "decode_attention", lambda *a, **kw: seen.append(kw["use_kernel"]) or real(*a, **kw))
    cache = SKVQCache(KVCacheConfig(method="skvq", options=SKVQOptions(skvq_window=8), fused_attention=fused), None, 0)
    x = mx.random.normal((1, 2, 40, 64))
    feed(cache, x, x, 39)
    assert seen == [fused]


def test_decode_through_the_model_matches_the_dequantized_reference():
    model = tiny_model("llama")
    cache = make_prompt_cache(model, KVCacheConfig(method="skvq", options=SKVQOptions(skvq_window=16)))
    model(prompt(120)[None], cache=cache)
    for t in prompt(5, seed=3):
        model(t.reshape(1, 1), cache=cache)
    c = cache[1]
    q = mx.random.normal((1, 4, 1, 32))
    k_hat, v_hat = c.dequantized(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=32**-0.5)
    assert c.n_quantized == 120 - 21 and mx.allclose(stored_decode_attention(c, q, 32**-0.5), ref, atol=1e-5)


def test_the_key_order_pairs_what_the_models_rope_rotates_together():
    for traditional, pairs in ((False, "half"), (True, "adjacent")):
        model = tiny_model("llama", rope_traditional=traditional)
        cache = make_prompt_cache(model, KVCacheConfig(method="skvq", options=SKVQOptions(skvq_window=16)))
        assert cache[0].store.key_order == RangeOrder(pairs) and cache[0].store.value_order == RangeOrder()


# -- memory and limits ----------------------------------------------------------------------------------
def test_memory_at_4k_matches_the_cards_formula():
    t, h, d, g, window, n_sink = 4096, 2, 128, 32, 128, 5
    x = spread_channels((1, h, t, d), seed=13).astype(mx.float16)
    cache = skvq(skvq_group_size=g)
    feed(cache, x, x, 2048)
    n_q = t - n_sink - window
    assert cache.n_quantized == n_q
    # Per token and head (the card): 2 bits + a 2-byte scale and minimum per group, K and V;
    # 2d bytes per full-precision row; per head and layer, the orders (3 x d uint32: keys,
    # values, the values' inverse) and the two clip ratios (float32).
    per_token = 2 * (2 * d / 8 + 4 * d / g)
    side = 3 * d * 4 + 2 * 4
    formula = h * (n_q * per_token + 2 * (n_sink + window) * 2 * d + side)
    room = h * (GROWTH_TOKENS * per_token + 2 * 32 * 2 * d)  # packed growth + the window's room
    assert formula <= cache.nbytes <= formula + room, (cache.nbytes, formula)
    assert cache.nbytes < 2 * t * h * d * 2 / 4.5  # vs the fp16 cache


def test_max_ctx_caps_the_storage_and_refuses_a_longer_sequence():
    x = mx.random.normal((1, 2, 300, 64))
    cache = skvq(skvq_window=16, skvq_n_sink=4, skvq_max_ctx=260)
    feed(cache, x[:, :, :200], x[:, :, :200], 200)
    feed(cache, x[:, :, 200:260], x[:, :, 200:260], 1)
    assert cache.store.keys.codes.capacity == 240  # capped room: 260 - 4 sinks - 16 window
    with pytest.raises(ValueError, match=r"skvq_max_ctx=260: .* 261 tokens; allowed: at most 260"):
        cache.update_and_fetch(x[:, :, 260:261], x[:, :, 260:261])
    assert cache.offset == 260 and cache.stored_length == 260


def test_group_size_must_divide_head_dim():
    model = tiny_model("llama")  # head_dim 32
    with pytest.raises(ValueError, match="skvq_group_size=64 must divide head_dim=32"):
        cache = make_prompt_cache(model, KVCacheConfig(method="skvq", options=SKVQOptions(skvq_group_size=64)))
        model(prompt(8)[None], cache=cache)


def test_a_restored_state_must_agree_with_itself():
    from veloxquant_mlx.cache.base import CacheStateError

    x = mx.random.normal((1, 2, 200, 64))
    cache = skvq(skvq_window=16, skvq_n_sink=4)
    feed(cache, x, x, 200)
    state = cache.state
    restored = SKVQCache.from_state(state)
    assert all(mx.array_equal(a, b) for a, b in zip(restored.dequantized(mx.float32), cache.dequantized(mx.float32)))
    swapped = lambda p: mx.concatenate([p[..., :1], p[..., :-1]], axis=-1)  # noqa: E731 - a repeat
    for name, edit, message in (("perm_k", swapped, "key order"),
                                ("inv_v", lambda p: p[..., ::-1], "inverse value order"),
                                ("alpha_v", lambda a: a * 0.5, "value clip ratio"),
                                ("k_res", lambda a: a[:, :, :3], "full-precision tokens"),
                                ("sink_v", lambda a: a[:, :, :1], "sink tokens")):
        arrays = {**state["arrays"], name: edit(state["arrays"][name])}
        with pytest.raises(CacheStateError, match=message):
            SKVQCache.from_state({"arrays": arrays, "meta": state["meta"]})
