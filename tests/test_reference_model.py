"""The shipped reference model loads with mlx-lm and retrieves a needle, on the CPU."""

import json

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx.bench import tasks

MODEL_DIR = tasks.HELDOUT_TEXT_PATH.parent


@pytest.fixture(scope="module")
def loaded():
    mx.set_default_device(mx.cpu)
    return load(str(MODEL_DIR))


def test_shipped_files_and_architecture():
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    ) == (8, 2, 128)
    assert all(cfg["head_dim"] % g == 0 for g in (32, 64, 128))
    assert "rope_theta" in cfg
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 16_000_000
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
        "heldout_kjv_acts.txt",
    ):
        assert (MODEL_DIR / name).exists(), name


def test_byte_tokenizer(loaded):
    _, tok = loaded
    text = "The special magic number for pale-falcon is: 6240632."
    ids = tok.encode(text)
    assert ids == [256] + list(text.encode("utf-8"))
    assert tok.decode(ids[1:]) == text
    assert tok.eos_token_id == 257


def test_retrieves_a_needle_end_to_end(loaded):
    model, tok = loaded
    ex = tasks.make_example(
        "niah_single", 320, seed=tasks.EVAL_SEED, index=0, depth=0.2
    )
    assert ex.meta["distance_tokens"] > 150  # the needle is well before the question
    ids = tok.encode(ex.prompt)
    assert len(ids) == ex.n_tokens <= 320
    cache = make_prompt_cache(model)
    logits = model(mx.array(ids)[None], cache=cache)[0, -1]
    out = []
    for _ in range(len(ex.answer)):  # greedy decode with the KV cache
        out.append(int(mx.argmax(logits).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]
    text = bytes(t for t in out if t < 256).decode("utf-8", "replace")
    assert tasks.score(ex, text), (text, ex.answer)


def test_streamed_completion_keeps_its_leading_space(loaded):
    """Issue 25 item 6: mlx-lm's streaming detokenizer (what generate and the server
    print) gives the completion exactly, so prompt + completion reads as one decode."""
    _, tok = loaded
    prompt = tok.encode("And they departed from")
    completion = list(" them. And they \u00e9\u4e2d\nsaid ".encode("utf-8"))  # multi-byte too
    detokenizer = tok.detokenizer
    detokenizer.reset()
    streamed = ""
    for token in completion:
        detokenizer.add_token(token)
        streamed += detokenizer.last_segment
    detokenizer.finalize()
    streamed += detokenizer.last_segment
    assert streamed == " them. And they \u00e9\u4e2d\nsaid "
    assert tok.decode(prompt) + streamed == tok.decode(prompt + completion)
