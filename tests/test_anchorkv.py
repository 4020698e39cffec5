"""AnchorKV: every token kept (anchors and the window exactly), exact with every token an
anchor, residuals orthogonal to their anchors, anchors chosen by window/score/seed, the
byte budget, more budget never worse, decode over the anchor form against attention over
the reconstruction, decode tokens exact, memory, and the residual codec's levels."""

import math

import mlx.core as mx
import numpy as np
import pytest

from test_kivi import feed
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import AnchorKVOptions
from veloxquant_mlx.methods.anchorkv.anchors import AnchorPart
from veloxquant_mlx.methods.anchorkv.cache import AnchorKVCache, _assign, compress
from veloxquant_mlx.methods.anchorkv.lloyd_max import RotatedGaussian, gaussian_levels
from feeding import peak_above_held, stored_decode_attention


def anchorkv(**options):
    return AnchorKVCache(KVCacheConfig(method="anchorkv", options=AnchorKVOptions(**options)), None, 0)


def kv(t, d=32, h=2, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(1, h, 8, d))  # tokens near a few directions, as real keys are
    pick = rng.integers(0, 8, size=(1, h, t))
    k = np.take_along_axis(base, pick[..., None], axis=2) * rng.normal(1, 0.3, size=(1, h, t, 1))
    k = k + 0.3 * rng.normal(size=(1, h, t, d))
    v = rng.normal(size=(1, h, t, d))
    return mx.array(k, mx.float32), mx.array(v, mx.float32)


def compressed(n_prompt=300, n_decode=3, **options):
    keys, values = kv(n_prompt + n_decode)
    cache = anchorkv(**options)
    feed(cache, keys[:, :, :n_prompt], values[:, :, :n_prompt], 128)
    feed(cache, keys[:, :, n_prompt:], values[:, :, n_prompt:], 1)
    return cache, keys, values


def in_prompt_order(cache, keys, values):
    """The stored prompt rows put back in prompt order (the cache keeps no positions; the
    compression returns them to its caller)."""
    s = cache.store.part.count
    part, positions = compress(keys[:, :, :s], values[:, :, :s], cache.config.options, cache.store.codec)
    assert all(mx.array_equal(a, b) for a, b in zip(part.arrays().values(), cache.store.part.arrays().values()))
    k_hat, v_hat = part.dense(cache.store.codec)
    back = mx.argsort(positions, axis=-1)[..., None]
    return mx.take_along_axis(k_hat, back, axis=2), mx.take_along_axis(v_hat, back, axis=2), positions


def test_every_token_is_kept_and_decode_tokens_are_exact():
    cache, keys, values = compressed(anchorkv_window=8, anchorkv_anchor_frac=0.05)
    assert cache.stored_length == cache.offset == 303 and cache.store.part.count == 300
    assert mx.array_equal(cache.store.k_tail.view(), keys[:, :, 300:])
    assert mx.array_equal(cache.store.v_tail.view(), values[:, :, 300:])
    k_hat, v_hat = cache.dequantized(mx.float32)
    assert k_hat.shape == keys.shape and v_hat.shape == values.shape


