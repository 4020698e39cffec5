"""`veloxquant serve` under a hostile client (issue 38, issue 37's server bullet): Ctrl-C
stops an idle server cleanly, options that conflict with our cache are refused, requests
over a method's or the model's limit are refused at once, huge ``max_tokens`` are capped,
and an abandoned request stops generating so that later ones are answered.

Every server here runs on 127.0.0.1, a few requests each, bounded in time.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from child_process import sigint_as_default
from veloxquant_mlx.reference import REFERENCE_MODEL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict, timeout: float) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _start(tmp_path, *args, server_args=(), env=None):
    """A serve process on a free loopback port, answering: (process, port, its log file)."""
    port = _free_port()
    log = open(tmp_path / f"server-{port}.log", "w+")
    server = subprocess.Popen(
        [sys.executable, "-m", "veloxquant_mlx.cli", "serve", *args, "--",
         "--model", str(REFERENCE_MODEL), "--host", "127.0.0.1", "--port", str(port), *server_args],
        stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, **(env or {})}, preexec_fn=sigint_as_default,
    )
    deadline = time.time() + 60
    while time.time() < deadline and server.poll() is None:
        try:
            if _post(port, {"prompt": "Hi", "max_tokens": 1}, timeout=30)[0] == 200:
                return server, port, log
        except OSError:
            time.sleep(0.2)
    server.kill()
    log.seek(0)
    raise AssertionError(f"the server did not answer: {log.read()}")


def _stop(server, log) -> str:
    if server.poll() is None:
        server.kill()
    server.wait(timeout=20)
    log.seek(0)
    text = log.read()
    log.close()
    return text


@pytest.mark.parametrize("stop", range(3))  # it aborted in 6 of 9 stops
def test_ctrl_c_stops_an_idle_server_cleanly(stop, tmp_path):
    server, port, log = _start(tmp_path)
    try:
        time.sleep(0.3)
        server.send_signal(signal.SIGINT)
        code = server.wait(timeout=30)
    finally:
        output = _stop(server, log)
    assert code in (0, 130), output
    assert "terminate called" not in output and "Traceback" not in output, output


@pytest.mark.parametrize("given", [["--kv-bits", "4"], ["--kv-bits=4"], ["--kv-group-size", "32"],
                                   ["--quantized-kv-start", "0"], ["--kv-b", "8"]])
def test_serve_refuses_mlx_lm_kv_options_that_our_cache_would_ignore(given, monkeypatch, capsys):
    import mlx_lm.server

    from veloxquant_mlx import cli

    started = []
    monkeypatch.setattr(mlx_lm.server, "main", lambda: started.append(True))
    assert cli.main(["serve", "--method", "kivi", "--", "--port", "1", *given]) == 2
    assert not started
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"veloxquant serve: error: {' '.join(given)}: ") and "kivi" in err, err


def test_serve_banner_says_one_at_a_time_when_mlx_lm_would_serve_so(monkeypatch, capsys):
    """mlx-lm serves one request at a time under --kv-bits (its _is_batchable); the banner
    must not say continuous batching then (patch_server used without our CLI)."""
    from types import SimpleNamespace

    from tiny_models import tiny_model
    from veloxquant_mlx import KVCacheConfig
    from veloxquant_mlx.integrations import mlx_lm as integration

    class Provider:
        model_key, draft_model = ("tiny",), None

        def _load(self):
            self.model = tiny_model("llama")

    for kv_bits, batchable in ((4, False), (None, True)):
        provider_class = type("Provider", (Provider,), {"_load": Provider._load})
        integration.patch_server(SimpleNamespace(ModelProvider=provider_class), KVCacheConfig(method="snapkv"))
        provider = provider_class()
        provider.cli_args = SimpleNamespace(kv_bits=kv_bits)
        provider._load()
        banner = capsys.readouterr().err
        assert provider.is_batchable is batchable
        assert ("continuous batching" in banner) is batchable, banner
        assert ("one request at a time" in banner) is not batchable, banner


def _abandon(port: int, body: dict, after: float) -> None:
    """Send a request and close the connection without reading the reply."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(after)


