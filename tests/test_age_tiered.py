"""AgeTieredKV: tiers by age, block-wise demotion, bounded error per tier, real memory."""

import mlx.core as mx
import pytest

import veloxquant_mlx.methods.age_tiered.tiers as tiers_module
from veloxquant_mlx.kernels.decode import decode_attention
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import AgeTieredKVOptions
from veloxquant_mlx.methods.age_tiered import AgeTieredKVCache
from veloxquant_mlx.quant.affine import (
    dequantize_per_channel,
    dequantize_per_token,
    quantize_per_channel,
    quantize_per_token,
)
from veloxquant_mlx.quant.packed import GROWTH_TOKENS, AffineLayout
from veloxquant_mlx.methods.age_tiered.tiers import TieredStore
from feeding import stored_decode_attention


def options(r=32, m=96, bits=(8, 4, 2), g=32):
    return AgeTieredKVOptions(age_recent_boundary=r, age_mid_boundary=m, age_bits_recent=bits[0],
                              age_bits_mid=bits[1], age_bits_old=bits[2], age_group_size=g)


def cache(r=32, m=96, bits=(8, 4, 2), g=32, **kw):
    return AgeTieredKVCache(KVCacheConfig(method="age_tiered", options=options(r, m, bits, g), **kw), None, 0)


def store(r=32, m=96, bits=(8, 4, 2), g=32):
    """bits: recent, mid, old (the options' order); the store takes them oldest first."""
    return TieredStore(bits=list(bits[::-1]), ages=[m, r], block=g)


def feed(target, keys, values, chunks):
    """Commit (B, H, T, D) keys/values in chunks of the given sizes, then one by one."""
    i, t = 0, keys.shape[2]
    for n in list(chunks) + [1] * t:
        if i >= t:
            break
        n = min(n, t - i)
        target.commit(keys[:, :, i : i + n], values[:, :, i : i + n])
        i += n
        yield i


def data(t, h=1, d=32, seed=0, dtype=mx.float32):
    k = mx.random.normal((1, h, t, d), key=mx.random.key(seed)).astype(dtype)
    v = mx.random.normal((1, h, t, d), key=mx.random.key(seed + 1)).astype(dtype)
    return k, v


def expected_counts(n, r, m, g):
    """The block-wise tiers: (old, mid, recent) quantized, and the full-precision tail."""
    old, older, whole = max(n - m, 0) // g * g, max(n - r, 0) // g * g, n // g * g
    return [old, older - old, whole - older], n - whole


@pytest.mark.parametrize("r, m, chunks", [(32, 96, []), (40, 100, []), (0, 64, []), (40, 100, [7, 64, 90]),
                                          (128, 160, [300])])
def test_tier_sizes_follow_the_boundaries_within_a_block(r, m, chunks):
    g, t = 32, 300
    s = store(r, m, bits=(8, 4, 2), g=g)
    keys, values = data(t)
    for n in feed(s, keys, values, chunks):
        counts, tail = expected_counts(n, r, m, g)
        assert s.counts == counts and s.k_tail.length == s.v_tail.length == tail
        assert s.length == n  # no token dropped
        assert all(t_.keys.count == t_.values.count for t_ in s.tiers)  # K and V over the same tokens
        # the card's per-token tiers, up to a block: the newest token is recent (or in the tail)
        old, mid, recent = counts[0], counts[1], counts[2] + tail
        assert 0 <= max(n - m, 0) - old < g
        assert 0 <= recent - min(n, r) < g
        assert abs(mid - min(max(n - r, 0), m - r)) < g


def test_prefill_then_decode_gives_the_tiers_of_a_longer_prefill():
    keys, values = data(290)
    longer = store(40, 100)
    list(feed(longer, keys, values, [290]))
    for t in (0, 33, 150, 289):
        s = store(40, 100)
        list(feed(s, keys, values, [t] if t else []))  # prefill t, decode the rest
        assert s.counts == longer.counts and s.k_tail.length == longer.k_tail.length


