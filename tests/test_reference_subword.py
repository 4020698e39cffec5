"""The embedded subword reference model (issue 34): its tokenizer keeps what the tasks ask
about short and spelled one way, the shipped weights are the trained ones, and the model
retrieves a needle through the full cache and loses it when the cache drops it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import veloxquant_mlx  # noqa: F401  (before mlx: OpenBLAS)
from veloxquant_mlx.bench import ruler, tasks
from veloxquant_mlx.cli_common import resolve_model
from veloxquant_mlx.reference import REFERENCE_MODEL, REFERENCE_SUBWORD_MODEL

REPO = Path(__file__).resolve().parents[1]
PARITY = REPO / "training" / "logs" / "subword_parity.safetensors"


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(REFERENCE_SUBWORD_MODEL / "tokenizer.json"))


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


def test_numbers_are_groups_of_three_digits_from_the_left(tokenizer):
    assert tokenizer.encode("1234567", add_special_tokens=False).tokens == ["123", "456", "7"]
    assert tokenizer.encode("12345", add_special_tokens=False).tokens == ["123", "45"]
    for n in ("0", "09", "999", "007"):  # every group of one to three digits is one token
        assert len(_ids(tokenizer, n)) == 1, n


def test_every_needle_key_is_two_tokens_and_every_name_one(tokenizer):
    keys = [f"{a}-{n}" for a in tasks._ADJECTIVES for n in tasks._NOUNS]
    assert {len(_ids(tokenizer, k)) for k in keys} == {2}
    for word in ruler._NAMES + ruler._THINGS + tuple(t for t in ruler._TOWNS if " " not in t):
        assert len(_ids(tokenizer, word)) == 1, word


def test_a_word_is_the_same_tokens_after_a_space_at_a_prompt_end_or_alone(tokenizer):
    # RULER's answer prefixes end with a space; the answer must be spelled as in the context
    space = _ids(tokenizer, " ")
    assert len(space) == 1
    for word in ("Westmoor", "1234567", "ledger"):
        alone = _ids(tokenizer, word)
        assert _ids(tokenizer, "in " + word)[-len(alone):] == alone
        assert _ids(tokenizer, "in " + word) == _ids(tokenizer, "in ") + alone
        assert _ids(tokenizer, "in ")[-1:] == space


def test_the_tokenizer_round_trips_the_held_out_book_with_bos_in_front(tokenizer):
    text = (REFERENCE_MODEL / "heldout_kjv_acts.txt").read_text()
    enc = tokenizer.encode(text)
    assert enc.ids[0] == tokenizer.token_to_id("<bos>") == 0
    assert tokenizer.decode(enc.ids, skip_special_tokens=True) == text


def test_the_model_is_named_reference_subword_on_the_command_line():
    assert resolve_model("reference-subword") == str(REFERENCE_SUBWORD_MODEL)
    assert resolve_model("reference") == str(REFERENCE_MODEL)
    weights = sum(f.stat().st_size for f in REFERENCE_SUBWORD_MODEL.glob("model*.safetensors"))
    assert weights <= 40e6  # issue 34: small enough to ship


@pytest.fixture(scope="module")
def model_and_tokenizer():
    import mlx.core as mx
    from mlx_lm import load

    model, tok = load(str(REFERENCE_SUBWORD_MODEL))
    model.set_dtype(mx.float32)
    return model, tok


def test_the_shipped_weights_give_the_training_runs_logits(model_and_tokenizer):
    # training/logs/subword_parity.safetensors: a fixed prompt and the float32 logits of
    # its last positions as PyTorch computed them from the exported weights on the GPU
    # (TF32 products: about 1e-3 relative), so float32 MLX matches to that, not exactly
    import mlx.core as mx
    import numpy as np

    model, _ = model_and_tokenizer
    ref = mx.load(str(PARITY))
    want = np.array(ref["logits"]).astype(np.float32)
    got = np.array(model(ref["input_ids"]).astype(mx.float32))[:, -want.shape[1]:]
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.99


def _greedy(model, tok, config, example):
    from veloxquant_mlx.bench.harness import MethodRun, answer

    return answer(model, tok, MethodRun("t", config), example)


def test_it_finds_a_needle_through_the_full_cache_and_not_once_the_cache_drops_it(model_and_tokenizer):
    from veloxquant_mlx import KVCacheConfig
    from veloxquant_mlx.cache.options import StreamingLLMOptions

    model, tok = model_and_tokenizer
    count = lambda s: len(tok.encode(s))  # noqa: E731
    ex = ruler.make_ruler_example("niah_single", 1024, seed=0, index=0, count_tokens=count)
    assert 0.2 < ex.meta["depths"][0] < 0.8  # far from both ends of the window below
    full = _greedy(model, tok, KVCacheConfig(method="full"), ex)
    assert ex.answers[0] in full
    window = KVCacheConfig(method="streaming_llm",
                           options=StreamingLLMOptions(stream_window_size=128, stream_n_sink=4))
    assert ex.answers[0] not in _greedy(model, tok, window, ex)


def test_the_model_card_states_the_baseline_it_measured():
    card = (REFERENCE_SUBWORD_MODEL / "README.md").read_text()
    table = re.search(r"\| task \|.*?\n\n", card, re.S)
    assert table, "the card has no table of the baseline's scores"
    for task in ruler.RULER_TASKS:
        assert f"| {task} |" in table.group(0), task
