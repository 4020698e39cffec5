"""A2ATS: with K covering the context attention is exact; a retrieving step is exact attention
over sinks, the chosen tokens and the window; windowed RoPE scores far keys as if b tokens
away from pre-RoPE codes; codes are nearest centroids (under the query metric when asked);
exact K/V are kept and counted in nbytes, against the card's formula."""

import mlx.core as mx
import pytest

from test_methods_exactness import run
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import A2ATSOptions
from veloxquant_mlx.methods.a2ats.cache import N_SINK, A2ATSCache
from veloxquant_mlx.quant.packed import GROWTH_TOKENS
from veloxquant_mlx.methods.a2ats.retrieval import metric_factor
from veloxquant_mlx.quant.vq import lookup_scores

BASE = 10000.0


def a2ats(**options):
    return A2ATSCache(KVCacheConfig(method="a2ats", options=A2ATSOptions(**options)), None, 0)


def rope(x, offset):
    return mx.fast.rope(x, x.shape[-1], traditional=False, base=BASE, scale=1.0, offset=offset)


def kv(t, d=64, h=2, seed=0, dtype=mx.float32):
    k = mx.random.normal((1, h, t, d), key=mx.random.key(seed))
    v = mx.random.normal((1, h, t, d), key=mx.random.key(seed + 1))
    return rope(k, 0).astype(dtype), v.astype(dtype)


def feed(cache, keys, values, chunk, gqa=2, seed=5):
    outs, t, i = [], keys.shape[2], 0
    while i < t:
        n = min(chunk, t - i)
        k, v = keys[:, :, i : i + n], values[:, :, i : i + n]
        cache.update_and_fetch(k, v)
        q = mx.random.normal((k.shape[0], k.shape[1] * gqa, n, k.shape[3]), key=mx.random.key(seed + i))
        outs.append(cache.attend(rope(q, i).astype(k.dtype), k, v, scale=k.shape[3] ** -0.5,
                                 mask="causal" if n > 1 else None))
        i += n
    return outs


@pytest.mark.parametrize("fraction, window", [(1.0, 128), (0.9, 16)])
def test_with_k_covering_every_candidate_the_model_decodes_as_with_the_full_cache(fraction, window):
    # (0.9, 16): floor(0.9 t) >= t - 16 - 8 candidates for every t up to 240 tokens
    model = tiny_model("llama")
    tokens = prompt(150)
    ref = run(model, make_prompt_cache(model, KVCacheConfig(method="full")), tokens, chunk=60, decode=10)
    config = KVCacheConfig(method="a2ats", options=A2ATSOptions(
        a2ats_retrieval_fraction=fraction, a2ats_window=window, a2ats_codebook_bits=4))
    out = run(model, make_prompt_cache(model, config), tokens, chunk=60, decode=10)
    assert mx.allclose(out, ref, atol=1e-5, rtol=1e-5), float(mx.abs(out - ref).max())
    sparse = KVCacheConfig(method="a2ats", options=A2ATSOptions(
        a2ats_retrieval_fraction=0.05, a2ats_window=16, a2ats_codebook_bits=4))
    out = run(model, make_prompt_cache(model, sparse), tokens, chunk=60, decode=10)
    assert not mx.allclose(out, ref, atol=1e-4, rtol=1e-4)  # the same run retrieving: not exact


def test_a_retrieving_step_is_exact_attention_over_sinks_chosen_tokens_and_window():
    keys, values = kv(300)
    cache = a2ats(a2ats_retrieval_fraction=0.1, a2ats_window=32, a2ats_codebook_bits=5, a2ats_rope_base=BASE)
    feed(cache, keys[:, :, :299], values[:, :, :299], 299)
    q = rope(mx.random.normal((1, 4, 1, 64), key=mx.random.key(7)), 299)
    k, v = keys[:, :, 299:], values[:, :, 299:]
    cache.update_and_fetch(k, v)
    out = cache.attend(q, k, v, scale=0.125, mask=None)
    idx, repeat = cache.store.selected(q, 299)
    assert idx.shape == (1, 2, 2 * 30)  # 2 query heads' top floor(0.1 * 300) = 30, a KV head
    keep = mx.zeros((1, 2, 300), mx.bool_)
    keep[:, :, :N_SINK] = True
    keep[:, :, 300 - 32 :] = True
    for head in range(2):
        keep[0, head, idx[0, head]] = True
    n_kept = keep.sum(axis=-1)
    assert bool(mx.all(n_kept >= N_SINK + 32 + 30)) and bool(mx.all(n_kept <= N_SINK + 32 + 60))
    mask = mx.where(mx.repeat(keep, 2, axis=1)[:, :, None, :], 0.0, -mx.inf)
    ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask)
    assert mx.allclose(out, ref, atol=1e-5, rtol=1e-5), float(mx.abs(out - ref).max())
    full = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125)
    assert not mx.allclose(out, full, atol=1e-4)