def test_anchors_are_exact_the_window_first_then_by_score_then_seeded():
    cache, keys, values = compressed(anchorkv_window=8, anchorkv_anchor_frac=0.1, anchorkv_rho=0.5)
    part = cache.store.part
    assert part.anchor_k.shape[2] == 30  # round(300 * 0.1)
    k_hat, v_hat, positions = in_prompt_order(cache, keys, values)
    pos = np.array(positions[..., :30])
    prompt = np.array(keys[:, :, :300])
    assert np.array_equal(np.array(part.anchor_k), np.take_along_axis(prompt, pos[..., None], axis=2))
    assert mx.array_equal(k_hat[:, :, 292:], keys[:, :, 292:300])  # the window, bit-exact
    assert mx.array_equal(v_hat[:, :, 292:], values[:, :, 292:300])
    # scores: mean attention of the last 8 keys (as queries, causal) over every token
    q = prompt[:, :, 292:]
    logits = q @ prompt.swapaxes(-1, -2) / math.sqrt(32)
    logits = np.where(np.arange(300) <= np.arange(292, 300)[:, None], logits, -np.inf)
    alpha = np.exp(logits - logits.max(-1, keepdims=True))
    score = (alpha / alpha.sum(-1, keepdims=True)).mean(axis=2)
    window = set(range(292, 300))
    for h in range(2):
        chosen = set(pos[0, h].tolist())
        ranked = [p for p in np.argsort(-score[0, h]) if p not in window][:11]  # round(0.5 * 22)
        assert window <= chosen and set(ranked) <= chosen
    other = compressed(anchorkv_window=8, anchorkv_anchor_frac=0.1, anchorkv_rho=0.5, anchorkv_seed=7)[0]
    again = compressed(anchorkv_window=8, anchorkv_anchor_frac=0.1, anchorkv_rho=0.5)[0]
    assert all(mx.array_equal(a, b) for a, b in zip(again.store.part.arrays().values(), part.arrays().values()))
    assert not mx.array_equal(other.store.part.anchor_k, part.anchor_k)  # the uniform picks move


def test_every_token_an_anchor_is_exact():
    cache, keys, values = compressed(anchorkv_anchor_frac=1.0)
    k_hat, v_hat = cache.dequantized(mx.float32)
    assert mx.array_equal(k_hat, keys) and mx.array_equal(v_hat, values)  # anchors, in order


def test_a_residual_is_orthogonal_to_its_anchor_up_to_the_stored_coefficient():
    keys, _ = kv(200)
    anchors, x = keys[:, :, :10], keys[:, :, 10:]
    ref, gamma, res = _assign(x, anchors)
    chosen = mx.take_along_axis(anchors, ref[..., None].astype(mx.int32), axis=2)
    cos = (x[..., None, :] * anchors[:, :, None]).sum(-1) / (
        mx.linalg.norm(x, axis=-1)[..., None] * mx.linalg.norm(anchors, axis=-1)[:, :, None])
    assert mx.array_equal(ref, mx.argmax(mx.abs(cos), axis=-1))
    exact = (x * chosen).sum(-1) / (chosen * chosen).sum(-1)
    inner = (res * chosen).sum(-1)
    assert mx.allclose(inner, (exact - gamma.astype(mx.float32)) * (chosen * chosen).sum(-1), atol=1e-4)
    assert float(mx.abs(inner).max()) < 1e-2 * float((chosen * chosen).sum(-1).max())
    assert bool((gamma < 0).any())  # |cos| picks anti-aligned anchors too


def test_the_assignment_in_row_blocks_equals_it_in_one_and_holds_one_block(monkeypatch):
    """Rows are assigned a block at a time (issue 31: a 128k prompt held 35 GB of row-anchor
    products at once on the H200); each row's anchor, coefficient and residual are the ones
    of the unblocked assignment, and the peak is a block's, not all M x k products'."""
    from veloxquant_mlx.evict import attention

    keys, _ = kv(4096, d=64)
    anchors, x = keys[:, :, :1024], keys[:, :, 1024:]
    whole = _assign(x, anchors)  # 2 x 3072 x 1024 products: one block at the default size
    mx.eval(whole)
    products = 2 * 3072 * 1024 * 4  # bytes of the float32 products, 25 MB
    monkeypatch.setattr(attention, "SCORE_ELEMENTS", 2**16)  # 32 rows a block
    blocked, peak = peak_above_held(lambda: _assign(x, anchors))
    assert all(mx.array_equal(a, b) for a, b in zip(whole, blocked))
    outputs = sum(a.nbytes for a in blocked)  # 1.6 MB; the blocks' concatenation doubles it
    assert peak < 3 * outputs + products // 8, (peak, outputs, products)


