"""Hard choices made on ties must not depend on the last bits of the inputs or on how a
back-end's selection routine orders equal values (benchmarks/results/cuda_paths.md:
knorm and a2ats chose different tokens on the GPU and on the CPU in float32).

knorm: a token id seen twice gives the first layer two keys of one norm, rotated by RoPE,
equal up to rounding. a2ats: two keys with one VQ code score equally to the bit.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from paper_rule import no_recent_floor  # noqa: F401  (a fixture)
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import L2NormOptions
from veloxquant_mlx.methods.knorm import L2NormCache
from veloxquant_mlx.methods.a2ats.retrieval import RetrievalStore, top_k_ties_to_latest

H, D = 2, 16


def _kept_after_prompt(keys, budget):
    cache = L2NormCache(KVCacheConfig(options=L2NormOptions(knorm_budget=budget, knorm_n_sink=0,
                                                            knorm_recent=0)))
    values = mx.zeros_like(keys)
    k, v = cache.update_and_fetch(keys, values)
    q = mx.zeros((1, H, keys.shape[2], D))
    cache.attend(q, k, v, scale=D**-0.5, mask="causal")
    return [sorted(cache.kept_positions[0, h].tolist()) for h in range(H)]


def _one_ulp_up(x: np.ndarray, where: np.ndarray) -> np.ndarray:
    return np.where(where, np.nextafter(x, np.float32(np.inf)), x).astype(np.float32)


def test_knorm_keeps_the_later_tokens_among_norms_equal_up_to_the_last_bits():
    # 48 keys of one norm in different directions (as RoPE makes of a repeated token id in
    # the first layer), their last bits nudged up in two different patterns, as two
    # back-ends' rounding would. A budget of 24 is decided by the ties alone: the later 24
    # tokens, whichever bits were nudged.
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((1, H, 48, D)).astype(np.float32)
    keys = (keys / np.linalg.norm(keys, axis=-1, keepdims=True)).astype(np.float32)
    pattern = rng.random(keys.shape) < 0.5
    kept_a = _kept_after_prompt(mx.array(_one_ulp_up(keys, pattern)), budget=24)
    kept_b = _kept_after_prompt(mx.array(_one_ulp_up(keys, ~pattern)), budget=24)
    assert kept_a == kept_b == [list(range(24, 48))] * H


@pytest.mark.usefixtures("no_recent_floor")
def test_knorm_still_orders_norms_that_differ_beyond_the_rounding():
    # Norms apart by 1e-3 relative are not ties: the lowest are kept, early or late.
    scale = 1.0 + 1e-3 * np.arange(40, dtype=np.float32)[::-1].copy()
    keys = np.ones((1, H, 40, D), np.float32) * scale[None, None, :, None]
    assert _kept_after_prompt(mx.array(keys), budget=10) == [list(range(30, 40))] * H
    keys = np.ones((1, H, 40, D), np.float32) * scale[::-1].copy()[None, None, :, None]
    assert _kept_after_prompt(mx.array(keys), budget=10) == [list(range(10))] * H


def test_top_k_breaks_ties_at_the_kth_score_towards_the_latest_index():
    scores = mx.array([[3.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 2.0],
                       [5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0]])
    got = [sorted(r) for r in top_k_ties_to_latest(scores, 3).tolist()]
    assert got == [[0, 5, 7], [5, 6, 7]]
    assert sorted(top_k_ties_to_latest(scores, 8)[0].tolist()) == list(range(8))


def test_retrieval_picks_the_latest_of_tokens_with_one_code():
    # Two centroids; every candidate key is one of them, so candidates of one code tie to
    # the bit. 40 tokens, fraction 0.25: k = 10 of the 32 candidates (4 sinks, 4 window).
    # The query prefers code 0, held by 14 candidates: 10 of them are chosen, the latest.
    codebook = mx.array([[1.0] * 4, [-1.0] * 4])
    store = RetrievalStore(bits=1, sub_dim=4, window=4, n_sink=4, fraction=0.25,
                           frame=lambda x, positions: x, codebook=codebook)
    rng = np.random.default_rng(1)
    which = rng.permutation(np.r_[np.zeros(14), np.ones(18)]).astype(int)
    cand = np.where(which[:, None] == 0, 1.0, -1.0).repeat(D, axis=1).astype(np.float32)
    keys = np.concatenate([np.zeros((4, D)), cand, np.zeros((4, D))]).astype(np.float32)
    keys = mx.array(np.broadcast_to(keys, (1, H, 40, D)).copy())
    store.append(keys, mx.zeros_like(keys))
    idx, _ = store.selected(mx.ones((1, H, 1, D)), position=39)
    code0 = 4 + np.flatnonzero(which == 0)
    for h in range(H):
        assert sorted(idx[0, h].tolist()) == sorted(code0[-10:].tolist())
