"""ZipCache's decode read (``token_mixed._JointRead``: both classes and the buffer under one
softmax, the channel scales folded into the query and the output, views of the classes
kept between flushes, the block scored by the step's own scores) against attention over
the dequantized history computed the straightforward way, over 40 decode steps that
flush twice.

Tolerance: both sides are float32 evaluations of the same function, so they differ by
rounding only. A score is a dot product of D terms, scaled, with the channel scale folded
in on one side and multiplied into the key on the other, and the key dequantized (an
affine map): at most D + 3 roundings a term, so each score is off by at most
``gamma(D + 3) * S`` (``gamma(n) = n u / (1 - n u)``, u = 2^-24, S the largest
``scale * sum_i |q_i k_i|``). Scores off by at most delta move each softmax weight by a
factor within ``exp(+-2 delta)``, so the output by at most ``(exp(2 delta) - 1) max |v|``;
the weighted sum of N rows (and the channel scale of the values) adds ``gamma(N + 3) max
|v|``. Taken per query row and channel (delta the row's largest, ``sum_t p_t |v_tj|`` for
``max |v|``) against a float64 reference: only the read's float32 rounding remains.
"""

from __future__ import annotations

import copy
import math

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from float64_attention import exact_attention_and_bound, gamma
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import ZipCacheOptions
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.zipcache import ZipCacheKVCache
from veloxquant_mlx.methods.zipcache import token_mixed
from veloxquant_mlx.quant import token_rows

PROMPT, STEPS, GAP, GQA, D = 200, 40, 16, 2, 64


def zipcache(hi, lo, group, quantize_values, gap=GAP):
    options = ZipCacheOptions(zipcache_hi_fraction=0.3, zipcache_hi_bits=hi, zipcache_lo_bits=lo,
                              zipcache_group_size=group, zipcache_quantize_values=quantize_values)
    return ZipCacheKVCache(KVCacheConfig(method="zipcache", options=options, residual_window=gap), None, 0)


def outlier_rows(shape, seed):
    """Normal rows whose channels' scales span 30x (what the channel scales flatten)."""
    x = mx.random.normal(shape, key=mx.random.key(seed))
    return x * mx.power(30.0, mx.random.uniform(shape=(shape[-1],), key=mx.random.key(seed + 1)))


def call(cache, q, k, v, scale):
    cache.update_and_fetch(k, v)
    return cache.attend(q, k, v, scale=scale, mask="causal" if k.shape[2] > 1 else None)


def decode_against_reference(cache, monkeypatch, pure_path, batch=2, seed=3, check_blocks=True):
    """Prefill, then STEPS decode steps; each step's output against SDPA over the history
    it attends (the dequantized history before it plus its own token); at each flush, the
    block's classes against the saliency of that reference attention."""
    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", pure_path)
    h, total = 2, PROMPT + STEPS
    keys = outlier_rows((batch, h, total, D), seed)
    values = outlier_rows((batch, h, total, D), seed + 2) * 0.5
    scale = D**-0.5
    for start, stop in ((0, 120), (120, PROMPT)):  # a chunked prompt
        q = mx.random.normal((batch, h * GQA, stop - start, D), key=mx.random.key(seed + start))
        call(cache, q, keys[:, :, start:stop], values[:, :, start:stop], scale)
    worst, flushes = 0.0, 0
    for t in range(PROMPT, total):
        q = mx.random.normal((batch, h * GQA, 1, D), key=mx.random.key(100 + t))
        old_k, old_v = cache.dequantized(mx.float32)
        ref_k = mx.concatenate([old_k, keys[:, :, t : t + 1]], axis=2)
        ref_v = mx.concatenate([old_v, values[:, :, t : t + 1]], axis=2)
        ref, bound = exact_attention_and_bound(q, ref_k, ref_v, scale)
        flushing = cache.store.k_buf.length + 1 == GAP
        out = call(cache, q, keys[:, :, t : t + 1], values[:, :, t : t + 1], scale)
        gap = np.abs(np.array(out, dtype=np.float64) - ref) - bound  # <= 0 everywhere
        assert gap.max() <= 0, (t, gap.max(), bound.max())
        worst = max(worst, (np.abs(np.array(out, dtype=np.float64) - ref) / bound).max())
        if flushing and check_blocks:  # the block's classes: its most salient by the reference
            flushes += 1
            logits = (q.reshape(batch, h, GQA, D) * scale) @ ref_k.swapaxes(-1, -2)
            sal = mx.softmax(logits, axis=-1, precise=True)[..., -GAP:].sum(axis=2)  # (B, H, GAP)
            hi = cache.store.flags.view()[..., -GAP:] > 0
            assert (hi.sum(axis=-1) == round(0.3 * GAP)).all().item()
            tol = GQA * math.expm1(2 * gamma(D + 3) * (mx.abs(q).max().item() * mx.abs(ref_k).max().item() * D * scale))
            low_hi = mx.where(hi, sal, mx.inf).min(axis=-1)
            high_lo = mx.where(hi, -mx.inf, sal).max(axis=-1)
            assert (low_hi >= high_lo - tol).all().item(), (low_hi, high_lo)
    assert not check_blocks or flushes == STEPS // GAP
    return worst


