"""benchmarks/decode_merge.py: rows are ratios to their own run's baseline, later runs win."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import decode_merge  # noqa: E402


def _run(path, base_tps, rows):
    results = [{"method": "mlx-lm KVCache", "context": 4096, "kv_bytes": 100, "peak_bytes": 10,
                "prefill_warm_s": 1.0, "decode_tokens_per_s": base_tps, "host_s": 2.0}]
    for method, tps in rows:
        results.append({"method": method, "context": 4096, "kv_bytes": 25, "peak_bytes": 5,
                        "prefill_warm_s": 3.0, "decode_tokens_per_s": tps, "host_s": 4.0})
    results.append({"method": "broken", "context": 4096, "error": "RuntimeError: no"})
    path.write_text(json.dumps({"results": results}))
    return path


def test_ratios_are_to_each_runs_baseline_and_the_latest_run_wins(tmp_path):
    slow = _run(tmp_path / "slow.json", 50.0, [("kivi", 40.0), ("snapkv", 60.0)])
    fast = _run(tmp_path / "fast.json", 200.0, [("kivi", 100.0)])
    rows = {}
    for path in (slow, fast):
        rows.update(decode_merge.rows_of(path))
    assert rows[("kivi", 4096)]["decode"] == 0.5 and rows[("kivi", 4096)]["run"] == "fast"
    assert rows[("snapkv", 4096)]["decode"] == 1.2 and rows[("snapkv", 4096)]["run"] == "slow"
    assert rows[("snapkv", 4096)]["kv"] == 0.25 and rows[("snapkv", 4096)]["host"] == 2.0
    assert ("broken", 4096) not in rows
    lines = decode_merge.table(rows)
    assert [l.split("|")[2].strip() for l in lines[2:]] == ["snapkv", "kivi"]  # by decode ratio


def test_an_isolated_runs_methods_are_each_to_their_own_processs_baseline(tmp_path):
    """decode.py --isolate writes {"runs": {method: results}}, one baseline per process."""
    def process(base_tps, method, tps):
        slow = json.loads(_run(tmp_path / "x.json", base_tps, [(method, tps)]).read_text())
        return slow["results"]

    path = tmp_path / "isolated.json"
    path.write_text(json.dumps({"runs": {"kivi": process(50.0, "kivi", 40.0), "h2o": process(200.0, "h2o", 100.0),
                                         "broken": [{"method": "broken", "context": 4096,
                                                     "error": "process exited 1: Killed"}]}}))
    rows = decode_merge.rows_of(path)
    assert rows[("kivi", 4096)]["decode"] == 0.8 and rows[("h2o", 4096)]["decode"] == 0.5
    assert rows[("kivi", 4096)]["run"] == "isolated" and ("broken", 4096) not in rows
