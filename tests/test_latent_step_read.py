"""The latent store's one-run decode step (``LatentStore.attend_parts``: the steady state
before any refit, read without building ``DecodePart``s and dispatching on them, the
softmax taken in the head groups' layout) against the general reading of the same store
(``kernels/decode.py``'s ``decode_attention`` over ``decode_parts``), bit for bit: the
same operations in the same order. Over 40 decode steps that flush, on the CPU's read and
a GPU's."""

from __future__ import annotations

import mlx.core as mx
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import PALUOptions, SVDqOptions
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.kernels.decode import decode_attention
from veloxquant_mlx.methods.palu import PALUCache
from veloxquant_mlx.methods.svdq import SVDqCache
from veloxquant_mlx.quant import store as store_module
from veloxquant_mlx.quant.store import absent_buffer

STEPS, GQA, D, HEADS = 40, 2, 32, 4

CACHES = {
    "palu, two heads a basis": lambda: PALUCache(KVCacheConfig(method="palu", options=PALUOptions(
        palu_n_head_groups=2, palu_hi_fraction=0.4)), None, 0),
    "palu, a head a basis, 1 and 8 bits": lambda: PALUCache(KVCacheConfig(method="palu", options=PALUOptions(
        palu_n_head_groups=HEADS, palu_hi_bit=1, palu_lo_bit=8)), None, 0),
    "palu, exact value latents": lambda: PALUCache(KVCacheConfig(method="palu", options=PALUOptions(
        palu_n_head_groups=1, palu_quantize_values=False)), None, 0),
    "svdq": lambda: SVDqCache(KVCacheConfig(method="svdq", options=SVDqOptions(svdq_group_size=32)), None, 0),
    "svdq, unquantized and 3-bit spans": lambda: SVDqCache(KVCacheConfig(method="svdq", options=SVDqOptions(
        svdq_bit_schedule=(4, 16, 1, 3, 0, 2), svdq_group_size=32)), None, 0),
}


def rows(shape, seed):
    x = mx.random.normal(shape, key=mx.random.key(seed)) * mx.power(0.8, mx.arange(shape[-1]))
    return x + mx.random.normal((*shape[:2], 1, shape[-1]), key=mx.random.key(seed + 1))


@pytest.mark.parametrize("name", list(CACHES))
@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's read, and a GPU's
def test_one_run_step_is_the_general_read_bit_for_bit(name, pure_path, monkeypatch):
    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", pure_path)
    cache = CACHES[name]()
    prompt, batch = 150, 2  # fitted in the prompt (at most 4 x 32 tokens); no refit in 40 steps
    keys = rows((batch, HEADS, prompt + STEPS, D), 3)
    values = rows((batch, HEADS, prompt + STEPS, D), 5) * 0.5
    scale = D**-0.5
    q = mx.random.normal((batch, HEADS * GQA, prompt, D), key=mx.random.key(7))
    cache.update_and_fetch(keys[:, :, :prompt], values[:, :, :prompt])
    cache.attend(q, keys[:, :, :prompt], values[:, :, :prompt], scale=scale, mask="causal")
    store = cache.store
    flushes = 0
    for t in range(prompt, prompt + STEPS):
        q = mx.random.normal((batch, HEADS * GQA, 1, D), key=mx.random.key(100 + t)) * 3
        k, v = keys[:, :, t : t + 1], values[:, :, t : t + 1]
        flushed = store.keys.tokens.flushed
        cache.update_and_fetch(k, v)
        out = cache.attend(q, k, v, scale=scale, mask=None)
        flushes += store.keys.tokens.flushed > flushed
        assert len(store.keys.runs) == 1  # the one-run step
        general = decode_attention(q, store.decode_parts(absent_buffer(q.dtype)), scale=scale,
                                   use_kernel=False, n_kv_heads=HEADS)
        assert out.shape == general.shape and out.dtype == general.dtype
        assert mx.array_equal(out, general).item(), (name, t)
    assert flushes >= 1 and store.keys.tokens.buf.length


def test_several_runs_take_the_general_read(monkeypatch):
    """After a refit (two runs) the step is the general reading's."""
    cache = CACHES["palu, two heads a basis"]()
    calls = []
    monkeypatch.setattr(store_module, "decode_attention", lambda *a, **k: calls.append(1) or decode_attention(*a, **k))
    keys = rows((1, HEADS, 80, D), 3)
    cache.update_and_fetch(keys[:, :, :64], keys[:, :, :64])
    cache.attend(mx.zeros((1, HEADS * GQA, 64, D)), keys[:, :, :64], keys[:, :, :64], scale=D**-0.5, mask="causal")
    for t in range(64, 80):
        k = keys[:, :, t : t + 1]
        cache.update_and_fetch(k, k)
        cache.attend(mx.ones((1, HEADS * GQA, 1, D)), k, k, scale=D**-0.5, mask=None)
    assert not calls and len(cache.store.keys.runs) == 1
    cache.store.fitted_at = 40  # the next token's commit refits: a second run
    k = rows((1, HEADS, 1, D), 9)
    cache.update_and_fetch(k, k)
    cache.attend(mx.ones((1, HEADS * GQA, 1, D)), k, k, scale=D**-0.5, mask=None)
    assert len(cache.store.keys.runs) == 2 and calls == [1]


def test_the_head_groups_are_read_at_the_first_update_only(monkeypatch):
    """``palu_n_head_groups`` is checked against the model's heads (a config read that
    builds the options) once: the first commit fixes the groups."""
    cache = CACHES["palu, two heads a basis"]()
    calls = []
    real = PALUCache.head_groups.__func__
    monkeypatch.setattr(PALUCache, "head_groups", classmethod(lambda cls, *a: calls.append(1) or real(cls, *a)))
    keys = rows((1, HEADS, 70, D), 3)
    cache.update_and_fetch(keys[:, :, :64], keys[:, :, :64])
    cache.attend(mx.zeros((1, HEADS * GQA, 64, D)), keys[:, :, :64], keys[:, :, :64], scale=D**-0.5, mask="causal")
    for t in range(64, 70):
        k = keys[:, :, t : t + 1]
        cache.update_and_fetch(k, k)
        cache.attend(mx.ones((1, HEADS * GQA, 1, D)), k, k, scale=D**-0.5, mask=None)
    assert calls == [1] and cache.store.heads_per_group == 2
