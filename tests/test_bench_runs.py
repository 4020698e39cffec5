"""Issues 37 and 38: the bench's speed rounds and peak memory, its progress without a
terminal, results kept run by run when interrupted, an earlier run's folder kept."""

import json

import mlx.core as mx
import mlx_lm
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.bench import cli as bench_cli
from veloxquant_mlx.bench import harness, report, synthetic
from veloxquant_mlx.bench.harness import MethodRun, Workload
from veloxquant_mlx.cli import REFERENCE_MODEL, main
from veloxquant_mlx.integrations.mlx_lm import make_prompt_cache

SYNTHETIC = ["bench", "--synthetic", "--context", "128", "--methods", "streaming_llm,snapkv,h2o"]


def test_speed_is_timed_in_rounds_that_alternate_full_and_the_method(monkeypatch):
    passes = []
    # (prefill tok/s, decode tok/s) of each pass, in the order they run
    speeds = iter([(100, 50), (50, 40), (100, 50), (200, 60), (50, 25), (40, 20)])

    def timed(model, run, work, tokenizer=None):
        passes.append(run.label)
        return next(speeds)
    monkeypatch.setattr(harness, "timed_pass", timed)
    full, method = MethodRun("full", KVCacheConfig()), MethodRun("m", KVCacheConfig())
    work = Workload([], [1] * 8, [2] * 4)
    speed = harness.interleaved_speed(None, method, full, work, rounds=3)
    assert passes == ["full", "m"] * 3
    # per round: prefill 0.5, 2.0, 0.8; decode 0.8, 1.2, 0.8
    assert speed["prefill_speed"] == 0.8 and speed["prefill_speed_range"] == [0.5, 2.0]
    assert speed["decode_speed"] == 0.8 and speed["decode_speed_range"] == [0.8, 1.2]
    assert speed["rounds"] == 3 and speed["decode_steps"] == 4


def _model_result(label, peak, speed_rounds=None):
    memory = {"bytes_per_token_prefill": 10.0, "bytes_per_token_decode": 10.0,
              "peak_bytes": peak, "prefill_tokens_per_s": 1.0, "decode_tokens_per_s": 1.0}
    result = {"label": label, "method": label, "status": "ok", "memory_speed": memory,
              "continuation": {"perplexity": 2.0}, "retrieval": {"accuracy": 1.0}}
    if speed_rounds:
        result["speed_rounds"] = speed_rounds
    return result


def test_the_table_gives_speed_from_the_rounds_with_their_spread():
    rounds = {"prefill_speed": 0.8, "prefill_speed_range": [0.5, 2.0], "decode_speed": 1.25,
              "decode_speed_range": [1.2, 1.314], "rounds": 3}
    results = [_model_result("full", 0), _model_result("m", 100, rounds),
               _model_result("single-pass", 100)]
    # the single pass's own speed (4x the full's) is not a ratio taken in rounds
    results[2]["memory_speed"]["decode_tokens_per_s"] = 4.0
    report.add_ratios(results, synthetic=False)
    head, rows = report.table_rows(results, synthetic=False)
    cells = [dict(zip(head, row)) for row in rows]
    assert cells[1]["prefill"] == "0.80x (0.50-2.00)" and cells[1]["decode"] == "1.25x (1.20-1.31)"
    assert cells[0]["decode"] == "1.00x" and cells[2]["decode"] == "-"
    assert cells[1]["peak"] == "-"  # the full cache's peak was 0: no ratio to it
    assert "median over" in report.LEGEND.replace("\n", " ") and "rounds" in report.LEGEND


def test_peak_is_never_negative_when_memory_is_freed_during_the_run():
    model, _ = mlx_lm.load(str(REFERENCE_MODEL))
    held = [mx.zeros((16, 1024, 1024))]  # 64 MiB freed once the run has begun
    mx.eval(held)

    def frees_memory(m):
        held.clear()
        return make_prompt_cache(m, KVCacheConfig())
    work = Workload([], list(range(10, 42)), list(range(42, 46)))
    figures, _ = harness.held_out_text(model, MethodRun("full", KVCacheConfig(), frees_memory), work)
    assert 0 <= figures["peak_bytes"] < 64 * 2**20


def test_without_a_terminal_each_run_prints_a_line(capsys, tmp_path):
    assert main(SYNTHETIC + ["--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err.splitlines()
    starts = [line for line in err if line.endswith(": started")]
    ends = [line for line in err if " in " in line and line.endswith(" s")]
    assert starts == [f"synthetic [{i}/4] {m}: started"
                      for i, m in enumerate(["full", "streaming_llm", "snapkv", "h2o"], 1)]
    assert [line.split(":")[0] for line in ends] == [line.split(":")[0] for line in starts]
    assert all(": ok in " in line for line in ends)


def test_an_interrupted_bench_keeps_its_finished_runs_marked_partial(capsys, tmp_path, monkeypatch):
    real = synthetic.attention_error
    calls = []

    def interrupted_at_the_third(config, spec, tensors):
        calls.append(config.method)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(config, spec, tensors)
    monkeypatch.setattr(synthetic, "attention_error", interrupted_at_the_third)
    assert main(SYNTHETIC + ["--out", str(tmp_path)]) == 130
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["partial"] is True and (data["runs_finished"], data["runs_planned"]) == (2, 4)
    assert [r["label"] for r in data["results"]] == ["full", "streaming_llm"]
    assert all(r["status"] == "ok" for r in data["results"])
    table = (tmp_path / "table.md").read_text()
    assert table.splitlines()[0].endswith("(PARTIAL: 2 of 4 runs)") and "streaming_llm" in table
    err = capsys.readouterr().err
    assert "interrupted after 2 of 4 runs" in err and str(tmp_path / "results.json") in err


def test_a_finished_bench_is_not_partial(capsys, tmp_path):
    assert main(SYNTHETIC[:-1] + ["streaming_llm", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["partial"] is False and data["runs_finished"] == data["runs_planned"] == 2
    assert "PARTIAL" not in (tmp_path / "table.md").read_text()


def test_an_earlier_runs_results_are_not_overwritten_without_force(capsys, tmp_path):
    argv = SYNTHETIC[:-1] + ["streaming_llm", "--out", str(tmp_path)]
    (tmp_path / "results.json").write_text('{"earlier": true}\n')
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"veloxquant bench: error: --out {tmp_path}: already holds the results of a "
                   f"run ({tmp_path / 'results.json'}); choose another folder or pass --force "
                   "to overwrite them")
    assert json.loads((tmp_path / "results.json").read_text()) == {"earlier": True}
    assert main(argv + ["--force"]) == 0
    assert json.loads((tmp_path / "results.json").read_text())["partial"] is False


def test_the_default_workload_leaves_out_the_task_the_model_never_learned():
    args = bench_cli.argparse.Namespace(quick=False, context=4096)
    settings = bench_cli.workload_settings(args)
    assert "variable_tracking" not in settings["tasks"]
    assert settings["tasks"] == ("niah_single", "niah_multikey", "kv_lookup")
