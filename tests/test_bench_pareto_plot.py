"""Issue 37: the Pareto plot shows quality as the KL divergence from the full cache (log
scale) against KV bytes per token, and marks a run Pareto-optimal on those two axes only
(retrieval, which the quick workload scores on 3 examples, does not make a run optimal)."""

from veloxquant_mlx.bench import report


def _run(label, bytes_per_token, kl, retrieval):
    return {"label": label, "method": label, "settings": {}, "status": "ok",
            "memory_speed": {"bytes_per_token_decode": bytes_per_token},
            "retrieval": {"accuracy": retrieval}, "continuation": {"perplexity": 2.0, "kl_mean": kl}}


def _results():
    return [
        _run("full", 8200.0, None, 1.0),  # the reference: KL 0
        _run("a", 2000.0, 0.01, 0.0),  # fewest bytes of those with a KL: optimal, retrieval 0 or not
        _run("b", 3000.0, 0.05, 1.0),  # worse KL and more bytes than a: dominated, retrieval 1.0 or not
        _run("c", 4000.0, 0.001, 0.0),  # more bytes than a, better KL: optimal
        _run("d", 1000.0, None, 1.0),  # no KL: not plotted, never optimal
        {"label": "broken", "method": "x", "settings": {}, "status": "failed", "error": "boom"},
    ]


def test_the_front_is_taken_on_kl_and_bytes_only():
    points = report.plot_points(_results(), synthetic=False)
    assert [(r["label"], x, e) for r, x, e in points] == [
        ("full", 8200.0, 0.0), ("a", 2000.0, 0.01), ("b", 3000.0, 0.05), ("c", 4000.0, 0.001)]
    assert sorted(points[i][0]["label"] for i in report.quality_front(points)) == ["a", "c", "full"]


def test_a_run_with_worse_kl_and_more_bytes_is_not_marked(tmp_path):
    results = _results()
    png = tmp_path / "pareto.png"
    report.plot(png, results, synthetic=False, title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {r["label"]: r.get("pareto") for r in results} == {
        "full": True, "a": True, "b": False, "c": True, "d": False, "broken": None}
