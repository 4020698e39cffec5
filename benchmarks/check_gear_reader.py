"""gear's decode read against attention over its dequantized history, on this machine's
default device, at the 8B layer's shape (32 query / 8 KV heads of 128): a ``--context``-token
prompt fed in 2,048-token chunks, then ``--steps`` decode tokens, then one query read from
the store (``tests/feeding.stored_decode_attention``: the reader's compiled pass with the
low-rank and sparse terms) and from the reconstructed keys and values; prints the largest
relative error and the reader's median time. Exit status 1 where the error passes
``--tolerance``.

    python benchmarks/check_gear_reader.py --context 32768           # on the device
    MLX_DEFAULT_DEVICE=cpu python benchmarks/check_gear_reader.py --context 1024 --dtype float32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import veloxquant_mlx  # noqa: F401  (first: it may load OpenBLAS)
import mlx.core as mx  # noqa: E402

from veloxquant_mlx import KVCacheConfig  # noqa: E402
from veloxquant_mlx.methods.gear import GEARCache  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from feeding import stored_decode_attention  # noqa: E402
from prompt_mass import timed  # noqa: E402  (median seconds after one warm-up call)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=70, help="decode tokens after the prompt (flushes included)")
    ap.add_argument("--dtype", default="float16", choices=("float16", "float32"))
    ap.add_argument("--tolerance", type=float, default=1e-2)
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    cache = GEARCache(KVCacheConfig(method="gear"), None, 0)
    total = args.context + args.steps
    k = mx.random.normal((1, 8, total, 128), key=mx.random.key(0)).astype(dtype)
    v = mx.random.normal((1, 8, total, 128), key=mx.random.key(1)).astype(dtype)
    for start in range(0, args.context, 2048):
        stop = min(start + 2048, args.context)
        q = mx.random.normal((1, 32, stop - start, 128), key=mx.random.key(start + 2)).astype(dtype)
        cache.update_and_fetch(k[:, :, start:stop], v[:, :, start:stop])
        mx.eval(cache.attend(q, None, None, scale=128 ** -0.5, mask="causal"))
    for t in range(args.context, total):
        q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(t + 2)).astype(dtype)
        cache.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
        mx.eval(cache.attend(q, None, None, scale=128 ** -0.5, mask=None))
    q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(total + 2)).astype(dtype)
    got = stored_decode_attention(cache, q, 128 ** -0.5).astype(mx.float32)
    k_hat, v_hat = cache.dequantized(mx.float32)
    qf = q.astype(mx.float32).reshape(1, 8, 4, 128) * 128 ** -0.5
    p = mx.softmax(qf @ k_hat.swapaxes(-1, -2), axis=-1)
    want = (p @ v_hat).reshape(got.shape)
    err = float(mx.abs(got - want).max() / mx.abs(want).max())
    ms = timed(lambda: stored_decode_attention(cache, q, 128 ** -0.5), 10) * 1e3
    print(f"{mx.default_device()}, gear at its defaults, {args.context} + {args.steps} tokens, {args.dtype}: "
          f"largest error {err:.2e} of the output's largest (tolerance {args.tolerance:g}); "
          f"the reader alone {ms:.2f} ms a layer")
    return 0 if err <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