@pytest.mark.parametrize("chunks", [[], [5, 70, 31], [200]])
def test_16_bit_tiers_keep_every_token_exactly_in_order(chunks):
    keys, values = data(260, h=2, dtype=mx.float16)
    s = store(40, 100, bits=(16, 16, 16))
    list(feed(s, keys, values, chunks))
    k_hat, v_hat = s.history(mx.float16)
    assert s.counts == expected_counts(260, 40, 100, 32)[0]
    assert mx.array_equal(k_hat, keys) and mx.array_equal(v_hat, values)


def _chain(x, bits, axis):
    """x quantized at bits[0], its reconstruction at bits[1], ...: reconstructions and scales."""
    q, dq = (quantize_per_channel, dequantize_per_channel) if axis == "channel" else \
        (quantize_per_token, dequantize_per_token)
    out = []
    for b in bits:
        codes, scales, biases = q(x, 32, b)
        x = dq(codes, scales, biases, 32, b, mx.float32)
        scale = mx.repeat(scales, 32, axis=-1)
        out.append((x, scale.swapaxes(-1, -2) if axis == "channel" else scale))
    return out


def test_demotion_requantizes_the_current_reconstruction_and_stays_in_its_bound():
    """Decoded one by one, every old block went 8 -> 4 -> 2 bits; each tier's tokens equal
    that cascade and stay within half a step of each width they passed through."""
    r, m, t = 64, 160, 320
    keys, values = data(t, h=2, d=64, seed=4)
    s = store(r, m)
    list(feed(s, keys, values, [40]))
    k_hat, v_hat = s.history(mx.float32)
    (old, mid, recent), tail = s.counts, s.k_tail.length
    spans = {(2,): (old + mid, old + mid + recent), (8, 4): (old, old + mid), (8, 4, 2): (0, old)}
    assert old and mid and recent and all(b - a for a, b in spans.values())
    bits_of = {(2,): (8,), (8, 4): (8, 4), (8, 4, 2): (8, 4, 2)}
    for key, (a, b) in spans.items():
        for x, x_hat, axis in ((keys, k_hat, "channel"), (values, v_hat, "token")):
            steps = _chain(x[:, :, a:b], bits_of[key], axis)
            assert mx.allclose(x_hat[:, :, a:b], steps[-1][0], atol=1e-6)  # the cascade, exactly
            bound = sum(scale for _, scale in steps) / 2 + 1e-5  # compounding, width by width
            assert mx.all(mx.abs(x_hat[:, :, a:b] - x[:, :, a:b]) <= bound)
    assert mx.array_equal(k_hat[:, :, t - tail :], keys[:, :, t - tail :])  # the tail is exact


def _rel(x_hat, x):
    return float(mx.linalg.norm((x_hat - x).flatten()) / mx.linalg.norm(x.flatten()))


def test_error_grows_with_age_and_the_cascade_stays_close_to_direct_quantization():
    r, m, t = 64, 160, 480
    keys, values = data(t, h=2, d=64, seed=9)
    direct, cascaded = store(r, m), store(r, m)
    list(feed(direct, keys, values, [t]))  # a prompt: each tier straight from the input
    list(feed(cascaded, keys, values, [32]))  # decoded: demoted 8 -> 4 -> 2
    assert direct.counts == cascaded.counts
    old, mid, recent = cascaded.counts
    spans = [(0, old), (old, old + mid), (old + mid, old + mid + recent)]
    for x, i in ((keys, 0), (values, 1)):
        errs = {}
        for name, s in (("direct", direct), ("cascaded", cascaded)):
            x_hat = s.history(mx.float32)[i]
            errs[name] = [_rel(x_hat[:, :, a:b], x[:, :, a:b]) for a, b in spans]
        e_old, e_mid, e_recent = errs["cascaded"]
        assert e_recent < 1e-2 < e_mid < e_old  # 8-bit error is negligible (card: ~0.005)
        assert errs["direct"][2] == e_recent  # the recent tier is quantized once either way
        assert errs["direct"][1] <= e_mid <= 1.01 * errs["direct"][1]
        assert errs["direct"][0] <= e_old <= 1.05 * errs["direct"][0]


def c(bits, d=128, g=32):
    """The card's bytes per head per token: codes plus fp16 scale and zero per group."""
    return bits * d / 8 + 4 * d / g


