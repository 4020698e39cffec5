"""The quantized store's packed batch layout (quant/batch.py, issue 32): a batch of KIVI
sequences decodes in one attention call per layer, flushes at each sequence's own steps,
and gives back each sequence's store exactly as it runs alone."""

from __future__ import annotations

import mlx.core as mx
import pytest

import batching
from decode_steps import recording_host_reads
from tiny_models import prompt
from veloxquant_mlx.cache import batch as batch_module
from veloxquant_mlx.kernels import kivi_decode as kd

# Prompts that leave each sequence at another point of its key block and value window, and
# enough steps that every one flushes a key block at a different step.
PROMPTS = (45, 100, 67)
MAX_TOKENS = (40, 25, 33)


def _prompts():
    return [prompt(n, seed=i + 11).tolist() for i, n in enumerate(PROMPTS)]


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_batch_decodes_packed_and_equals_each_sequence_alone(bits, monkeypatch):
    model, make = batching.rowwise_setup("kivi", {"kv_bits": bits, "residual_window": 32})
    prompts = _prompts()
    alone = [batching.run_alone(model, make, t, m) for t, m in zip(prompts, MAX_TOKENS)]
    batches = []
    calls = []
    scores = kd.affine_key_scores
    monkeypatch.setattr(kd, "affine_key_scores", lambda q, *a: calls.append(q.shape[0]) or scores(q, *a))

    def check(gen):
        batching.memory_check(gen)
        batches.extend((c.mode, c.batch_size) for c in batching.batch_caches(gen))

    got = batching.run_batched(model, prompts, MAX_TOKENS, join_at=5, check=check)
    # packed steps ran with several sequences at once, each layer's attention one call
    assert ("packed", 3) in batches and ("packed", 2) in batches
    assert {2, 3} <= set(calls)
    for (tokens, logprobs, cache), (a_tokens, a_logprobs, a_cache) in zip(got, alone):
        assert tokens == a_tokens
        for x, y in zip(logprobs, a_logprobs):
            assert mx.allclose(x, y, atol=1e-5, rtol=1e-5), float(mx.abs(x - y).max())
        batching.assert_same_cache(cache, a_cache, exact=False)


def test_a_packed_kivi_decode_step_reads_nothing_on_the_host():
    model, make = batching.rowwise_setup("kivi", {"kv_bits": 4, "residual_window": 32})
    caches = []
    for t in _prompts():
        c = make()
        model(mx.array(t)[None], cache=c)
        caches.append(c)
    merged = [type(caches[0][i]).merge([c[i] for c in caches]) for i in range(len(model.layers))]
    y = mx.array([[1], [2], [3]])
    for _ in range(2):  # the first step packs (host ints only)
        model(y, cache=merged)
    assert all(c.mode == batch_module.PACKED for c in merged)
    with recording_host_reads() as reads:
        for _ in range(40):  # every sequence flushes a key block and values
            out = model(y, cache=merged)
            mx.async_eval(out)
    assert not reads, [str(r) for r in reads]


def test_a_packed_kivi_batch_hands_each_sequence_its_counts_to_the_packed_launch(monkeypatch):
    """Where the fused kernel reads a packed batch (CUDA, float16), the layout hands it each
    sequence's counts and ring start (``kivi_decode_attention_rows``). Here the launch is its
    reference, each sequence read alone from the packed buffers: the tokens must be those of
    each sequence run alone, and every packed step's attention that one call."""
    model, make = batching.rowwise_setup("kivi", {"kv_bits": 4, "residual_window": 32})
    prompts = _prompts()
    alone = [batching.run_alone(model, make, t, m) for t, m in zip(prompts, MAX_TOKENS)]
    launches = []

    def rows_launch(queries, *buffers_and_rows, **kw):
        launches.append(buffers_and_rows[-1])
        return kd.kivi_decode_attention_rows_reference(queries, *buffers_and_rows, **kw)

    monkeypatch.setattr(kd, "rows_kernel_applies", lambda *a, **k: True)
    monkeypatch.setattr(kd, "kivi_decode_attention_rows", rows_launch)
    monkeypatch.setattr(kd, "affine_key_scores", lambda *a: pytest.fail("the pure-MLX read ran"))
    got = batching.run_batched(model, prompts, MAX_TOKENS, join_at=5)
    # rings that have turned, sequences at different counts in one launch
    assert any(len(rows) == 3 and len({r[0] for r in rows}) > 1 for rows in launches)
    assert any(r[4] for rows in launches for r in rows)
    batching.assert_batch_equals_alone(got, alone)