def test_two_large_blocks_of_the_assignment_are_not_computed_together(monkeypatch):
    """Blocks chained lazily (``mx.depends``) ran together when they were few and large:
    two blocks of 2,048 rows peaked at 8.5 times one block's row-anchor products (abs,
    the norms' product, the cosines: about 3 arrays of that size a block, plus the
    residuals); evaluated one after the other, 4.8."""
    from veloxquant_mlx.evict import attention

    x = mx.random.normal((1, 2, 4096, 64), key=mx.random.key(1))
    anchors = mx.random.normal((1, 2, 256, 64), key=mx.random.key(2))
    mx.eval(x, anchors)
    monkeypatch.setattr(attention, "SCORE_ELEMENTS", 2 * 256 * 2048)  # two blocks
    _, peak = peak_above_held(lambda: _assign(x, anchors))
    block_products = 2 * 2048 * 256 * 4
    assert peak < 6 * block_products, peak / block_products


def test_compress_holds_no_float32_copy_of_the_others_or_their_residuals(monkeypatch):
    """The utilities are taken a block of the others at a time and only the chosen
    residuals are made again, from their anchor and γ: the stored part is bit for bit the
    one-block one, and the peak (float16 prompt, 2 heads, 3,000 tokens, 11 blocks) stays
    under 8 times the prompt's K+V bytes; gathering the others' keys and values and both
    residuals in float32 held 13 times them. (A block's products are one BLAS call of
    fewer rows: a γ may round to the next float16, here one of 2,977.)"""
    from veloxquant_mlx.evict import attention

    keys = mx.random.normal((1, 2, 3000, 64), key=mx.random.key(3)).astype(mx.float16)
    values = mx.random.normal((1, 2, 3000, 64), key=mx.random.key(4)).astype(mx.float16)
    mx.eval(keys, values)
    cache = AnchorKVCache(KVCacheConfig(method="anchorkv"), None, 0)
    o, codec = cache.config.options, cache.store.codec

    def compressed_arrays():
        part, positions = compress(keys, values, o, codec)
        return {**part.arrays(), "positions": positions}

    monkeypatch.setattr(attention, "SCORE_ELEMENTS", 1 << 30)
    whole = compressed_arrays()
    mx.eval(whole)
    monkeypatch.setattr(attention, "SCORE_ELEMENTS", 1 << 14)  # 11 blocks of 273 rows
    blocked, peak = peak_above_held(compressed_arrays)
    for name, a in whole.items():
        if name.endswith("_coef"):
            assert mx.allclose(a.astype(mx.float32), blocked[name].astype(mx.float32), rtol=2**-10, atol=0)
            assert (a != blocked[name]).sum().item() <= 2, name
        else:
            assert mx.array_equal(a, blocked[name]), name
    assert peak < 8 * (keys.nbytes + values.nbytes), peak / (keys.nbytes + values.nbytes)


def part_bytes(part: AnchorPart) -> int:
    return sum(a.nbytes for a in part.arrays().values())


@pytest.mark.parametrize("theta", [0.05, 0.1, 0.3])
def test_stored_bytes_meet_the_budget_and_the_formula(theta):
    cache, _, _ = compressed(anchorkv_theta=theta, anchorkv_window=8, anchorkv_anchor_frac=0.02, anchorkv_residual_bits=2)
    part, s, d, h = cache.store.part, 300, 32, 2
    k, m = 6, 294
    n_k, n_v = part.key_codes.shape[2], part.value_codes.shape[2]
    words = d * 2 // 32
    formula = h * (k * 2 * d * 4 + m * (1 + 4 + 2) + 4 * k + n_k * (4 * words + 2) + n_v * (4 * words + 2 + 2))
    assert part_bytes(part) == formula
    assert part_bytes(part) <= theta * s * 2 * d * 4 * h  # θ of the prompt's float32 K+V
    base = h * (k * 2 * d * 4 + m * 7 + 4 * k)
    # the budget is used: what is left is less than one more residual (each priced with a
    # position, which key residuals do not store)
    if n_v < m:
        assert theta * s * 2 * d * 4 * h - part_bytes(part) < h * (4 * words + 4 + n_k * 2)
        assert n_v - n_k in (0, 1) and n_k > 0 and base < part_bytes(part)
    else:  # every token has both residuals: the budget cannot all be spent
        assert n_k == n_v == m


