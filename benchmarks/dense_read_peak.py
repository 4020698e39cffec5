"""Peak memory of a kitty decode step on the CPU, its CUDA read (``--read cuda``: the
history decoded in the queries' dtype + one fused attention, ``kd.gpu_backend`` made to
answer "cuda") against its CPU read: how many layers' decoded rows MLX holds at once.

    python benchmarks/dense_read_peak.py --read cpu
    python benchmarks/dense_read_peak.py --read cuda --context 4096
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import veloxquant_mlx  # noqa: F401  (before mlx: the system BLAS)
import mlx.core as mx

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.kernels import kivi_decode as kd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--read", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=None, help="of the small preset's 8: a pile-up across layers grows with them")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("decode_bench", Path(__file__).with_name("decode.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = bench.build_model("small", mx.float32, args.layers)
    cache = bench.make_cache(model, KVCacheConfig(method="kitty"))
    tokens = mx.random.randint(0, model.args.vocab_size, (args.context,), key=mx.random.key(1))
    y = mx.argmax(bench.prefill(model, cache, tokens))[None]
    if args.read == "cuda":
        kd.gpu_backend = lambda: "cuda"
    for _ in range(3):  # past the first steps' one-time work
        y, _ = bench.step(model, cache, y)
    mx.clear_cache()
    mx.reset_peak_memory()
    held = mx.get_active_memory()
    for _ in range(args.steps):
        y, _ = bench.step(model, cache, y)
    layer = model.args.num_key_value_heads * 128 * args.context * 2 * 4
    print(f"{args.read} read: peak {(mx.get_peak_memory() - held) / 2**20:.1f} MiB above the held memory; "
          f"one layer's float32 keys and values {layer / 2**20:.1f} MiB, {model.args.num_hidden_layers} layers")


if __name__ == "__main__":
    main()
