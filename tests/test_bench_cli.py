"""Issue 14 item 6: bench sweeps come from the spec, --quick is bounded per method."""

import json

import pytest

from veloxquant_mlx.bench import cli as bench_cli
from veloxquant_mlx.bench.cli import method_runs
from veloxquant_mlx.cli import main
from veloxquant_mlx.registry import METHODS, implemented_methods


def test_sweeps_are_the_specs_today_values():
    assert not hasattr(bench_cli, "SWEEPS")  # no table of its own
    assert METHODS["streaming_llm"].sweeps == (("stream_window_size", (124, 252, 508, 1020)),)
    assert METHODS["snapkv"].sweeps == (("snap_budget", (128, 256, 512, 1024)),)
    assert METHODS["kivi"].sweeps == (("kv_bits", (2, 4, 8)),)  # a config field, used_by kivi
    assert METHODS["full"].sweeps == ()


@pytest.mark.parametrize("method", [m for m in implemented_methods() if m != "full"])
def test_sweep_runs_each_value_of_the_registry(method):
    runs = method_runs([method], None, sweep=True)
    expected = [f"{method} {f}={v}" for f, values in METHODS[method].sweeps for v in values] or [method]
    assert [r.label for r in runs] == ["full", *expected]
    for run, (field, value) in zip(runs[1:], [(f, v) for f, vs in METHODS[method].sweeps for v in vs]):
        assert getattr(run.config, field) == value and run.settings[field] == value


def test_quick_and_sweep_together_are_refused(capsys, tmp_path):
    assert main(["bench", "--quick", "--sweep", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "veloxquant bench: error: --quick runs one setting per method; drop --sweep or --quick"


def test_quick_workload_is_small_and_the_same_for_every_method(capsys, tmp_path):
    assert main(["bench", "--quick", "--methods", "full", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["workload"]["contexts"] == [1024] and data["workload"]["continuation"] == 32
    for result in data["results"]:
        assert result["status"] == "ok", result.get("error")
        assert len(result["retrieval"]["examples"]) == 3
        assert result["memory_speed"]["tokens_prefill"] == 1024 - 32
        # the full baseline takes ~3 s on 2 cores (median method 6 CPU-s); 20 s leaves room for a busy CI.
        assert result["elapsed_s"] < 20
