"""`veloxquant serve`: mlx-lm's HTTP server, answering with our caches, request after request.

mlx-lm's server keeps the caches of earlier requests and reuses them for later prompts
that share a prefix: it deep-copies them, trims them and prefills the rest. Each method's
server gets a short prompt, then different ones, then the first again, then one that
continues an earlier exchange; every request must be answered.
"""

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest

from veloxquant_mlx.reference import REFERENCE_MODEL
from veloxquant_mlx.registry import implemented_methods

# Small budgets, so that the longer prompts evict or quantize and the short ones do not.
SETTINGS = {
    "streaming_llm": ["stream_window_size=64"],
    "snapkv": ["snap_budget=256"],
    "kivi": ["residual_window=32"],
}
PROMPTS = ["Hello", "World", "Hello", "In the beginning was the Word, and the Word was with God. " * 6]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete(port: int, text: str, timeout: float) -> dict:
    body = json.dumps({"prompt": text, "max_tokens": 12, "temperature": 0.0}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body,
        headers={"Content-Type": "application/json"},
    )
    return json.loads(urllib.request.urlopen(request, timeout=timeout).read())


# One method of each kind runs by default (the dense cache, the window, the eviction base,
# the quantized store, a cross-layer and an entropy-coded cache); every other method's run
# is marked slow (`pytest -m slow`): the conformance suite already checks each one's deep
# copy, trim-and-reuse and state, and a server run costs ~5 s of CI's 2 cores. The eviction
# base's two-stage and pass-driven methods (rocketkv, kvzip) and the codebook store (kvquant)
# went to the slow runs when the suite reached CI's 10 minutes (2026-12-07).
SERVER_DEFAULT = {"full", "streaming_llm", "snapkv", "kivi", "xkv", "cachegen"}
SERVER_METHODS = [m if m in SERVER_DEFAULT else pytest.param(m, marks=pytest.mark.slow)
                  for m in implemented_methods()]


