"""SnapKV: the last prompt queries vote, once, on which prompt tokens each KV head keeps.

Scores once, when the prompt is in (mlx-lm sends its last token alone): until then
attention sees every token and the last ``snap_obs_window`` queries are buffered. Each
prefix token's score is the attention the window pays it (softmax over all keys, causal
inside the window, summed over the window, mean over the query heads of a KV head),
max-pooled with kernel 7 over the prefix; the sinks and the window are kept, and the top
``snap_budget - snap_obs_window`` prefix tokens with them. Decode only appends.
Adapted: sinks are an addition to the paper. ``snap_backend``: both choices run the one
MLX matmul + softmax path this implementation has (no fused path returns weights).
"""

from __future__ import annotations

import mlx.core as mx

from ..evict.attention import attention_mass
from ..evict.base import Roles, Schedule, ScoredEvictionCache
from ..evict.select import max_pool_same

POOL_KERNEL = 7  # the official LongBench configs: max-pool, kernel 7, window 32
SCORE_DTYPES = {"auto": "float32", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class SnapKVCache(ScoredEvictionCache):
    roles = Roles(budget="snap_budget", n_sink="snap_n_sink", recent="snap_obs_window",
                  window="snap_obs_window")
    schedule = Schedule(prefill_end=True)
    batchable = True  # packed decode: evict/batch.py runs the base's decode steps for the batch

    def score(self, inputs):
        queries, keys, positions = inputs.window_queries, inputs.keys, inputs.positions
        dtype = getattr(mx, SCORE_DTYPES[self.options.snap_dtype])
        q_positions = inputs.query_positions[-1] + 1 - queries.shape[2] + mx.arange(queries.shape[2])
        if self.options.snap_batched_scoring:
            mass = attention_mass(queries, keys, inputs.scale, q_positions, positions, dtype=dtype)
        else:  # one KV head at a time: lower peak memory, the same numbers
            g, masses = queries.shape[1] // keys.shape[1], []
            for h in range(keys.shape[1]):
                q = queries[:, h * g : (h + 1) * g]
                if masses:  # independent heads would be scored side by side, all at once
                    q = mx.depends(q, masses[-1])
                masses.append(attention_mass(q, keys[:, h : h + 1], inputs.scale, q_positions,
                                             positions[:, h : h + 1], dtype=dtype))
            mass = mx.concatenate(masses, axis=1)
        # Pool over neighbours in token order; the window (the newest tokens) is protected.
        order = mx.argsort(positions, axis=-1)
        prefix = keys.shape[2] - queries.shape[2]
        pooled = max_pool_same(mx.take_along_axis(mass, order, axis=-1)[..., :prefix], POOL_KERNEL)
        pooled = mx.pad(pooled, [(0, 0), (0, 0), (0, keys.shape[2] - prefix)])
        return mx.put_along_axis(mx.zeros_like(pooled), order, pooled, axis=-1)
