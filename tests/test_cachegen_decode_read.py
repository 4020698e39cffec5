"""CacheGen's decode read (``delta.AnchoredStore``): on a GPU's path (``kivi_decode``'s
"reference") the runs rebuilt from views kept between flushes (codes unpacked at unit scale,
then one fused ``delta s + anchor s_a`` pass) and the buffer's rows under one softmax; on
the CPU's path ("qmm") the joint read of ``AnchoredScores`` over the packed codes. Both
against attention over the reconstructed history computed the straightforward way (float64),
over 40 decode steps that flush (and grow the codes' buffer).

Tolerance: both sides evaluate the same function; they differ by float32 rounding only. A
score is a dot product of D terms, scaled, each key element a delta plus its anchor (both
products of a small integer and a float16 step: exact in float32) added once, or read by
two products summed (the CPU's): at most D + 3 roundings a term, of magnitudes at most
``|q| (|k| + 2 |anchor|)`` (``|delta| <= |k| + |anchor|``). So each score is off by at most
``gamma(D + 3) * S`` (``gamma(n) = n u / (1 - n u)``, u = 2^-24, S the largest such sum of
the row), which moves each softmax weight by a factor within ``exp(+-2 delta)``, so the
output by at most ``(exp(2 delta) - 1) sum_t p_t m_t``; the weighted sum of N rows (the
anchors' per-group sums on the CPU) adds ``gamma(N + 3) sum_t p_t m_t``, m_t the value's
magnitude ``|v_t| + 2 |anchor_t|``. Taken per query row and channel against float64.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from conformance import config
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.cachegen import delta
from veloxquant_mlx.methods.cachegen.cache import CacheGenCache
from veloxquant_mlx.methods.cachegen.delta import ANCHOR_BITS, dequantize_symmetric
from veloxquant_mlx.quant.affine import unpack_codes

U = 2.0**-24
PROMPT, STEPS, GQA, D = 250, 40, 2, 64


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def cachegen(**settings):
    return CacheGenCache(config("cachegen", settings), None, 0)


def rows(shape, seed, smooth):
    x = mx.random.normal(shape, key=mx.random.key(seed))
    return mx.cumsum(x * 0.3, axis=2) + 2 * x[:, :, :1] if smooth else x


def call(cache, q, k, v, scale):
    cache.update_and_fetch(k, v)
    return cache.attend(q, k, v, scale=scale, mask="causal" if k.shape[2] > 1 else None)


def anchors(run, total: int, like: mx.array) -> mx.array:
    """Each stored token's anchor (B, H, total, D) float32: zero for the buffer's rows and
    without delta coding."""
    out = mx.zeros(like.shape, mx.float32)
    if not run.codec.use_delta or not run.count:
        return out
    a = dequantize_symmetric(unpack_codes(run.anchor_codes.view(), ANCHOR_BITS), run.anchor_scales.view(), ANCHOR_BITS)
    a = mx.repeat(a, run.codec.group, axis=2)
    return mx.concatenate([a, out[:, :, run.count : total]], axis=2)


def exact_attention_and_bound(q, keys, values, key_anchors, value_anchors, scale):
    b, hq, _, d = q.shape
    h, n = keys.shape[1], keys.shape[2]
    qs = np.array(q.astype(mx.float32), dtype=np.float64).reshape(b, h, hq // h, d) * scale
    k, v = np.array(keys, dtype=np.float64), np.array(values, dtype=np.float64)
    s = qs @ k.swapaxes(-1, -2)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    mk = np.abs(k) + 2 * np.abs(np.array(key_anchors, dtype=np.float64))
    mv = np.abs(v) + 2 * np.abs(np.array(value_anchors, dtype=np.float64))
    delta_s = gamma(d + 3) * (np.abs(qs) @ mk.swapaxes(-1, -2)).max(axis=-1, keepdims=True)
    bound = (np.expm1(2 * delta_s) + gamma(n + 3)) * (p @ mv)
    return (p @ v).reshape(b, hq, 1, -1), bound.reshape(b, hq, 1, -1)


def decode_against_reference(cache, monkeypatch, pure_path, batch=2, seed=3, smooth=True):
    """A chunked prompt, then STEPS decode steps, each against attention over the history it
    attends (the reconstructed history after its own token is stored: a flushing step codes
    it first). Returns the worst |error| / bound and the flushes seen."""
    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", pure_path)
    if pure_path == "reference":  # a GPU's: ``token_mix`` cut along the tokens, as on CUDA
        monkeypatch.setattr(kd, "_splits_tokens", lambda: True)
        monkeypatch.setattr(kd, "SPLIT_TOKENS", 64)
    h, total = 2, PROMPT + STEPS
    keys = rows((batch, h, total, D), seed, smooth)
    values = rows((batch, h, total, D), seed + 2, smooth) * 0.5
    scale = D**-0.5
    for start, stop in ((0, 120), (120, PROMPT)):
        q = mx.random.normal((batch, h * GQA, stop - start, D), key=mx.random.key(seed + start))
        call(cache, q, keys[:, :, start:stop], values[:, :, start:stop], scale)
    worst, flushes = 0.0, 0
    for t in range(PROMPT, total):
        q = mx.random.normal((batch, h * GQA, 1, D), key=mx.random.key(100 + t))
        count = cache.store.keys.count
        out = call(cache, q, keys[:, :, t : t + 1], values[:, :, t : t + 1], scale)
        flushes += cache.store.keys.count != count
        ref_k, ref_v = cache.dequantized(mx.float32)
        ka, va = (anchors(r, t + 1, x) for r, x in ((cache.store.keys, ref_k), (cache.store.values, ref_v)))
        ref, bound = exact_attention_and_bound(q, ref_k, ref_v, ka, va, scale)
        err = np.abs(np.array(out, dtype=np.float64) - ref)
        assert (err <= bound).all(), (t, (err - bound).max(), bound.max())
        worst = max(worst, (err / bound).max())
    return worst, flushes


SETTINGS = [
    {"cachegen_group_size": 32},  # 4-bit deltas, 8-bit anchors
    {"cachegen_group_size": 32, "cachegen_resolved_bits": 5},  # codes across words
    {"cachegen_group_size": 64, "cachegen_bits": 3},
    {"cachegen_group_size": 32, "cachegen_use_delta": False},  # every token coded directly
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's read, and a GPU's
def test_decode_read_matches_attention_over_the_reconstructed_history(settings, pure_path, monkeypatch):
    worst, flushes = decode_against_reference(cachegen(**settings), monkeypatch, pure_path)
    assert flushes == (PROMPT + STEPS) // settings["cachegen_group_size"] - PROMPT // settings["cachegen_group_size"]
    assert flushes >= 1 and 0 < worst <= 1


def test_the_gpu_read_keeps_its_views_between_flushes_and_rebuilds_them_after_one(monkeypatch):
    """A step between flushes reads the views the last one built (no slice of the history);
    a flush (which writes into the viewed buffers in place) drops them first."""
    cache = cachegen(cachegen_group_size=32)
    decode_against_reference(cache, monkeypatch, "reference", batch=1)
    run, group = cache.store.keys, 32
    built = run._views.value
    assert built is not None and run._views.owner() is run
    k = rows((1, 2, group, D), 40, True)
    q = mx.random.normal((1, 2 * GQA, 1, D), key=mx.random.key(41))
    for i in range(group):
        count = run.count
        mx.eval(call(cache, q, k[:, :, i : i + 1], k[:, :, i : i + 1], D**-0.5))
        if run.count == count:
            assert run._views.value is built
        else:  # the flush: views of the new count
            assert run._views.value is not built and run._views.key[-1] == run.count
            built = run._views.value
    run.put(*run.encode(k))  # a write in place into the viewed buffers: the views go first
    assert run._views.value is None


def test_a_copy_reads_as_the_original(monkeypatch):
    """A deep copy starts without the original's views (they view the original's buffers)
    and builds its own: both give the same steps."""
    cache = cachegen(cachegen_group_size=32)
    decode_against_reference(cache, monkeypatch, "reference", batch=1)
    clone = copy.deepcopy(cache)
    assert clone.store.keys._views.value is None
    k = rows((1, 2, 1, D), 50, False)
    q = mx.random.normal((1, 2 * GQA, 1, D), key=mx.random.key(51))
    a, b = call(cache, q, k, k, D**-0.5), call(clone, q, k, k, D**-0.5)
    assert mx.array_equal(a, b).item()
    assert clone.store.keys._views.owner() is clone.store.keys


def test_the_cpu_read_rebuilds_nothing(monkeypatch):
    """On the CPU (``quantized_matmul``) a decode step reads the packed codes as they are."""
    if mx.default_device() != mx.cpu:
        pytest.skip("the CPU's read")  # a GPU's rebuilds the runs (results/h200_s67)
    def refuse(*a, **k):
        raise AssertionError("a CPU decode step rebuilt a run")

    monkeypatch.setattr(delta.AnchoredTokens, "rebuilt", refuse)
    decode_against_reference(cachegen(cachegen_group_size=32), monkeypatch, "qmm", batch=1)


def _plain_layout(run, empty):
    """``AnchoredTokens.layout`` built the plain way each step: fresh views of the valid rows."""
    views = (run.codes.view(), run.scales.view())
    if run.codec.use_delta:
        views += (run.anchor_codes.view(), run.anchor_scales.view())
    return delta.AnchoredScores(run.codec, run.count, views)


def _plain_token_affine(scores):
    """``AnchoredScores._token_affine`` the plain way: the steps cast, then repeated over their tokens."""
    c, codes, s = scores.codec, scores.views[0], scores.views[1].astype(mx.float32)
    if c.use_delta:
        b, h, n_groups, w = s.shape
        s = mx.broadcast_to(s[:, :, :, None], (b, h, n_groups, c.group, w)).reshape(b, h, -1, w)
    return codes, s, s * delta._neg_offset(c.bits), c.bits


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
@pytest.mark.parametrize("pure_path", ["qmm", "reference"])
def test_the_parts_read_kept_between_flushes_is_the_plain_one_bit_for_bit(settings, pure_path, monkeypatch):
    """The parts' path (the CPU's; a GPU's where the runs are not rebuilt) reads the scores'
    views kept between flushes (``layout``) and the steps broadcast once (``_token_affine``):
    over 40 steps crossing flushes, each step's output equals, bit for bit, that of a twin
    whose reads are built the plain way every step."""
    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", pure_path)
    # the parts' path on either: values kept unquantized would leave it too, so refuse the rebuild
    monkeypatch.setattr(delta.AnchoredTokens, "rebuilds", property(lambda self: False))
    batch, h, total, seed = 2, 2, PROMPT + STEPS, 7
    keys = rows((batch, h, total, D), seed, True)
    values = rows((batch, h, total, D), seed + 2, True) * 0.5
    kept, plain = cachegen(**settings), cachegen(**settings)
    kept_layout, kept_affine = delta.AnchoredTokens.layout, delta.AnchoredScores._token_affine

    def step(q, start, stop):
        outs = []
        for cache, layout, affine in ((kept, kept_layout, kept_affine), (plain, _plain_layout, _plain_token_affine)):
            monkeypatch.setattr(delta.AnchoredTokens, "layout", layout)
            monkeypatch.setattr(delta.AnchoredScores, "_token_affine", affine)
            outs.append(call(cache, q, keys[:, :, start:stop], values[:, :, start:stop], D**-0.5))
        mx.eval(outs)
        return outs

    for start, stop in ((0, 120), (120, PROMPT)):
        step(mx.random.normal((batch, h * GQA, stop - start, D), key=mx.random.key(seed + start)), start, stop)
    flushes = 0
    for t in range(PROMPT, total):
        count = kept.store.keys.count
        a, b = step(mx.random.normal((batch, h * GQA, 1, D), key=mx.random.key(200 + t)), t, t + 1)
        flushes += kept.store.keys.count != count
        assert a.shape == b.shape and mx.array_equal(a, b).item(), t
    assert flushes >= 1
    assert kept.store.keys._scores.value is not None  # the kept views were read


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
def test_on_cuda_the_rebuilt_runs_and_one_fused_attention_give_the_float32_read(settings, monkeypatch):
    """On CUDA a step reads the runs rebuilt in the queries' dtype and the buffer through one
    ``scaled_dot_product_attention``: against float64 within the bound above, every step
    (the rows rebuilt in float32, as the bound takes them, here: a float32 model)."""
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    from sdpa_calls import one_row, recorded

    calls = recorded(monkeypatch)
    worst, flushes = decode_against_reference(cachegen(**settings), monkeypatch, "reference")
    assert flushes >= 1 and 0 < worst <= 1
    assert len(one_row(calls)) == STEPS


def test_cuda_read_rebuilds_a_layers_runs_only_once_its_queries_exist(monkeypatch):
    """The kept codes are ready before a step runs: unless each layer's rebuild waits for its
    queries, MLX rebuilds later layers' runs while this layer's are still held. Gated, at most
    the next layer's rebuild overlaps this layer's attention: from 1 to 4 chained layers the
    step's peak grows by at most about one layer's rebuilt rows (3.4 MiB of 8 in a process of
    its own, 7.6 in a test worker after other tests); ungated by three layers' (24)."""
    from chained_layers import layer_rows, peak_growth

    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", "reference")
    assert peak_growth(cachegen, 1, 4, monkeypatch) < 1.5 * layer_rows()  # defaults
