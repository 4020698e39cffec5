"""ChunkKV's card invariants, checked by brute force on synthetic K/V/Q and on tiny models.

Caches are driven the way mlx-lm drives them: update_and_fetch, then attention through
the cache (the hook's job); the prompt's last token comes alone and ends the prefill.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from feeding import feed, run_prompt, synthetic_kvq
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import ChunkKVOptions
from veloxquant_mlx.evict.select import top_k_chunks
from veloxquant_mlx.methods.chunkkv import WINDOW, ChunkKVCache

HKV, GROUP, D = 2, 3, 16
SCALE = D**-0.5


def synthetic(n, seed=0, batch=1):
    return synthetic_kvq(n, HKV, GROUP, D, q_scale=2.0, seed=seed, batch=batch)


def window_attention(k, q, n, batch=0):
    """a_j: softmax attention of the last 32 queries, causal, summed over them and over every
    query head (float32): (n,)."""
    qw = q[batch, :, n - WINDOW : n].reshape(HKV, GROUP, WINDOW, D)
    logits = (qw * SCALE) @ k[batch, :, None, :n].swapaxes(-1, -2)  # (HKV, G, w, n)
    visible = mx.arange(n)[None] <= mx.arange(n - WINDOW, n)[:, None]
    return mx.softmax(mx.where(visible, logits, -float("inf")), axis=-1).sum(axis=(0, 1, 2))


def expected_keep(a, n, budget, c, s):
    """Brute force: sinks + window + the k chunks of the middle with the largest sum of a_j."""
    middle = range(s, n - WINDOW)
    chunks = [list(middle[i : i + c]) for i in range(0, len(middle), c)]
    sums = [sum(a[j].item() for j in chunk) for chunk in chunks]
    best = sorted(range(len(chunks)), key=lambda i: -sums[i])[: (budget - s - WINDOW) // c]
    kept = set(range(s)) | set(range(n - WINDOW, n))
    for i in best:
        kept |= set(chunks[i])
    return kept, [chunks[i] for i in best]


def options(**kw):
    return KVCacheConfig(options=ChunkKVOptions(**kw))


@pytest.mark.parametrize("n,c,s", [(300, 8, 4), (301, 8, 4), (257, 5, 0), (290, 13, 2)])
def test_keeps_the_chunks_of_largest_summed_window_attention_whole(n, c, s):
    budget = s + WINDOW + 6 * c + c // 2  # the remainder stays unused
    k, v, q = synthetic(n + 5, seed=n)
    cache = ChunkKVCache(options(chunkkv_budget=budget, chunkkv_chunk_size=c, chunkkv_n_sink=s))
    run_prompt(cache, k, v, q, n)
    expected, chosen = expected_keep(window_attention(k, q, n), n, budget, c, s)
    kept = cache.kept_positions[0]
    assert all(set(kept[h].tolist()) == expected for h in range(HKV))  # every head the same
    assert cache.stored_length == s + WINDOW + sum(len(ch) for ch in chosen) <= budget
    # structure: outside sinks and window, the kept positions are complete aligned chunks
    middle = [p for p in kept[0].tolist() if s <= p < n - WINDOW]
    starts = {s + (p - s) // c * c for p in middle}
    whole = {p for st in starts for p in range(st, min(st + c, n - WINDOW))}
    assert set(middle) == whole and len(starts) == 6
    for t in range(n, n + 5):  # decode only appends
        feed(cache, k, v, q, t, t + 1)
    assert cache.stored_length == s + WINDOW + sum(len(ch) for ch in chosen) + 5
    assert set(cache.kept_positions[0, 0].tolist()) == expected | set(range(n, n + 5))


def test_chunk_size_one_is_token_level_top_k_on_the_same_score():
    n, s, budget = 260, 4, 100
    k, v, q = synthetic(n, seed=3)
    cache = ChunkKVCache(options(chunkkv_budget=budget, chunkkv_chunk_size=1, chunkkv_n_sink=s))
    run_prompt(cache, k, v, q, n)
    a = window_attention(k, q, n)
    middle = mx.arange(s, n - WINDOW)
    top = middle[mx.argsort(-a[s : n - WINDOW])[: budget - s - WINDOW]].tolist()
    expected = set(range(s)) | set(range(n - WINDOW, n)) | set(top)
    assert cache.stored_length == budget
    assert [set(cache.kept_positions[0, h].tolist()) for h in range(HKV)] == [expected] * HKV


def test_each_sequence_of_a_batch_chooses_its_own_chunks():
    n, c, s, budget = 292, 8, 4, 4 + WINDOW + 40  # the middle is 256 = 32 whole chunks
    k, v, q = synthetic(n, seed=7, batch=2)
    cache = ChunkKVCache(options(chunkkv_budget=budget, chunkkv_chunk_size=c, chunkkv_n_sink=s))
    run_prompt(cache, k, v, q, n)
    sets = []
    for b in range(2):
        expected, _ = expected_keep(window_attention(k, q, n, batch=b), n, budget, c, s)
        assert set(cache.kept_positions[b, 0].tolist()) == expected
        sets.append(expected)
    assert sets[0] != sets[1]


def test_a_prompt_within_the_budget_is_kept_whole_and_attended_exactly():
    n = 120
    k, v, q = synthetic(n, seed=1)
    cache = ChunkKVCache(options(chunkkv_budget=n))
    out = run_prompt(cache, k, v, q, n)
    assert cache.kept_positions is None and cache.stored_length == n
    assert mx.array_equal(out, mx.fast.scaled_dot_product_attention(q[:, :, -1:], k, v, scale=SCALE))


def test_top_k_chunks_ranks_chunks_by_their_sum_and_keeps_them_whole():
    # token 0 is kept; chunks: 0 = tokens 1-3, 1 = 4-6, 2 = 7 (short), 3 = none, 4 = 8-11
    ids = mx.array([0, 0, 0, 0, 1, 1, 1, 2, 4, 4, 4, 4])
    keep = mx.arange(12) == 0
    scores = mx.array([[9.0, 0, 1, 1, 1, 1, 1, 5, 1, 0.5, 0.5, 0.5],   # sums 2, 3, 5, -, 2.5
                       [9.0, 0, 0, 0, 3, 2, 2, 3, 1, 1, 1, 1]])        # sums 0, 7, 3, -, 4
    got = top_k_chunks(scores, mx.broadcast_to(ids, (2, 12)), 5, 2, mx.broadcast_to(keep, (2, 12)))
    assert got.shape == (2, 8)
    assert got[1].tolist() == [0, 4, 5, 6, 8, 9, 10, 11]  # chunks 1 and 4 (by mean: 2 and 1)
    # row 0 keeps chunks 2 and 1 (5 tokens) and is topped up from its next chunk, 4
    assert got[0, :5].tolist() == [0, 4, 5, 6, 7] and set(got[0, 5:].tolist()) < {8, 9, 10, 11}
    # a chunk holding no token ranks below every real one, even negative ones
    every = top_k_chunks(-mx.ones((12,)), ids, 5, 4, keep)
    assert every.tolist() == list(range(12))


# -- layer-wise index reuse, through the model context ----------------------------------------
def _prefill(model, cache, tokens):
    model(tokens[:-1][None], cache=cache)
    model(tokens[-1:][None], cache=cache)


def _kept(cache):
    return [c.kept_positions[0].tolist() for c in cache]


@pytest.mark.parametrize("reuse,groups", [(1, [[0], [1], [2], [3]]), (2, [[0, 1], [2, 3]]),
                                          (3, [[0, 1, 2], [3]])])
def test_layers_of_a_reuse_group_keep_the_positions_their_first_layer_chose(reuse, groups):
    model = tiny_model("llama", num_hidden_layers=4)
    config = KVCacheConfig(method="chunkkv", options=ChunkKVOptions(
        chunkkv_budget=60, chunkkv_chunk_size=4, chunkkv_reuse_layers=reuse))
    cache = make_prompt_cache(model, config)
    cache[0].context.layer_budgets = {1: 100}  # a reusing layer's own budget does not apply
    buffered = set()  # layers that ever held window queries
    for c in cache:
        def spy(*a, _c=c, _attend=c.attend, **kw):
            if _c.window_queries is not None:
                buffered.add(_c.layer)
            return _attend(*a, **kw)
        c.attend = spy
    _prefill(model, cache, prompt(200))
    kept = _kept(cache)
    for group in groups:
        assert all(kept[i] == kept[group[0]] for i in group)
    firsts = [kept[g[0]] for g in groups]
    assert all(a != b for i, a in enumerate(firsts) for b in firsts[i + 1 :])  # groups choose apart
    assert buffered == {g[0] for g in groups}  # only a group's first layer needs queries
    assert cache[0].context.shared == {}  # the published slots are dropped once used
    assert cache[1].stored_length == (100 if reuse == 1 else cache[0].stored_length)


def test_a_reusing_layer_without_the_model_context_refuses():
    k, v, q = synthetic(200, seed=2)
    cache = ChunkKVCache(options(chunkkv_budget=60, chunkkv_reuse_layers=2), None, 1)
    with pytest.raises(ValueError, match="chunkkv_reuse_layers=2"):
        run_prompt(cache, k, v, q, 200)


def test_a_reusing_layer_that_holds_other_tokens_refuses():
    model = tiny_model("llama", num_hidden_layers=2)
    config = KVCacheConfig(method="chunkkv",
                           options=ChunkKVOptions(chunkkv_budget=60, chunkkv_reuse_layers=2))
    cache = make_prompt_cache(model, config)
    tokens = prompt(200)
    model(tokens[:-1][None], cache=cache)
    cache[1].update_and_fetch(*[mx.zeros((1, 2, 1, 32))] * 2)  # layer 1 gets one extra token
    cache[1]._awaiting_attend = False
    with pytest.raises(RuntimeError, match="does not hold the tokens"):
        model(tokens[-1:][None], cache=cache)


def test_a_budget_that_fits_no_chunk_is_refused_naming_the_fields():
    with pytest.raises(ValueError, match="chunkkv_budget=40, chunkkv_n_sink=4, chunkkv_chunk_size=8"):
        ChunkKVOptions(chunkkv_budget=40)
