"""benchmarks/step_anatomy.py: a step whose building reads a new value on the host waits for
the work queued before it, and the probe names the call; a cache that does not, does not."""

import sys
from pathlib import Path

import veloxquant_mlx  # noqa: F401  (before mlx)
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import step_anatomy  # noqa: E402

BUSY_MS = 150.0


def _probe(syncing: bool):
    bench = step_anatomy.bench
    model = bench.build_model("tiny", mx.float32)
    cache, y, _ = bench.start(model, bench.KVCacheConfig(), 32, prefill_repeats=1)
    if syncing:
        layer = cache[0]
        update = layer.update_and_fetch

        def update_and_sync(keys, values):
            keys.sum().item()  # a host read of a value this step computes
            return update(keys, values)

        layer.update_and_fetch = update_and_sync
    return step_anatomy.busy_anatomy(model, cache, y, probes=1, busy_ms=BUSY_MS, block_ms=BUSY_MS / 3,
                                     calibrated={})


def test_the_probe_sees_a_build_that_waits_for_the_device_and_names_the_call():
    _, build_ms, slow = _probe(syncing=True)
    assert build_ms > BUSY_MS / 3
    assert any(".item()" in code and where.startswith("tests/test_step_anatomy.py")
               for code, where in slow), slow


def test_a_cache_that_reads_nothing_builds_without_waiting():
    _, build_ms, slow = _probe(syncing=False)
    assert build_ms < BUSY_MS / 3 and not slow, (build_ms, slow)
