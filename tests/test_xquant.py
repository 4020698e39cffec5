"""XQuant: the card's invariants (group size 1 is KIVI bit for bit, affine invariance of
borrowed codes, a reuse layer keeps no codes, the residual never hurts, identical token
ranges), decode over the borrowed layout, lossless windows, and memory."""

import mlx.core as mx
import pytest

from cross_layer_util import feed, kv, layered, reference_attention
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.methods.kivi import KIVICache
from veloxquant_mlx.quant.packed import AffineLayout
from veloxquant_mlx.quant.residual import ResidualScores
from feeding import stored_decode_attention

T, DECODE = 150, 40


def _run(n_layers=2, window=32, related=None, **options):
    caches = layered("xquant", n_layers, {"residual_window": window}, **options)
    ks, vs = kv(T + DECODE, n_layers, related=related)
    feed(caches, ks, vs, 64, stop=T)
    outs = feed(caches, ks, vs, 1, start=T)
    return caches, ks, vs, outs


def _err(cache, k, v):
    k_hat, v_hat = cache.dequantized(mx.float32)
    return float(((k_hat - k) ** 2).sum() + ((v_hat - v) ** 2).sum())


@pytest.mark.parametrize("bits", [2, 4])
def test_group_size_one_is_kivi_bit_for_bit(bits):
    caches, ks, vs, outs = _run(xquant_group_size=1, xquant_base_bits=bits)
    kivi = KIVICache(KVCacheConfig(method="kivi", kv_bits=bits, residual_window=32), None, 0)
    feed([kivi], ks[:1], vs[:1], 64, stop=T)
    want = feed([kivi], ks[:1], vs[:1], 1, start=T)[0]  # the same queries as layer 0's
    for a, b in zip(outs[0], want):
        assert mx.array_equal(a, b)
    for a, b in zip(caches[0].dequantized(mx.float32), kivi.dequantized(mx.float32)):
        assert mx.array_equal(a, b)
    assert caches[1].is_owner and caches[0].nbytes == kivi.nbytes


def test_a_layer_that_is_a_positive_scaling_of_the_anchor_gets_its_own_codes_exactly():
    caches, ks, vs, _ = _run(xquant_residual_bits=0, related=lambda x0, i: x0 * 2.0)
    direct = layered("xquant", 1, {"residual_window": 32}, xquant_group_size=1)
    feed(direct, [ks[1]], [vs[1]], 64, stop=T)
    feed(direct, [ks[1]], [vs[1]], 1, start=T)
    for a, b in zip(caches[1].dequantized(mx.float32), direct[0].dequantized(mx.float32)):
        assert mx.array_equal(a, b)


def test_a_reuse_layer_keeps_no_codes_only_scales_zeros_and_its_window():
    caches, ks, vs, _ = _run(xquant_residual_bits=0)
    anchor, reuse = caches[0].store, caches[1].store
    assert not any("codes" in name for name in reuse.arrays())
    assert reuse.keys.count == anchor.keys.count and reuse.values.count == anchor.values.count
    assert reuse.keys._base(mx.zeros((0,))).codes is anchor.keys.codes.buffer  # read in place
    n_k, n_v, h, d, gq, s = reuse.keys.count, reuse.values.count, 2, 32, 32, 4
    scales = 2 * s * h * d * (n_k + n_v) / gq  # scale + zero per group, float32 model
    windows = sum(a.nbytes for a in (reuse.k_win, reuse.v_win))
    room = 2 * 2 * s * h * d * 256 / gq  # growth room of the scale/zero buffers
    assert scales + windows <= caches[1].nbytes <= scales + windows + room


def test_the_residual_never_increases_a_reuse_layers_error():
    errors = []
    for bits in (0, 2, 4, 8):
        caches, ks, vs, _ = _run(xquant_residual_bits=bits)
        errors.append(_err(caches[1], ks[1], vs[1]))
    assert all(b < a for a, b in zip(errors, errors[1:])), errors


@pytest.mark.parametrize("residual", [0, 4])
def test_decode_over_the_borrowed_layout_equals_attention_over_the_dequantized_history(residual):
    caches, ks, vs, outs = _run(xquant_residual_bits=residual)
    layout = caches[1].store.decode_parts(mx.zeros((0,)))[0].keys
    assert isinstance(layout, AffineLayout if residual == 0 else ResidualScores)
    k_hat, v_hat = caches[1].dequantized(mx.float32)
    q = mx.random.normal((1, 4, 1, 32))
    got = stored_decode_attention(caches[1], q, 32 ** -0.5)
    assert mx.allclose(got, reference_attention(q, k_hat, v_hat, 32 ** -0.5), atol=1e-5)


def test_a_window_beyond_the_context_is_lossless():
    caches, ks, vs, outs = _run(window=4096)
    for i, c in enumerate(caches):
        q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(5 + T + DECODE - 1 + 100 * i))
        want = reference_attention(q, ks[i], vs[i], 32 ** -0.5)
        assert mx.allclose(outs[i][-1], want, atol=1e-5)


def test_groups_beyond_xquant_max_ctx_are_refused_naming_the_field():
    caches = layered("xquant", 2, {"residual_window": 32}, xquant_max_ctx=100)
    ks, vs = kv(T, 2)
    with pytest.raises(ValueError, match="xquant_max_ctx=100"):
        feed(caches, ks, vs, 64, stop=T)
    alone = layered("xquant", 1, {"residual_window": 32}, xquant_group_size=1, xquant_max_ctx=100)
    feed(alone, ks[:1], vs[:1], 64, stop=T)  # a group of one shares nothing: no limit
