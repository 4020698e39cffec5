"""``quant.vq.nearest`` at vecinfer's shapes (one 8B layer's 4k prompt: 8 heads x 4,096
tokens x 32 key sub-vectors of 4 channels against 4,096 centroids; 16 value sub-vectors of
8 against 256) with the distances formed ``--blocks`` at a time (``NEAREST_CHUNK`` and
``NEAREST_CHUNK_GPU`` patched to each): median seconds of ``--repeats`` after a warm-up,
the peak memory a call adds, and whether the indices equal the first block size's.

    python benchmarks/nearest_blocks.py                       # on the device
    MLX_DEFAULT_DEVICE=cpu python benchmarks/nearest_blocks.py --tokens 256 --repeats 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import veloxquant_mlx  # noqa: F401  (first: it may load OpenBLAS)
import mlx.core as mx  # noqa: E402

from veloxquant_mlx.quant import vq  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompt_mass import timed  # noqa: E402  (median seconds after one warm-up call)


def nearest_evaluated(x, centroids, rows):
    """``vq.nearest`` with each block's indices evaluated before the next block is built
    (an experiment: whether lazy blocks leave every block's distances alive at once)."""
    *lead, s = x.shape
    flat = x.reshape(-1, s).astype(mx.float32)
    c = centroids.astype(mx.float32)
    ext = mx.concatenate([-2.0 * c, (c * c).sum(axis=-1, keepdims=True)], axis=1).T
    flat = mx.concatenate([flat, mx.ones((flat.shape[0], 1), mx.float32)], axis=1)
    out = []
    for i in range(0, flat.shape[0], rows):
        out.append(mx.argmin(flat[i:i + rows] @ ext, axis=-1))
        mx.eval(out[-1])
    return mx.concatenate(out).astype(mx.uint32).reshape(lead)


def peak_of(fn) -> float:
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    out = fn()
    mx.eval(out)
    return out, (mx.get_peak_memory() - base) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--blocks", type=int, nargs="+", default=[19, 22, 24, 26], help="log2 of the distances a block")
    args = ap.parse_args()
    keys = mx.random.normal((8, args.tokens, 32, 4), key=mx.random.key(0))
    values = mx.random.normal((8, args.tokens, 16, 8), key=mx.random.key(1))
    k_book = mx.random.normal((4096, 4), key=mx.random.key(2))
    v_book = mx.random.normal((256, 8), key=mx.random.key(3))
    mx.eval(keys, values, k_book, v_book)
    print(f"{mx.default_device()}, MLX {mx.__version__}, {args.tokens} tokens x 8 heads\n")
    print("| distances a block | keys (4,096 centroids) ms | values (256) ms | keys' peak added MiB | "
          "keys evaluated block by block: ms / peak MiB | same indices |")
    print("|---:|---:|---:|---:|---:|---|")
    first = None
    for b in args.blocks:
        vq.NEAREST_CHUNK = vq.NEAREST_CHUNK_GPU = 1 << b
        rows = max(1, (1 << b) // k_book.shape[0])
        tk = timed(lambda: vq.nearest(keys, k_book), args.repeats)
        tv = timed(lambda: vq.nearest(values, v_book), args.repeats)
        te = timed(lambda: nearest_evaluated(keys, k_book, rows), args.repeats)
        idx, peak = peak_of(lambda: vq.nearest(keys, k_book))
        _, peak_e = peak_of(lambda: nearest_evaluated(keys, k_book, rows))
        same = "" if first is None else str(bool(mx.array_equal(idx, first)))
        first = idx if first is None else first
        print(f"| 2^{b} | {tk * 1e3:.1f} | {tv * 1e3:.1f} | {peak:.0f} | {te * 1e3:.1f} / {peak_e:.0f} | {same} |",
              flush=True)


if __name__ == "__main__":
    main()
