"""Issue 17: every command and the README example behave as a newcomer expects.

CLI behaviour is checked through the entry point (``main([...])`` or a subprocess)."""

import json
import os
import re
import subprocess
import sys

import mlx_lm
import pytest

import veloxquant_mlx
from veloxquant_mlx.cli import main
from veloxquant_mlx.cache.config import CONFIG_FIELD_USERS
from veloxquant_mlx.registry import METHODS

UNIMPLEMENTED = "{unimplemented}"  # filled in by the fixture of that name
REF_BYTES_PER_TOKEN = 4 * 2 * 2 * 128 * 4  # layers x (K, V) x kv heads x head_dim x float32


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"veloxquant {command}: error: "), err
    return lines[0]


@pytest.fixture
def no_model_loading(monkeypatch):
    import mlx_lm.server

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded or a server started")

    monkeypatch.setattr(mlx_lm, "load", refuse)
    monkeypatch.setattr(mlx_lm.server, "main", refuse)


# -- 1. a listed method without an implementation ---------------------------------------
@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--method", UNIMPLEMENTED, "--prompt", "hi"],
        ["bench", "--methods", UNIMPLEMENTED],
        ["serve", "--method", UNIMPLEMENTED, "--", "--model", "reference"],
    ],
    ids=["generate", "bench", "serve"],
)
def test_unimplemented_method_is_one_line_before_any_model_loads(argv, capsys, no_model_loading, unimplemented):
    argv = [a.format(unimplemented=unimplemented) for a in argv]
    code, _, err = run_cli(capsys, *argv)
    line = one_error_line(err, argv[0])
    assert code == 2
    assert f"method '{unimplemented}' has no implementation yet; implemented: full, " in line
    assert ".)" not in line and ".;" not in line


def test_first_api_example_uses_an_implemented_method(repo_root):
    text = (repo_root / "generated" / "API.md").read_text()
    first = text.split("```pycon", 1)[1].split("```", 1)[0]
    method = re.search(r'method="(\w+)"', first).group(1)
    assert METHODS[method].implemented, method


# -- 2. a model that is not there ---------------------------------------------------------
@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda tmp: "/nonexistent/model", "model not found (no such folder)"),
        (lambda tmp: "./nomodel", "model not found (no such folder)"),
        (lambda tmp: str(tmp), "the folder has no config.json"),
        (lambda tmp: (tmp / "config.json").write_text("{}") and str(tmp), "the folder has no weights (*.safetensors)"),
        (lambda tmp: (tmp / "model.txt").write_text("x") and str(tmp / "model.txt"), "not a folder"),
    ],
    ids=["absolute", "relative", "empty-folder", "no-weights", "a-file"],
)
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_missing_model_says_what_a_model_path_needs(command, make, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    model = make(tmp_path)
    argv = [command, "--model", model] + (["--prompt", "hi"] if command == "generate" else ["--out", str(tmp_path / "o")])
    code, _, err = run_cli(capsys, *argv)
    line = one_error_line(err, command)
    assert code == 2 and f"--model {model}: {expected}" in line
    assert "config.json" in line and "hub id" in line and "'reference'" in line


def test_serve_checks_the_servers_model_before_starting(capsys, no_model_loading):
    code, _, err = run_cli(capsys, "serve", "--method", "snapkv", "--", "--model", "/nonexistent/model", "--port", "0")
    assert code == 2
    assert "--model /nonexistent/model: model not found (no such folder)" in one_error_line(err, "serve")


# -- 3. generate --dtype, float32 on the CPU by default -------------------------------------
def test_generate_has_dtype_float32_by_default_on_the_cpu(capsys):
    code, _, err = run_cli(capsys, "generate", "--prompt", "And he said", "--max-tokens", "2")
    assert code == 0 and "dtype=float32 " in err.splitlines()[-1]
    code, _, err = run_cli(capsys, "generate", "--prompt", "And he said", "--max-tokens", "2", "--dtype", "float16")
    assert code == 0 and "dtype=float16 " in err.splitlines()[-1]


# -- 4. import order and the fast BLAS ------------------------------------------------------
def _python(code: str, **env):
    full_env = {k: v for k, v in os.environ.items() if k != "VELOXQUANT_SYSTEM_BLAS"}
    full_env.update(env)
    return subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
                          env=full_env, timeout=60)