@pytest.mark.parametrize("hi, lo, group, quantize_values", [(4, 2, 32, True), (7, 3, 16, True), (8, 1, 32, False)])
@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's read, and a GPU's
def test_decode_read_matches_attention_over_the_dequantized_history(hi, lo, group, quantize_values, pure_path,
                                                                     monkeypatch):
    decode_against_reference(zipcache(hi, lo, group, quantize_values), monkeypatch, pure_path)


def test_a_copy_reads_as_the_original(monkeypatch):
    """A deep copy starts without the original's views (they view the original's buffers)
    and builds its own: both give the same steps."""
    cache = zipcache(4, 2, 32, True)
    decode_against_reference(cache, monkeypatch, "reference", batch=1, check_blocks=False)
    clone = copy.deepcopy(cache)
    assert clone.store._views.value is None
    k = outlier_rows((1, 2, 1, D), 50)
    q = mx.random.normal((1, 4, 1, D), key=mx.random.key(51))
    a, b = call(cache, q, k, k, D**-0.5), call(clone, q, k, k, D**-0.5)
    assert mx.array_equal(a, b).item()
    assert clone.store._views.owner() is clone.store and cache.store._views.owner() is cache.store


def test_the_cpu_read_dequantizes_nothing(monkeypatch):
    """On the CPU (``quantized_matmul`` widths and groups) a decode step, flushes included,
    reads the packed codes as they are."""
    if mx.default_device() != mx.cpu:
        pytest.skip("the CPU's read")  # a GPU's reads the rows decoded (results/h200_s67)
    cache = zipcache(4, 2, 32, True)

    def refuse(*a, **k):
        raise AssertionError("a decode step dequantized packed rows")

    monkeypatch.setattr(token_rows, "dequantize_rows", refuse)
    monkeypatch.setattr(token_mixed.TokenMixedStore, "history", refuse)
    keys = outlier_rows((1, 2, PROMPT + STEPS, D), 9)
    q = mx.random.normal((1, 4, PROMPT, D), key=mx.random.key(10))
    cache.update_and_fetch(keys[:, :, :PROMPT], keys[:, :, :PROMPT])
    monkeypatch.undo()
    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", "qmm")
    cache.attend(q, keys[:, :, :PROMPT], keys[:, :, :PROMPT], scale=D**-0.5, mask="causal")  # the prompt decodes
    monkeypatch.setattr(token_rows, "dequantize_rows", refuse)
    monkeypatch.setattr(token_mixed.TokenMixedStore, "history", refuse)
    for t in range(PROMPT, PROMPT + STEPS):
        k = keys[:, :, t : t + 1]
        mx.eval(call(cache, q[:, :, :1], k, k, D**-0.5))
    assert cache.store.compressed == PROMPT + STEPS - STEPS % GAP


@pytest.mark.parametrize("hi, lo, group, quantize_values", [(4, 2, 32, True), (8, 1, 32, False)])
def test_on_cuda_a_step_that_scores_no_block_reads_the_decoded_rows_in_one_fused_attention(
        hi, lo, group, quantize_values, monkeypatch):
    """On CUDA every step but a block's last reads both classes' rows decoded and multiplied
    by the channel scales, and the buffer's rows, in one ``scaled_dot_product_attention``;
    the block's last step reads the joint
    part, whose scores classify the block. Against the float64 reference with the float32
    bound above, over 40 steps and both flushes."""
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    from sdpa_calls import one_row, recorded

    calls = recorded(monkeypatch)
    decode_against_reference(zipcache(hi, lo, group, quantize_values), monkeypatch, "reference")
    assert len(one_row(calls)) == STEPS - STEPS // GAP  # every step but the two that score a block


def test_cuda_read_decodes_a_layers_rows_only_once_its_queries_exist(monkeypatch):
    """The kept codes are ready before a step runs: unless each layer's decode waits for its
    queries, MLX decodes later layers' rows while this layer's are still held. Gated, from 1
    to 4 chained layers the step's peak grows by half of one layer's decoded rows on this CPU
    (4.0 MiB of 8); ungated, by one layer's (8.0)."""
    from chained_layers import layer_rows, peak_growth

    make = lambda: ZipCacheKVCache(KVCacheConfig(method="zipcache"), None, 0)  # noqa: E731  (defaults)
    assert peak_growth(make, 1, 4, monkeypatch) < 0.7 * layer_rows()
