# Session 76: one method at its defaults on one layer of the 8B shape (1,024-word vocabulary),
# a 1,024-token prompt; the distinct graph structures of 72 decode steps built as on CUDA
# (tests/decode_steps.graph_shape). CPU: cd tests && MLX_DEFAULT_DEVICE=cpu python
# ../benchmarks/results/h200_s76/step_structures_defaults.py 1024 72 palu kvquant
import sys, warnings, collections
warnings.simplefilter("ignore")
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests")); sys.path.insert(0, str(ROOT / "benchmarks"))
import veloxquant_mlx
import mlx.core as mx
from decode import build_model, make_cache, METHODS
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.bench.runner import prefill
from decode_steps import graph_shape, cache_arrays, steps_as_on_cuda
import decode as _d
_d.PRESETS["llama3-8b"] = {**_d.PRESETS["llama3-8b"], "vocab_size": 1024}
ctx = int(sys.argv[1]); steps = int(sys.argv[2])
for method in sys.argv[3:]:
    model = build_model("llama3-8b", mx.float32, layers=1)
    config = METHODS[method] if method in METHODS else KVCacheConfig(method=method)
    cache = make_cache(model, config)
    logits = prefill(model, cache, mx.random.randint(0, 1000, (ctx,), key=mx.random.key(0)))
    y = mx.argmax(logits).reshape(1, 1)
    for _ in range(4):
        out = model(y, cache=cache); y = mx.argmax(out[:, -1], -1).reshape(1, 1); mx.eval(y, cache_arrays(cache))
    ds = []
    with steps_as_on_cuda():
        for i in range(steps):
            mx.eval(y, cache_arrays(cache))
            out = model(y, cache=cache); y = mx.argmax(out[:, -1], -1).reshape(1, 1)
            ds.append(graph_shape([y, *cache_arrays(cache)])[1])
        mx.eval(y, cache_arrays(cache))
    ids = {}
    seq = "".join(chr(65 + ids.setdefault(d, len(ids)) % 58) for d in ds)
    t = sum(a != b for a, b in zip(ds, ds[1:]))
    print(f"{method:22s} distinct {len(ids):2d} trans {t:2d} {seq}", flush=True)