FAKE_OPENBLAS = "import ctypes.util; ctypes.util.find_library = lambda name: 'libopenblas.so.0'\n"
NO_OPENBLAS = "import ctypes.util; ctypes.util.find_library = lambda name: None\n"


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS is loaded on Linux only")
def test_mlx_imported_first_warns_once_how_to_fix_it():
    run = _python(FAKE_OPENBLAS + "import mlx.core\nimport veloxquant_mlx\nveloxquant_mlx._blas.use_optimized_blas()")
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("SlowBLASWarning") == 1, run.stderr
    assert "mlx was imported before veloxquant_mlx" in run.stderr
    assert "import veloxquant_mlx before mlx" in run.stderr and "VELOXQUANT_SYSTEM_BLAS=0" in run.stderr
    assert "<string>:3" in run.stderr  # it points at the user's import line


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS is loaded on Linux only")
def test_no_openblas_installed_warns_how_to_install_it():
    run = _python(NO_OPENBLAS + "import veloxquant_mlx")
    assert "SlowBLASWarning: no OpenBLAS is installed" in run.stderr, run.stderr
    assert "apt-get install libopenblas0-pthread" in run.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS is loaded on Linux only")
def test_blas_warning_is_quiet_when_turned_off_or_when_nothing_is_wrong():
    for code in (FAKE_OPENBLAS + "import mlx.core\nimport veloxquant_mlx", NO_OPENBLAS + "import veloxquant_mlx"):
        run = _python(code, VELOXQUANT_SYSTEM_BLAS="0")
        assert run.returncode == 0 and "Warning" not in run.stderr, run.stderr
    if veloxquant_mlx._blas.loaded:  # this machine has OpenBLAS: the right order is silent
        run = _python("import veloxquant_mlx\nimport mlx.core")
        assert "Warning" not in run.stderr, run.stderr


# -- 5. generate's memory line: kept rows against kept rows --------------------------------
def test_memory_line_compares_like_with_like(capsys):
    code, _, err = run_cli(capsys, "generate", "--method", "kivi", "--prompt", "And he said", "--max-tokens", "16")
    assert code == 0
    line = err.splitlines()[-1]
    tokens = int(re.search(r"tokens=(\d+)", line).group(1))
    kept, full = (int(x.replace(",", "")) for x in re.findall(r"([\d,]+) bytes", line)[:2])
    assert tokens == 28  # <bos> + 11 prompt bytes + the 16 generated (mlx-lm runs one ahead)
    assert full == tokens * REF_BYTES_PER_TOKEN  # the full cache's valid rows, not its 256-row steps
    # Nothing was quantized (all inside the 128-token window): the same rows on both sides,
    # the method's full-precision windows with up to one 32-row growth step of room.
    assert full <= kept <= full + 32 * REF_BYTES_PER_TOKEN
    assert line.endswith(f"= {kept / full:.3f}x")
    assert "every array the method holds" in line and f"the same {tokens} rows" in line


# -- 6. --set of a field the method does not read -------------------------------------------
SNAPKV_READS = "snapkv reads snap_dtype, snap_batched_scoring, snap_backend, snap_budget, snap_obs_window, snap_n_sink (SnapKVOptions)"


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--method", "snapkv", "--set", "kv_bits=4", "--prompt", "hi"],
        ["serve", "--method", "snapkv", "--set", "kv_bits=4", "--", "--model", "reference"],
    ],
    ids=["generate", "serve"],
)
def test_config_field_the_method_does_not_read_is_an_error(argv, capsys, no_model_loading):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert one_error_line(err, argv[0]).endswith(f"--set kv_bits: snapkv does not read kv_bits; {SNAPKV_READS}")


def test_bench_refuses_a_config_field_no_benchmarked_method_reads(capsys, tmp_path, no_model_loading):
    code, _, err = run_cli(capsys, "bench", "--methods", "snapkv", "--set", "kv_bits=4", "--out", str(tmp_path))
    assert code == 2
    readers = ", ".join(k for k in CONFIG_FIELD_USERS["kv_bits"])
    assert one_error_line(err, "bench").endswith(f"--set kv_bits: none of the benchmarked methods reads it (read by: {readers})")


