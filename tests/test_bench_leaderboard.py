"""Issue 34: ``veloxquant bench --leaderboard``: settings found by measured bytes, the
table and plot in kvpress's shape."""

import json
import math

import pytest

from veloxquant_mlx.bench import leaderboard as lb
from veloxquant_mlx.cli import main


def test_main_field_is_the_swept_field_else_the_budget():
    assert lb.main_field("snapkv") == "snap_budget"
    assert lb.main_field("kivi") == "kv_bits"  # a config field, swept for kivi
    assert lb.main_field("knorm") == "knorm_budget"  # no sweep in the spec
    assert lb.main_field("streaming_llm") == "stream_window_size"
    assert lb.main_field("full") is None


def _counting(f):
    calls = []

    def measure(v):
        calls.append(v)
        return f(v)

    return measure, calls


def test_integer_search_starts_above_refused_values_and_finds_the_nearest():
    # refused below 37 (a budget that leaves no room for sinks and window), 100 B a token
    measure, calls = _counting(lambda v: None if v < 37 else 100 * v + 20)
    measured: dict = {}
    # full = 5000: the search stops early only within 25 bytes of the target
    value, nbytes = lb.search(measure, "snap_budget", 5000, 5000, 1024, measured)
    assert (value, nbytes) == (50, 5020)
    assert len(calls) == len(set(calls)) < 40  # each value measured once
    before = len(calls)  # a second target reuses what the first measured
    assert lb.search(measure, "snap_budget", 5000, 5000, 1024, measured) == (50, 5020)
    assert len(calls) == before
    # with a looser tolerance (0.5% of a larger full cache) a nearby value ends it early
    value, nbytes = lb.search(measure, "snap_budget", 5000, 102_400, 1024, {})
    assert abs(nbytes - 5000) <= 0.005 * 102_400


def test_integer_search_reads_a_linear_budget_off_the_line_in_few_prefills():
    # each measurement is a prefill of the whole prompt: bytes linear in a budget (plus a
    # fixed part) are found by interpolation, where bisection of [1, 4096] took 12
    measure, calls = _counting(lambda v: 6144 * min(v, 4096) + 99_000)
    full = 6144 * 4096 + 99_000
    value, nbytes = lb.search(measure, "snap_budget", full / 2, full, 4096, {})
    assert abs(nbytes - full / 2) <= 0.005 * full
    assert len(calls) <= 3


def test_integer_search_still_halves_bytes_far_from_a_line():
    measure, calls = _counting(lambda v: v ** 3)
    value, nbytes = lb.search(measure, "snap_budget", 1000 ** 3, 1000 ** 3, 4096, {})
    assert abs(nbytes - 1000 ** 3) <= 0.005 * 1000 ** 3 and len(calls) <= 2 * 12 + 2


def test_float_search_follows_bytes_that_fall_as_the_value_rises():
    measure, _ = _counting(lambda v: 1000.0 / v)
    value, nbytes = lb.search(measure, "rocketkv_compression_ratio", 250.0, 1000.0, 1024, {})
    assert value == pytest.approx(4.0, abs=0.05) and nbytes == pytest.approx(250, abs=5)


def test_a_field_bounded_by_another_is_searched_inside_the_bounds_that_run():
    # adakv's average bits: [1, 8] by its own rule, [2, 4] by its lowest and highest widths
    measure, calls = _counting(lambda v: None if not 2 <= v <= 4 else 1000.0 * v)
    value, nbytes = lb.search(measure, "adakv_target_avg_bits", 3000.0, 8000.0, 1024, {},
                              inside=(2.0, 2.5, 3.0, 4.0))
    assert value == pytest.approx(3.0, abs=0.05) and nbytes == pytest.approx(3000, abs=50)
    assert lb.search(measure, "adakv_target_avg_bits", 3000.0, 8000.0, 1024, {}) is None


def test_choices_are_all_measured():
    measure, calls = _counting({2: 10, 4: 20, 8: 40}.get)
    assert lb.search(measure, "kv_bits", 18, 64, 1024, {}) == (4, 20)
    assert sorted(calls) == [2, 4, 8]


