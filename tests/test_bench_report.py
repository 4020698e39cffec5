"""Bench metrics, method selection, and the output files, on cases with known answers."""

import json
import math

import mlx.core as mx
import pytest

from veloxquant_mlx.bench import metrics, report
from veloxquant_mlx.bench.cli import BenchError, method_runs, select_methods
from veloxquant_mlx.registry import METHODS



def test_kl_and_top1_of_identical_distributions():
    x = mx.random.normal((20, 50))
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    assert float(mx.abs(metrics.kl_divergence(lp, lp)).max()) == 0.0
    assert metrics.top1_agreement(lp, lp) == 1.0


def test_kl_of_known_distributions():
    p = mx.log(mx.array([[0.5, 0.5]]))
    q = mx.log(mx.array([[0.9, 0.1]]))
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert abs(float(metrics.kl_divergence(p, q)[0]) - expected) < 1e-6
    assert metrics.top1_agreement(mx.log(mx.array([[0.6, 0.4]])), q) == 1.0
    assert metrics.top1_agreement(mx.log(mx.array([[0.4, 0.6]])), q) == 0.0


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    lp = mx.full((10, 64), -math.log(64))
    assert abs(metrics.perplexity(lp, list(range(10))) - 64) < 1e-3
    # Add-one unigram counts: a token seen 3 of 4 times (+1 smoothing) over 2 symbols.
    assert abs(metrics.unigram_perplexity([0, 0, 0, 1], [0], 2) - 6 / 4) < 1e-6


def test_pareto_front():
    points = [(100, 0.9), (50, 0.9), (50, 0.5), (10, 0.2), (200, 0.95), (60, 0.8)]
    assert metrics.pareto_front(points) == [3, 1, 4]


def _results():
    ok = lambda label, bpt, err: {  # noqa: E731
        "label": label, "method": label.split()[0], "settings": {}, "status": "ok",
        "bytes_per_token": bpt, "relative_error_mean": err, "relative_error_max": err,
    }
    return [
        ok("full", 1000.0, 0.0),
        ok("kivi", 200.0, 0.3),
        ok("snapkv", 400.0, 0.5),
        {"label": "broken", "method": "kivi", "settings": {}, "status": "failed", "error": "ValueError: boom"},
    ]


def test_ratios_table_json_and_png(tmp_path):
    results = _results()
    report.add_ratios(results, synthetic=True)
    assert results[1]["ratios"]["bytes_per_token"] == 0.2
    head, rows = report.table_rows(results, synthetic=True)
    assert rows[3][-1] == "FAILED: ValueError: boom" and rows[0][3] == "1.000"
    png = tmp_path / "pareto.png"
    report.plot(png, results, synthetic=True)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1320, 605)  # the plot and its numbered table beside it
    assert [r.get("pareto") for r in results[:3]] == [True, True, False]  # snapkv is dominated
    payload = {"environment": report.environment(0, None), "results": results}
    report.write_json(tmp_path / "results.json", payload)
    assert json.loads((tmp_path / "results.json").read_text()) == json.loads(json.dumps(payload))


def test_method_selection_and_settings(unimplemented):
    assert select_methods("all")[:1] == ["full"]
    with pytest.raises(BenchError, match=r"--methods: method='kivy' is not a known method \(did you mean 'kivi'\?\)"):
        select_methods("kivy")
    with pytest.raises(BenchError, match=f"--methods: method '{unimplemented}' has no implementation yet"):
        select_methods(unimplemented)
    runs = method_runs(["kivi", "snapkv"], ["kv_bits=4", "snap_budget=256"], sweep=False)
    assert [r.label for r in runs] == ["full", "kivi kv_bits=4", "snapkv snap_budget=256"]
    assert runs[1].config.kv_bits == 4 and runs[2].config.snap_budget == 256
    with pytest.raises(BenchError, match="--set snap_budget: a field of snapkv, which is not benchmarked"):
        method_runs(["kivi"], ["snap_budget=256"], sweep=False)
    with pytest.raises(BenchError, match=r"^kv_bits=3 is out of range; allowed: int, one of 2, 4, 8"):
        method_runs(["kivi"], ["kv_bits=3"], sweep=False)
    swept = method_runs(["kivi"], None, sweep=True)
    assert [r.label for r in swept] == ["full", "kivi kv_bits=2", "kivi kv_bits=4", "kivi kv_bits=8"]
