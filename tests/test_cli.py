"""The command line: methods, generate (completion + measured memory line), bad --set."""

import pytest

from veloxquant_mlx.cli import main
from veloxquant_mlx.cli_common import config_from_args, parse_assignments
from veloxquant_mlx.registry import METHODS


def test_methods_lists_every_method_with_its_status(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines()[2:] if line and not line.startswith(" ")]
    assert len([r for r in rows if r.split()[0] in METHODS]) == len(METHODS)
    done = sum(m.implemented for m in METHODS.values())
    assert "kivi" in out and "turboquant" in out and f"{len(METHODS)} methods, {done} implemented" in out
    assert len(METHODS) == 39  # the 37 families of the contract, turboquant (issue 35), full
    assert all(("yes" in line) == METHODS[line.split()[0]].implemented for line in rows if line.split()[0] in METHODS)


def test_generate_prints_completion_and_measured_memory(capsys):
    prompt = "The special magic number for pale-falcon is: 6240632. " * 8 + "The special magic number for pale-falcon is:"
    code = main(["generate", "--method", "streaming_llm", "--set", "stream_window_size=64",
                 "--set", "stream_n_sink=4", "--prompt", prompt, "--max-tokens", "8"])
    assert code == 0
    captured = capsys.readouterr()
    assert captured.out.strip()  # the completion
    line = captured.err.strip().splitlines()[-1]
    assert line.startswith("[kv cache] method=streaming_llm dtype=float32 tokens=")
    assert "; 68 rows/layer)" in line  # 4 sinks + 64 window rows
    assert "vs" in line and "for the full cache" in line


@pytest.mark.parametrize(
    "method, sets, message",
    [
        ("kivi", ["kv_bits=3"], "kv_bits=3 is out of range; allowed: int, one of 2, 4, 8"),
        ("kivi", ["kivi_group=64"], "'kivi_group' is not a field of KIVIOptions (did you mean 'kivi_group_size'?)"),
        ("snapkv", ["snap_budget=-5"], "snap_budget=-5 is out of range"),
        ("snapkv", ["snap_budget"], "--set expects FIELD=VALUE, got 'snap_budget'"),
        ("kivvi", [], "method='kivvi' is not a known method (did you mean 'kivi'?)"),
    ],
)
def test_bad_set_values_get_the_configs_clear_errors(method, sets, message, capsys):
    argv = ["generate", "--method", method, "--prompt", "x"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_set_values_are_parsed_as_literals():
    own, options = parse_assignments(["svdq_bit_schedule=(8, 4, 0)", "svdq_rank=None", "kv_bits=4"])
    assert options == {"svdq_bit_schedule": (8, 4, 0), "svdq_rank": None} and own == {"kv_bits": 4}
    assert config_from_args("snapkv", ["snap_backend=reference"]).snap_backend == "reference"
