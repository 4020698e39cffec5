"""RocketKV's card invariants, by brute force on synthetic K/V/Q.

Caches are driven the way mlx-lm drives them: update_and_fetch, then attention through
the cache (the hook's job); the last prompt token comes alone, then one token a step.
"""

from __future__ import annotations

import copy
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from feeding import feed, run_prompt, synthetic_kvq
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import RocketKVOptions, SnapKVOptions
from veloxquant_mlx.evict.base import ScoreInputs
from veloxquant_mlx.methods.rocketkv.window_vote import window_vote
from veloxquant_mlx.methods.rocketkv.cache import RocketKVCache, approximate_logits, capacity, stage2_plan
from veloxquant_mlx.methods.snapkv import SnapKVCache

HKV, D = 2, 16
SCALE = D**-0.5


def synthetic(n, group=3, seed=0):
    return synthetic_kvq(n, HKV, group, D, q_scale=1.5, norm_range=(0.2, 3.0), seed=seed)


def rocket(**options):
    return RocketKVCache(KVCacheConfig(options=RocketKVOptions(**options)))


def kept_lists(cache):
    if cache.kept_positions is None:
        return [list(range(cache.offset))] * HKV
    return [cache.kept_positions[0, h].tolist() for h in range(HKV)]


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


# -- budgets ------------------------------------------------------------------------------
def test_budget_formulas_give_the_cards_numbers():
    assert capacity(4096, 8.0) == 1858
    assert stage2_plan(4096, 8.0, 128, 1858) == (2, 71, 256)
    assert capacity(16384, 32.0) == 2896
    assert stage2_plan(16384, 32.0, 128, 2896) == (3, 68, 256)
    assert stage2_plan(4096, 8.0, 128, 1858, page_size=4) == (4, 128, 256)  # r = round(128 * 4 / 3.63), capped
    assert stage2_plan(4096, 8.0, 128, 1858, page_size=4, topk1=10) == (4, 10, 256)
    assert capacity(4096, 1.0) == 4096  # c = 1 keeps everything


def test_a_head_topk1_above_head_dim_is_refused_naming_the_field():
    k, v, q = synthetic(10)
    cache = rocket(rocketkv_head_topk1=17)
    with pytest.raises(ValueError, match=r"rocketkv_head_topk1=17: the model's head_dim is 16; allowed: 1 to 16"):
        cache.update_and_fetch(k, v)


# -- stage 1 -------------------------------------------------------------------------------
def test_the_vote_with_kernel_7_is_snapkvs_score():
    k, v, q = synthetic(150, seed=4)
    cache = SnapKVCache(KVCacheConfig(options=SnapKVOptions(snap_budget=512)))
    feed(cache, k, v, q, 0, 149)
    inputs = ScoreInputs(cache, q[:, :, 148:149], SCALE)
    assert mx.array_equal(window_vote(inputs, 7), cache.score(inputs))


def _stage1_pooled(kn, qn, n, group, window, kernel=63):
    """Softmax of the window's queries over all keys (causal), summed over the window and
    the group, max-pooled (-inf padding) over the prefix: (H, n - window)."""
    rows = np.arange(n - window, n)
    out = []
    for h in range(HKV):
        x = np.einsum("gwd,jd->gwj", qn[h * group : (h + 1) * group][:, rows], kn[h][:n]) * SCALE
        x = np.where(np.arange(n)[None, None] <= rows[None, :, None], x, -np.inf)
        s = softmax(x).sum(axis=(0, 1))[: n - window]
        half = kernel // 2
        out.append(np.array([s[max(0, j - half) : j + half + 1].max() for j in range(n - window)]))
    return out


@pytest.mark.parametrize("ratio,window,sink,group,chunk", [(16.0, 16, 4, 3, 64), (8.0, 32, 0, 1, 300),
                                                           (32.0, 8, 2, 2, 37)])
