"""Scores an eviction method takes at prefill hold one block of queries' logits at a time.

A 2,048-token chunk scored against 32k keys, all at once, is 8 GiB of float32 logits for
32 query heads (issue 31: h2o peaked at 37.9 GiB at 32k against fp16's 11.1 GiB). The
blocks must also give the unblocked numbers, up to float32 summation order.
"""

from __future__ import annotations

import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401  (before mlx)
import mlx.core as mx

from feeding import peak_above_held, run_prompt, synthetic_kvq
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import H2OOptions, SnapKVOptions
from veloxquant_mlx.evict import attention
from veloxquant_mlx.evict.attention import attention_mass, attention_weights, query_block
from veloxquant_mlx.methods.h2o import H2OCache
from veloxquant_mlx.methods.snapkv import SnapKVCache

EPS32 = float(np.finfo(np.float32).eps)


def _chunk_against_history(hq=8, hkv=2, n=2048, t=4096, d=64):
    q = mx.random.normal((1, hq, n, d), key=mx.random.key(1))
    k = mx.random.normal((1, hkv, t, d), key=mx.random.key(2))
    k_pos = mx.broadcast_to(mx.arange(t, dtype=mx.int32), (1, hkv, t))
    q_pos = mx.arange(t - n, t)
    weights = 0.99 ** mx.arange(n - 1, -1, -1, dtype=mx.float32)
    mx.eval(q, k, k_pos, q_pos, weights)
    return q, k, k_pos, q_pos, weights


def test_mass_of_a_chunk_holds_one_block_of_logits_at_a_time():
    q, k, k_pos, q_pos, weights = _chunk_against_history()
    block = query_block(q, k.shape[2])
    block_logits = q.shape[0] * q.shape[1] * block * k.shape[2] * 4  # float32
    all_logits = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * 4
    assert all_logits >= 8 * block_logits  # the shape must tell a bounded scoring apart

    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mass = attention_mass(q, k, 0.125, q_pos, k_pos, weights)
    mx.eval(mass)
    peak = mx.get_peak_memory() - base
    # logits, masked logits and softmax of one block (3.3x measured), and the result
    assert peak <= 4 * block_logits + 2 * mass.nbytes, (peak / 2**20, block_logits / 2**20)

    # the unblocked sum: the same terms, summed in one order (float32 rounding only)
    whole = (attention_weights(q, k, 0.125, q_pos, k_pos) * weights[:, None]).sum(axis=3).mean(axis=2)
    np.testing.assert_allclose(np.array(mass), np.array(whole), rtol=q.shape[2] * EPS32, atol=0)


@pytest.mark.parametrize("make", [
    lambda: H2OCache(KVCacheConfig(options=H2OOptions(h2o_budget=96, h2o_n_sink=4, h2o_grace=8))),
    lambda: SnapKVCache(KVCacheConfig(options=SnapKVOptions(snap_budget=96, snap_obs_window=16))),
], ids=["h2o", "snapkv"])
def test_blocked_scores_keep_the_positions_unblocked_scores_keep(make, monkeypatch):
    k, v, q = synthetic_kvq(400, heads=2, group=4, head_dim=32, seed=3)

    def kept(block_elements, block_queries):
        monkeypatch.setattr(attention, "SCORE_ELEMENTS", block_elements)
        monkeypatch.setattr(attention, "QUERY_BLOCK", block_queries)
        cache = make()
        run_prompt(cache, k, v, q, 400, chunk=256)
        return np.array(cache.kept_positions)

    blocked = kept(2 * 8 * 400, 256)  # two queries a block
    assert query_block(q[:, :, :256], 400) == 2
    np.testing.assert_array_equal(blocked, kept(2**40, 2**20))


def test_snapkv_scoring_one_head_at_a_time_holds_one_heads_logits(monkeypatch):
    monkeypatch.setattr(attention, "SCORE_ELEMENTS", 2**40)  # one block per head: heads alone bound it
    hkv, g, window, t, d = 8, 4, 64, 4096, 32
    cache = SnapKVCache(KVCacheConfig(options=SnapKVOptions(
        snap_budget=256, snap_obs_window=window, snap_batched_scoring=False)))
    k, v, q = synthetic_kvq(t, heads=hkv, group=g, head_dim=d, seed=5)
    cache.update_and_fetch(k, v)
    cache.window_queries = q[:, :, -window:]
    cache.offset = t
    from veloxquant_mlx.evict.base import ScoreInputs

    inputs = ScoreInputs(cache, q[:, :, -1:], d**-0.5)
    mx.eval(inputs.keys, inputs.positions, cache.window_queries)
    head_logits = g * window * t * 4  # float32
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(cache.score(inputs))
    peak = mx.get_peak_memory() - base
    assert peak <= 4 * head_logits + 8 * hkv * t * 4, (peak / 2**20, head_logits / 2**20)


