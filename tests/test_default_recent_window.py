"""Keyformer, Q-Filters and L2Norm at the contract's defaults (``*_recent=0``), and TOVA
(no recent window in its options), keep the newest tokens for a window of steps (issue 37):
a generated token is attended by the steps after it before it can be evicted
(``ScoredEvictionCache.recent_floor``)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from feeding import feed
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.evict.base import RECENT_FLOOR
from veloxquant_mlx.registry import METHODS

FLOORED = ["keyformer", "qfilters", "knorm", "tova"]
N_PROMPT, N_STEPS, H, GROUP, D = 1000, 64, 2, 2, 16


def _adversarial_kvq():
    """Queries share one direction u; the prompt's keys are random, every generated key
    points away from u with a large norm: it draws the least attention, has the largest
    norm and the lowest projection on u, so each method scores it last."""
    n = N_PROMPT + N_STEPS
    keys = mx.random.normal((1, H, n, D), key=mx.random.key(1))
    u = mx.zeros((D,)).at[0].add(1.0)
    generated = -4.0 * u + 0.1 * mx.random.normal((1, H, N_STEPS, D), key=mx.random.key(2))
    keys = mx.concatenate([keys[:, :, :N_PROMPT], generated], axis=2)
    values = mx.random.normal((1, H, n, D), key=mx.random.key(3))
    queries = 3.0 * u + 0.3 * mx.random.normal((1, H * GROUP, n, D), key=mx.random.key(4))
    return keys, values, queries


@pytest.mark.parametrize("method", FLOORED)
def test_at_defaults_each_generated_token_is_kept_for_the_floor_window(method):
    cache = METHODS[method].load_implementation()(KVCacheConfig(method=method))
    assert cache.recent == RECENT_FLOOR == min(RECENT_FLOOR, cache.budget // 4)
    k, v, q = _adversarial_kvq()
    for s in range(0, N_PROMPT - 1, 256):
        feed(cache, k, v, q, s, min(s + 256, N_PROMPT - 1))
    for t in range(N_PROMPT - 1, N_PROMPT + N_STEPS):
        feed(cache, k, v, q, t, t + 1)
        kept = cache.kept_positions
        seen = t + 1
        for h in range(H):
            held = set(kept[0, h].tolist())
            newest = set(range(seen - RECENT_FLOOR, seen))
            assert newest <= held, (method, seen, sorted(newest - held))
        decode_every = cache.schedule.decode_every  # qfilters: every step; the others in batches
        assert cache.stored_length == cache.budget + (t - N_PROMPT + 1) % decode_every