def test_stage1_keeps_the_max_pooled_window_vote_then_decode_evicts_nothing(ratio, window, sink, group, chunk):
    n_prompt = 300
    k, v, q = synthetic(340, group=group, seed=int(ratio))
    kn, qn = np.array(k[0], dtype=np.float64), np.array(q[0], dtype=np.float64)
    cache = rocket(rocketkv_compression_ratio=ratio, rocketkv_obs_window=window, rocketkv_n_sink=sink)
    run_prompt(cache, k, v, q, n_prompt, chunk)
    c1 = max(capacity(n_prompt, ratio), sink + window)
    assert cache.stored_length == c1 == cache.budget
    kept = kept_lists(cache)
    protected = set(range(sink)) | set(range(n_prompt - window, n_prompt))
    def ranked_by(pooled, h):  # pooling makes runs of equal scores: any of a tie may be kept
        chosen = set(kept[h]) - protected
        dropped = set(range(sink, n_prompt - window)) - chosen
        return min(pooled[j] for j in chosen) >= max(pooled[j] for j in dropped) * (1 - 1e-5)

    for h, pooled in enumerate(_stage1_pooled(kn, qn, n_prompt, group, window)):
        assert protected <= set(kept[h]) and len(kept[h]) == c1
        assert ranked_by(pooled, h)
    # and not by SnapKV's kernel 7
    assert not all(ranked_by(p, h) for h, p in enumerate(_stage1_pooled(kn, qn, n_prompt, group, window, 7)))
    for t in range(n_prompt, 340):  # stage 2 evicts nothing: every decoded token joins
        feed(cache, k, v, q, t, t + 1)
        assert cache.stored_length == c1 + t + 1 - n_prompt
    assert kept_lists(cache) == [s + list(range(n_prompt, 340)) for s in kept]


# -- pages ---------------------------------------------------------------------------------
def _check_pages(cache):
    p = cache.plan[0]
    keys = np.array(cache.store.view("keys"))
    rows = keys.shape[2]
    pages = np.array(cache.pages.view())  # (B, H, 2D, pages)
    d = keys.shape[-1]
    lo, hi = pages[:, :, :d].swapaxes(-1, -2), pages[:, :, d:].swapaxes(-1, -2)
    assert lo.shape[2] == hi.shape[2] == math.ceil(rows / p) and cache.paged_rows == rows
    for page in range(lo.shape[2]):
        block = keys[:, :, page * p : (page + 1) * p]
        assert np.array_equal(lo[:, :, page], block.min(axis=2))
        assert np.array_equal(hi[:, :, page], block.max(axis=2))


def test_page_min_and_max_bound_every_key_of_their_page_as_tokens_arrive():
    k, v, q = synthetic(260, seed=2)
    cache = rocket(rocketkv_compression_ratio=16.0, rocketkv_page_size=3)
    run_prompt(cache, k, v, q, 200)
    assert cache.stored_length % 3  # the last page is partial: decode tokens fill it, then open one
    _check_pages(cache)
    for t in range(200, 260):
        feed(cache, k, v, q, t, t + 1)
        _check_pages(cache)
    store = sum(a.nbytes for a in cache.store.arrays.values())
    assert cache.pages.nbytes > 0 and cache.nbytes == store + cache.pages.nbytes


def test_trimming_an_uncompressed_cache_rebuilds_its_pages():
    k, v, q = synthetic(120, seed=5)
    cache = rocket(rocketkv_compression_ratio=1.0, rocketkv_page_size=4)  # c = 1: nothing evicted
    run_prompt(cache, k, v, q, 90)
    for t in range(90, 95):
        feed(cache, k, v, q, t, t + 1)
    assert cache.is_trimmable() and cache.trim(7) == 7 and cache.offset == 88
    _check_pages(cache)
    for t in range(88, 100):  # steps after the trim extend the rebuilt pages
        feed(cache, k, v, q, t, t + 1)
        _check_pages(cache)


def test_single_token_pages_are_the_keys_themselves():
    k, v, q = synthetic(220, seed=3)
    cache = rocket(rocketkv_compression_ratio=16.0, rocketkv_page_size=1)
    run_prompt(cache, k, v, q, 200)
    feed(cache, k, v, q, 200, 201)
    assert cache.pages.buffer is None and cache.nbytes == sum(a.nbytes for a in cache.store.arrays.values())


