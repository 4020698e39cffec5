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


def _launch_recorder(calls):
    """A stand-in for the compiled kernel: records each launch's inputs (evaluated) and
    plan, returns zeros of its output shapes."""

    def launch(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        mx.eval(inputs)
        calls.append((list(inputs), list(template), grid, threadgroup, output_shapes, output_dtypes))
        return [mx.zeros(s, t) for s, t in zip(output_shapes, output_dtypes)]

    return lambda backend: launch


@pytest.mark.parametrize("qjl", [True, False])
def test_the_kept_launch_plan_is_each_steps_own_launch(monkeypatch, qjl):
    """Issue 30: ``kernel_partials`` keeps a launch's plan on the key run between two flushes
    (count and buffers unchanged). Over 40 steps whose runs gain rows (a flush: 16 rows each
    time) and outgrow their buffers, each launch takes what ``launch_args`` builds from the
    step's own state and turned query, bit for bit, and the partials are turned back by the
    values' own matrix."""
    calls = []
    monkeypatch.setattr(tk, "_kernel", _launch_recorder(calls))
    monkeypatch.setattr(tk, "_CHECKED", {})
    monkeypatch.setattr(tk, "_self_check_problem", lambda *a, **k: None)
    h, gqa, d = 2, 2, 64
    k_run, v_run = TurboCodec(3, qjl, seed=5).tokens(step_tokens=32), TurboCodec(2, False, seed=5).tokens(step_tokens=32)
    for run, key in ((k_run, 1), (v_run, 2)):
        run.append(mx.random.normal((1, h, 24, d), key=mx.random.key(key)))
    plans = []  # the plan objects themselves (kept alive: ids are not reused)
    for step in range(40):
        if step % 8 == 7:  # a flush: rows written in place, the buffers grown every other time
            for run, key in ((k_run, 3), (v_run, 4)):
                run.append(mx.random.normal((1, h, 16, d), key=mx.random.key(100 * step + key)), decoding=True)
        keys, values = k_run.layout(None), v_run.layout(None)
        q = mx.random.normal((1, h * gqa, 1, d), key=mx.random.key(1000 + step))
        scale = d ** -0.5 if step < 30 else 0.25  # another scale: another plan
        o, ml = tk.kernel_partials("cuda", q, keys, values, scale)
        if not plans or plans[-1] is not k_run.launch:
            plans.append(k_run.launch)
        want = tk.launch_args(keys, values, tk.turned_query(q, keys, scale))
        inputs, template, grid, threadgroup, shapes, dtypes = calls[-1]
        assert len(inputs) == len(want["inputs"])
        for got_x, want_x in zip(inputs, want["inputs"]):
            assert got_x.shape == want_x.shape and got_x.dtype == want_x.dtype
            assert mx.array_equal(got_x, want_x).item()
        assert (template, grid, threadgroup) == (want["template"], want["grid"], want["threadgroup"])
        assert shapes == want["output_shapes"] and dtypes == want["output_dtypes"]
        assert o.shape == (h * gqa, want["grid"][0] // tk.NT, d) and ml.shape == shapes[1]
    assert len(plans) == 7  # one per flush (steps 7, 15, 23, 31, 39) and scale (step 30), kept between them
