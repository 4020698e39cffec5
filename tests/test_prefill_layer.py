"""benchmarks/prefill_layer.py: a layer's prompt is fed as the model feeds it (every token
once, in chunks, the last alone), each chunk timed apart, and its yardstick computes the
full cache's outputs."""

import sys
import time
from pathlib import Path

import numpy as np

import veloxquant_mlx  # noqa: F401  (before mlx)
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import prefill_layer  # noqa: E402


def _kvq(n, hq=4, hkv=2, d=16):
    return [mx.random.normal((1, h, n, d), key=mx.random.key(i)) for i, h in enumerate((hkv, hkv, hq))]


def test_chunks_then_the_last_token_alone_each_timed():
    k, v, q = _kvq(70)
    seen = []
    cache = prefill_layer.maker("full")()
    update = cache.update_and_fetch

    def recording(keys, values):
        seen.append(keys.shape[2])
        if len(seen) == 2:
            time.sleep(0.05)  # the second chunk is slow: its own entry shows it
        return update(keys, values)

    cache.update_and_fetch = recording
    times = prefill_layer.prefill(cache, k, v, q, chunk=32)
    assert seen == [32, 32, 5, 1] and cache.offset == 70
    assert len(times) == 4 and times[1] >= 0.05 > max(times[0], times[2], times[3])


def test_the_yardstick_attends_as_the_full_cache():
    k, v, q = _kvq(40)
    outs = []
    for name in (prefill_layer.BASELINE, "full"):
        cache = prefill_layer.maker(name)()
        keys, values = cache.update_and_fetch(k, v)
        outs.append(np.array(cache.attend(q, keys, values, scale=0.25, mask="causal")))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)
