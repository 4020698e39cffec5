"""SKVQ's decode read (``sliding_store._JointRead``: the sinks, the packed rows and the
window under one softmax in the reordered channel space, views of the packed runs and of
the orders kept between flushes) against attention over the dequantized history (model
order) computed the straightforward way, over 40 decode steps (one flush of ``FLUSH``
tokens past the window).

Tolerance: both sides are float32 evaluations of the same function (a permutation moves
values exactly), so they differ by rounding only. A score is a dot product of D terms,
scaled, its key dequantized (an affine map): at most D + 3 roundings a term, so each score
is off by at most ``gamma(D + 3) * S`` (``gamma(n) = n u / (1 - n u)``, u = 2^-24, S the
largest ``scale * sum_i |q_i k_i|``). Scores off by at most delta move each softmax weight
by a factor within ``exp(+-2 delta)``, so the output by at most ``(exp(2 delta) - 1) max
|v|``; the weighted sum of N rows adds ``gamma(N + 3) max |v|``. Taken per query row and channel
(delta the row's largest, ``sum_t p_t |v_tj|`` for ``max |v|``) against a float64
reference: only the read's float32 rounding remains.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from chained_layers import layer_rows, peak_growth
from float64_attention import exact_attention_and_bound
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import SKVQOptions
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.skvq import SKVQCache
from veloxquant_mlx.quant import token_rows
from veloxquant_mlx.methods.skvq.sliding_store import FLUSH

PROMPT, STEPS, WINDOW, SINKS, GQA, D = 100, 40, 16, 4, 2, 64


def skvq(**kw):
    return SKVQCache(KVCacheConfig(method="skvq", options=SKVQOptions(skvq_window=WINDOW, skvq_n_sink=SINKS, **kw)),
                     None, 0)


def spread_rows(shape, seed):
    """Normal rows whose channels' scales span 30x (what the reorder groups by)."""
    x = mx.random.normal(shape, key=mx.random.key(seed))
    return x * mx.power(30.0, mx.random.uniform(shape=(shape[-1],), key=mx.random.key(seed + 1)))


def call(cache, q, k, v, scale):
    cache.update_and_fetch(k, v)
    return cache.attend(q, k, v, scale=scale, mask="causal" if k.shape[2] > 1 else None)


def decode_against_reference(cache, monkeypatch, pure_path, batch=2, seed=3):
    """Prefill, then STEPS decode steps; each step's output against SDPA over the history
    it attended (what ``dequantized`` gives after it: nothing changes after the read)."""
    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", pure_path)
    h, total = 2, PROMPT + STEPS
    keys = spread_rows((batch, h, total, D), seed)
    values = spread_rows((batch, h, total, D), seed + 2) * 0.5
    scale = D**-0.5
    for start, stop in ((0, 60), (60, PROMPT)):  # a chunked prompt
        q = mx.random.normal((batch, h * GQA, stop - start, D), key=mx.random.key(seed + start))
        call(cache, q, keys[:, :, start:stop], values[:, :, start:stop], scale)
    quantized, worst = cache.n_quantized, 0.0
    for t in range(PROMPT, total):
        q = mx.random.normal((batch, h * GQA, 1, D), key=mx.random.key(100 + t))
        out = call(cache, q, keys[:, :, t : t + 1], values[:, :, t : t + 1], scale)
        ref_k, ref_v = cache.dequantized(mx.float32)
        ref, bound = exact_attention_and_bound(q, ref_k, ref_v, scale)
        gap = np.abs(np.array(out, dtype=np.float64) - ref) - bound  # <= 0 everywhere
        assert gap.max() <= 0, (t, gap.max(), bound.max())
        worst = max(worst, (np.abs(np.array(out, dtype=np.float64) - ref) / bound).max())
    assert cache.n_quantized == quantized + FLUSH  # the read went on over a flush
    return worst