def test_below_the_base_cost_no_residual_is_kept():
    cache, _, _ = compressed(anchorkv_theta=0.02, anchorkv_anchor_frac=0.02)
    assert cache.store.part.key_codes.shape[2] == cache.store.part.value_codes.shape[2] == 0


def test_more_budget_never_reconstructs_worse():
    errors = []
    for theta in (0.02, 0.05, 0.1, 0.2, 0.5, 1.0):
        cache, keys, values = compressed(anchorkv_theta=theta, anchorkv_anchor_frac=0.02, anchorkv_window=4)
        k_hat, v_hat, _ = in_prompt_order(cache, keys, values)
        errors.append(float(((k_hat - keys[:, :, :300]) ** 2).sum() + ((v_hat - values[:, :, :300]) ** 2).sum()))
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.5 * errors[0]


def test_decode_over_the_anchor_form_equals_attention_over_the_reconstruction():
    cache, keys, values = compressed(anchorkv_theta=0.2, anchorkv_window=4, anchorkv_anchor_frac=0.05)
    part = cache.store.part
    assert part.key_codes.shape[2] > 0 and part.value_codes.shape[2] > 0
    k_hat, v_hat = cache.dequantized(mx.float32)
    for gqa in (1, 2):
        q = mx.random.normal((1, 2 * gqa, 1, 32), key=mx.random.key(gqa))
        ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=32**-0.5)
        assert mx.allclose(stored_decode_attention(cache, q, 32**-0.5), ref, atol=1e-5, rtol=1e-4)


def test_the_residual_codec_levels_and_its_reads():
    assert np.allclose(gaussian_levels(2), [-1.5104, -0.4528, 0.4528, 1.5104], atol=1e-4)
    assert np.allclose(gaussian_levels(1), [-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)], atol=1e-6)
    r = mx.random.normal((4, 50, 128), key=mx.random.key(0))
    errors = []
    for bits in (1, 2, 3, 4, 8):
        codec = RotatedGaussian(bits, 42)
        codes, scales = codec.encode(r)
        r_hat = codec.decode(codes, scales)
        errors.append(float(((r - r_hat) ** 2).sum() / (r**2).sum()))
        q = mx.random.normal((4, 1, 128), key=mx.random.key(1))
        folded = (codec.rotate(q) * codec.coordinates(codes, scales)).sum(-1)
        assert mx.allclose(folded, (q * r_hat).sum(-1), atol=1e-4)
    assert errors == sorted(errors, reverse=True)
    assert abs(errors[1] - 0.1175) < 0.01 and errors[-1] < 1e-3  # Lloyd-Max MSE of a Gaussian at 2 bits


@pytest.mark.parametrize("rho,frac", [(0.5, 0.1), (0.0, 0.3), (1.0, 0.05)])
def test_the_prompt_end_reads_no_anchor_count_on_the_host(rho, frac):
    """Issue 31: the random anchors' count was read on the host at every layer's prompt end
    (a device drain a layer). Each pick adds exactly the tokens asked for, so it is known:
    the only host work left is the memory-bounding evaluations, and the anchor count holds."""
    from decode_steps import recording_host_reads

    keys = mx.random.normal((2, 2, 300, 32), key=mx.random.key(5)).astype(mx.float16)
    values = mx.random.normal((2, 2, 300, 32), key=mx.random.key(6)).astype(mx.float16)
    o = AnchorKVOptions(anchorkv_rho=rho, anchorkv_anchor_frac=frac)
    cache = AnchorKVCache(KVCacheConfig(method="anchorkv", options=o), None, 0)
    with recording_host_reads() as reads:
        part, positions = compress(keys, values, cache.config.options, cache.store.codec)
        mx.eval(part.arrays())
    assert {r.call for r in reads} <= {"mx.eval"}, [str(r) for r in reads]
    n_anchor = max(1, round(300 * frac))
    assert part.anchor_k.shape[2] == n_anchor and part.count == 300  # as many anchors as asked
    assert mx.array_equal(mx.sort(positions, axis=-1), mx.broadcast_to(mx.arange(300), positions.shape))
