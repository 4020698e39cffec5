"""Issue 37: a short prompt does not pay a whole growth step (snapkv's first decode step
doubled a 256-row buffer; kivi's windows took 32-row steps), and `veloxquant generate` says
so in one line when a method still holds more than the full cache."""

import re

import pytest

from veloxquant_mlx.cli import main

PROMPT = "The quick brown fox"  # <bos> + 19 bytes = a 20-token prompt


def _memory(err: str) -> tuple[int, int, int]:
    line = err.strip().splitlines()[-1]
    tokens = int(re.search(r"tokens=(\d+)", line).group(1))
    kept, full = (int(x.replace(",", "")) for x in re.findall(r"([\d,]+) bytes", line)[:2])
    return tokens, kept, full


@pytest.mark.parametrize("method", ["kivi", "snapkv"])
def test_a_20_token_prompt_and_one_decode_step_hold_at_most_the_growth_bound(method, capsys):
    assert main(["generate", "--method", method, "--prompt", PROMPT, "--max-tokens", "1"]) == 0
    tokens, kept, full = _memory(capsys.readouterr().err)
    assert tokens == 21  # 20 prompt tokens and one decode step
    # Geometric growth (GrowingArray(geometric=True)): room added when ``rows`` rows are held
    # after an append is at most ceil(rows / 2) - 1 rows, so 21 rows sit in at most 21 + 10
    # slots; snapkv's int32 positions add 4 bytes per slot and head to 2 x 128 x 4 of K/V.
    bound = (21 + 10) / 21 * (1 + 4 / (2 * 128 * 4))
    assert kept <= bound * full, (kept / full, bound)


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
    prompt = "And he said unto them, " * 12
    assert main(["generate", "--method", "snapkv", "--set", "snap_budget=64", "--prompt", prompt,
                 "--max-tokens", "1"]) == 0
    err = capsys.readouterr().err
    _, kept, full = _memory(err)
    assert kept < full and "note:" not in err
