"""The quantized store and the decode entry point: parts attended under one softmax.

A store's history may sit in several parts of different bit widths (segments by age, by
epoch); decode attention over them must equal float32 attention over the dequantized
tokens, on the pure-MLX path here (the GPU path merges the kernels' partial states the
same way; benchmarks/fused_attention.py checks it on the device).
"""

import mlx.core as mx
import pytest

from veloxquant_mlx.kernels.decode import DecodePart, decode_attention
from veloxquant_mlx.quant.packed import GroupAffine, PackedTokens
from veloxquant_mlx.quant.store import QuantizedKVStore, Segment

B, H, G, D = 1, 2, 4, 64


def tokens(n, seed):
    k = mx.random.normal((B, H, n, D), key=mx.random.key(seed))
    v = mx.random.normal((B, H, n, D), key=mx.random.key(seed + 1))
    return k, v


def reference(q, k, v):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5)


@pytest.mark.parametrize("bits", [(8, 4), (2, 4, 8)])
def test_parts_of_different_bit_widths_share_one_softmax(bits):
    """Sealed segments at each width, then the open part (packed + residual tails)."""
    store = QuantizedKVStore(GroupAffine(bits[-1], 32, "channel"), GroupAffine(bits[-1], 32, "token"),
                             window=32, key_block=32, step_tokens=256)
    for i, b in enumerate(bits[:-1]):
        seg = Segment(PackedTokens(GroupAffine(b, 32, "channel")), PackedTokens(GroupAffine(b, 32, "token")))
        k, v = tokens(96, seed=10 * i)
        seg.keys.append(k)
        seg.values.append(v)
        store.segments.append(seg)
    k, v = tokens(150, seed=99)
    store.commit(k, v)
    q = mx.random.normal((B, H * G, 1, D), key=mx.random.key(5))
    hist_k, hist_v = store.history(mx.float32)
    assert hist_k.shape[2] == 96 * (len(bits) - 1) + 150
    parts = store.decode_parts(mx.zeros((0,)))
    assert len(parts) == len(bits)
    out = decode_attention(q, parts, scale=D**-0.5)
    assert mx.allclose(out, reference(q, hist_k, hist_v), atol=1e-5, rtol=1e-5)


def test_one_part_split_in_two_gives_the_same_attention():
    """The open part alone, or its packed tokens as a sealed segment of their own."""
    k, v = tokens(256, seed=3)
    codec_k, codec_v = GroupAffine(4, 32, "channel"), GroupAffine(4, 32, "token")
    whole = PackedTokens(codec_k), PackedTokens(codec_v)
    whole[0].append(k[:, :, :224])
    whole[1].append(v[:, :, :224])
    first, second = (PackedTokens(codec_k), PackedTokens(codec_v)), (PackedTokens(codec_k), PackedTokens(codec_v))
    for packed, part in ((first, slice(0, 128)), (second, slice(128, 224))):
        packed[0].append(k[:, :, part])
        packed[1].append(v[:, :, part])
    empty = mx.zeros((0,))
    tail_k, tail_v = k[:, :, 224:], v[:, :, 224:]
    one = [DecodePart(whole[0].layout(empty), tail_k, whole[1].layout(empty), tail_v)]
    two = [DecodePart(first[0].layout(empty), None, first[1].layout(empty), None),
           DecodePart(second[0].layout(empty), tail_k, second[1].layout(empty), tail_v)]
    q = mx.random.normal((B, H * G, 1, D), key=mx.random.key(8))
    a, b = decode_attention(q, one, scale=D**-0.5), decode_attention(q, two, scale=D**-0.5)
    assert mx.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_the_store_keeps_no_full_precision_history():
    store = QuantizedKVStore(GroupAffine(2, 32, "channel"), GroupAffine(2, 32, "token"),
                             window=64, key_block=64, step_tokens=256)
    for seed in range(10):
        k, v = tokens(100, seed)
        store.commit(k, v)
    for t in range(70):  # then decode steps, one token each
        k, v = tokens(1, 100 + t)
        store.commit(k, v)
    full_precision = [a for name, a in store.arrays().items() if name.endswith("_res")]
    assert sum(a.capacity for a in full_precision) <= 64 + 64 + 32  # the windows and their room
    assert store.length == 1070 and store.keys.count + store.k_res.shape[2] == 1070
    assert store.v_res.shape[2] == 64 and store.values.count == 1070 - 64


