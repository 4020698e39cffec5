"""xKV's prompt end at Llama-3-8B's key shape (8 KV heads of 128): the first decode step's
cache updates, where each group of layers fits its shared basis (issue 31).

Each group's fit is one eigenproblem of its keys' Gram matrix (2 layers x 8 x 128 = 2,048
channels at the defaults) on a CPU stream, then a host read of its rank. mlx-lm's first
decode step reaches the groups one after another, so the fits ran one at a time; now the
first group to end its prompt queues the later groups' eigenproblems too, as many at a
time as there are fit streams (``lowrank/factors.leading_bases``). This times the step's
updates of every layer (random keys, float32 unless --dtype; a model's projections and
attention are left out: only the caches' work) both ways in one process, the arms taking
turns, each repeat a fresh cache. The fits run on the CPU streams on a GPU machine too,
so the ratio is the host's.

    python benchmarks/xkv_prompt_end.py                              # 8 layers, 4,096 tokens
    python benchmarks/xkv_prompt_end.py --layers 32 --streams 1 2 4  # VQ_FIT_STREAMS' choices
"""

from __future__ import annotations

import argparse
import statistics
import time

import veloxquant_mlx  # noqa: F401  first: it may load an optimized BLAS before mlx

import mlx.core as mx  # noqa: E402

from veloxquant_mlx import KVCacheConfig  # noqa: E402
from veloxquant_mlx.cache.context import ModelContext  # noqa: E402
from veloxquant_mlx.lowrank import cpu_streams  # noqa: E402
from veloxquant_mlx.methods.xkv import XKVCache  # noqa: E402

HEADS, DIM = 8, 128


def caches(n_layers: int) -> list:
    config = KVCacheConfig(method="xkv")
    context = ModelContext(config, n_layers, tuple(range(n_layers)))
    context.layers = [XKVCache(config, context, i) for i in range(n_layers)]
    return context.layers


def prompt_end(n_layers: int, tokens: int, dtype, one_group_at_a_time: bool) -> float:
    """Seconds for the first decode step's updates of every layer after a ``tokens`` prompt."""
    layers = caches(n_layers)
    keys = [mx.random.normal((1, HEADS, tokens + 1, DIM), key=mx.random.key(i)).astype(dtype)
            for i in range(n_layers)]
    mx.eval(keys)
    for c, k in zip(layers, keys):  # the prompt, one chunk a layer (its end is the next update)
        c.update_and_fetch(k[:, :, :tokens], k[:, :, :tokens])
        c._awaiting_attend = False  # the layer's attention is left out
    mx.eval([c.keys.buffer for c in layers])
    saved = XKVCache._waiting_groups
    if one_group_at_a_time:
        XKVCache._waiting_groups = lambda self, end: []
    try:
        start = time.perf_counter()
        for c, k in zip(layers, keys):
            c.update_and_fetch(k[:, :, tokens:], k[:, :, tokens:])
            c._awaiting_attend = False
        mx.eval([x for c in layers for x in (c.b, *c.shared.items.values()) if isinstance(x, mx.array)])
        return time.perf_counter() - start
    finally:
        XKVCache._waiting_groups = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2], help="fit streams (VQ_FIT_STREAMS)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    print(f"{args.layers} layers, {args.tokens} tokens, {HEADS} x {DIM} keys, {args.dtype}; "
          f"median of {args.repeats}\n")
    print("| fit streams | one group at a time s | queued together s | ratio |")
    print("|---:|---:|---:|---:|")
    for streams in args.streams:
        cpu_streams.set_fit_streams(streams)
        prompt_end(2, 600, dtype, False)  # warm: the streams' threads, LAPACK's first call
        times = {False: [], True: []}
        for _ in range(args.repeats):
            for alone in (True, False):
                times[alone].append(prompt_end(args.layers, args.tokens, dtype, alone))
        before, after = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {streams} | {before:.2f} | {after:.2f} | {before / after:.2f}x |", flush=True)
    cpu_streams.set_fit_streams(None)


if __name__ == "__main__":
    main()
