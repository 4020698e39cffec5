"""`veloxquant serve`: mlx-lm's HTTP server, answering with our caches."""

import json
import socket
import subprocess
import sys
import time
import urllib.request

from veloxquant_mlx.cli import REFERENCE_MODEL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_completions_with_the_method(tmp_path):
    port = _free_port()
    log = open(tmp_path / "server.log", "w+")
    server = subprocess.Popen(
        [sys.executable, "-m", "veloxquant_mlx.cli", "serve", "--method", "streaming_llm",
         "--set", "stream_window_size=64", "--", "--model", str(REFERENCE_MODEL),
         "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        body = json.dumps({"prompt": "In the beginning was the Word", "max_tokens": 12,
                           "temperature": 0.0}).encode()
        deadline, reply = time.time() + 90, None
        while time.time() < deadline and server.poll() is None:
            try:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/completions", data=body,
                    headers={"Content-Type": "application/json"},
                )
                reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
                break
            except OSError:
                time.sleep(0.5)
        log.seek(0)
        output = log.read()
        assert reply is not None, output
        assert reply["choices"][0]["text"], reply
        assert "with KV cache method 'streaming_llm'" in output
    finally:
        server.terminate()
        server.wait(timeout=20)
        log.close()
