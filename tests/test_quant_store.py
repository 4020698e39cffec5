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
    full_precision = [a for name, a in store.arrays().items() if name.endswith("_res")]
    assert sum(a.shape[2] for a in full_precision) < 64 + 64  # the windows, nothing else
    assert store.length == 1000 and store.keys.count + store.k_res.shape[2] == 1000
