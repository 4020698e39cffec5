"""Serving under a bounded local load: continuous batching against one request at a time.

Starts servers on loopback (127.0.0.1, a free port) on the embedded reference model and
sends each the same load: 8 requests, prompts of different lengths cut from the held-out
book, different ``max_tokens``, greedy (temperature 0), each request sent 50 ms after the
previous one so that requests arrive while earlier ones decode; no prompt cache
(``--prompt-cache-size 0``), so no request reuses another's cache. Two loads (``LOADS``):
"prompts" (prefill most of the work) and "answers" (decode most of the work). Per load
and method, three ways in one run:

- ``batching``: ``veloxquant serve --method M`` (continuous batching, for the methods
  that batch);
- ``one at a time``: ``veloxquant serve --method M --no-batching`` (the same requests
  arrive the same way and wait their turn);
- ``mlx-lm fp16``: mlx-lm's own server (``mlx_lm.server``'s ``main``, unpatched, with its
  own fp16 ``KVCache`` and its own continuous batching), in a wrapper process
  (``--mlx-lm-server``) that imports veloxquant_mlx first, only so that MLX uses the same
  BLAS as ours (veloxquant_mlx/_blas.py), and prints the same stats line at exit.

For each: wall time from the first request sent to the last answer, requests/s and
completion tokens/s over it, the mean latency, the peak memory of the server process
(``mx.get_peak_memory()``: weights, caches and temporaries, printed by the server when it
stops, see ``VELOXQUANT_SERVE_STATS`` in veloxquant/cli.py) and its peak resident set,
and whether every greedy answer equals the one-at-a-time server's (mlx-lm's row is checked
against ``full`` one at a time). The load is sent ``--rounds`` times to each server; the
table shows the median round (every round is checked for equality).

    python benchmarks/serve_load.py                          # snapkv, kivi, full
    python benchmarks/serve_load.py --methods snapkv --rounds 1 --out /tmp/serve_load.md
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "veloxquant" / "assets" / "reference_model"
STATS_ENV, STATS_PREFIX = "VELOXQUANT_SERVE_STATS", "veloxquant serve stats: "  # veloxquant/cli.py

# Per load: prompt lengths in bytes (the reference tokenizer is byte-level: about as many
# tokens) and answer lengths. "prompts": over and under snapkv's 256-token budget, over
# kivi's 32-token window, prefill most of the work; "answers": short prompts, long answers,
# decode most of the work. Short enough for MLX's CPU back-end, whose float16 matrix
# products are slow (a 300-token float16 prefill of the reference model takes seconds).
LOADS = {
    "prompts": ((40, 400, 120, 520, 24, 280, 460, 200), (24, 8, 40, 16, 48, 12, 32, 20)),
    "answers": ((24, 60, 40, 120, 30, 90, 50, 100), (64, 96, 48, 128, 80, 56, 112, 72)),
}
ARRIVAL_GAP_S = 0.05
SETTINGS = {"snapkv": ["snap_budget=256"], "kivi": ["residual_window=32"]}
MLX_LM = "mlx-lm fp16"


def load(name: str) -> list[tuple[str, int]]:
    text = (MODEL / "heldout_kjv_acts.txt").read_text()
    return [(text[5000 * i : 5000 * i + n], m) for i, (n, m) in enumerate(zip(*LOADS[name]))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete(port: int, prompt: str, max_tokens: int, timeout: float) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    reply = json.loads(urllib.request.urlopen(request, timeout=timeout).read())
    choice = reply["choices"][0]
    return {"text": choice["text"], "finish": choice["finish_reason"],
            "tokens": reply["usage"]["completion_tokens"]}


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Server:
    """One server process on loopback; ``stop()`` sends SIGINT and reads its stats line."""

    def __init__(self, name: str, command: list[str], folder: Path):
        self.name, self.port = name, _free_port()
        self.log_path = folder / (name.replace(" ", "_").replace(",", "") + ".log")
        self.log = open(self.log_path, "w+")
        args = ["--model", str(MODEL), "--host", "127.0.0.1", "--port", str(self.port),
                "--prompt-cache-size", "0"]
        env = dict(os.environ, **{STATS_ENV: "1"})
        # SIGINT stops the server (KeyboardInterrupt) only if the child does not start with it
        # ignored, as children of a background job do.
        self.process = subprocess.Popen(command + args, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name}: the server exited:\n{self.output()}")
            try:
                _complete(self.port, "Hello", 1, timeout=60)  # also warms the model up
                return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"{self.name}: no answer after {timeout:.0f} s:\n{self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def stop(self) -> dict:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        lines = [ln for ln in self.output().splitlines() if ln.startswith(STATS_PREFIX)]
        if not lines:
            raise RuntimeError(f"{self.name}: no stats line at exit:\n{self.output()[-4000:]}")
        return json.loads(lines[-1][len(STATS_PREFIX):])


def send_load(server: Server, requests: list[tuple[str, int]], label: str) -> dict:
    """The load, each request ARRIVAL_GAP_S after the previous; answers in request order."""
    answers: dict[int, dict | Exception] = {}
    done = []
    start = time.perf_counter()

    def ask(i: int) -> None:
        sent = time.perf_counter()
        try:
            answers[i] = _complete(server.port, *requests[i], timeout=600)
            answers[i]["latency"] = time.perf_counter() - sent
        except Exception as exc:  # reported with the row
            answers[i] = exc
        done.append(i)
        _say(f"  {label}: request {i + 1} answered ({len(done)}/{len(requests)}, "
             f"{time.perf_counter() - start:.1f} s)")

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
        time.sleep(ARRIVAL_GAP_S)
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    failed = {i: repr(a) for i, a in answers.items() if isinstance(a, Exception)}
    if failed:
        raise RuntimeError(f"{label}: requests failed: {failed}\n{server.output()[-4000:]}")
    ordered = [answers[i] for i in range(len(requests))]
    return {"wall_s": wall, "answers": ordered,
            "tokens": sum(a["tokens"] for a in ordered),
            "latency_s": statistics.mean(a["latency"] for a in ordered)}


def run_server(name: str, command: list[str], folder: Path, rounds: int, expect: str | None,
               requests: list[tuple[str, int]]) -> dict:
    _say(f"[{name}] starting: {' '.join(command)}")
    server = Server(name, command, folder)
    try:
        server.wait_ready()
        results = [send_load(server, requests, f"[{name}] round {r + 1}/{rounds}") for r in range(rounds)]
    finally:
        stats = server.stop()
    output = server.output()
    if "Traceback" in output:
        raise RuntimeError(f"{name}: the server logged a traceback:\n{output[-4000:]}")
    if expect and expect not in output:
        raise RuntimeError(f"{name}: expected {expect!r} in the server log:\n{output[-4000:]}")
    median = sorted(results, key=lambda r: r["wall_s"])[len(results) // 2]
    texts = [[a["text"] for a in r["answers"]] for r in results]
    _say(f"[{name}] median wall {median['wall_s']:.2f} s, peak memory "
         f"{stats.get('peak_memory_bytes', 0) / 2**20:.1f} MiB")
    return {"name": name, **median, "rounds_wall_s": [r["wall_s"] for r in results],
            "texts": texts, "stats": stats, "stable": all(t == texts[0] for t in texts)}


def ours(method: str, batching: bool) -> list[str]:
    sets = [a for s in SETTINGS.get(method, []) for a in ("--set", s)]
    return [sys.executable, "-m", "veloxquant_mlx.cli", "serve", "--method", method, *sets,
            *([] if batching else ["--no-batching"]), "--"]


def mlx_lm_server_main(server_args: list[str]) -> None:
    """``--mlx-lm-server``: mlx-lm's own server, unpatched, plus the stats line at exit."""
    import veloxquant_mlx._blas  # noqa: F401  before mlx: the same BLAS as our serve
    from veloxquant_mlx.cli import print_serve_stats

    import mlx_lm.server

    sys.argv = ["mlx_lm.server", *server_args]
    try:
        mlx_lm.server.main()
    finally:
        print_serve_stats()


