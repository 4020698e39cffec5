"""A decode step builds no options object (issue 30: the host's work per step).

``KVCacheConfig.options`` builds the method's options dataclass from the flat fields and
validates it at every read: about 8 us on the development CPU, where a whole layer's step
costs the host about 180 us with mlx-lm's own cache (``benchmarks/results/host_time_s61.md``).
minicache read it nine times a layer and step (its groups, asked by ``role`` and ``owner``),
xkv three times, zipcache, skvq, kvtc, nsnquant and vecinfer once or twice, amc and
minicache at each flush. A decode step, a flushing one included, reads the flat fields (what
``options`` is built from) or what the cache kept at its start.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from decode_steps import WARMUP, decode_overlapped, prefilled, step
from conformance import COMPOSED
from veloxquant_mlx.cache.config import KVCacheConfig
from veloxquant_mlx.registry import implemented_methods

STEPS = 40  # past a flush (32 rows a batch for most quantized stores) and an eviction


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("method", [*implemented_methods(), *COMPOSED])
def test_a_decode_step_builds_no_options_object(method, monkeypatch):
    model, cache, token = prefilled(method)
    token = decode_overlapped(model, cache, token, WARMUP)
    mx.eval(token)
    built = []
    options = KVCacheConfig.options
    monkeypatch.setattr(KVCacheConfig, "options", property(
        lambda config: built.append(config.method) or options.fget(config), options.fset))
    for _ in range(STEPS):
        token, _ = step(model, cache, token)
        mx.eval(token)
    assert not built, f"{method}: {len(built)} options objects built over {STEPS} decode steps"
