"""Issue 37: `veloxquant generate` says in one line when a method holds more than the full
cache (a short prompt inside a method's full-precision window, or growth room)."""

import re


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