def test_parts_that_hold_some_heads_each_merge_per_head():
    """Per-head bit widths: heads 0 and 2 at 8 bits, 1 and 3 at 2 bits, then a tail."""
    h = 4
    k = mx.random.normal((B, h, 128, D), key=mx.random.key(1))
    v = mx.random.normal((B, h, 128, D), key=mx.random.key(2))
    tail_k = mx.random.normal((B, h, 20, D), key=mx.random.key(3))
    tail_v = mx.random.normal((B, h, 20, D), key=mx.random.key(4))
    empty, parts, hist_k, hist_v = mx.zeros((0,)), [], mx.zeros_like(k), mx.zeros_like(v)
    for bits, heads in ((8, mx.array([0, 2])), (2, mx.array([1, 3]))):
        pk, pv = PackedTokens(GroupAffine(bits, 32, "channel")), PackedTokens(GroupAffine(bits, 32, "token"))
        pk.append(k[:, heads])
        pv.append(v[:, heads])
        hist_k[:, heads] = pk.decode(mx.float32)
        hist_v[:, heads] = pv.decode(mx.float32)
        parts.append(DecodePart(pk.layout(empty), None, pv.layout(empty), None, heads=heads))
    parts.append(DecodePart(None, tail_k, None, tail_v))
    q = mx.random.normal((B, h * G, 1, D), key=mx.random.key(5))
    out = decode_attention(q, parts, scale=D**-0.5)
    ref = reference(q, mx.concatenate([hist_k, tail_k], 2), mx.concatenate([hist_v, tail_v], 2))
    assert mx.allclose(out, ref, atol=1e-5, rtol=1e-5)
    only_heads = decode_attention(q, parts[:2], scale=D**-0.5, n_kv_heads=h)
    assert mx.allclose(only_heads, reference(q, hist_k, hist_v), atol=1e-5, rtol=1e-5)


class DenseScores:
    """A stand-in codec the kernels cannot read: plain keys and values."""

    def __init__(self, x):
        self.x, self.count, self.n_heads = x.astype(mx.float32), x.shape[2], x.shape[1]

    def scores(self, q):
        return q @ self.x.swapaxes(-1, -2)

    def mix(self, p):
        return p @ self.x


def test_parts_in_a_codec_only_the_pure_path_reads_join_the_merge():
    k, v = tokens(100, seed=7)
    tail_k, tail_v = tokens(9, seed=8)
    parts = [DecodePart(DenseScores(k), None, DenseScores(v), None), DecodePart(None, tail_k, None, tail_v)]
    q = mx.random.normal((B, H * G, 1, D), key=mx.random.key(9))
    out = decode_attention(q, parts, scale=D**-0.5)
    ref = reference(q, mx.concatenate([k, tail_k], 2), mx.concatenate([v, tail_v], 2))
    assert mx.allclose(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 8])
