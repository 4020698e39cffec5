"""The leaderboard's question-after protocol (kvpress's pipeline, issue 34): a cache told to
``stop_evicting`` after the context keeps every later token, through prompt ends and decode
steps, and says so in its saved state; the protocol's answer splits each prompt before its
closing question."""

import mlx.core as mx
import pytest

from conformance import config
from feeding import feed, run_prompt, synthetic_kvq
from tiny_models import tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.bench.harness import MethodRun, answer, answer_question_after
from veloxquant_mlx.bench.ruler import RULER_TASKS, make_ruler_example
from veloxquant_mlx.registry import METHODS

HEAD_DIM, CONTEXT, QUESTION, STEPS = 32, 150, 20, 70  # 70 steps: two of knorm's and h2o's decode evictions


def _cache(method, settings):
    return METHODS[method.partition("+")[0]].load_implementation()(config(method, settings))


@pytest.mark.parametrize("method, settings", [
    ("knorm", {"knorm_budget": 40}),  # scores every chunk and every 32 steps
    ("h2o", {"h2o_budget": 40}),
    ("snapkv", {"snap_budget": 40}),
    ("tova+kivi4", {"tova_budget": 40, "storage": {"method": "kivi", "options": {"kivi_group_size": 32}}}),
])
def test_after_stop_evicting_every_later_token_is_kept(method, settings):
    cache = _cache(method, settings)
    k, v, q = synthetic_kvq(CONTEXT + QUESTION + STEPS, 2, 2, HEAD_DIM)
    run_prompt(cache, k, v, q, CONTEXT)  # the context, compressed at its end
    kept = set(cache.kept_positions[0, 0].tolist())
    assert len(kept) == 40
    cache.stop_evicting()
    run_prompt(cache, k, v, q, CONTEXT + QUESTION, start=CONTEXT)  # the question: a chunk, then its last token
    for t in range(CONTEXT + QUESTION, CONTEXT + QUESTION + STEPS):
        out = feed(cache, k, v, q, t, t + 1)
    mx.eval(out)
    later = set(range(CONTEXT, CONTEXT + QUESTION + STEPS))
    assert set(cache.kept_positions[0, 0].tolist()) == kept | later
    assert cache.stored_length == 40 + QUESTION + STEPS
    # saved and loaded, it still keeps what comes
    loaded = type(cache).from_state(cache.state)
    assert loaded.evicting is False
    end = CONTEXT + QUESTION + STEPS
    k2, v2, q2 = synthetic_kvq(end + 40, 2, 2, HEAD_DIM, seed=3)
    for t in range(end, end + 40):
        feed(loaded, k2, v2, q2, t, t + 1)
    assert loaded.stored_length == 40 + QUESTION + STEPS + 40


def test_a_cache_that_never_stopped_saves_no_evicting_field():
    cache = _cache("knorm", {"knorm_budget": 40})
    k, v, q = synthetic_kvq(CONTEXT, 2, 2, HEAD_DIM)
    run_prompt(cache, k, v, q, CONTEXT)
    assert "evicting" not in cache.state["meta"]  # files saved before the protocol load as they did


def test_rocketkv_after_stop_evicting_attends_to_every_kept_token():
    """RocketKV's stage 2 (a decode step's top pages) summarises the tokens kept at the
    prompt's end; stopped, a decode step reads every kept token: the fused attention over
    the store's rows, bit for bit."""
    cache = _cache("rocketkv", {"rocketkv_compression_ratio": 4.0})
    k, v, q = synthetic_kvq(CONTEXT + QUESTION + 8, 2, 2, HEAD_DIM)
    run_prompt(cache, k, v, q, CONTEXT)
    assert cache.plan is not None
    cache.stop_evicting()
    run_prompt(cache, k, v, q, CONTEXT + QUESTION, start=CONTEXT)
    for t in range(CONTEXT + QUESTION, CONTEXT + QUESTION + 8):
        keys, values = cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        out = cache.attend(q[:, :, t : t + 1], keys, values, scale=HEAD_DIM**-0.5, mask=None)
        want = mx.fast.scaled_dot_product_attention(q[:, :, t : t + 1], cache.store.view("keys"),
                                                    cache.store.view("values"), scale=HEAD_DIM**-0.5)
        assert mx.array_equal(out, want), t
    assert cache.plan is None


@pytest.mark.parametrize("task", RULER_TASKS)
def test_every_tasks_question_closes_its_prompt(task):
    ex = make_ruler_example(task, 600, seed=0, index=1)
    assert ex.question.startswith("Question:") and ex.prompt.endswith(ex.question)
    assert ex.prompt[: -len(ex.question)].endswith("\n\n")


class _ByteTokenizer:
    """The reference model's bytes, <bos> first (what ``load_model`` gives it)."""

    def encode(self, text):
        return [1] + list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i > 1 and i < 256).decode("utf-8", errors="replace")


def test_the_protocol_with_nothing_evicted_answers_as_the_whole_prompt_does():
    """A cache that evicts nothing (budget above the prompt) answers the same in two
    prefills (context, then question) as in one, and so does the full cache."""
    model = tiny_model("llama")
    ex = make_ruler_example("niah_single", 300, seed=0, index=0)
    tok = _ByteTokenizer()
    for cfg in (KVCacheConfig(), config("knorm", {"knorm_budget": 1024})):
        run = MethodRun("t", cfg)
        assert answer_question_after(model, tok, run, ex) == answer(model, tok, run, ex)