@pytest.mark.parametrize("serving", [(), ("--no-batching",)], ids=["batching", "one-at-a-time"])
def test_xkv_server_refuses_over_limit_prompts_at_once_and_drops_abandoned_requests(tmp_path, serving):
    """xkv, with continuous batching (it batches per sequence) and one request at a time: a
    prompt over xkv_max_ctx, or over the model's 8,192 positions, is refused with a 400
    naming the limit, at once; a non-streaming request with max_tokens=10**30 whose client
    went away stops, and the next request is answered."""
    server, port, log = _start(tmp_path, "--method", "xkv", "--set", "xkv_max_ctx=64", *serving)
    try:
        started = time.time()
        status, reply = _post(port, {"prompt": "a" * 200, "max_tokens": 4}, timeout=20)
        assert status == 400 and "xkv_max_ctx=64" in reply["error"], reply
        status, reply = _post(port, {"prompt": "a" * 9000, "max_tokens": 4}, timeout=20)
        assert status == 400 and "max_position_embeddings=8192" in reply["error"], reply
        assert time.time() - started < 10
        _abandon(port, {"prompt": "Hi", "max_tokens": 10**30, "temperature": 0.0}, after=1.0)
        started = time.time()
        status, reply = _post(port, {"prompt": "Hello", "max_tokens": 4, "temperature": 0.0}, timeout=30)
        assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply
        assert time.time() - started < 15  # uncapped and unnoticed, it waited for ever
    finally:
        output = _stop(server, log)
    assert "client closed its connection" in output, output
    assert "Traceback" not in output, output
    assert ("continuous batching" in output) is not serving, output


def test_huge_max_tokens_is_capped_at_the_methods_limit(tmp_path):
    server, port, log = _start(tmp_path, "--method", "skvq", "--set", "skvq_max_ctx=64")
    try:
        status, reply = _post(port, {"prompt": "Hi", "max_tokens": 10**30, "temperature": 0.0}, timeout=60)
        assert status == 200, reply
        usage = reply["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 64, reply
        assert reply["choices"][0]["finish_reason"] == "length", reply
        status, reply = _post(port, {"prompt": "a" * 100, "max_tokens": 1}, timeout=20)
        assert status == 400 and "skvq_max_ctx=64" in reply["error"], reply
    finally:
        output = _stop(server, log)
    assert "Traceback" not in output, output


def test_ctrl_c_stops_a_server_that_is_generating(tmp_path):
    """A request generating thousands of tokens (its client still waiting) does not hold the
    stop: mlx-lm joins its generation thread, which now stops the request at its next token."""
    import threading

    server, port, log = _start(tmp_path, "--method", "full", "--no-batching")
    try:
        waiting = threading.Thread(target=_abandon, daemon=True, args=(
            port, {"prompt": "Hi", "max_tokens": 10**30, "temperature": 0.0}, 30.0))
        waiting.start()
        time.sleep(1.5)
        server.send_signal(signal.SIGINT)
        code = server.wait(timeout=15)
    finally:
        output = _stop(server, log)
    assert code in (0, 130), output
    assert "terminate called" not in output and "Traceback" not in output, output


def test_an_abandoned_streaming_request_stops_quietly(tmp_path):
    """A streaming client that goes away: the next write fails, the request stops (mlx-lm's
    own handling), and the server logs one line instead of a traceback."""
    server, port, log = _start(tmp_path, "--method", "full", "--no-batching")
    try:
        _abandon(port, {"prompt": "Hi", "max_tokens": 10**30, "stream": True, "temperature": 0.0}, after=1.0)
        started = time.time()
        status, reply = _post(port, {"prompt": "Hello", "max_tokens": 4, "temperature": 0.0}, timeout=30)
        assert status == 200 and time.time() - started < 15, reply
    finally:
        output = _stop(server, log)
    assert "client closed its connection" in output, output
    assert "Traceback" not in output, output