def test_codes_pack_in_mx_quantize_order_at_every_width(bits):
    from veloxquant_mlx.quant.affine import pack_codes, unpack_codes

    codes = mx.random.randint(0, 2**bits, (2, 3, 96), key=mx.random.key(bits)).astype(mx.uint32)
    words = pack_codes(codes, bits)
    assert words.shape == (2, 3, 96 * bits // 32)
    assert mx.array_equal(unpack_codes(words, bits), codes)
    ones, zeros = mx.ones((2, 3, 3)), mx.zeros((2, 3, 3))
    assert mx.array_equal(mx.dequantize(words, ones, zeros, group_size=32, bits=bits), codes.astype(mx.float32))


def _quantized_op_by_op(x, group_size, bits, alpha=None):
    """The card's min-max quantizer written out one operation at a time (the reference);
    ``alpha`` (B, H): SKVQ's clip ratio on each group's minimum and maximum."""
    from veloxquant_mlx.quant.affine import _MIN_SCALE, pack_codes

    *lead, n = x.shape
    groups = x.reshape(*lead, n // group_size, group_size).astype(mx.float32)
    low, high = groups.min(axis=-1, keepdims=True), groups.max(axis=-1, keepdims=True)
    if alpha is not None:
        low, high = low * alpha[:, :, None, None, None], high * alpha[:, :, None, None, None]
    scale = mx.maximum((high - low) / (2**bits - 1), _MIN_SCALE).astype(x.dtype)
    low = low.astype(x.dtype)
    codes = mx.clip(mx.round((groups - low.astype(mx.float32)) / scale.astype(mx.float32)), 0, 2**bits - 1)
    return pack_codes(codes.reshape(*lead, n), bits), scale.squeeze(-1), low.squeeze(-1)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_the_compiled_quantizer_gives_the_op_by_op_codes_at_any_shape(bits, dtype):
    """One shapeless compiled pass a width and group serves every chunk length (a prompt's
    last chunk, a decode block, one token), a constant group included, bit for bit."""
    from veloxquant_mlx.quant.affine import quantize

    for shape, group in [((1, 4, 64, 128), 32), ((1, 4, 7, 128), 64), ((2, 3, 1, 64), 32), ((3, 5, 256), 128)]:
        x = (3 * mx.random.normal(shape, key=mx.random.key(bits + shape[-2]))).astype(dtype)
        x = mx.concatenate([mx.full(x[..., :1, :].shape, 1.5, dtype), x[..., 1:, :]], axis=-2)
        for got, want in zip(quantize(x, group, bits), _quantized_op_by_op(x, group, bits)):
            assert got.dtype == want.dtype and mx.array_equal(got, want)


@pytest.mark.parametrize("bits, group", [(4, 1), (2, 8), (4, 16), (7, 32), (3, 64), (8, 128)])
def test_clipped_rows_at_any_width_and_group_give_the_op_by_op_codes(bits, group):
    """``token_rows.quantize_rows`` through the same compiled pass: a clip ratio per (batch
    row, KV head), groups narrower than a word's codes (2 bits in 8) and widths that
    straddle words (3, 7); groups of one channel uncompiled (MLX's shapeless compile
    crashes on a reduction over one element)."""
    from veloxquant_mlx.quant.token_rows import quantize_rows

    x = (2 * mx.random.normal((2, 3, 9, 128), key=mx.random.key(bits))).astype(mx.float16)
    alpha = mx.random.uniform(0.6, 1.0, (2, 3), key=mx.random.key(group))
    for a in (None, alpha):
        for got, want in zip(quantize_rows(x, group, bits, a), _quantized_op_by_op(x, group, bits, a)):
            assert got.dtype == want.dtype and mx.array_equal(got, want)


def test_a_prompt_chunks_quantization_is_seven_kernels():
    """The minimum and maximum (in the input's dtype) and their casts, the scales' pass, the
    codes' pass (shifted into their words) and the words' sum: on a GPU each node is a
    launch, and a prompt chunk quantizes keys and values of every layer (the operations one
    by one made 13 kernels: kivi's chunk 60 kernels a layer then, 40 now; age_tiered's
    176 -> 96: ``benchmarks/prefill_census.py``)."""
    import os
    import re
    import tempfile

    from veloxquant_mlx.quant.affine import quantize

    x = mx.random.normal((1, 8, 2048, 128), key=mx.random.key(0)).astype(mx.float16)
    mx.eval(x)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "q.dot")
        mx.export_to_dot(path, *quantize(x, 32, 2))
        kernels = [label for label in re.findall(r'label ="?([A-Za-z_]+)"?, shape=rectangle', open(path).read())
                   if label not in ("Reshape", "Squeeze", "Broadcast", "Slice")]
    assert len(kernels) == 7, kernels


def test_the_quantizers_switch_gives_the_same_codes_one_operation_at_a_time(monkeypatch):
    """``VQ_COMPILED_QUANTIZER=0`` (benchmarks' A/B): the same pass uncompiled, the same codes."""
    from veloxquant_mlx.quant.affine import quantize

    x = mx.random.normal((1, 2, 40, 64), key=mx.random.key(5)).astype(mx.float16)
    compiled = quantize(x, 32, 4)
    monkeypatch.setenv("VQ_COMPILED_QUANTIZER", "0")
    for got, want in zip(quantize(x, 32, 4), compiled):
        assert mx.array_equal(got, want)


@pytest.mark.parametrize("bits", [3, 5, 6, 7])
def test_codes_of_six_axes_pack_and_unpack_at_widths_across_words(bits):
    """kitty's 7-bit plane, (B, H, blocks, channels, words): on CUDA its pack and unpack
    failed with 'ndim can not be larger than 10' (MLX turns the slices before an index
    array into index arrays; benchmarks/results/h200_s67). The leading axes go as one."""
    from veloxquant_mlx.quant.affine import pack_codes, unpack_codes

    codes = mx.random.randint(0, 2**bits, (2, 2, 3, 4, 5, 64), key=mx.random.key(bits)).astype(mx.uint32)
    words = pack_codes(codes, bits)
    assert words.shape == (2, 2, 3, 4, 5, 64 * bits // 32)
    assert mx.array_equal(unpack_codes(words, bits), codes)
    flat = pack_codes(codes.reshape(-1, 64), bits)  # the same words as each row packed alone
    assert mx.array_equal(words.reshape(-1, 2 * bits), flat)


@pytest.mark.parametrize("bits", [3, 5, 6])
def test_a_lone_part_at_a_width_the_kernels_do_not_take_is_attended(bits):
    k, v = tokens(320, seed=bits)
    pk, pv = PackedTokens(GroupAffine(bits, 32, "channel")), PackedTokens(GroupAffine(bits, 32, "token"))
    pk.append(k)
    pv.append(v)
    empty = mx.zeros((0,))
    q = mx.random.normal((B, H * G, 1, D), key=mx.random.key(1))
    out = decode_attention(q, [DecodePart(pk.layout(empty), None, pv.layout(empty), None)], scale=D**-0.5)
    assert mx.allclose(out, reference(q, pk.decode(mx.float32), pv.decode(mx.float32)), atol=1e-4, rtol=1e-4)


def test_a_part_of_full_precision_tokens_only_is_attended():
    k, v = tokens(50, seed=4)
    q = mx.random.normal((B, H * G, 1, D), key=mx.random.key(2))
    out = decode_attention(q, [DecodePart(None, k, None, v)], scale=D**-0.5)
    assert mx.allclose(out, reference(q, k, v), atol=1e-5, rtol=1e-5)


def test_one_softmax_over_every_part_matches_the_merge_of_per_part_partials():
    """The pure path's joint softmax against the partials' log-sum-exp merge it replaced.

    Both are float32 sums of the same products with weights that differ only in rounding:
    the merge weighs a part by 2^(m log2 e - top), whose exponent is rounded to within
    eps |m| log2 e (a relative error of eps |m| in the weight), then exp, power, the two
    sums (log2 n levels) and the division add a few eps each. So the outputs agree to
    eps (max|m| + log2 n + 8) max|v|."""
    import math

    from veloxquant_mlx.kernels.decode import _pure_partials, merge_partials_mlx

    k, v = tokens(256, seed=11)
    tail_k, tail_v = tokens(17, seed=12)
    codec_k, codec_v = GroupAffine(4, 32, "channel"), GroupAffine(2, 32, "token")
    packed = [(PackedTokens(codec_k), PackedTokens(codec_v)) for _ in range(2)]
    for (pk, pv), rows in zip(packed, (slice(0, 128), slice(128, 256))):
        pk.append(k[:, :, rows] * 3)  # scores of a few units: the exponent rounding shows
        pv.append(v[:, :, rows])
    empty = mx.zeros((0,))
    parts = [DecodePart(packed[0][0].layout(empty), None, packed[0][1].layout(empty), None),
             DecodePart(DenseScores(k[:, :, :64]), None, DenseScores(v[:, :, :64]), None),
             DecodePart(packed[1][0].layout(empty), tail_k, packed[1][1].layout(empty), tail_v)]
    q = mx.random.normal((B, H * G, 1, D), key=mx.random.key(13))
    joint = decode_attention(q, parts, scale=D**-0.5)
    states = [_pure_partials(q, p, D**-0.5) for p in parts]
    merged = merge_partials_mlx(mx.concatenate([o for o, _ in states], axis=1),
                                mx.concatenate([ml for _, ml in states], axis=1), q.shape, q.dtype)
    m = mx.concatenate([ml[..., 0] for _, ml in states], axis=1) / 1.4426950408889634
    n = sum(p.length for p in parts)
    eps = float(mx.finfo(mx.float32).eps)
    bound = eps * (mx.abs(m).max().item() + math.log2(n) + 8) * mx.abs(v).max().item()
    assert mx.abs(joint - merged).max().item() <= bound
    assert not mx.array_equal(joint, merged)  # the joint path ran, not the merge


def test_a_prompt_chunk_over_a_history_waits_for_the_layer_before_it(monkeypatch):
    """Layer by layer through one prompt chunk (each layer's queries from the one before):
    when layer 1's chunk has attended, layer 0's output is computed, not a graph waiting
    for the end of the model. Left lazy, a GPU held every layer's decoded history at once
    (the 8B shape at 32k: 11.7 GB against 2.5 GB paced, benchmarks/notes/prefill.md).
    Without the GPU, not paced: the output stays a graph."""
    from decode_steps import graph_nodes
    from veloxquant_mlx.quant import store as store_module

    monkeypatch.setattr(store_module, "PACE_ON_CPU", True)  # paced on a GPU only

    stores = [QuantizedKVStore(GroupAffine(4, 32, "channel"), GroupAffine(4, 32, "token"),
                               window=32, key_block=32, step_tokens=256) for _ in range(2)]
    for i, store in enumerate(stores):
        store.commit(*tokens(128, 10 + i))
    mx.eval([a for s in stores for a in s.arrays().values() if isinstance(a, mx.array)])
    q = mx.random.normal((B, H * G, 64, D), key=mx.random.key(7))
    outs, wants = [], []
    for i, store in enumerate(stores):
        k, v = tokens(64, 20 + i)
        old_k, old_v = store.history(mx.float32)
        wants.append(mx.fast.scaled_dot_product_attention(
            q, mx.concatenate([old_k, k], 2), mx.concatenate([old_v, v], 2), scale=D**-0.5, mask="causal"))
        q = store.prefill_attention(q, k, v, scale=D**-0.5, mask="causal")
        outs.append(q)
    assert graph_nodes([outs[0]]) == 0
    assert store_module._pacing.previous is outs[1]  # held until the next layer's chunk...
    store_module.end_pacing()  # ...or a decode step
    assert store_module._pacing.previous is None
    monkeypatch.setattr(store_module, "PACE_ON_CPU", False)
    assert graph_nodes([stores[0].prefill_attention(q, *tokens(8, 30), scale=D**-0.5, mask="causal")]) > 0
    assert all(mx.array_equal(o, w) for o, w in zip(outs, wants))  # the same attention, scheduled earlier
