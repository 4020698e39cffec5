"""Issue 37, "First use": the server's default model, method keys in any case, the
bench table in a narrow terminal."""

import io
import sys

import mlx_lm.server
import pytest
from rich.console import Console

from veloxquant_mlx.bench import report
from veloxquant_mlx.cli import REFERENCE_MODEL, main


@pytest.fixture
def server_argv(monkeypatch):
    seen = []
    monkeypatch.setattr(mlx_lm.server, "main", lambda: seen.append(list(sys.argv)))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    return seen


def test_serve_without_a_model_serves_the_reference_model(server_argv):
    assert main(["serve", "--method", "snapkv"]) == 0
    argv = server_argv[0]
    assert argv[argv.index("--model") + 1] == str(REFERENCE_MODEL)


def test_serve_keeps_a_given_model(server_argv):
    assert main(["serve", "--", "--model=reference", "--port", "0"]) == 0
    assert server_argv[0][1:] == [f"--model={REFERENCE_MODEL}", "--port", "0"]


def test_a_method_key_in_another_case_is_accepted(server_argv, capsys):
    assert main(["serve", "--method", "KIVI"]) == 0
    assert main(["bench", "--methods", "SnapKV", "--set", "snap_budget=0", "--out", "x"]) == 2
    # the error is about the value: the method was found
    assert "snap_budget=0 is out of range" in capsys.readouterr().err


def test_a_misspelt_method_key_in_another_case_gets_a_suggestion(capsys):
    assert main(["generate", "--method", "KIVY", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "method='KIVY' is not a known method (did you mean 'kivi'?)" in err


def _results():
    memory = {"bytes_per_token_prefill": 8200.0, "bytes_per_token_decode": 8200.0,
              "peak_bytes": 1000, "prefill_tokens_per_s": 1.0, "decode_tokens_per_s": 1.0}
    rounds = {"prefill_speed": 0.987, "prefill_speed_range": [0.671, 1.462],
              "decode_speed": 1.204, "decode_speed_range": [1.199, 1.433]}
    out = []
    for label, settings in [("full", {}), ("streaming_llm", {"stream_n_sink": 4,
                                                             "stream_window_size": 512}),
                            ("kivi", {"kivi_group_size": 32, "kv_bits": 2,
                                      "residual_window": 128, "fused_attention": True})]:
        out.append({"label": label, "method": label, "status": "ok", "settings": settings,
                    "memory_speed": dict(memory), "retrieval": {"accuracy": 0.333},
                    "continuation": {"perplexity": 1.8329, "kl_mean": 0.00104,
                                     "top1_agreement": 0.96875}})
        if label != "full":
            out[-1]["speed_rounds"] = rounds
    report.add_ratios(out, synthetic=False)
    return out


@pytest.mark.parametrize("width", [80, 60])
def test_a_narrow_terminal_gets_every_column_and_whole_numbers(width):
    results = _results()
    buffer = io.StringIO()
    report.print_table(results, False, console=Console(width=width, file=buffer), title="t")
    text = buffer.getvalue()
    assert max(len(line) for line in text.splitlines()) <= width
    head, rows = report.table_rows(results, synthetic=False)
    for h in head:
        assert h in text, h
    for row in rows:
        for cell in row[2:-1]:  # the figures, each whole on one line
            assert cell in text, cell
        for assignment in row[1].split():
            assert assignment in text, assignment


def test_a_wide_terminal_keeps_one_table():
    buffer = io.StringIO()
    report.print_table(_results(), False, console=Console(width=200, file=buffer), title="t")
    assert buffer.getvalue().count("┏") == 1


def _one_error_line(capsys, command):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"veloxquant {command}: error: "), err
    return err


def test_generate_with_a_missing_calibration_file_is_one_line(capsys, tmp_path):
    missing = tmp_path / "none.safetensors"
    assert main(["generate", "--method", "vecinfer", "--set", f"calibration_file={missing}",
                 "--prompt", "hi", "--max-tokens", "1"]) == 2
    assert f"calibration_file='{missing}': no such file" in _one_error_line(capsys, "generate")


def test_generate_with_a_calibration_file_for_other_settings_is_one_line(capsys, tmp_path):
    made = tmp_path / "vecinfer.safetensors"
    assert main(["calibrate", "--method", "vecinfer", "--set", "key_sub_dim=4", "--tokens", "32",
                 "--iters", "1", "--out", str(made)]) == 0
    capsys.readouterr()
    assert main(["generate", "--method", "vecinfer", "--set", f"calibration_file={made}",
                 "--set", "key_sub_dim=8", "--prompt", "hi", "--max-tokens", "1"]) == 2
    assert "key_sub_dim is 4 in the file" in _one_error_line(capsys, "generate")


@pytest.mark.parametrize("command", [
    ["generate", "--prompt", "hi", "--max-tokens", "1"],
    ["calibrate", "--tokens", "32", "--iters", "1", "--out", "unused.safetensors"],
])
def test_a_sub_dim_that_does_not_divide_head_dim_is_one_line(capsys, command):
    assert main(command[:1] + ["--method", "vecinfer", "--set", "key_sub_dim=3"] + command[1:]) == 2
    assert _one_error_line(capsys, command[0]).endswith(
        "error: --set key_sub_dim=3 must divide head_dim=128; allowed here: "
        "1, 2, 4, 8, 16, 32, 64, 128")


def test_listing_models_without_a_hub_cache_answers_the_served_model(monkeypatch):
    import io as _io
    from types import SimpleNamespace

    from huggingface_hub.errors import CacheNotFound

    from veloxquant_mlx import KVCacheConfig
    from veloxquant_mlx.integrations.mlx_lm import patch_server

    def no_cache(*args, **kwargs):
        raise CacheNotFound("Cache directory not found: /nowhere", "/nowhere")
    monkeypatch.setattr(mlx_lm.server, "scan_cache_dir", no_cache)
    monkeypatch.setattr(mlx_lm.server.ModelProvider, "_load", mlx_lm.server.ModelProvider._load)
    patch_server(mlx_lm.server, KVCacheConfig())
    handler = SimpleNamespace(
        path="/v1/models", created=0, wfile=_io.BytesIO(),
        response_generator=SimpleNamespace(cli_args=SimpleNamespace(model=str(REFERENCE_MODEL))),
        _set_completion_headers=lambda status: None, end_headers=lambda: None)
    mlx_lm.server.APIHandler.handle_models_request(handler)
    import json
    listed = json.loads(handler.wfile.getvalue())
    assert listed == {"object": "list", "data": [
        {"id": str(REFERENCE_MODEL.resolve()), "object": "model", "created": 0}]}
