"""benchmarks/standing.py: each method's newest measured GPU figure, as ratios to the
KVCache of its own process, with a newer failure named beside it."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import standing  # noqa: E402


def _row(method, tok_s, prefill_s, peak, kv=100, context=4096, **extra):
    return {"method": method, "context": context, "kv_bytes": kv, "peak_bytes": peak, "prefill_first_s": 9.0,
            "prefill_warm_s": prefill_s, "host_s": 0.002, "device_s": 0.006, "step_s": 1 / tok_s,
            "decode_tokens_per_s": tok_s, **extra}


def _write(path: Path, data: dict, mtime: float) -> Path:
    path.write_text(json.dumps(data))
    os.utime(path, (mtime, mtime))
    return path


def test_newest_figures_are_ratios_to_their_own_processes_kvcache(tmp_path):
    env = {"device": "Device(gpu, 0)", "preset": "llama3-8b", "timing": "overlapped"}
    base = "mlx-lm KVCache"
    # an old shared run: kivi at half KVCache's speed
    _write(tmp_path / "old.json", {"environment": env, "results": [
        _row(base, 100.0, 0.1, 1000, kv=400), _row("kivi", 50.0, 0.2, 900)]}, 1_000)
    # a newer isolated run: kivi beside a slower KVCache of its own (0.8x), tova failed
    _write(tmp_path / "new.json", {"environment": {**env, "isolated": True}, "runs": {
        "kivi": [_row(base, 60.0, 0.1, 1000, kv=400), _row("kivi", 48.0, 0.3, 500)],
        "tova": [{"method": "tova", "context": 4096, "error": "RuntimeError: out of memory"}]}}, 2_000)
    # newer: kivi failed; the newest: kivi skipped (a budget: nothing of the method), and a CPU
    # run and a batch-8 run that do not count here
    _write(tmp_path / "newer.json", {"environment": {**env, "isolated": True}, "runs": {
        "kivi": [{"method": "kivi", "context": 4096, "error": "RuntimeError: boom"}]}}, 2_500)
    _write(tmp_path / "newest.json", {"environment": {**env, "isolated": True}, "runs": {
        "kivi": [{"method": "kivi", "context": 4096, "error": "skipped: --budget-s 100 spent"}]}}, 3_000)
    _write(tmp_path / "cpu.json", {"environment": {**env, "device": "Device(cpu, 0)"}, "results": [
        _row(base, 100.0, 0.1, 1000), _row("kivi", 10.0, 0.1, 1000)]}, 4_000)
    _write(tmp_path / "b8.json", {"environment": {**env, "batch": 8}, "results": [
        _row(base, 400.0, 0.1, 1000), _row("kivi", 600.0, 0.1, 1000)]}, 4_000)
    # the newest of all: an A/B's arm the tree does not ship
    _write(tmp_path / "variant.json", {"environment": {**env, "variant": "blocks of 2^25"}, "results": [
        _row(base, 100.0, 0.1, 1000), _row("kivi", 200.0, 0.1, 1000), _row("tova", 100.0, 0.1, 1000)]}, 5_000)
    figures = [f for p in sorted(tmp_path.glob("*.json")) for f in standing.figures_of(p, "llama3-8b")]
    best = standing.latest(figures)
    kivi = best[("kivi", 4096, 1)]
    assert kivi.source.endswith("new.json") and kivi.decode == 0.8 and abs(kivi.prefill - 3.0) < 1e-12 and kivi.peak == 0.5
    assert kivi.kv == 0.25 and kivi.newer_failure.error == "RuntimeError: boom"
    assert best[("tova", 4096, 1)].error.startswith("RuntimeError")
    assert best[("kivi", 4096, 8)].decode == 1.5
    rows = standing.table(best, 4096, 1, ["kivi", "tova", "h2o"])
    assert "**3.00**" in rows[2] and "| **0.80** |" in rows[2] and "newer.json`: RuntimeError: boom" in rows[2]
    assert "failed or skipped: RuntimeError" in rows[3] and rows[4].startswith("| h2o | no figure")
