"""`veloxquant generate` given what a hostile user gives it: one line per error, no traceback."""

import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "veloxquant_mlx.cli", "generate", "--max-tokens", "4"]


def _run(extra, tmp_path, prompt="In the beginning"):
    done = subprocess.run([*CLI, "--prompt", prompt, *extra], capture_output=True, timeout=120, cwd=tmp_path)
    return done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")


@pytest.mark.parametrize("extra, prompt, message", [
    (["--method", "xkv", "--set", "xkv_max_ctx=8"], "In the beginning God created the heaven",
     r"method 'xkv': xkv_max_ctx=8: layer 0 would hold \d+ exact prompt keys"),
    (["--method", "full"], "caf\udcff", r"--prompt is not UTF-8 text: byte 0xff at character 3"),
])
def test_errors_while_generating_are_one_line(extra, prompt, message, tmp_path):
    """Before: a 20-40 line traceback, exit 1."""
    import re

    code, _, err = _run(extra, tmp_path, prompt)
    assert code == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and re.search(message, lines[0]), err
    assert lines[0].startswith("veloxquant generate: error: ")


def test_a_closed_pipe_ends_quietly(tmp_path):
    """Before: ``| head`` gave a BrokenPipeError traceback."""
    cmd = [*CLI[:-1], "200", "--prompt", "In the beginning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    proc.stdout.read(1)
    proc.stdout.close()  # the reader goes away, as `head -c 1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0
    assert "Traceback" not in err and "BrokenPipe" not in err, err
