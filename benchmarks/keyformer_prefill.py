"""One attention layer's prefill: keyformer against the ``full`` cache (and an older keyformer).

Issue 31: keyformer's prefill scoring drew ``mx.random.gumbel`` noise for every (query, key)
logit of the prompt (threefry bits), 32x the uncompressed prefill on an H200. This times one
layer's prompt the way ``bench/runner.prefill`` feeds it: chunks of ``--chunk`` tokens
(``update_and_fetch`` + ``attend``, then the cache's state evaluated), then the last token
alone, on synthetic float keys, values and queries; each repeat on a fresh cache, the
caches taking turns so that the machine's drift hits them alike; medians of the warm
repeats (the first run of each is a warm-up: compilation). Then the prompt's scoring alone
(``gumbel_mass`` over the whole prompt as one chunk), without noise, with noise, and with
the old module's noise, so that the noise's own share shows. ``--old PATH`` also times a
keyformer module saved elsewhere (``git show REV:veloxquant/methods/keyformer.py >
PATH``), loaded as a sibling of the current one.

    MLX_DEFAULT_DEVICE=cpu python benchmarks/keyformer_prefill.py                  # 32/8 heads x 128, 2,048 tokens, one chunk
    git show HEAD~1:veloxquant/methods/keyformer.py > /tmp/keyformer_old.py
    MLX_DEFAULT_DEVICE=cpu python benchmarks/keyformer_prefill.py --old /tmp/keyformer_old.py --repeats 5
    python benchmarks/keyformer_prefill.py --context 4096 --chunk 2048 --dtype float16   # issue 31's GPU shape (one layer)
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

from veloxquant_mlx import KVCacheConfig  # first: it may load OpenBLAS

import mlx.core as mx  # noqa: E402

from veloxquant_mlx.cache.options import KeyformerOptions  # noqa: E402
from veloxquant_mlx.registry import METHODS  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill_layer import prefill as chunked_prefill, synthetic_layer  # noqa: E402


def prefill(cache, k, v, q, chunk) -> float:
    """Seconds to feed the prompt as ``prefill_layer.prefill`` does, all chunks together."""
    return sum(chunked_prefill(cache, k, v, q, chunk))


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("veloxquant_mlx.methods._keyformer_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scorers(q, k, old):
    """The prompt's scoring alone (``gumbel_mass`` over the whole prompt, one chunk): without
    noise (its floor), with the position-hash noise, and with the old module's noise."""
    from veloxquant_mlx.methods import keyformer

    scale, positions = k.shape[-1] ** -0.5, mx.arange(k.shape[2])[None, None]
    positions = mx.broadcast_to(positions, k.shape[:3])
    stream = keyformer.noise_stream(0, 0, q.shape[0], q.shape[1], k.shape[1])
    out = {
        "scoring, no noise": lambda: keyformer.gumbel_mass(q, k, scale, 0, positions, 1.0),
        "scoring": lambda: keyformer.gumbel_mass(q, k, scale, 0, positions, 1.0, stream),
    }
    if old is not None:
        key_at = lambda p: old.noise_key(0, 0, p)  # noqa: E731
        out["scoring (old)"] = lambda: old.gumbel_mass(q, k, scale, 0, positions, 1.0, key_at)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HKV"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--dtype", default="float32", choices=("float16", "bfloat16", "float32"))
    p.add_argument("--repeats", type=int, default=3, help="warm repeats per cache (after one warm-up)")
    p.add_argument("--budget", type=int, default=512, help="keyformer_budget")
    p.add_argument("--old", help="an older keyformer module to time as well")
    a = p.parse_args()

    hq, hkv = a.heads
    k, v, q = synthetic_layer(hq, hkv, a.head_dim, a.context, getattr(mx, a.dtype))

    full_config = KVCacheConfig()
    kf_config = KVCacheConfig(options=KeyformerOptions(keyformer_budget=a.budget))
    makers = {
        "full": lambda: METHODS["full"].load_implementation()(full_config, layer=0),
        "keyformer": lambda: METHODS["keyformer"].load_implementation()(kf_config, layer=0),
    }
    old = load_old(a.old) if a.old else None
    if old is not None:
        makers["keyformer (old)"] = lambda: old.KeyformerCache(kf_config, layer=0)
    scoring = scorers(q, k, old)

    times = {name: [] for name in makers}
    for name, make in makers.items():  # warm-up: compilation, first use
        prefill(make(), k, v, q, a.chunk)
    times.update({name: [] for name in scoring})
    for name, score in scoring.items():
        mx.eval(score())
    for _ in range(a.repeats):
        for name, make in makers.items():
            times[name].append(prefill(make(), k, v, q, a.chunk))
        for name, score in scoring.items():
            t0 = time.perf_counter()
            mx.eval(score())
            times[name].append(time.perf_counter() - t0)

    print(f"{mx.default_device()}, {hq}/{hkv} heads x {a.head_dim}, {a.dtype}, {a.context} tokens "
          f"in {a.chunk}-token chunks + the last alone, keyformer_budget {a.budget}, "
          f"median of {a.repeats} warm prefills")
    full = statistics.median(times["full"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:18s} {m * 1e3:9.1f} ms  {m / full:6.2f}x full   (runs: "
              + ", ".join(f"{t * 1e3:.0f}" for t in ts) + ")")


if __name__ == "__main__":
    main()
