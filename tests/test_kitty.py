"""Kitty: the card's invariants (top-|K| channels per block and head, widths, f=0 and f=1,
sinks and tails exact, no lookahead), the two-plane storage, decode attention and memory."""

import functools

import mlx.core as mx
import pytest

from feeding import feed_chunks, stored_decode_attention
from test_methods_exactness import run
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.buffers import GrowingArray
from veloxquant_mlx.cache.options import KittyOptions
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.kitty.cache import N_SINK, KittyCache
from veloxquant_mlx.quant.affine import dequantize_per_channel, quantize_per_channel, quantize_per_token
from veloxquant_mlx.quant.packed import GROWTH_TOKENS, AffineLayout
from veloxquant_mlx.quant.store import VALUE_ROOM
from veloxquant_mlx.methods.kitty.promoted import PromotedChannels, PromotedKeys, PromotedScores


# queries from MLX's global generator, as these tests always drew them
feed = functools.partial(feed_chunks, seed=None)


def kitty(f=0.25, hi=4, lo=2, group=32, block=128, **kw):
    options = KittyOptions(kitty_hi_fraction=f, kitty_hi_bit=hi, kitty_lo_bit=lo, kitty_group_size=group)
    return KittyCache(KVCacheConfig(method="kitty", options=options, residual_window=block, **kw), None, 0)


def outliers(shape, channels, seed, size=8.0):
    """Normal keys plus channels of consistently large magnitude (real key outliers)."""
    x = mx.random.normal(shape, key=mx.random.key(seed))
    return x + size * (mx.arange(shape[-1]) == mx.array(list(channels))[:, None]).any(axis=0)


def packed(x, f=0.25, hi=4, lo=2, group=32, block=128):
    keys = PromotedKeys(PromotedChannels(lo, hi, group, block, f))
    keys.append(x)
    return keys


def test_promoted_channels_are_the_top_mean_abs_of_each_block_and_head():
    b, h, d, L = 2, 3, 64, 128
    # Block 0 has outliers in channels 0-7, block 1 in 40-47; batch 1 and head 2 differ.
    x = mx.concatenate([outliers((b, h, L, d), range(8), 1), outliers((b, h, L, d), range(40, 48), 2)], axis=2)
    x[1, 2] = outliers((L * 2, d), range(20, 28), 3)
    keys = packed(x, f=0.25)  # int(64 * 0.25) = 16 channels
    index = keys.index.view()
    assert index.shape == (b, h, 2, 16) and index.dtype == mx.uint8
    score = mx.abs(x).reshape(b, h, 2, L, d).mean(axis=3)  # brute force, per block
    for bi in range(b):
        for hi in range(h):
            for blk in range(2):
                top = sorted(sorted(range(d), key=lambda c: -score[bi, hi, blk, c].item())[:16])
                assert index[bi, hi, blk].tolist() == top
    assert set(range(8)) <= set(index[0, 0, 0].tolist()) and set(range(40, 48)) <= set(index[0, 0, 1].tolist())
    assert index[0, 0, 0].tolist() != index[0, 0, 1].tolist()  # dynamic: a new mask per block
    assert set(range(20, 28)) <= set(index[1, 2, 0].tolist())  # per (batch, head)


def test_truncation_follows_the_repo():
    assert packed(mx.random.normal((1, 1, 128, 128)), f=0.25).index.view().shape[-1] == 32
    assert packed(mx.random.normal((1, 1, 128, 128)), f=0.1).index.view().shape[-1] == 12
    assert packed(mx.random.normal((1, 1, 128, 100)), f=0.29).index.view().shape[-1] == 29  # 28.999...