def test_markdown_has_the_rows_and_kvpress_table():
    rows = [lb.Row("full", None, 0.0, None, None, 8192.0, {"qa": 50.0, "cwe": 100.0}, 75.0),
            lb.Row("snapkv", 0.5, 0.498, "snap_budget", 255, 4112.0,
                   {"qa": 0.0, "cwe": 50.0}, 25.0),
            lb.Row("kivi", 0.5, math.nan, "kv_bits", None, math.nan, status="failed",
                   error="ValueError: x")]
    text = lb.markdown(rows, ["qa", "cwe"], "T", "veloxquant bench --leaderboard")
    lines = text.splitlines()
    assert lines[0] == "# T" and "veloxquant bench --leaderboard" in lines
    assert "| full | - | 0.000 | - | 8192.0 | 50.0 | 100.0 | 75.0 |" in lines
    assert "| snapkv | 0.5 | 0.498 | snap_budget=255 | 4112.0 | 0.0 | 50.0 | 25.0 |" in lines
    assert "| kivi | 0.5 | - | kv_bits=None | - | - | - | failed: ValueError: x |" in lines
    assert "| method | 0.5 |" in lines and "| snapkv | 25.0 (0.498) |" in lines
    assert "| full | 75.0 |" in lines and "| kivi | - |" in lines


def test_bad_arguments_are_refused_before_the_model_loads(capsys, tmp_path):
    out = str(tmp_path)
    assert main(["bench", "--leaderboard", "--sweep", "--out", out]) == 2
    assert "drop --sweep" in capsys.readouterr().err
    assert main(["bench", "--leaderboard", "--ratios", "0.5,1.5", "--out", out]) == 2
    assert "each ratio is in [0, 1)" in capsys.readouterr().err
    assert main(["bench", "--leaderboard", "--tasks", "niah,qa", "--out", out]) == 2
    assert "choose from niah_single" in capsys.readouterr().err
    assert main(["bench", "--leaderboard", "--jobs", "0", "--out", out]) == 2
    assert "--jobs 0: at least 1 process" in capsys.readouterr().err


TINY = ["bench", "--leaderboard", "--methods", "snapkv,streaming_llm", "--ratios", "0.5",
        "--context", "300", "--examples", "1", "--tasks", "niah_single"]


