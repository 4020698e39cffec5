"""Issue 37: `veloxquant generate` says in one line when a method holds more than the full
cache (a short prompt inside a method's full-precision window, or growth room), and a short
prompt does not pay a whole growth step (snapkv's 256 slots, kivi's 32-row window steps)."""

import re

import mlx.core as mx
import pytest

from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cli import main

PROMPT = "The quick brown fox"  # <bos> + 19 bytes = a 20-token prompt


def _memory(err: str) -> tuple[int, int, int]:
    line = err.strip().splitlines()[-1]
    tokens = int(re.search(r"tokens=(\d+)", line).group(1))
    kept, full = (int(x.replace(",", "")) for x in re.findall(r"([\d,]+) bytes", line)[:2])
    return tokens, kept, full


def test_generate_says_in_one_line_when_a_method_holds_more_than_the_full_cache(capsys):
    assert main(["generate", "--method", "kivi", "--prompt", PROMPT, "--max-tokens", "1"]) == 0
    err = capsys.readouterr().err
    tokens, kept, full = _memory(err)
    assert kept > full  # nothing is quantized inside kivi's 128-token window
    notes = [line for line in err.splitlines() if "note:" in line]
    assert len(notes) == 1, err
    assert notes[0].startswith("[kv cache] note: kivi holds MORE than the full cache here "
                               f"({kept / full:.2f}x its bytes): at {tokens} tokens"), notes[0]


def test_no_note_when_the_method_holds_less(capsys):
    prompt = "And he said unto them, " * 40
    assert main(["generate", "--method", "snapkv", "--set", "snap_budget=64", "--prompt", prompt,
                 "--max-tokens", "1"]) == 0
    err = capsys.readouterr().err
    _, kept, full = _memory(err)
    assert kept < full and "note:" not in err


# Growth follows what is held (GrowingArray(geometric=True): the eviction slots, the quantized
# stores' full-precision windows, streaming_llm's window): an append of n rows that overflows
# adds ceil(n / s) * s < n + s rows, s = min(step, ceil(rows / 2)) for the ``rows`` held after
# it, so the buffer holds at most rows + ceil(rows / 2) - 1 <= 1.5 * rows - 0.5 rows, and
# appends that fit only lower the ratio. Whole rows: at most floor(1.5 * rows) a layer and head.
@pytest.mark.parametrize("n_prompt", [20, 33])
@pytest.mark.parametrize("method", ["kivi", "snapkv", "streaming_llm"])
def test_a_short_prompt_and_its_decode_steps_hold_at_most_one_and_a_half_rows_per_token(method, n_prompt):
    model = tiny_model("llama")
    args = model.args
    cache = make_prompt_cache(model, KVCacheConfig(method=method))
    tokens = prompt(n_prompt + 6)
    model(tokens[None, :n_prompt], cache=cache)
    # K and V rows of the full cache; snapkv adds an int32 position per slot and head
    row = 2 * args.head_dim * 4
    extra = 4 if method == "snapkv" else 0
    for i in range(n_prompt, n_prompt + 6):
        mx.eval(model(tokens[None, i : i + 1], cache=cache))
        rows = i + 1
        full = len(cache) * args.num_key_value_heads * rows * row
        held = sum(c.nbytes for c in cache)
        bound = len(cache) * args.num_key_value_heads * (int(1.5 * rows)) * (row + extra)
        assert held <= bound, (rows, held / full, bound / full)


# The same rule where the other methods keep rows that grow (issue 37): exact rows held
# until a fit or kept beside a latent (xkv, a2ats, svdq, palu, spectral, minicache), the
# full-precision windows (adakv, kvtc), kvquant's per-token runs and amc's tiers (no fused
# kernel reads them by steps). Their growing buffers together hold at most floor(1.5 * rows)
# full-precision rows a layer and head (quantized rows are smaller than those); what a cache
# allocates exactly sized (bases, moments, a latent written once) is added as it is.
GROWN_EXACTLY_SIZED = re.compile(r"[kv]\d+_(codes|scales|biases|positions)")  # amc's tiers: plain arrays that grow


def _exactly_sized_bytes(cache) -> int:
    from mlx.utils import tree_flatten

    from veloxquant_mlx.cache.buffers import GrowingArray

    total = 0
    for c in cache:
        arrays = c._arrays()
        if c.config.method == "amc":
            arrays = {k: a for k, a in arrays.items() if not GROWN_EXACTLY_SIZED.fullmatch(k)}
        total += sum(a.nbytes for _, a in tree_flatten(arrays)
                     if isinstance(a, mx.array) and not isinstance(a, GrowingArray))
    return total


@pytest.mark.parametrize("n_prompt", [20, 33])
@pytest.mark.parametrize("method", ["xkv", "a2ats", "svdq", "spectral", "palu", "minicache", "adakv",
                                    "amc", "kvquant", "kvtc"])
def test_growing_rows_of_other_methods_hold_at_most_one_and_a_half_rows_per_token(method, n_prompt):
    model = tiny_model("llama")
    args = model.args
    cache = make_prompt_cache(model, KVCacheConfig(method=method))
    tokens = prompt(n_prompt + 6)
    model(tokens[None, :n_prompt], cache=cache)
    row = 2 * args.head_dim * 4
    for i in range(n_prompt, n_prompt + 6):
        mx.eval(model(tokens[None, i : i + 1], cache=cache))
        rows = i + 1
        full = len(cache) * args.num_key_value_heads * rows * row
        held = sum(c.nbytes for c in cache)
        bound = len(cache) * args.num_key_value_heads * int(1.5 * rows) * row + _exactly_sized_bytes(cache)
        assert held <= bound, (rows, held / full, bound / full)
