"""Issue 25 item 5: `veloxquant generate` streams, stops cleanly on Ctrl-C, warns past the
model's positions, and measures the full-cache baseline without generating again."""

import os
import re
import select
import signal
import subprocess
import sys
import time

import mlx_lm.models.llama as llama

from child_process import sigint_as_default
from veloxquant_mlx.cli import main

REF_BYTES_PER_TOKEN = 4 * 2 * 2 * 128 * 4  # layers x (K, V) x kv heads x head_dim x float32


def test_generate_streams_warns_past_positions_and_stops_on_ctrl_c(tmp_path):
    """--max-tokens 100000 passes the embedded model's 8,192 positions; the first streamed
    text arrives long before the end, and SIGINT then ends the run without a traceback."""
    cmd = [sys.executable, "-m", "veloxquant_mlx.cli", "generate", "--prompt", "And the apostles said",
           "--max-tokens", "100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                            preexec_fn=sigint_as_default)
    try:
        first = b""
        deadline = time.monotonic() + 60
        while not first.strip() and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if ready:
                first += os.read(proc.stdout.fileno(), 64)  # whatever was flushed so far
        assert first.strip(), "nothing was streamed within 60 s"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    out, err = (first + out).decode(), err.decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "passes the model's 8192 positions (max_position_embeddings)" in err
    assert "--max-tokens 100000" in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("[interrupted] [kv cache] method=full"), line
    tokens = int(re.search(r"tokens=(\d+)", line).group(1))
    assert 23 <= tokens < 23 + 100000  # what was generated before the signal, not the whole run
    assert len(out.strip()) >= len(first.strip())


def test_full_cache_baseline_is_computed_not_regenerated(monkeypatch, capsys):
    processed = []
    original = llama.Model.__call__

    def counting(self, inputs, *args, **kwargs):
        processed.append(inputs.shape[1])
        return original(self, inputs, *args, **kwargs)

    monkeypatch.setattr(llama.Model, "__call__", counting)
    prompt = "And he said unto them, " * 10
    assert main(["generate", "--method", "snapkv", "--set", "snap_budget=128", "--prompt", prompt,
                 "--max-tokens", "8"]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    prompt_tokens = len(prompt.encode()) + 1
    # The prompt once, the generated tokens, one probe token for the row size: no second pass.
    assert sum(processed) <= prompt_tokens + 8 + 1, processed
    tokens = int(re.search(r"tokens=(\d+)", line).group(1))
    full = int(re.search(r"vs ([\d,]+) bytes for the full cache", line).group(1).replace(",", ""))
    assert full == tokens * REF_BYTES_PER_TOKEN and "from the shapes" in line
    assert "every array the method holds" in line