def table(rows: list[dict], reference: dict[str, list[str]]) -> str:
    head = ("| server | method | requests/s | completion tokens/s | wall s (rounds) | mean latency s "
            "| peak MLX memory MiB | peak RSS MiB | greedy answers equal one at a time |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ref = reference.get(r["method"])
        equal = "n/a" if ref is None else "yes" if all(t == ref for t in r["texts"]) else (
            f"no ({sum(a != b for a, b in zip(r['texts'][0], ref))}/8 differ)")
        if r["way"] == "one at a time":
            equal = "(reference)" if r["stable"] else "no: rounds differ"
        peak = r["stats"].get("peak_memory_bytes")
        rss = r["stats"].get("max_rss_bytes")
        out.append(
            f"| {r['way']} | {r['method']} | {len(r['answers']) / r['wall_s']:.2f} "
            f"| {r['tokens'] / r['wall_s']:.1f} | {r['wall_s']:.2f} "
            f"({', '.join(f'{w:.2f}' for w in r['rounds_wall_s'])}) | {r['latency_s']:.2f} "
            f"| {'?' if peak is None else f'{peak / 2**20:.1f}'} "
            f"| {'?' if rss is None else f'{rss / 2**20:.0f}'} | {equal} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--mlx-lm-server"]:
        mlx_lm_server_main(argv[2:] if argv[1:2] == ["--"] else argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="snapkv,kivi,full", help="comma-separated method keys")
    parser.add_argument("--rounds", type=int, default=1, help="times the load is sent to each server")
    parser.add_argument("--loads", default="prompts,answers", help=f"comma-separated, of {sorted(LOADS)}")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "serve_load.md"))
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    sections = []
    for load_name in [n for n in args.loads.split(",") if n]:
        sections.append(measure(load_name, methods, args.rounds))
    command = "python benchmarks/serve_load.py " + " ".join(argv)
    settings = "; ".join(f"{m}: {', '.join(SETTINGS[m])}" for m in methods if m in SETTINGS)
    text = f"""# Serving under a bounded local load

`{command.strip()}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores shared with other
work, MLX CPU back-end, the embedded reference model: float16 weights and caches). 8
requests on loopback, sent {ARRIVAL_GAP_S * 1000:.0f} ms apart, greedy, no prompt cache.
Settings: {settings or 'defaults'}. Each server gets the load {args.rounds} time(s); a row
is the median round (all rounds listed). Peak memory is the server process's whole
`mx.get_peak_memory()` (model weights included) over its life (startup, a one-token
warm-up and every round). "mlx-lm fp16" is `mlx_lm.server` itself, unpatched (its
`KVCache`, its own continuous batching); its answers are compared with `full` one at a
time.
""" + "".join(sections)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


