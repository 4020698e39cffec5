"""evict/select.max_pool_same: the centred window's maximum, as the definition gives it (a
maximum is exact, so equality is exact), in about log2(kernel) operations: snapkv's 7 and
rocketkv's 63 were kernel - 1 maxima a layer at the prompt's end."""

import math

import pytest

import veloxquant_mlx  # noqa: F401  (before mlx)
import mlx.core as mx

from decode_steps import graph_nodes
from veloxquant_mlx.evict.select import max_pool_same


def by_definition(scores, kernel):
    """out[i] = max(scores[j] for j in [i - (kernel - 1) // 2, i + kernel // 2] inside the row)."""
    n, left = scores.shape[-1], (kernel - 1) // 2
    rows = scores.reshape(-1, n).tolist()
    out = [[max(r[max(0, i - left) : min(n, i - left + kernel)]) for i in range(n)] for r in rows]
    return mx.array(out, dtype=scores.dtype).reshape(scores.shape)


@pytest.mark.parametrize("n", [1, 2, 7, 33, 100])
def test_equals_the_window_maximum_for_every_kernel(n):
    scores = mx.random.normal((2, 3, n), key=mx.random.key(n))
    for kernel in range(1, 70):
        assert mx.array_equal(max_pool_same(scores, kernel), by_definition(scores, kernel)), kernel


@pytest.mark.parametrize("kernel", [7, 63])  # snapkv's and rocketkv's
def test_takes_about_log2_kernel_operations(kernel):
    scores = mx.random.normal((1, 8, 4096), key=mx.random.key(0))
    mx.eval(scores)
    # a pad, log2 doublings of two slices and a maximum, the last two slices and maximum
    doublings = int(math.log2(kernel))
    assert graph_nodes([max_pool_same(scores, kernel)]) <= 1 + 3 * (doublings + 1)