def test_windowed_rope_scores_every_far_key_as_if_b_tokens_away_from_its_pre_rope_code():
    s, bits, b, t = 8, 6, 512, 200
    centroids = mx.random.normal((1 << bits, s), key=mx.random.key(1))
    true_idx = mx.random.randint(0, 1 << bits, (1, 2, t, 64 // s), key=mx.random.key(2))
    k_pre = centroids[true_idx].reshape(1, 2, t, 64)  # every key sub-vector is a centroid
    values = mx.random.normal((1, 2, t, 64), key=mx.random.key(3))
    cache = a2ats(a2ats_retrieval_fraction=0.1, a2ats_window=16, a2ats_codebook_bits=bits, a2ats_b=b,
                  a2ats_codebook=centroids.tolist(), a2ats_use_query_aware=False, a2ats_rope_base=BASE)
    feed(cache, rope(k_pre, 0), values, 100)
    store = cache.store
    store._code_up_to(t)
    idx = store.codes.view().astype(mx.uint32)
    assert mx.array_equal(idx, true_idx.astype(mx.uint32))  # de-rotated exactly, coded exactly
    q_pre = mx.random.normal((1, 2, 2, 64), key=mx.random.key(4))  # 2 query heads a KV head
    q_post = rope(q_pre.reshape(1, 4, 1, 64), t - 1).reshape(1, 2, 2, 64)
    approx = lookup_scores(store.frame(q_post, mx.array([t - 1 - b])), idx, store.centroids[0])  # the row's codebook
    q_b = rope(q_pre.reshape(1, 4, 1, 64), b).reshape(1, 2, 2, 64)  # R_b q_pre (one position a head)
    wrope = q_b @ k_pre.swapaxes(-1, -2)
    assert mx.allclose(approx, wrope, atol=1e-3, rtol=1e-4), float(mx.abs(approx - wrope).max())
    true_logits = q_post @ rope(k_pre, 0).swapaxes(-1, -2)
    assert not mx.allclose(approx, true_logits, atol=1e-2)  # not the true relative positions


def _codes(**options):
    keys, values = kv(200, d=64)
    cache = a2ats(a2ats_retrieval_fraction=0.1, a2ats_window=16, a2ats_codebook_bits=5,
                  a2ats_rope_base=BASE, **options)
    feed(cache, keys, values, 100)
    feed(cache, *kv(1, seed=9), 1)  # a decode step: the codebook, codes past the window
    store = cache.store
    store._code_up_to(200)
    sub = store._sub_vectors(0, 200)
    return store.codes.view()[:, :, :200].astype(mx.uint32), sub, store.centroids[0]  # the row's codebook


def _assert_argmin(idx, dist):
    chosen = mx.take_along_axis(dist, idx.astype(mx.int32)[..., None], axis=-1)[..., 0]
    assert bool(mx.all(chosen <= dist.min(axis=-1) + 1e-4 * (1 + dist.min(axis=-1))))


def test_codes_are_the_nearest_centroid_of_the_pre_rope_sub_vectors():
    idx, sub, c = _codes(a2ats_use_query_aware=False)
    _assert_argmin(idx, mx.square(sub[..., None, :] - c).sum(-1))
    same, _, _ = _codes(a2ats_use_query_aware=True, a2ats_beta=1.0)  # beta 1: plain nearest
    assert mx.array_equal(same, idx)


def test_query_aware_codes_minimise_the_query_metric_error():
    a = mx.random.normal((8, 8), key=mx.random.key(11))
    h = a @ a.T + 0.1 * mx.eye(8)
    codebook = mx.random.normal((32, 8), key=mx.random.key(12))
    idx, sub, c = _codes(a2ats_query_h=h.tolist(), a2ats_codebook=codebook.tolist())
    diff = sub[..., None, :] - c  # (..., K, s)
    _assert_argmin(idx, ((diff @ (h + 1e-6 * mx.eye(8))) * diff).sum(-1))  # (k - c) H (k - c)^T
    plain, _, _ = _codes(a2ats_use_query_aware=False, a2ats_codebook=codebook.tolist())
    assert not mx.array_equal(idx, plain)
    identity, _, _ = _codes(a2ats_query_h=mx.eye(8).tolist(), a2ats_codebook=codebook.tolist())
    assert mx.array_equal(identity, plain)  # H = I: the plain nearest centroid
    l = metric_factor(h)  # the Cholesky identity the assignment relies on
    assert mx.allclose(l @ l.T, h + 1e-6 * mx.eye(8), atol=1e-4)


def test_exact_keys_and_values_are_kept_and_counted_in_nbytes_against_the_cards_formula():
    h, d, t, s, bits = 2, 64, 1000, 8, 8
    keys, values = kv(t, d=d, h=h, dtype=mx.float16)
    cache = a2ats(a2ats_retrieval_fraction=0.1, a2ats_window=64, a2ats_sub_dim=s, a2ats_codebook_bits=bits,
                  a2ats_rope_base=BASE)
    feed(cache, keys[:, :, :900], values[:, :, :900], 900)
    feed(cache, keys[:, :, 900:], values[:, :, 900:], 1)
    store = cache.store
    assert mx.array_equal(store.keys.view(), keys) and mx.array_equal(store.values.view(), values)
    # coded past the window at the first retrieval (token 901: 837 coded), then once a
    # window's worth more was past it (token 965: to 901); the newest 64 to 127 uncoded
    assert store.codes.length == 901
    per_token = h * 2 * d * 2  # K + V float16 rows
    tables = (1 << bits) * s * 4 + 2 * s * s * 4  # codebook, the metric's factor, the query moment
    formula = t * per_token + 901 * h * (d // s) + tables  # codes: a byte an index
    assert formula <= cache.nbytes <= formula + GROWTH_TOKENS * per_token, (cache.nbytes, formula)


def test_rotary_settings_contradicting_the_models_are_refused_naming_both():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"a2ats_rope_base=20000.0 contradicts the model's rope_theta=10000.0"):
        make_prompt_cache(model, KVCacheConfig(method="a2ats", options=A2ATSOptions(a2ats_rope_base=20000.0)))
    cache = make_prompt_cache(model, KVCacheConfig(method="a2ats", options=A2ATSOptions(a2ats_rope_base=10000.0)))
    assert cache[0].rotary.base == 10000.0
