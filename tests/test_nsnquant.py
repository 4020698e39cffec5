"""NSNQuant: the NSN transform and its exact inverse, the universal codebook reproducible from
its seed, codes that index the nearest centroid (signs kept at 2 bits), the card's errors,
a coded frontier at multiples of R whatever the chunking, decode read from the codes equal
to attention over the dequantized history, and nbytes against the card's formula."""

import math

import mlx.core as mx
import pytest

from feeding import feed_chunks
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.buffers import GrowingArray
from veloxquant_mlx.cache.options import NSNQuantOptions
from veloxquant_mlx.methods.nsnquant import NSNQuantCache
from veloxquant_mlx.methods.nsnquant import nsn as nsn_module
from veloxquant_mlx.methods.nsnquant.nsn import NSNCodec, NSNKeys, NSNValues, nsn, nsn_inverse, universal_codebook
from veloxquant_mlx.quant.packed import GROWTH_TOKENS
from veloxquant_mlx.quant.vq import relative_error, unpack_indices


def nsnquant(**options):
    return NSNQuantCache(KVCacheConfig(method="nsnquant", options=NSNQuantOptions(**options)), None, 0)


def card_data(t, d=128, h=2, seed=0, dtype=mx.float32):
    """The card's test data: 3 outlier channels x8, 2 offset channels +4."""
    x = mx.random.normal((1, h, t, d), key=mx.random.key(seed))
    x = x * mx.where(mx.arange(d) < 3, 8.0, 1.0) + mx.where((mx.arange(d) >= 3) & (mx.arange(d) < 5), 4.0, 0.0)
    return x.astype(dtype)


def test_nsn_normalises_shifts_normalises_and_its_inverse_is_exact_before_vq():
    x = card_data(128).reshape(1, 2, 2, 64, 128)  # two chunks of 64
    y, s1, s2, o = nsn(x)
    assert relative_error(x, nsn_inverse(y, s1, s2, o)) < 1e-12
    assert mx.allclose(mx.linalg.norm(y, axis=-1), mx.array(math.sqrt(128)), rtol=1e-3)  # s2 is float16-rounded
    x2 = x / s1 - o  # the shifted tokens: the chunk's own mean removed (up to o's float16 rounding)
    assert float(mx.abs(x2.mean(axis=-2)).max()) < 2e-3
    # metadata are float16 values
    for m in (s1, s2, o):
        assert mx.array_equal(m, m.astype(mx.float16).astype(mx.float32))


def test_the_universal_codebook_is_reproducible_from_its_seed_and_differs_with_another():
    universal_codebook.cache_clear()  # built again, not remembered
    a = universal_codebook(2, 16, 8, 1234)
    universal_codebook.cache_clear()
    b = universal_codebook(2, 16, 8, 1234)
    c = universal_codebook(2, 16, 8, 99)
    assert a is not b and mx.array_equal(a, b)
    assert not mx.allclose(a, c, atol=1e-3)
    assert a.shape == (16, 8) and float(a.min()) >= 0  # 2 bits: magnitudes (positive orthant)
    assert float(universal_codebook(1, 16, 8, 1234).min()) < 0  # 1 bit: signed centroids
    keys = card_data(64)
    cache = nsnquant(nsn_residual_length=32, nsn_codebook_size=16, nsn_seed=99)
    feed_chunks(cache, keys, keys, 64)
    assert mx.array_equal(cache.store.arrays()["codebook"], c)  # the cache's is its seed's


@pytest.mark.parametrize("bits", [1, 2])
def test_codes_index_the_nearest_centroid_and_two_bits_keep_every_sign(bits):
    x = card_data(64)
    codec = NSNCodec(universal_codebook(bits, 16, 8, 1234), bits)  # 16 centroids: a quick build
    y = nsn(x.reshape(1, 2, 1, 64, 128))[0].reshape(1, 2, 64, 128)
    idx_words, sign_words = codec.encode(y)
    idx = unpack_indices(idx_words, 4, 16)
    sub = y.reshape(1, 2, 64, 16, 8)
    target = mx.abs(sub) if bits == 2 else sub
    d = mx.square(target[..., None, :] - codec.codebook).sum(-1)
    chosen = mx.take_along_axis(d, idx.astype(mx.int32)[..., None], axis=-1)[..., 0]
    assert bool(mx.all(chosen <= d.min(-1) + 1e-5 * (mx.square(sub).sum(-1) + 1)))
    y_hat = codec.y_hat(idx_words, sign_words, 128)
    if bits == 2:
        assert bool(mx.all((mx.sign(y_hat) == mx.sign(y)) | (y == 0) | (y_hat == 0)))
    else:
        assert sign_words is None


@pytest.mark.parametrize("bits, bound", [(2, 0.12), (1, 0.38)])
def test_relative_error_on_the_cards_data_is_within_its_bound_and_scale_invariant(bits, bound):
    x = card_data(512, seed=3)
    cache = nsnquant(nsn_bits=bits, nsn_residual_length=64)
    feed_chunks(cache, x, x, 512)
    k_hat, _ = cache.dequantized(mx.float32)
    err = relative_error(x, k_hat)
    assert err < bound, err
    assert err > 0.01  # really coded
    scaled = nsnquant(nsn_bits=bits, nsn_residual_length=64)
    feed_chunks(scaled, 4 * x, 4 * x, 512)  # a power of two: s1 takes it exactly
    assert mx.allclose(scaled.dequantized(mx.float32)[0], 4 * k_hat, rtol=1e-5, atol=1e-5)


