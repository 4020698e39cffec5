"""benchmarks/periodic_steps.py: a step that costs more every N tokens is found at those
tokens, with its excess over the median; steady steps are not."""

import sys
import time
from pathlib import Path

import veloxquant_mlx  # noqa: F401  (before mlx)
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import periodic_steps  # noqa: E402

EVERY, SLEEP_S = 8, 0.05


def test_a_slow_step_every_n_tokens_spikes_at_those_tokens_only():
    bench = periodic_steps.bench
    model = bench.build_model("tiny", mx.float32)
    cache, y, _ = bench.start(model, bench.KVCacheConfig(), 32, prefill_repeats=1)
    layer, calls = cache[0], [0]
    update = layer.update_and_fetch

    def update_slowly_every_n(keys, values):
        calls[0] += 1
        if calls[0] % EVERY == 0:
            time.sleep(SLEEP_S)
        return update(keys, values)

    layer.update_and_fetch = update_slowly_every_n
    _, intervals = periodic_steps.token_intervals(model, cache, y, 4 * EVERY)
    found = periodic_steps.summary(intervals, spike=3.0)
    slowest = sorted(sorted(range(len(intervals)), key=intervals.__getitem__)[-4:])
    assert all(b - a == EVERY for a, b in zip(slowest, slowest[1:]))
    assert set(slowest) <= {s for s, _ in found["spikes"]}  # a loaded machine may add a few more
    assert found["excess_ms"] >= 0.8 * 4 * SLEEP_S * 1e3