# Graph nodes of one 2,048-token chunk's scoring against 4,096 keys at the 8B layer's heads
# (32/8 x 128, float16), as MLX's CUDA back-end builds it: what the host submits for it. On
# the H200 the blocks' kernel launches and passes were the scoring's cost
# (benchmarks/notes/prefill.md): h2o 1,182 nodes and 7.7 ms before its group's heads became one
# product's rows and its sums a product, keyformer 2,822 nodes and 14.1 ms with blocks a
# quarter of the shared size.
PROMPT_SCORING_NODES = {"h2o": 1057, "keyformer": 709}


@pytest.mark.parametrize("method", sorted(PROMPT_SCORING_NODES))
def test_prompt_scoring_of_a_chunk_builds_a_bounded_graph(method):
    from decode_steps import graph_nodes, steps_as_on_cuda
    from veloxquant_mlx.methods import keyformer

    hq, hkv, d, n, c = 32, 8, 128, 4096, 2048
    q, k = mx.zeros((1, hq, c, d), mx.float16), mx.zeros((1, hkv, n, d), mx.float16)
    k_pos = mx.broadcast_to(mx.arange(n)[None, None], (1, hkv, n))
    q_pos = mx.arange(n - c, n)
    weights = 0.98 ** mx.arange(c - 1, -1, -1, dtype=mx.float32)
    mx.eval(q, k, k_pos, q_pos, weights)
    with steps_as_on_cuda():
        if method == "h2o":
            mass = attention_mass(q, k, d**-0.5, q_pos, k_pos, weights)
        else:
            stream = keyformer.noise_stream(0, 0, 1, hq, hkv)
            mass = keyformer.gumbel_mass(q, k, d**-0.5, n - c, k_pos, 1.0, stream)
        nodes = graph_nodes([mass])
    assert nodes <= 1.05 * PROMPT_SCORING_NODES[method], nodes


def _blocked_scorers():
    from veloxquant_mlx.methods.qfilters import retention
    from veloxquant_mlx.quant.saliency import probe_attention_sums

    def zipcache_probes(q, k):
        return probe_attention_sums(q, k, 0.125, mx.arange(k.shape[2] - q.shape[2], k.shape[2]))

    def qfilters_retention(q, k):
        n = k.shape[2]
        kept = mx.broadcast_to(mx.arange(n) % 3 == 0, (1, k.shape[1], n))
        k_pos = mx.broadcast_to(mx.arange(n), (1, k.shape[1], n))
        return retention(q, mx.arange(n - q.shape[2], n), k, k_pos, kept, 0.125)

    return {"zipcache/amc probe sums": zipcache_probes, "qfilters retention": qfilters_retention}


@pytest.mark.parametrize("name", ["zipcache/amc probe sums", "qfilters retention"])
def test_a_blocked_scorer_casts_the_keys_once(name, monkeypatch):
    """Keys cast to float32 inside every block left several casts alive at once (619 MiB
    against 267 for 32k float16 keys on the CPU; at 128k on the H200, zipcache peaked at
    5.4x and qfilters at 3.7x fp16's): one cast, then the blocks, holds about one cast."""
    fn = _blocked_scorers()[name]
    keys = mx.random.normal((1, 8, 8192, 128), key=mx.random.key(0)).astype(mx.float16)
    queries = mx.random.normal((1, 32, 64, 128), key=mx.random.key(1)).astype(mx.float16)
    mx.eval(keys, queries)
    whole = fn(queries, keys)  # 64 queries x 8192 keys x 32 heads: one block
    mx.eval(whole)
    monkeypatch.setattr(attention, "SCORE_ELEMENTS", 2**18)  # one query a block: 64 blocks
    blocked, peak = peak_above_held(lambda: fn(queries, keys))
    cast = keys.size * 4
    assert peak < 1.5 * cast, (peak, cast)
    assert mx.allclose(blocked, whole, rtol=64 * EPS32, atol=0)
