"""Methods that save no memory at their defaults say so (issue 37): the status note
starts with the marker, and `veloxquant methods` lists them under its table."""

import pytest

from veloxquant_mlx.cli import NO_SAVING_NOTE, main
from veloxquant_mlx.registry import METHODS

NO_SAVING_AT_DEFAULTS = ("xquant", "minicache", "a2ats")


@pytest.mark.parametrize("key", NO_SAVING_AT_DEFAULTS)
def test_the_status_note_says_it_first(key):
    assert METHODS[key].status_note.startswith(NO_SAVING_NOTE)


def test_methods_listing_names_each_with_its_reason(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    listed = out.split("No memory saved at the defaults", 1)[1].splitlines()[1:]
    named = {line.split(":", 1)[0].strip() for line in listed if line.startswith("  ")}
    assert named == set(NO_SAVING_AT_DEFAULTS)
    assert "1.008x the full cache" in out and "1.02x the full cache" in out and "12x its KL" in out