@pytest.mark.parametrize("method", SERVER_METHODS)
def test_serve_keeps_answering_short_then_different_prompts(method, tmp_path):
    port = _free_port()
    log = open(tmp_path / "server.log", "w+")
    sets = [a for s in SETTINGS.get(method, []) for a in ("--set", s)]
    server = subprocess.Popen(
        [sys.executable, "-m", "veloxquant_mlx.cli", "serve", "--method", method, *sets,
         "--", "--model", str(REFERENCE_MODEL), "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline, first = time.time() + 90, None
        while first is None and time.time() < deadline and server.poll() is None:
            try:
                first = _complete(port, PROMPTS[0], timeout=60)
            except OSError:
                time.sleep(0.3)
        replies = [first] + [_complete(port, p, timeout=60) for p in PROMPTS[1:]]
        # and one that continues the first exchange: the server reuses that cache
        replies.append(_complete(port, PROMPTS[0] + first["choices"][0]["text"] + " and", 60))
        log.seek(0)
        output = log.read()
        assert all(r and r["choices"][0]["finish_reason"] for r in replies), output
        assert replies[0]["choices"][0]["text"] == replies[2]["choices"][0]["text"]  # greedy
        assert f"with KV cache method {method!r}" in output
        assert "Traceback" not in output, output
    finally:
        server.terminate()
        server.wait(timeout=20)
        log.close()


# -- continuous batching under a bounded local load (issue 24) ------------------------------
LOAD_TEXT = (REFERENCE_MODEL / "heldout_kjv_acts.txt").read_text()
# Eight prompts of different lengths (bytes, about tokens), eight different answer lengths.
# prompts of 40 to 355 bytes (tokens): six of the eight pass snapkv's budget and are compressed
LOAD = [(LOAD_TEXT[1000 * i : 1000 * i + 40 + 45 * i], 6 + 2 * i) for i in range(8)]
LOAD_SETTINGS = {"snapkv": ["snap_budget=128"], "kivi": ["residual_window=32"]}


def _complete_tokens(port, text, max_tokens, timeout):
    body = json.dumps({"prompt": text, "max_tokens": max_tokens, "temperature": 0.0}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body,
        headers={"Content-Type": "application/json"},
    )
    reply = json.loads(urllib.request.urlopen(request, timeout=timeout).read())
    return reply["choices"][0]["text"], reply["choices"][0]["finish_reason"]


# snapkv: a packed eviction batch. kivi (a packed quantized batch on the CPU, per sequence on
# a GPU) is slow here (36 s); its batching is checked against each sequence alone through
# mlx-lm's BatchGenerator in tests/test_quant_batch.py
@pytest.mark.parametrize("method", ["snapkv", pytest.param("kivi", marks=pytest.mark.slow)])
def test_serve_batches_eight_concurrent_requests_like_one_at_a_time(method, tmp_path):
    """Eight requests one at a time, then the same eight at once (each arriving while the
    earlier ones decode; they finish at different steps), on loopback, against one server
    with continuous batching on (no prompt cache, so neither round reuses the other's
    caches): every request is answered, and the greedy answers are equal."""
    port = _free_port()
    log = open(tmp_path / "server.log", "w+")
    sets = [a for s in LOAD_SETTINGS[method] for a in ("--set", s)]
    server = subprocess.Popen(
        [sys.executable, "-m", "veloxquant_mlx.cli", "serve", "--method", method, *sets, "--",
         "--model", str(REFERENCE_MODEL), "--host", "127.0.0.1", "--port", str(port),
         "--prompt-cache-size", "0"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 180
        while time.time() < deadline and server.poll() is None:
            try:
                _complete_tokens(port, "Hello", 1, timeout=60)
                break
            except OSError:
                time.sleep(0.3)
        sequential = [_complete_tokens(port, text, n, timeout=60) for text, n in LOAD]
        concurrent: dict[int, tuple] = {}

        def ask(i):
            try:
                concurrent[i] = _complete_tokens(port, *LOAD[i], timeout=max(5, deadline - time.time()))
            except Exception as exc:  # reported below
                concurrent[i] = exc

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(LOAD))]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=max(1, deadline - time.time()))
        log.seek(0)
        output = log.read()
        assert len(concurrent) == len(LOAD), output
        assert all(isinstance(r, tuple) and r[1] for r in concurrent.values()), (concurrent, output)
        assert [concurrent[i] for i in range(len(LOAD))] == sequential, output
        assert f"with KV cache method {method!r}, continuous batching" in output
        assert "Traceback" not in output, output
    finally:
        server.terminate()
        server.wait(timeout=20)
        log.close()


def test_serve_no_batching_reaches_patch_server_and_stats_line_reports_peak_memory(monkeypatch, capsys):
    """``veloxquant serve --no-batching`` passes batching=False to patch_server, which then
    serves a batching method one request at a time; with VELOXQUANT_SERVE_STATS set the
    serve command prints its peak memory as one JSON line when the server stops."""
    import mlx_lm.server

    from tiny_models import tiny_model
    from veloxquant_mlx import KVCacheConfig, cli
    from veloxquant_mlx.integrations import mlx_lm as integration

    seen = []
    monkeypatch.setattr(integration, "patch_server", lambda module, config, batching=True: seen.append(batching))
    monkeypatch.setattr(mlx_lm.server, "main", lambda: None)
    monkeypatch.setenv(cli.SERVE_STATS_ENV, "1")
    for flags in (["--no-batching"], []):
        assert cli.main(["serve", "--method", "snapkv", *flags, "--", "--model", "reference"]) == 0
    assert seen == [False, True]
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith(cli.SERVE_STATS_PREFIX)]
    assert len(lines) == 2
    stats = json.loads(lines[0][len(cli.SERVE_STATS_PREFIX):])
    assert stats["peak_memory_bytes"] > 0 and stats["max_rss_bytes"] > 0

    class Provider:  # what patch_server wraps in mlx_lm.server
        model_key, draft_model = ("tiny",), None

        def _load(self):
            self.model = tiny_model("llama")

    monkeypatch.undo()
    for batching, expected in ((False, False), (True, True)):
        provider_class = type("Provider", (Provider,), {"_load": Provider._load})
        integration.patch_server(SimpleNamespace(ModelProvider=provider_class),
                                 KVCacheConfig(method="snapkv"), batching=batching)
        provider = provider_class()
        provider._load()
        assert provider.is_batchable is expected
    assert "one request at a time (batching turned off)" in capsys.readouterr().err
