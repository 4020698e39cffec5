"""Issue 30 (host time of a decode step): the fused kernel's turned query (``qm = q scale
log2(e) M``) is one compiled call a step for a Python scale, bit for bit the plain
product (the cast and the product fused elementwise: the same float32 operations), and
the plain ops for an array scale."""

from __future__ import annotations

import mlx.core as mx
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from veloxquant_mlx.methods.turboquant import kernel as tk
from veloxquant_mlx.methods.turboquant.codec import TurboCodec, TurboScores, _matrices


def _plain(queries, keys, scale):
    b, hq, _, d = queries.shape
    h = keys.n_heads
    q = queries.astype(mx.float32).reshape(b, h, hq // h, d) * (scale * tk.LOG2E)
    return q @ _matrices(keys.tokens.codec, d)[0]


@pytest.mark.parametrize("qjl", [True, False])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("gqa,d", [(4, 64), (1, 128)])
def test_the_turned_query_is_the_plain_product_bit_for_bit(qjl, dtype, gqa, d):
    h = 2
    run = TurboCodec(3, qjl, seed=5).tokens()
    run.append(mx.random.normal((1, h, 40, d), key=mx.random.key(1)))
    keys = TurboScores(run, 40)
    for step in range(3):  # the compiled call kept between steps gives each step's own
        q = mx.random.normal((1, h * gqa, 1, d), key=mx.random.key(10 + step)).astype(dtype)
        for scale in (d ** -0.5, 0.25):
            got, want = tk.turned_query(q, keys, scale), _plain(q, keys, scale)
            assert got.dtype == mx.float32 and got.shape == want.shape
            assert mx.array_equal(got, want).item()
    array_scale = mx.array(d ** -0.5)
    assert mx.array_equal(tk.turned_query(q, keys, array_scale), _plain(q, keys, array_scale)).item()