def test_the_coded_frontier_is_a_multiple_of_r_and_the_state_does_not_depend_on_chunking():
    keys, values = card_data(150, dtype=mx.float16), card_data(150, seed=7, dtype=mx.float16)
    states = []
    for chunk, decode_from in ((150, 150), (100, 100), (13, 60), (1, 0)):
        cache = nsnquant(nsn_residual_length=32)
        feed_chunks(cache, keys[:, :, :decode_from], values[:, :, :decode_from], chunk)
        feed_chunks(cache, keys[:, :, decode_from:], values[:, :, decode_from:], 1)
        s = cache.store
        assert (s.keys.count, s.k_tail.length) == (128, 22)
        states.append({n: (a.view() if isinstance(a, GrowingArray) else a) for n, a in s.arrays().items()})
    for other in states[1:]:
        for name, a in states[0].items():
            assert mx.array_equal(a, other[name]), name
    k_hat, v_hat = cache.dequantized(mx.float16)
    assert mx.array_equal(k_hat[:, :, 128:], keys[:, :, 128:]) and mx.array_equal(v_hat[:, :, 128:], values[:, :, 128:])


@pytest.mark.parametrize("bits", [1, 2])
def test_decode_read_from_the_codes_equals_attention_over_the_dequantized_history(bits, monkeypatch):
    keys, values = card_data(200), card_data(200, seed=7)
    cache = nsnquant(nsn_bits=bits, nsn_residual_length=32)
    feed_chunks(cache, keys[:, :, :199], values[:, :, :199], 199)
    t = cache.store.keys
    q = mx.random.normal((1, 2, 4, 128), key=mx.random.key(2))
    k_hat = t.decode(mx.float32)
    assert mx.allclose(NSNKeys(t, 128).scores(q), q @ k_hat.swapaxes(-1, -2), atol=1e-4, rtol=1e-4)
    p = mx.softmax(q @ k_hat.swapaxes(-1, -2), axis=-1)
    v_hat = cache.store.values.decode(mx.float32)
    assert mx.allclose(NSNValues(cache.store.values, 128).mix(p), p @ v_hat, atol=1e-5, rtol=1e-4)
    # a decode step: the codes are read, the history is not rebuilt
    monkeypatch.setattr(nsn_module.NSNTokens, "decode", lambda *a: (_ for _ in ()).throw(AssertionError("decoded")))
    q1 = mx.random.normal((1, 4, 1, 128), key=mx.random.key(8))
    k, v = keys[:, :, 199:], values[:, :, 199:]
    cache.update_and_fetch(k, v)
    out = cache.attend(q1, k, v, scale=128**-0.5, mask=None)
    monkeypatch.undo()
    all_k, all_v = cache.dequantized(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q1, all_k, all_v, scale=128**-0.5)
    assert mx.allclose(out, ref, atol=1e-5, rtol=1e-4), float(mx.abs(out - ref).max())


@pytest.mark.parametrize("bits", [1, 2])
def test_nbytes_after_a_long_prompt_matches_the_cards_memory_formula(bits):
    h, d, r, t = 2, 128, 64, 1300
    x = card_data(t, dtype=mx.float16)
    cache = nsnquant(nsn_bits=bits, nsn_residual_length=r)
    feed_chunks(cache, x[:, :, :1200], x[:, :, :1200], 1200)
    feed_chunks(cache, x[:, :, 1200:], x[:, :, 1200:], 1)
    coded = t // r * r
    per_token = (d // 8) * 8 // 8 + (bits == 2) * 8 * (d // 8) // 8 + 4  # indices (+ signs), s1 and s2
    assert per_token == (36 if bits == 2 else 20)
    formula = 2 * h * (coded * per_token + coded // r * 2 * d + (t - coded) * 2 * d) + 256 * 8 * 4
    slack = 2 * h * GROWTH_TOKENS * (per_token + 2 * d // r) + 2 * h * (r - (t - coded)) * 2 * d
    assert formula <= cache.nbytes <= formula + slack, (cache.nbytes, formula)
    # the card's 40 B (2 bits) / 24 B (1 bit) a token, head and tensor at R = 64
    assert per_token + 2 * d / r == (40 if bits == 2 else 24)


def test_a_context_beyond_nsn_max_ctx_is_refused_naming_the_field():
    cache = nsnquant(nsn_residual_length=16, nsn_max_ctx=40, nsn_codebook_size=16)
    x = card_data(48)
    feed_chunks(cache, x[:, :, :40], x[:, :, :40], 40)
    with pytest.raises(ValueError, match="nsn_max_ctx=40"):
        cache.update_and_fetch(x[:, :, 40:41], x[:, :, 40:41])
    with pytest.raises(ValueError, match="nsn_subvector_dim=5 must divide head_dim=128"):
        nsnquant(nsn_subvector_dim=5, nsn_codebook_size=16).update_and_fetch(x, x)
