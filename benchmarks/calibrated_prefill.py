"""Prefill with a calibration file against the per-prompt fit (issue 31), for the methods
that take one (kvtc, palu, svdq, spectral, skvq, kvquant), one layer at Llama-3-8B's shape (8 KV heads of 128,
rope_theta 500000), fed as mlx-lm feeds it: chunks of --chunk tokens, each stored then
attended by 32 query heads, the cache's state evaluated after each chunk. The file is
calibrated on other keys and values of the same statistics. Median of --repeats;
mlx-lm's KVCache with the same attention as the baseline. float32 by default on the CPU:
its half-precision kernels are slower still, and the attention already dominates there.

    MLX_DEFAULT_DEVICE=cpu python benchmarks/calibrated_prefill.py --methods palu svdq
    python benchmarks/calibrated_prefill.py --dtype float16 --tokens 4096 32768   # a GPU
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from types import SimpleNamespace

import veloxquant_mlx  # noqa: F401  first: it may load an optimized BLAS before mlx

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402
from mlx_lm.models.llama import ModelArgs  # noqa: E402

from veloxquant_mlx import KVCacheConfig  # noqa: E402
from veloxquant_mlx.cache.calibration import calibration_header, write_calibration  # noqa: E402
from veloxquant_mlx.methods.kvquant import KVQuantCache  # noqa: E402
from veloxquant_mlx.methods.kvtc import KVTCCache  # noqa: E402
from veloxquant_mlx.methods.palu import PALUCache  # noqa: E402
from veloxquant_mlx.methods.skvq import SKVQCache  # noqa: E402
from veloxquant_mlx.methods.spectral import SpectralQuantCache  # noqa: E402
from veloxquant_mlx.methods.svdq import SVDqCache  # noqa: E402

LLAMA3_8B = ModelArgs(model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                      num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, vocab_size=128256,
                      rope_theta=500000.0)
CACHES = {"kvtc": KVTCCache, "palu": PALUCache, "svdq": SVDqCache, "spectral": SpectralQuantCache,
          "skvq": SKVQCache, "kvquant": KVQuantCache}


def kv(t, dtype, seed):
    """Keys and values (1, 8, t, 128) with a decaying spectrum over the 1,024 channels."""
    mix = mx.random.normal((1024, 1024), key=mx.random.key(seed)) / 32
    x = [(mx.random.normal((t, 1024), key=mx.random.key(seed + i)) * 0.995 ** mx.arange(1024)) @ mix
         for i in (1, 2)]
    return [a.reshape(1, t, 8, 128).transpose(0, 2, 1, 3).astype(dtype) for a in x]


def prefill(cache, keys, values, queries, chunk):
    for s in range(0, keys.shape[2], chunk):
        k, v = cache.update_and_fetch(keys[:, :, s : s + chunk], values[:, :, s : s + chunk])
        q = queries[:, :, s : s + chunk]
        if hasattr(cache, "attend"):
            out = cache.attend(q, k, v, scale=128**-0.5, mask="causal")
            mx.eval(out, cache.state)
        else:
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=128**-0.5, mask="causal"), cache.state)


def timed(make, args, data):
    times = []
    for _ in range(args.repeats):
        cache = make()
        t0 = time.perf_counter()
        prefill(cache, *data, args.chunk)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(CACHES), choices=list(CACHES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--chunk", type=int, default=2048, help="mlx-lm's prefill_step_size (default 2048)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("bfloat16", "float16", "float32"))
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    context = SimpleNamespace(model_args=LLAMA3_8B)
    print(f"chunks of {args.chunk}, {args.dtype}, one layer of 8 x 128, device {mx.default_device()}, "
          f"median of {args.repeats}")
    print("| tokens | cache | prefill s | x KVCache |")
    print("|---:|---|---:|---:|")
    for tokens in args.tokens:
        keys, values = kv(tokens, dtype, 0)
        queries = mx.random.normal((1, 32, tokens, 128), key=mx.random.key(9)).astype(dtype)
        mx.eval(keys, values, queries)
        data = (keys, values, queries)
        base = timed(KVCache, args, data)
        print(f"| {tokens} | mlx-lm KVCache | {base:.3f} | 1.0 |", flush=True)
        text_k, text_v = kv(tokens, dtype, 100)  # another text of the same statistics
        for method in args.methods:
            cls, plain = CACHES[method], KVCacheConfig(method=method)
            with tempfile.TemporaryDirectory() as folder:
                path = f"{folder}/{method}.safetensors"
                arrays = cls.calibrate(text_k, text_v, plain, iters=1, seed=0, model_args=LLAMA3_8B)
                write_calibration(path, {0: arrays}, calibration_header(cls, plain, LLAMA3_8B, "llama3-8b shape"))
                calibrated = KVCacheConfig(method=method, calibration_file=path)
                for name, config in (("fitted on the prompt", plain), ("calibration file", calibrated)):
                    s = timed(lambda: cls(config, context, 0), args, data)
                    print(f"| {tokens} | {method}, {name} | {s:.3f} | {s / base:.1f} |", flush=True)


if __name__ == "__main__":
    main()
