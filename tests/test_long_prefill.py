"""benchmarks/long_prefill.py: every method gets a row, and one that overruns its time (or
kills its process) is a failed row while the methods after it still run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from veloxquant_mlx.bench.runner import PREFILL_CHUNK

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "long_prefill.py"


def run(tmp_path, *args):
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny", "--contexts", "96", "128",
                    "--out", str(out), *args], check=True, capture_output=True, text=True,
                   env={**__import__("os").environ, "MLX_DEFAULT_DEVICE": "cpu"})
    return json.loads(out.read_text())["rows"]


@pytest.mark.slow
def test_every_method_and_context_gets_a_row(tmp_path):
    rows = run(tmp_path, "--methods", "full", "kivi")
    assert [(r["method"], r["context"]) for r in rows] == [
        (m, c) for m in ("mlx-lm KVCache", "full", "kivi") for c in (96, 128)]
    assert all("error" not in r and r["finite_logits"] and r["kv_bytes"] > 0 for r in rows)
    held = {(r["method"], r["context"]): r["kv_bytes"] for r in rows}
    # the full cache holds what mlx-lm's does (room included); kivi's codes, less
    assert all(held["full", c] == held["mlx-lm KVCache", c] > held["kivi", c] for c in (96, 128))
    for r in rows:  # one chunk per PREFILL_CHUNK tokens before the last; the peak is the phases' largest
        assert len(r["chunk_s"]) == len(r["chunk_peak_bytes"]) == -(-(r["context"] - 1) // PREFILL_CHUNK)
        phases = r["chunk_peak_bytes"] + [r["last_token"][1], r["decode"][1]]
        assert r["peak_bytes"] == max(phases) > 0
        assert r["peak_in"] == (["chunk 1/1"] + ["last token", "decode"])[phases.index(max(phases))]


@pytest.mark.slow
def test_a_method_over_its_time_is_a_failed_row_and_the_next_one_runs(tmp_path):
    rows = run(tmp_path, "--methods", "full", "kivi", "--method-timeout-s", "0")
    assert [(r["method"], r["error"]) for r in rows] == [
        (m, "over --method-timeout-s 0") for m in ("mlx-lm KVCache", "full", "kivi")]