def test_a_main_field_that_leaves_bytes_unchanged_runs_the_method_at_its_defaults(
        capsys, tmp_path):
    # a2ats keeps the exact K/V beside its codes: no retrieval fraction changes its bytes,
    # and the nearest of equal bytes was the lowest fraction, 0 (no retrieval: 0 points)
    assert lb.bytes_do_not_move({0.0: 1000, 0.5: 1024, 1.0: 1000}, full=1000)
    assert not lb.bytes_do_not_move({0.0: 1000, 1.0: 900}, full=1000)
    assert not lb.bytes_do_not_move({0.0: 1000, 1.0: None}, full=1000)
    assert main(["bench", "--leaderboard", "--methods", "a2ats", "--ratios", "0.5",
                 "--context", "300", "--examples", "1", "--tasks", "niah_single",
                 "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "leaderboard.json").read_text())
    row = data["rows"][1]
    assert row["field"] == "a2ats_retrieval_fraction" and row["value"] is None
    assert row["ratio"] <= 0.0  # its codes come on top of the exact K/V
    assert "defaults (a2ats_retrieval_fraction does not change bytes)" in (
        tmp_path / "leaderboard.md").read_text()
    capsys.readouterr()


@pytest.mark.slow
def test_leaderboard_every_task_and_ratio(tmp_path):
    assert main(["bench", "--leaderboard", "--methods", "knorm,kivi", "--context", "1024",
                 "--examples", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "leaderboard.json").read_text())
    assert len(data["rows"]) == 1 + 2 * 4
    for r in data["rows"][1:]:
        assert r["status"] == "ok" and set(r["scores"]) == set(data["tasks"])
        if r["method"] == "knorm":
            assert abs(r["ratio"] - r["target"]) < 0.01


def _part(rows, **over):
    base = {"context": 300, "tasks": ["niah_single"], "examples_per_task": 1,
            "full_bytes": 1000, "probe_tokens": 256, "seed": 0, "partial": False,
            "title": "T", "command": "c", "outputs": {}}
    return {**base, **over, "rows": [r.__dict__ for r in rows]}


def test_merge_takes_the_scored_baseline_and_every_parts_rows_in_order():
    full = lb.Row("full", None, 0.0, None, None, 4.0, {"niah_single": 100.0}, 100.0)
    unscored = lb.Row("full", None, 0.0, None, None, 4.0, status="not scored")
    snap = lb.Row("snapkv", 0.5, 0.5, "snap_budget", 128, 2.0, {"niah_single": 0.0}, 0.0)
    kivi = lb.Row("kivi", 0.5, 0.6, "kv_bits", 8, 1.6, {"niah_single": 100.0}, 100.0)
    payload, rows = lb.merge([_part([full]), _part([unscored, snap]),
                              _part([unscored, kivi], partial=True)])
    assert [(r.method, r.status) for r in rows] == [("full", "ok"), ("snapkv", "ok"),
                                                    ("kivi", "ok")]
    assert payload["partial"] is True and payload["full_bytes"] == 1000
    with pytest.raises(ValueError, match="full_bytes is 999"):
        lb.merge([_part([full]), _part([unscored, snap], full_bytes=999)])
    with pytest.raises(ValueError, match="no part scored the full cache"):
        lb.merge([_part([unscored, snap])])


def _check_tiny_leaderboard(out, capsys):
    """What the one-process run of ``TINY`` writes in ``out``."""
    data = json.loads((out / "leaderboard.json").read_text())
    assert data["partial"] is False and data["probe_tokens"] == 256  # whole steps of 256
    rows = {r["method"]: r for r in data["rows"]}
    assert list(rows) == ["full", "snapkv", "streaming_llm"]
    assert rows["full"]["ratio"] == 0 and rows["full"]["scores"] == {"niah_single": 100.0}
    for m, name in (("snapkv", "snap_budget"), ("streaming_llm", "stream_window_size")):
        assert rows[m]["field"] == name and rows[m]["target"] == 0.5
        assert abs(rows[m]["ratio"] - 0.5) < 0.01  # token budgets reach a ratio closely
        assert rows[m]["scores"]["niah_single"] in (0.0, 100.0)
    # the committed command reruns the same leaderboard
    assert data["command"].startswith("veloxquant bench --leaderboard --methods "
                                      "snapkv,streaming_llm --ratios 0.5 --tasks niah_single "
                                      "--context 300 --examples 1 --seed 0")
    assert (out / "leaderboard.png").stat().st_size > 10_000
    assert "| streaming_llm | 0.5 |" in (out / "leaderboard.md").read_text()
    capsys.readouterr()
    assert main([*TINY, "--out", str(out)]) == 2  # an earlier leaderboard is kept
    assert "pass --force" in capsys.readouterr().err


def test_jobs_runs_each_method_in_a_part_and_resumes(capsys, tmp_path):
    assert main([*TINY, "--jobs", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "leaderboard.json").read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert list(rows) == ["full", "snapkv", "streaming_llm"] and data["partial"] is False
    assert rows["full"]["scores"] == {"niah_single": 100.0}
    # the same rows as one process gives
    single = tmp_path / "single"
    assert main([*TINY, "--out", str(single)]) == 0
    alone = {r["method"]: r for r in json.loads((single / "leaderboard.json").read_text())["rows"]}
    assert rows == alone
    _check_tiny_leaderboard(single, capsys)
    parts = json.loads((tmp_path / "parts" / "snapkv" / "leaderboard.json").read_text())
    assert parts["rows"][0]["status"] == "not scored"  # the baseline is answered once
    assert "| full | - | 0.000 | - |" in (tmp_path / "parts" / "snapkv" / "leaderboard.md"
                                          ).read_text().replace("not scored |", "")
    capsys.readouterr()
    # a finished part is reused: a rerun with --force scores nothing again
    assert main([*TINY, "--jobs", "2", "--force", "--out", str(tmp_path)]) == 0
    assert "reusing the finished parts of full, snapkv, streaming_llm" in capsys.readouterr().err
    # a part run with other settings is not: another --examples reruns every part
    assert main([*TINY[:-4], "--examples", "2", "--tasks", "niah_single", "--jobs", "2",
                 "--force", "--out", str(tmp_path)]) == 0
    assert "reusing" not in capsys.readouterr().err
    assert json.loads((tmp_path / "leaderboard.json").read_text())["examples_per_task"] == 2


def test_the_fields_a_ratio_is_searched_through_are_the_main_field_then_the_other_sweeps():
    assert lb.byte_fields("spectral") == ["spectral_key_d_eff", "kv_bits"]
    assert lb.byte_fields("snapkv") == ["snap_budget"] and lb.byte_fields("full") == []


@pytest.mark.slow  # 15 s: two settings of spectral searched and scored at 1,024 tokens
def test_a_flat_main_field_hands_the_ratio_to_the_methods_next_swept_field(capsys, tmp_path):
    # spectral's effective dimension leaves its bytes unchanged; kv_bits, swept after it,
    # sets them: the ratio is searched through kv_bits, not given up for the defaults
    assert main(["bench", "--leaderboard", "--methods", "spectral", "--ratios", "0.25,0.75",
                 "--context", "1024", "--examples", "1", "--tasks", "niah_single",
                 "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "leaderboard.json").read_text())
    rows = data["rows"][1:]
    assert [r["field"] for r in rows] == ["kv_bits", "kv_bits"]
    assert rows[0]["value"] > rows[1]["value"]  # more bytes kept at the lower ratio
    assert set(data["outputs"]) == {"full|None", *(f"spectral|kv_bits={r['value']}" for r in rows)}
    assert "| spectral | 0.25 |" in (tmp_path / "leaderboard.md").read_text()
    capsys.readouterr()


def test_a_jobs_run_stops_once_on_sigterm_and_ignores_the_next_until_it_has_merged():
    """``timeout`` signals the ``--jobs`` process and then its process group: the first TERM
    stops the parts as Ctrl-C does, and a second one must not cut the merge short (it did:
    the run then wrote no leaderboard)."""
    import signal

    from veloxquant_mlx.bench import cli as bench_cli

    previous = signal.signal(signal.SIGTERM, bench_cli.stop_once)
    try:
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
        try:
            signal.raise_signal(signal.SIGTERM)  # ignored: the merge goes on
        except KeyboardInterrupt:
            pytest.fail("a second SIGTERM stopped the run again, inside its merge")
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_part_whose_process_dies_shows_as_failed_rows_naming_how_it_ended(capsys, tmp_path, monkeypatch):
    """A part's process that ends unfinished without a word of its own (a crash in native
    code, as kvtc's part did on the H100) leaves failed rows in the merged table for the
    ratios it had not reached, naming how the process ended; its log says so too."""
    import signal
    import subprocess
    import sys

    real = subprocess.Popen

    def popen(argv, **kwargs):
        if "streaming_llm" in argv:  # this part dies as a segmentation fault would end it
            argv = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
        return real(argv, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    assert main([*TINY, "--jobs", "2", "--out", str(tmp_path)]) == 1
    data = json.loads((tmp_path / "leaderboard.json").read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert list(rows) == ["full", "snapkv", "streaming_llm"] and data["partial"] is True
    assert rows["snapkv"]["status"] == "ok"
    dead = rows["streaming_llm"]
    assert dead["status"] == "failed" and dead["target"] == 0.5
    assert "its process ended unfinished (killed by SIGSEGV" in dead["error"]
    table = (tmp_path / "leaderboard.md").read_text()
    assert "| streaming_llm | 0.5 | - | - | - | - | failed: its process ended unfinished (killed by SIGSEGV" in table
    log = (tmp_path / "parts" / "streaming_llm" / "log.txt").read_text()
    assert log.endswith("leaderboard: the process ended unfinished: killed by SIGSEGV\n")
    assert "streaming_llm: stopped (killed by SIGSEGV" in capsys.readouterr().err
    # resumed, the part runs again and its failure is forgotten
    monkeypatch.setattr(subprocess, "Popen", real)
    assert main([*TINY, "--jobs", "2", "--force", "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "parts" / "streaming_llm" / "stopped.txt").exists()
    assert json.loads((tmp_path / "leaderboard.json").read_text())["partial"] is False


def test_question_after_is_recorded_and_runs_in_parts(capsys, tmp_path):
    """``--question-after`` answers by kvpress's protocol: the title, the JSON and each
    part's command say so (a part run without it is not reused), and with a budget that
    keeps the whole prompt a method scores as the full cache does."""
    base = ["bench", "--leaderboard", "--methods", "knorm", "--ratios", "0.25", "--context", "300",
            "--examples", "1", "--tasks", "niah_single", "--question-after"]
    assert main([*base, "--jobs", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "leaderboard.json").read_text())
    assert data["question_after"] is True and "--question-after" in data["command"]
    assert "question after compression (kvpress's protocol)" in (tmp_path / "leaderboard.md").read_text()
    part = json.loads((tmp_path / "parts" / "knorm" / "leaderboard.json").read_text())
    assert part["command"].endswith("--question-after --out " + str(tmp_path / "parts" / "knorm"))
    capsys.readouterr()
    assert main([*base[:-1], "--jobs", "2", "--force", "--out", str(tmp_path)]) == 0
    assert "reusing" not in capsys.readouterr().err  # without it, another protocol: run again
    assert json.loads((tmp_path / "leaderboard.json").read_text())["question_after"] is False


def test_question_after_needs_the_leaderboard(capsys, tmp_path):
    assert main(["bench", "--quick", "--question-after", "--out", str(tmp_path)]) == 2
    assert "--question-after is a protocol of --leaderboard" in capsys.readouterr().err


def test_merge_leaderboards_puts_a_rerun_method_in_its_place_and_clears_partial(tmp_path, monkeypatch):
    """``benchmarks/merge_leaderboards.py``: a method whose part died (no rows) and was run
    alone later takes its place in the first run's order; a method run again replaces its
    earlier rows; the merge is partial only while a method of the first command has none;
    a run written before ``question_after`` existed merges with one run without it."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "merge_leaderboards.py"
    spec = importlib.util.spec_from_file_location("merge_leaderboards", path)
    merge_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge_script)
    full = lb.Row("full", None, 0.0, None, None, 4.0, {"niah_single": 100.0}, 100.0)

    def row(method, score):
        return lb.Row(method, 0.5, 0.5, "f", 1, 2.0, {"niah_single": score}, score)

    def run(name, methods, rows, **over):
        part = _part([full, *rows], command=f"veloxquant bench --leaderboard --methods {methods} --out x",
                     **over)
        part.setdefault("question_after", False)
        if over.get("question_after", False) is None:
            del part["question_after"]
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(part))
        return p

    first = run("first", "a,kvtc,b", [row("a", 10.0), row("b", 30.0)], partial=True, question_after=None)
    kvtc = run("kvtc", "kvtc", [row("kvtc", 20.0)])
    again = run("again", "a", [row("a", 15.0)])

    def merged(*runs):
        out = tmp_path / "out"
        monkeypatch.setattr(sys, "argv", ["merge", "--out", str(out), *map(str, runs)])
        merge_script.main()
        return json.loads((out / "leaderboard.json").read_text())

    data = merged(first, kvtc, again)
    assert [(r["method"], r["average"]) for r in data["rows"]] == [("full", 100.0), ("a", 15.0), ("kvtc", 20.0),
                                                                  ("b", 30.0)]
    assert data["partial"] is False and "PARTIAL" not in (tmp_path / "out" / "leaderboard.md").read_text()
    data = merged(first, again)
    assert data["partial"] is True and [r["method"] for r in data["rows"]] == ["full", "a", "b"]
