"""A batch's decode steps leave nothing to pile up unevaluated (issue 32).

mlx-lm's batch loop evaluates only the next tokens. A cache array a step writes but the
step's attention does not read (an eviction method's accumulated scores, a window of recent
queries) stays lazy and chains onto the next step's, holding every intermediate it came
from: a packed h2o or keyformer batch held one copy of its keys a step until its next
eviction (17 MB a step on the tiny preset; out of memory on the H200 at 32k). The single
caches' guard is tests/test_decode_step_guards.py's; this one drives each batch layout.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from decode_steps import cache_arrays, graph_nodes, prefilled
from veloxquant_mlx.cache import batch as batch_module
from veloxquant_mlx.registry import METHODS

PACKED = sorted(k for k, info in METHODS.items() if info.implemented
                and batch_module.batch_mode(info.load_implementation()) == batch_module.PACKED)


def _pending_after(method, checks=(4, 12, 20)):
    """Operations left unevaluated in a packed batch of two copies of one prefilled
    sequence, after each of ``checks`` decode steps run as the batch loop runs them."""
    model, cache, token = prefilled(method)
    seqs = [[batch_module.copy_single(c, "merge") for c in cache] for _ in range(2)]
    batch = [c.merge([s[i] for s in seqs]) for i, c in enumerate(cache)]

    def step(y):
        return mx.argmax(model(y[:, None], cache=batch)[:, -1], axis=-1)

    y, pending = step(mx.concatenate([token, token])), []
    mx.async_eval(y)
    for n in range(1, max(checks) + 1):
        next_y = step(y)
        mx.async_eval(next_y)
        y.tolist()
        y = next_y
        if n in checks:
            mx.eval(y)
            pending.append(graph_nodes(cache_arrays(batch)))
    assert all(c.mode == "packed" for c in batch)
    return pending


@pytest.mark.parametrize("method", PACKED)
def test_a_packed_batch_leaves_no_growing_lazy_state(method):
    pending = _pending_after(method)
    assert pending[-1] <= pending[0], f"{method}: unevaluated operations after 4, 12, 20 steps: {pending}"