@pytest.mark.parametrize("options", [
    {},  # 2-bit keys and values, reordered, clipped
    {"skvq_reorder": False, "skvq_clip_search": False, "skvq_clip_alpha": 0.9},
    {"skvq_bits_key": 3, "skvq_bits_value": 7},  # a width MLX lacks (7-bit values)
])
@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's read, and a GPU's
def test_decode_read_matches_attention_over_the_dequantized_history(options, pure_path, monkeypatch):
    decode_against_reference(skvq(**options), monkeypatch, pure_path)


def test_a_copy_reads_as_the_original(monkeypatch):
    """A deep copy starts without the original's views (they view the original's buffers)
    and builds its own: both give the same steps."""
    cache = skvq()
    decode_against_reference(cache, monkeypatch, "reference", batch=1)
    clone = copy.deepcopy(cache)
    assert clone.store._views.value is None
    k = spread_rows((1, 2, 1, D), 50)
    q = mx.random.normal((1, 4, 1, D), key=mx.random.key(51))
    a, b = call(cache, q, k, k, D**-0.5), call(clone, q, k, k, D**-0.5)
    assert mx.array_equal(a, b).item()
    assert clone.store._views.owner() is clone.store and cache.store._views.owner() is cache.store


def test_the_cpu_read_dequantizes_nothing(monkeypatch):
    """On the CPU (``quantized_matmul`` widths and groups) a decode step, flushes included,
    reads the packed codes as they are."""
    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", "qmm")
    cache = skvq()
    keys = spread_rows((1, 2, PROMPT + STEPS, D), 9)
    q = mx.random.normal((1, 4, 1, D), key=mx.random.key(10))
    call(cache, mx.random.normal((1, 4, PROMPT, D)), keys[:, :, :PROMPT], keys[:, :, :PROMPT], D**-0.5)

    def refuse(*a, **k):
        raise AssertionError("a decode step dequantized packed rows")

    monkeypatch.setattr(token_rows, "dequantize_rows", refuse)
    for t in range(PROMPT, PROMPT + STEPS):
        k = keys[:, :, t : t + 1]
        mx.eval(call(cache, q, k, k, D**-0.5))
    assert cache.n_quantized == PROMPT - SINKS - WINDOW + FLUSH


@pytest.mark.parametrize("options", [
    {},  # reordered keys and values
    {"skvq_reorder": False, "skvq_clip_search": False, "skvq_clip_alpha": 0.9},
    {"skvq_bits_key": 3, "skvq_bits_value": 7},
])
def test_on_cuda_the_decoded_rows_and_one_fused_attention_give_the_attention_over_the_history(options, monkeypatch):
    """On CUDA a step decodes the kept rows in the queries' dtype and reads them with one
    fused attention, queries and output through the orders (benchmarks/results/h200_s65):
    within the float32 bound of the float64 reference, as the float32 read, over a flush."""
    from sdpa_calls import recorded

    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    calls = recorded(monkeypatch)
    decode_against_reference(skvq(**options), monkeypatch, "reference")
    # one fused read a decode step, over every kept row (the prompt's chunks read their own way)
    assert [c.keys for c in calls[-STEPS:]] == list(range(PROMPT + 1, PROMPT + STEPS + 1))


def test_cuda_read_decodes_a_layers_rows_only_once_its_queries_exist(monkeypatch):
    """The kept codes are ready before a step runs: unless each layer's decode waits for its
    queries, MLX decodes the next layer's rows while this layer's are still held. Gated, at
    most the next layer's decode overlaps this layer's attention: from 1 to 4 layers the
    step's peak grows by well under one layer's decoded rows (0.43 of them on this CPU;
    ungated 0.98)."""
    make = lambda: SKVQCache(KVCacheConfig(method="skvq"), None, 0)  # noqa: E731  (defaults)
    assert peak_growth(make, 1, 4, monkeypatch, t=8192) < 0.7 * layer_rows(8192)