def test_unknown_option_lists_every_field_the_method_reads(capsys, no_model_loading):
    code, _, err = run_cli(capsys, "generate", "--method", "kivi", "--set", "snap_budget=100", "--prompt", "hi")
    assert code == 2
    assert one_error_line(err, "generate").endswith(
        "'snap_budget' is not a field of KIVIOptions; kivi reads kivi_group_size (KIVIOptions); "
        "kv_bits, residual_window, fused_attention (config fields)"
    )


# -- 7. error lines: one prefix style, never wrapped; --max-tokens 0 ------------------------
def test_bench_errors_share_one_style_and_are_not_wrapped(capsys, monkeypatch, tmp_path, no_model_loading):
    monkeypatch.setenv("COLUMNS", "40")  # rich would wrap at the terminal's width
    lines = []
    for sets in (["kv_bits=3"], ["snap_budget=-5"]):
        code, _, err = run_cli(capsys, "bench", "--methods", "kivi,snapkv", "--set", sets[0], "--out", str(tmp_path))
        assert code == 2
        lines.append(one_error_line(err, "bench"))
    assert re.fullmatch(r"veloxquant bench: error: kv_bits=3 is out of range; allowed: int, one of 2, 4, 8", lines[0])
    assert re.match(r"veloxquant bench: error: snap_budget=-5 is out of range; allowed: int, in \[1, inf\)", lines[1])


@pytest.mark.parametrize("n", ["0", "-3"])
def test_max_tokens_below_one_is_a_clean_error(n, capsys, no_model_loading):
    code, _, err = run_cli(capsys, "generate", "--prompt", "hi", "--max-tokens", n)
    assert code == 2 and one_error_line(err, "generate").endswith(f"--max-tokens must be at least 1, got {n}")


# -- 8. help texts -------------------------------------------------------------------------
def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def _options_without_help(text: str) -> list[str]:
    """argparse lays an option out as '  --name ARG  help' or '  --name ARG' + indented help."""
    body = text.split("options:", 1)[1].splitlines()
    missing = []
    for i, line in enumerate(body):
        m = re.match(r"^  (-[-\w]+(?:[ ,][^ ].*?)?)(?:\s{2,}(\S.*))?$", line)
        if not m or line.startswith("   "):
            continue
        following = body[i + 1] if i + 1 < len(body) else ""
        if not m.group(2) and not re.match(r"^\s{4,}\S", following):
            missing.append(m.group(1))
    return missing


@pytest.mark.parametrize("command", ["methods", "generate", "serve", "bench"])
def test_every_subcommand_has_a_description_and_every_option_help(command, capsys):
    text = _help(capsys, command)
    description = text.split("\n\n", 2)[1]
    assert not description.startswith(("options:", "positional")) and len(description) > 30, text
    assert _options_without_help(text) == [], text


def test_bench_help_is_plain_text_and_says_what_the_defaults_are(capsys):
    text = " ".join(_help(capsys, "bench").split())
    assert "``" not in text and ":class:" not in text
    assert "--seed SEED picks the held-out text window" in text
    assert "(default: bench-out)" in text and "'reference', the embedded byte-level reference model; 'reference-subword'" in text
    quick = re.search(r"--quick (.*?) --synthetic", text).group(1)
    assert "context 1024 tokens" in quick and "one setting per method" in quick
    assert "with --quick 1024" in text  # --context says what --quick uses


def test_quick_results_record_the_context_actually_used(capsys, tmp_path):
    code, _, _ = run_cli(capsys, "bench", "--quick", "--synthetic", "--methods", "full", "--out", str(tmp_path))
    assert code == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["arguments"]["context"] == 1024 and data["workload"]["contexts"] == [1024]
    assert data["results"][0]["tokens"] == 1024 + data["workload"]["synthetic_decode"]