def card_bytes(n, h, r=128, m=1024, bits=(8, 4, 2), d=128):
    per_head = min(n, r) * c(bits[0], d) + min(max(n - r, 0), m - r) * c(bits[1], d) + max(n - m, 0) * c(bits[2], d)
    return 2 * h * per_head  # K and V


def test_memory_matches_the_card_formula():
    h, d, g = 2, 128, 32
    tail_room = 2 * h * g * d * 2  # the full-precision tail's buffers (a block of rows, fp16)
    keys, values = data(4096 + 40, h=h, d=d, dtype=mx.float16)
    at_1k = cache(128, 1024)  # the card's defaults
    at_1k.store.commit(keys[:, :, :1024], values[:, :, :1024])
    # at N = 1024: the card's 90,112 B per head per tensor, exactly (the tiers are sized
    # to their spans: no room beyond them)
    assert card_bytes(1024, h) == 2 * h * 90_112
    assert at_1k.nbytes == card_bytes(1024, h)  # (and no tail yet)
    x = cache(128, 1024)
    room = tail_room + GROWTH_TOKENS * c(2) * 2 * h  # and the old tier's growth room
    for n in feed(x.store, keys, values, [2048, 2048]):
        if n in (4096, 4096 + 17, 4096 + 40):
            formula = card_bytes(n, h)  # blocks: the old tier lags the card by under a block
            assert formula - g * c(2) * 2 * h <= x.nbytes <= formula + room, (n, x.nbytes, formula)
    assert card_bytes(4096, h) < 0.25 * (2 * h * 4096 * d * 2)  # about 4.4x under fp16 at 4k


def test_demotion_is_block_wise_front_removal_every_block_steps(monkeypatch):
    """Between blocks a step writes one tail row in place; the step that completes a block
    demotes one block across each boundary: one front-removal copy per array of each tier
    that gave a block (3 arrays x K, V x 2 boundaries)."""
    r, m, g = 32, 96, 32
    keys, values = data(m + 6 * g, h=2)
    s = store(r, m, g=g)
    list(feed(s, keys, values, [m + g]))
    calls = []
    real = tiers_module._drop_front
    monkeypatch.setattr(tiers_module, "_drop_front", lambda a, n: (calls.append(n), real(a, n)))
    for n in feed(s, keys[:, :, m + g :], values[:, :, m + g :], []):
        total = m + g + n
        assert len(calls) == (12 if total % g == 0 else 0), (total, len(calls))
        assert s.k_tail.capacity == g  # the tail never grows beyond a block
        calls.clear()


@pytest.mark.parametrize("bits", [(8, 4, 2), (8, 3, 2), (4, 4, 4), (16, 8, 3), (16, 16, 16)])
def test_decode_attention_matches_the_dequantized_reference(bits):
    """Over 3 tiers and the tail; 3-bit tiers of more than 320 tokens included."""
    keys, values = data(421, h=2, d=64, seed=2)
    s = store(32, 64, bits=bits)
    list(feed(s, keys, values, [300, 100]))
    assert all(s.counts) and s.k_tail.length and s.counts[0] > 320
    q = mx.random.normal((1, 8, 1, 64), key=mx.random.key(3))
    parts = s.decode_parts(mx.zeros((0,)))
    out = decode_attention(q, parts, scale=0.125)
    k_hat, v_hat = s.history(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=0.125)
    assert mx.allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_which_tiers_the_kernel_can_serve():
    """2/4/8-bit tiers are layouts the fused kernel reads; 3-bit ones and 16-bit rows not."""
    keys, values = data(200, h=2, d=64)
    s = store(32, 64, bits=(16, 8, 3))
    list(feed(s, keys, values, [200]))
    old, mid, recent, tail = s.decode_parts(mx.zeros((0,)))
    assert isinstance(old.keys, AffineLayout) and old.keys.bits == 3 and not old.affine
    assert isinstance(mid.keys, AffineLayout) and (mid.keys.bits, mid.keys.axis) == (8, "channel")
    assert isinstance(mid.values, AffineLayout) and mid.values.axis == "token" and mid.affine
    assert recent.keys is None and not recent.affine and recent.key_tail.shape[2] == s.counts[2]
    assert tail.keys is None and tail.tail_counts[0] == 200 % 32 and tail.tails()[0].shape[2] == 200 % 32


