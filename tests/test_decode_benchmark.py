"""benchmarks/decode.py's batches (issue 30's ``--batch``): equal-length prompts prefilled as
one batch into one cache per method give each sequence what it gets alone, decode steps
carry every sequence, and tokens a second count every sequence's token."""

import sys
from pathlib import Path

import veloxquant_mlx  # noqa: F401  (before mlx)
import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import decode  # noqa: E402
from veloxquant_mlx.bench.runner import prefill  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return decode.build_model("tiny", mx.float32)


@pytest.mark.parametrize("name", ["mlx-lm KVCache", "full", "kivi-4bit", "snapkv"])
def test_a_batch_prefills_and_steps_each_sequence_as_alone(model, name):
    """Three 300-token prompts in chunks of 128 then their last tokens, as one batch: each
    sequence's last logits and its next two greedy tokens are its own run's (float32, the
    rows' products batched: rounding only)."""
    config = decode.METHODS[name] if name in decode.METHODS else veloxquant_mlx.KVCacheConfig(method=name)
    tokens = mx.random.randint(0, model.args.vocab_size, (3, 300), key=mx.random.key(7))
    cache = decode.make_cache(model, config)
    logits = prefill(model, cache, tokens, chunk=128)
    assert logits.shape == (3, model.args.vocab_size)
    y = mx.argmax(logits, axis=-1)
    steps = []
    for _ in range(2):
        y, _ = decode.step(model, cache, y)
        steps.append(y)
    for b in range(3):
        alone = decode.make_cache(model, config)
        want = prefill(model, alone, tokens[b], chunk=128)
        assert mx.allclose(logits[b], want, atol=1e-4, rtol=1e-4).item()
        z = mx.argmax(want)[None]
        for got in steps:
            z, _ = decode.step(model, alone, z)
            assert got[b].item() == z.item()


def test_start_prefills_a_batch_and_tokens_a_second_count_every_sequence(model):
    cache, y, figures = decode.start(model, None, 200, prefill_repeats=1, batch=4)
    assert y.shape == (4,)
    one = decode.start(model, None, 200, prefill_repeats=1, batch=1)[2]
    assert figures["kv_bytes"] == 4 * one["kv_bytes"]  # KVCache's rows for four sequences
    times = [(0.002, 0.008)] * 5
    assert decode.summary(figures, times, batch=4)["decode_tokens_per_s"] == pytest.approx(4 / 0.010)