# -- 9. results: table.md, settings, configs, the plot ---------------------------------------
@pytest.fixture
def captured_figures(monkeypatch):
    import matplotlib.figure

    figures = []
    original = matplotlib.figure.Figure.savefig

    def savefig(self, *args, **kwargs):
        figures.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    return figures


def test_bench_writes_table_md_with_values_and_json_with_only_fields_read(capsys, tmp_path, captured_figures):
    code, out, _ = run_cli(capsys, "bench", "--quick", "--synthetic", "--methods", "kivi,snapkv", "--out", str(tmp_path))
    assert code == 0 and "table.md" in out
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("# veloxquant bench: synthetic K/V/Q, context 1,024 tokens, ")
    assert "defaults" not in table
    assert "| kivi | kivi_group_size=32 kv_bits=2 residual_window=128 fused_attention=True |" in table
    assert "snap_budget=512" in table and "| full | - |" in table
    configs = {r["method"]: r["config"] for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert configs["full"] == {"method": "full", "options": {}}
    assert "kv_bits" not in configs["snapkv"] and "residual_window" not in configs["snapkv"]
    assert configs["kivi"]["kv_bits"] == 2 and configs["kivi"]["options"] == {"kivi_group_size": 32}


def _check_figure(fig):
    ax = fig.axes[0]
    assert re.fullmatch(r"veloxquant bench: .+, context [\d,]+ tokens, \d{4}-\d\d-\d\d \d\d:\d\d UTC", ax.get_title())
    legend = ax.get_legend()
    handles, labels = ax.get_legend_handles_labels()
    assert [t.get_text() for t in legend.get_texts()] == labels
    for handle, label in zip(handles, labels):
        if hasattr(handle, "get_xdata"):  # a line is drawn only through 2 points or more
            assert len(handle.get_xdata()) >= 2, label
    low, high = ax.get_xlim()
    ticks = [t for t in ax.get_xticklabels() if low <= t.get_position()[0] <= high and t.get_text()]
    assert len(ticks) >= 3 and all(re.fullmatch(r"[\d,]+", t.get_text()) for t in ticks), [t.get_text() for t in ticks]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()  # pyplot closed it after saving
    box = ax.get_window_extent(renderer)
    for note in ax.texts:
        extent = note.get_window_extent(renderer)
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and box.y0 <= extent.y0 and extent.y1 <= box.y1, note.get_text()


def test_pareto_plot_has_a_title_true_legend_readable_ticks_and_unclipped_labels(capsys, tmp_path, captured_figures):
    for methods in ("kivi,snapkv,streaming_llm", "full"):  # a frontier of several points, then of one
        code, _, _ = run_cli(capsys, "bench", "--quick", "--synthetic", "--methods", methods, "--out", str(tmp_path), "--force")
        assert code == 0
    assert len(captured_figures) == 2
    for fig in captured_figures:
        _check_figure(fig)
    lone = captured_figures[1].axes[0]  # the full cache alone: error 0, drawn at the floor
    texts = [t.get_text() for t in lone.get_legend().get_texts()]
    assert texts[0].startswith("error 0 (drawn at") and texts[1:] == ["Pareto-optimal"], texts


# -- 10. pytest shows why tests were skipped ---------------------------------------------------
def test_pytest_reports_skip_reasons(repo_root, tmp_path):
    (tmp_path / "test_skip.py").write_text(
        "import pytest\n\n@pytest.mark.skip(reason='no GPU here, loudly')\ndef test_gpu():\n    pass\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(repo_root / "pyproject.toml"),
         "--rootdir", str(tmp_path), str(tmp_path / "test_skip.py")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert "SKIPPED [1]" in run.stdout and "no GPU here, loudly" in run.stdout, run.stdout


# -- done when: the README example runs offline as written --------------------------------------
def test_readme_python_example_runs_offline(repo_root, tmp_path):
    readme = (repo_root / "README.md").read_text()
    block = readme.split("<!-- readme-example -->", 1)[1]
    code = block.split("```python\n", 1)[1].split("```", 1)[0]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("VELOXQUANT_SYSTEM_BLAS", None)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    assert len(run.stdout.strip()) > 20  # the completion
    assert "SlowBLASWarning" not in run.stderr or not veloxquant_mlx._blas.loaded