# -- stage 2 -------------------------------------------------------------------------------
def _stage2_expected(cache, kn, vn, qn, t, group):
    """The chosen pages (per KV head, as sets) and each query head's output, float64."""
    p, r, k2 = cache.plan
    n_sel = -(-k2 // p)
    pages, outs = [], []
    for h, kept in enumerate(kept_lists(cache)):
        keys, values = kn[h][kept], vn[h][kept]
        rows = len(kept)
        q = qn[h * group : (h + 1) * group, t]  # (G, D)
        dims = np.argsort(-np.abs(q).sum(0))[:r]
        up = q[:, dims].sum(0) > 0
        page_of = np.arange(rows) // p
        n_pages = page_of[-1] + 1
        proxy = np.stack([np.where(up, keys[page_of == i][:, dims].max(0), keys[page_of == i][:, dims].min(0))
                          for i in range(n_pages)])
        x = q[:, dims] @ proxy.T  # (G, pages)
        temp = np.sqrt(D * np.abs(q[:, dims]).sum(1) / np.abs(q).sum(1))[:, None]
        token = softmax(x[:, page_of] / temp).sum(0)  # every token carries its page's score
        per_page = np.array([token[page_of == i][0] for i in range(n_pages)])
        chosen = set(np.argsort(-per_page)[:n_sel].tolist()) if n_sel < n_pages else set(range(n_pages))
        pages.append(chosen)
        attended = np.isin(page_of, list(chosen))
        for g in range(group):
            w = softmax(keys[attended] @ qn[h * group + g, t] * SCALE)
            outs.append(w @ values[attended])
    return pages, np.array(outs)


@pytest.mark.parametrize("options,group", [
    ({"rocketkv_compression_ratio": 16.0}, 3),  # P = 3, r = 10, k2 = 9: 3 of ~30 pages
    ({"rocketkv_compression_ratio": 16.0, "rocketkv_page_size": 4, "rocketkv_head_topk1": 5}, 2),
    ({"rocketkv_compression_ratio": 8.0, "rocketkv_page_size": 1}, 1),
    ({"rocketkv_compression_ratio": 4.0, "rocketkv_page_size": 7, "rocketkv_head_topk1": 16}, 3),
])
def test_a_step_attends_to_the_tokens_of_the_pages_with_the_best_approximate_scores(options, group):
    n_prompt, n = 300, 330
    k, v, q = synthetic(n, group=group, seed=6)
    kn, vn, qn = (np.array(a[0], dtype=np.float64) for a in (k, v, q))
    cache = rocket(**options)
    run_prompt(cache, k, v, q, n_prompt)
    if "rocketkv_page_size" in options:
        assert cache.plan[0] == options["rocketkv_page_size"]
    if "rocketkv_head_topk1" in options:
        assert cache.plan[1] == options["rocketkv_head_topk1"]
    sparse = 0
    for t in range(n_prompt, n):
        keys, values = cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        chosen = cache.chosen_pages(q[:, :, t : t + 1], keys)
        pages, expected = _stage2_expected(cache, kn, vn, qn, t, group)
        out = cache.attend(q[:, :, t : t + 1], keys, values, scale=SCALE, mask=None)
        assert chosen is not None and [set(c.tolist()) for c in chosen[0]] == pages
        assert np.allclose(np.array(out[0, :, 0]), expected, atol=1e-5)
        sparse += keys.shape[2] % cache.plan[0] != 0  # the partial last page's padding is masked
    assert sparse or cache.plan[0] == 1


def test_when_k_covers_every_page_a_step_is_exact_attention_over_every_kept_token():
    k, v, q = synthetic(240, seed=8)
    cache = rocket(rocketkv_compression_ratio=8.0, rocketkv_page_size=4096)  # one page
    run_prompt(cache, k, v, q, 200)
    for t in range(200, 240):
        keys, values = cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert cache.chosen_pages(q[:, :, t : t + 1], keys) is None
        out = cache.attend(q[:, :, t : t + 1], keys, values, scale=SCALE, mask=None)
        dense = mx.fast.scaled_dot_product_attention(q[:, :, t : t + 1], keys, values, scale=SCALE)
        assert mx.array_equal(out, dense)
    # the gather itself: every page, in any order, the partial last one masked, is the same
    cache = rocket(rocketkv_compression_ratio=8.0, rocketkv_page_size=5)
    run_prompt(cache, k, v, q, 200)
    keys, values = cache.update_and_fetch(k[:, :, 200:201], v[:, :, 200:201])
    n_pages = -(-keys.shape[2] // 5)
    assert keys.shape[2] % 5
    order = mx.broadcast_to(mx.random.permutation(n_pages, key=mx.random.key(1)), (1, HKV, n_pages))
    gk, gv, mask = cache.gather_pages(order, keys, values, q.shape[1])
    out = mx.fast.scaled_dot_product_attention(q[:, :, 200:201], gk, gv, scale=SCALE, mask=mask)
    dense = mx.fast.scaled_dot_product_attention(q[:, :, 200:201], keys, values, scale=SCALE)
    assert mx.allclose(out, dense, atol=1e-6, rtol=1e-5)


def test_single_token_pages_and_every_dim_rank_like_the_true_logits():
    """P = 1, r = d, g = 1: the proxy is the key, the temperature sqrt(d): the chosen
    tokens are the top-k2 by q . k (oracle top-k)."""
    k, v, q = synthetic(230, group=1, seed=10)
    cache = rocket(rocketkv_compression_ratio=8.0, rocketkv_page_size=1, rocketkv_head_topk1=D)
    run_prompt(cache, k, v, q, 200)
    k2 = cache.plan[2]
    for t in range(200, 230):
        keys, values = cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        chosen = cache.chosen_pages(q[:, :, t : t + 1], keys)
        true = (q[:, :, t : t + 1] @ keys.swapaxes(-1, -2))[:, :, 0]  # (1, H, rows)
        top = mx.argsort(-true, axis=-1)[..., :k2]
        assert [set(c.tolist()) for c in chosen[0]] == [set(c.tolist()) for c in top[0]]
        cache.attend(q[:, :, t : t + 1], keys, values, scale=SCALE, mask=None)


def test_the_page_proxy_bounds_the_partial_logit_of_every_token_of_the_page():
    k, v, q = synthetic(260, group=1, seed=12)
    cache = rocket(rocketkv_compression_ratio=16.0, rocketkv_page_size=4, rocketkv_head_topk1=6)
    run_prompt(cache, k, v, q, 200)
    for t in range(200, 260):
        keys, values = cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        query = q[:, :, t : t + 1]
        x, _, dims = approximate_logits(query, cache.pages.view(), 6)  # dims (1, H, r, 1)
        dims = dims.swapaxes(-1, -2)
        partial = (mx.take_along_axis(query, dims, -1) @ mx.take_along_axis(keys, dims, -1).swapaxes(-1, -2))
        page_of = mx.arange(keys.shape[2]) // 4
        assert mx.all(x[:, :, 0][..., page_of] >= partial[:, :, 0] - 1e-5)
        assert mx.any(mx.abs(x[:, :, 0][..., page_of] - partial[:, :, 0]) > 1e-3)  # a bound, not equal
        cache.attend(query, keys, values, scale=SCALE, mask=None)


# -- the model path: state -----------------------------------------------------------------
def _decode(model, cache, tokens):
    return mx.concatenate([model(t.reshape(1, 1), cache=cache)[:, -1] for t in tokens])


def test_a_saved_or_copied_cache_continues_the_sparse_steps_the_same(tmp_path):
    model = tiny_model("llama")
    tokens = prompt(240)
    config = KVCacheConfig(method="rocketkv", options=RocketKVOptions(rocketkv_compression_ratio=4.0))
    cache = make_prompt_cache(model, config)
    model(tokens[:199][None], cache=cache)
    _decode(model, cache, tokens[199:205])
    c = cache[0]
    assert c.plan[0] > 1 and -(-c.plan[2] // c.plan[0]) < c.pages.length  # sparse steps, pages kept
    path = str(tmp_path / "rocket.safetensors")
    save_prompt_cache(path, cache)
    loaded, clone = load_prompt_cache(path), copy.deepcopy(cache)
    assert [l.plan for l in loaded] == [c.plan for c in cache]
    a = _decode(model, cache, tokens[205:220])
    assert mx.allclose(a, _decode(model, loaded, tokens[205:220]), atol=1e-5)
    assert mx.allclose(a, _decode(model, clone, tokens[205:220]), atol=1e-5)
    _check_pages(loaded[1])