@pytest.mark.parametrize("lo, hi", [(2, 4), (1, 8), (2, 7), (3, 7), (4, 5)])
def test_reconstruction_is_the_hi_or_lo_bit_grid_of_each_channel(lo, hi):
    """Each channel's scale is its group's range over 2^bits - 1 levels (bits by promotion),
    each element within scale / 2, and the lo + up planes give exactly that grid point
    (lo=1, hi=8: a 7-bit upper plane, packed by hand)."""
    g, L, d = 32, 128, 64
    x = outliers((1, 2, 2 * L, d), [3, 17, 50], seed=lo * 10 + hi)
    keys = packed(x, f=0.25, hi=hi, lo=lo, group=g, block=L)
    x_hat = keys.decode(mx.float32)
    promoted = mx.zeros((1, 2, 2, d), mx.bool_)
    promoted = mx.put_along_axis(promoted, keys.index.view().astype(mx.int32), mx.array(True), axis=-1)
    bits = mx.where(promoted, hi, lo)  # (B, H, blocks, D)
    bits = mx.repeat(bits.swapaxes(-1, -2), L // g, axis=-1)  # (B, H, D, groups)
    groups = x.swapaxes(-1, -2).reshape(1, 2, d, -1, g)
    scale, low = keys.scales.view(), keys.biases.view()
    expected = (groups.max(-1) - groups.min(-1)) / (2.0**bits - 1)
    assert mx.allclose(scale, expected, rtol=1e-6, atol=1e-7)
    s = mx.repeat(scale, g, axis=-1).swapaxes(-1, -2)  # per element (B, H, T, D)
    m = mx.repeat(low, g, axis=-1).swapaxes(-1, -2)
    assert mx.all(mx.abs(x_hat - x) <= s / 2 + 1e-5)
    top = 2.0 ** mx.repeat(bits, g, axis=-1).swapaxes(-1, -2) - 1
    grid = mx.clip(mx.round((x - m) / s), 0, top) * s + m  # the channel's own bit width
    assert mx.allclose(x_hat, grid, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("hi", [4, 8])
def test_fraction_one_is_uniform_hi_bit(hi):
    x = outliers((1, 2, 256, 64), [5], seed=hi)
    codes, scales, biases = quantize_per_channel(x, 32, hi)
    uniform = dequantize_per_channel(codes, scales, biases, 32, hi, mx.float32)
    assert mx.allclose(packed(x, f=1.0, hi=hi).decode(mx.float32), uniform, atol=1e-6, rtol=1e-6)


def test_fraction_zero_is_lo_bit_per_channel_quantization_bit_for_bit():
    x = outliers((1, 2, 256, 64), [5], seed=4)
    keys = packed(x, f=0.0, lo=2)
    codes, scales, biases = quantize_per_channel(x, 32, 2)
    assert mx.array_equal(keys.codes.view(), codes) and mx.array_equal(keys.scales.view(), scales)
    assert mx.array_equal(keys.biases.view(), biases)
    assert keys.up.buffer is None and keys.index.buffer is None  # nothing else is kept
    assert isinstance(keys.layout(mx.zeros((0,))), AffineLayout)  # what the fused kernel reads


def test_promoted_channels_err_less_than_at_lo_bits():
    x = outliers((1, 2, 256, 64), range(8), seed=6)
    boosted, plain = packed(x, f=0.125), packed(x, f=0.0)
    chans = boosted.index.view()[0, 0, 0].tolist()
    assert set(chans) == set(range(8))
    err_boosted = mx.abs(boosted.decode(mx.float32) - x)[..., chans].mean()
    err_plain = mx.abs(plain.decode(mx.float32) - x)[..., chans].mean()
    assert float(err_boosted) < 0.3 * float(err_plain)  # 15 levels instead of 3


@pytest.mark.parametrize("t, chunk", [(20, 20), (32, 7), (33, 33), (160, 160), (161, 64), (300, 1), (517, 200)])
def test_sinks_and_tails_are_exact_and_order_is_kept(t, chunk):
    mx.random.seed(t)
    keys = mx.random.normal((1, 2, t, 64)).astype(mx.float16)
    values = mx.random.normal((1, 2, t, 64)).astype(mx.float16)
    cache = kitty(block=128)
    feed(cache, keys, values, chunk)
    rest = max(0, t - N_SINK)
    n_key_tail = 0 if rest == 0 else (rest - 1) % 128 + 1  # 1..L keys: the newest is never quantized
    n_val_tail = min(rest, 128)
    if chunk == 1:  # decode steps encode the values past the window 32 at a time
        n_val_tail += max(0, rest - 128) % VALUE_ROOM
    s = cache.store
    assert (s.sink_k.length, s.keys.count, s.values.count) == (min(t, N_SINK), rest - n_key_tail, rest - n_val_tail)
    assert cache.stored_length == t and cache.offset == t
    k_hat, v_hat = cache.dequantized(mx.float16)
    assert k_hat.shape == keys.shape and v_hat.shape == values.shape
    assert mx.array_equal(k_hat[:, :, :N_SINK], keys[:, :, :N_SINK])
    assert mx.array_equal(v_hat[:, :, :N_SINK], values[:, :, :N_SINK])
    assert mx.array_equal(k_hat[:, :, t - n_key_tail :], keys[:, :, t - n_key_tail :])
    assert mx.array_equal(v_hat[:, :, t - n_val_tail :], values[:, :, t - n_val_tail :])
    if s.keys.count:  # the quantized middle is in place and in order, not exact
        middle = slice(N_SINK, N_SINK + s.keys.count)
        err = mx.abs(k_hat[:, :, middle] - keys[:, :, middle]).astype(mx.float32)
        assert 0 < float(err.mean()) < 0.5


def test_chunking_does_not_change_what_is_stored():
    keys, values = outliers((1, 2, 420, 64), [1, 9], seed=8), mx.random.normal((1, 2, 420, 64))
    whole, steps = kitty(), kitty()
    feed(whole, keys[:, :, :400], values[:, :, :400], 400)
    feed(steps, keys[:, :, :400], values[:, :, :400], 1)
    feed(whole, keys[:, :, 400:], values[:, :, 400:], 1)
    feed(steps, keys[:, :, 400:], values[:, :, 400:], 1)
    a, b = whole.store.arrays(), steps.store.arrays()
    views = lambda x: x.view() if isinstance(x, GrowingArray) else x  # noqa: E731
    assert set(a) == set(b)
    # decode steps encode values 32 at a time, so the two may split the values between
    # codes and the window at different tokens: what both encoded, and what both hold exact,
    # must agree
    for n in a:
        x, y = views(a[n]), views(b[n])
        if x is None:
            continue
        if n.startswith("v_") and n != "v_res":
            m = min(x.shape[2], y.shape[2])
            x, y = x[:, :, :m], y[:, :, :m]
        elif n == "v_res":
            m = min(x.shape[2], y.shape[2])
            x, y = x[:, :, -m:], y[:, :, -m:]
        assert mx.array_equal(x, y), n
    assert whole.store.values.count + whole.store.v_win.held == steps.store.values.count + steps.store.v_win.held


def test_a_block_is_chosen_from_its_own_tokens_and_never_changes():
    """No lookahead: what follows a block (other tokens, more blocks) leaves it as it was."""
    first = outliers((1, 2, N_SINK + 129, 64), [2, 30], seed=9)
    caches = [kitty(), kitty()]
    for i, cache in enumerate(caches):
        feed(cache, first, first, 64)
        assert cache.store.keys.count == 128
        later = outliers((1, 2, 300, 64), [10 + i, 50 - i], seed=20 + i)  # different outliers
        feed(cache, later, later, 1 + 99 * i)
    a, b = (c.store.keys for c in caches)
    assert a.count == b.count == 3 * 128
    assert mx.array_equal(a.index.view()[:, :, :1], b.index.view()[:, :, :1])
    assert mx.array_equal(a.codes.view()[..., :8], b.codes.view()[..., :8])  # 128 tokens x 2 bits
    assert mx.array_equal(a.scales.view()[..., :4], b.scales.view()[..., :4])  # 4 groups of 32
    assert mx.array_equal(a.up.view()[:, :, :1], b.up.view()[:, :, :1])
    assert not mx.array_equal(a.index.view()[:, :, 1:], b.index.view()[:, :, 1:])


@pytest.mark.parametrize("pure_path", ["qmm", "reference"])
@pytest.mark.parametrize("lo, hi, f", [(2, 4, 0.25), (3, 7, 0.25), (1, 8, 0.5), (2, 4, 0.0), (3, 4, 0.0)])
def test_decode_attention_matches_the_dequantized_reference(lo, hi, f, pure_path, monkeypatch):
    """On the CPU's path and on the GPU's pure path (the dequantizing reference), at widths
    the shared readers take and at those they do not (3 bits, a 7-bit upper plane)."""
    monkeypatch.setattr(kd, "_pure_path", lambda: pure_path)
    model = tiny_model("llama")
    options = KittyOptions(kitty_hi_fraction=f, kitty_hi_bit=hi, kitty_lo_bit=lo)
    cache = make_prompt_cache(model, KVCacheConfig(method="kitty", options=options, residual_window=64))
    run(model, cache, prompt(300), chunk=128, decode=3)
    c = cache[0]
    assert c.store.keys.count >= 3 * 64 and c.store.values.count > 0
    q = mx.random.normal((1, 4, 1, 32))
    out = stored_decode_attention(c, q, 32**-0.5)
    k_hat, v_hat = c.dequantized(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=32**-0.5)
    assert mx.allclose(out, ref, atol=1e-5), float(mx.abs(out - ref).max())


@pytest.mark.parametrize("f, kernel_keys", [(0.0, True), (0.25, False)])
def test_which_parts_the_fused_kernel_could_serve(f, kernel_keys):
    """Sinks: exact rows (pure MLX); the quantized part: group-affine keys and values when
    nothing is promoted, promoted-channel scores otherwise."""
    cache = kitty(f=f)
    x = outliers((1, 2, 400, 64), [3], seed=11)
    feed(cache, x, x, 400)
    sinks, main = cache.store.decode_parts(mx.zeros((0,)))
    assert sinks.length == N_SINK and not sinks.affine
    assert isinstance(main.values, AffineLayout) and main.values.bits == 2
    assert isinstance(main.keys, AffineLayout if kernel_keys else PromotedScores) and main.affine == kernel_keys


@pytest.mark.parametrize("f, hi", [(0.25, 4), (0.125, 8)])
def test_memory_at_4k_matches_the_cards_formula(f, hi):
    t, h, d, g, L, lo = 4096, 2, 128, 32, 128, 2
    keys = outliers((1, h, t, d), [0, 64], seed=12).astype(mx.float16)
    cache = kitty(f=f, hi=hi, lo=lo, group=g, block=L)
    feed(cache, keys, keys, 2048)
    k = int(d * f)
    # Per token and head, in bytes: the card's keys (its d-bit mask per block replaced by the
    # k one-byte channel indices kept here), values, and 2d for every full-precision row.
    key_q = d * ((1 - f) * lo + f * hi) / 8 + 4 * d / g + k / L
    card_key_q = d * ((1 - f) * lo + f * hi) / 8 + 4 * d / g + d / (8 * L)
    val_q = lo * d / 8 + 4 * d / g
    s = cache.store
    n_kq, n_vq = s.keys.count, s.values.count
    assert (n_kq, n_vq) == (31 * L, t - N_SINK - L)
    fp_rows = 2 * N_SINK + (t - N_SINK - n_kq) + (t - N_SINK - n_vq)
    formula = h * (n_kq * key_q + n_vq * val_q + fp_rows * 2 * d)
    room = h * GROWTH_TOKENS * (key_q + val_q)
    assert formula <= cache.nbytes <= formula + room, (cache.nbytes, formula)
    card = h * (n_kq * card_key_q + n_vq * val_q + fp_rows * 2 * d)
    assert abs(cache.nbytes - card) <= room
    full = 2 * t * h * d * 2
    assert cache.nbytes < full / 3.5


def test_values_are_per_token_at_lo_bits():
    x = mx.random.normal((1, 2, 300, 64))
    cache = kitty(lo=3, hi=4)
    feed(cache, x, x, 300)
    n = cache.store.values.count
    codes, _, _ = quantize_per_token(x[:, :, N_SINK : N_SINK + n], 32, 3)
    assert mx.array_equal(cache.store.values.codes.view(), codes)


def test_group_size_must_divide_head_dim():
    model = tiny_model("llama")  # head_dim 32
    options = KittyOptions(kitty_group_size=64)
    with pytest.raises(ValueError, match="kitty_group_size=64 must divide head_dim=32"):
        cache = make_prompt_cache(model, KVCacheConfig(method="kitty", options=options))
        model(prompt(8)[None], cache=cache)


def test_the_block_must_hold_whole_groups():
    with pytest.raises(ValueError, match="residual_window .* multiple of kitty_group_size"):
        KVCacheConfig(method="kitty", options=KittyOptions(kitty_group_size=64), residual_window=96)
    with pytest.raises(ValueError, match="kitty_hi_bit must be larger than kitty_lo_bit"):
        KVCacheConfig(method="kitty", options=KittyOptions(kitty_hi_bit=3, kitty_lo_bit=3))


@pytest.mark.parametrize("fused", [True, False])
def test_fused_attention_option_reaches_the_kernel_dispatcher(fused, monkeypatch):
    seen = []
    real = kd.gpu_backend
    monkeypatch.setattr(kd, "gpu_backend", lambda: seen.append(1) or real())
    cache = kitty(f=0.0, fused_attention=fused)
    x = mx.random.normal((1, 2, 200, 64))
    feed(cache, x, x, 199)
    assert bool(seen) == fused


def test_a_restored_state_must_agree_with_the_policy():
    from veloxquant_mlx.cache.base import CacheStateError

    x = outliers((1, 2, 400, 64), [3], seed=13)
    cache = kitty()
    feed(cache, x, x, 400)
    state = cache.state
    restored = KittyCache.from_state(state)
    assert all(mx.array_equal(a, b) for a, b in zip(restored.dequantized(mx.float32), cache.dequantized(mx.float32)))
    for name, cut, message in (("k_index", lambda a: a[:, :, :1], "promoted-channel indices"),
                               ("k_up", lambda a: a[:, :, :, :3], "promoted-channel codes"),
                               ("k_res", lambda a: a[:, :, :0], "full-precision keys"),
                               ("sink_v", lambda a: a[:, :, :10], "sink tokens")):
        arrays = {**state["arrays"], name: cut(state["arrays"][name])}
        with pytest.raises(CacheStateError, match=message):
            KittyCache.from_state({"arrays": arrays, "meta": state["meta"]})