def test_decode_through_the_model_matches_the_dequantized_reference():
    model = tiny_model("llama")
    caches = make_prompt_cache(model, KVCacheConfig(method="age_tiered", options=options(32, 96)))
    tokens = prompt(220)
    model(tokens[None, :200], cache=caches)
    for i in range(200, 220):
        model(tokens[None, i : i + 1], cache=caches)
    c0 = caches[0]
    assert c0.offset == c0.stored_length == 220 and c0.tier_counts == (96, 64, 32 + 28)
    assert [t.keys.codec.bits for t in c0.store.tiers] == [2, 4, 8]  # old, mid, recent
    q = mx.random.normal((1, 4, 1, 32))
    k_hat, v_hat = c0.dequantized(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=32**-0.5)
    assert mx.allclose(stored_decode_attention(c0, q, 32**-0.5), ref, atol=1e-5)


def test_group_size_must_divide_head_dim():
    model = tiny_model("llama")  # head_dim 32
    with pytest.raises(ValueError, match="age_group_size=64 must divide head_dim=32"):
        caches = make_prompt_cache(model, KVCacheConfig(method="age_tiered", options=options(g=64)))
        model(prompt(8)[None], cache=caches)


@pytest.mark.parametrize("kw, message", [
    (dict(r=96, m=96), "age_recent_boundary < age_mid_boundary"),
    (dict(bits=(4, 8, 2)), "must not increase with age"),
])
def test_cross_field_rules_name_the_fields(kw, message):
    with pytest.raises(ValueError, match=message):
        options(**kw)


@pytest.mark.parametrize("fused", [True, False])
def test_fused_attention_option_reaches_the_decode_entry_point(fused, monkeypatch):
    seen = []
    import veloxquant_mlx.quant.store as store_module

    real = store_module.decode_attention
    monkeypatch.setattr(store_module, "decode_attention",
                        lambda *a, **kw: (seen.append(kw["use_kernel"]), real(*a, **kw))[1])
    x = cache(fused_attention=fused)
    keys, values = data(40, h=2)
    x.update_and_fetch(keys[:, :, :39], values[:, :, :39])
    x.attend(mx.zeros((1, 4, 39, 32)), None, None, scale=1.0, mask="causal")
    x.update_and_fetch(keys[:, :, 39:], values[:, :, 39:])
    x.attend(mx.zeros((1, 4, 1, 32)), None, None, scale=1.0, mask=None)
    assert seen == [fused]


def test_a_saved_state_whose_tiers_contradict_themselves_is_refused(tmp_path):
    from conformance import edit_saved_layer
    from mlx_lm.models.cache import save_prompt_cache

    from veloxquant_mlx import load_prompt_cache
    from veloxquant_mlx.cache.base import CacheStateError

    model = tiny_model("llama")
    caches = make_prompt_cache(model, KVCacheConfig(method="age_tiered", options=options(32, 96)))
    model(prompt(200)[None], cache=caches)
    path = tmp_path / "cache.safetensors"
    save_prompt_cache(str(path), caches)
    assert load_prompt_cache(path)[0].store.counts == caches[0].store.counts

    def drop_a_mid_block(meta, arrays):  # tier 1: codes, scales and biases of keys and values
        for name in [n for n in arrays if n.startswith("tier1_k")]:
            arrays[name] = arrays[name][..., 32 * 4 // 32 :] if "codes" in name else arrays[name][..., 1:]
        for name in [n for n in arrays if n.startswith("tier1_v")]:
            arrays[name] = arrays[name][:, :, 32:]

    edit_saved_layer(path, 0, drop_a_mid_block)
    with pytest.raises(CacheStateError, match="tokens stored is 168, expected the offset 200"):
        load_prompt_cache(path)
    edit_saved_layer(path, 0, lambda meta, arrays: arrays.update(tier0_k_codes=arrays["tier0_k_codes"][..., :1]))
    with pytest.raises(CacheStateError, match="tier 0 keys"):
        load_prompt_cache(path)