def measure(load_name: str, methods: list[str], rounds: int) -> str:
    """One load, every server: the section of the results file."""
    requests = load(load_name)
    rows, reference = [], {}
    with tempfile.TemporaryDirectory(prefix="serve_load-") as tmp:
        plan = [(MLX_LM, "mlx-lm KVCache", [sys.executable, str(Path(__file__).resolve()),
                                            "--mlx-lm-server", "--"], None)]
        for m in methods:
            plan.append(("one at a time", m, ours(m, False),
                         f"with KV cache method {m!r}, one request at a time"))
            plan.append(("batching", m, ours(m, True), f"with KV cache method {m!r}, continuous batching"))
        for way, method, command, expect in plan:
            row = run_server(f"{load_name}: {way}, {method}", command, Path(tmp), rounds, expect, requests)
            row.update(way=way, method=method)
            rows.append(row)
            if way == "one at a time":
                reference[method] = row["texts"][0]
    if "full" in reference:
        reference["mlx-lm KVCache"] = reference["full"]
    lengths = ", ".join(f"{n}/{m}" for n, m in zip(*LOADS[load_name]))
    return f"""
## Load "{load_name}"

Prompt bytes (about tokens) / max_tokens: {lengths}.

{table(rows, reference)}
"""


if __name__ == "__main__":
    sys.exit(main())
