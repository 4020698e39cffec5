"""The row kernels (vecinfer's ``kernels/codebook_rows.py``, nsnquant's, AdaKV's and kitty's
``methods/<key>/kernel.py``) off and on, alternated in one process.

``decode.py --isolate`` times a method in a process of its own, and two processes' host times
differed by 2x on one H100 (``results/h200_s69``). Here one process holds, per method, two
caches prefilled alike. One reads its rows through MLX's ops (the kernels' ``kernel_checked``
answers False while it prefills and steps). The other takes the kernels. An mlx-lm
``KVCache`` runs beside them. They take turns, round after round, each round
``--steps`` overlapped steps as ``generate_step`` runs them (``decode.overlapped_steps``).
The table gives the medians and the ratios on/off and against KVCache. On a CPU the kernels
do not run: both columns read the MLX ops, so the ratio there is the spread.

    python benchmarks/row_kernels_ab.py --preset llama3-8b --context 4096 \
        --methods vecinfer nsnquant adakv kitty [--steps 16] [--rounds 6]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import veloxquant_mlx  # noqa: F401  (the package's BLAS first, as everywhere)
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode  # noqa: E402  (this folder's decode.py: model, prefill and overlapped steps)

from veloxquant_mlx import KVCacheConfig  # noqa: E402
from veloxquant_mlx.kernels import codebook_rows  # noqa: E402
from veloxquant_mlx.methods.adakv import kernel as adakv_kernel  # noqa: E402
from veloxquant_mlx.methods.kitty import kernel as kitty_kernel  # noqa: E402
from veloxquant_mlx.methods.nsnquant import kernel as nsnquant_kernel  # noqa: E402

ROW_KERNELS = (codebook_rows, nsnquant_kernel, adakv_kernel, kitty_kernel)


@contextlib.contextmanager
def kernels(on: bool):
    """The row kernels as they are (``on``) or refused, as their failed check would refuse them."""
    saved = [m.kernel_checked for m in ROW_KERNELS]
    try:
        if not on:
            for m in ROW_KERNELS:
                m.kernel_checked = lambda *args: False
        yield
    finally:
        for m, fn in zip(ROW_KERNELS, saved):
            m.kernel_checked = fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=list(decode.PRESETS))
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--methods", nargs="+", default=["vecinfer", "nsnquant", "adakv", "kitty"])
    ap.add_argument("--steps", type=int, default=16, help="overlapped steps a cache takes a turn")
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds (one warm-up round first)")
    args = ap.parse_args()
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.float16
    model = decode.build_model(args.preset, dtype)
    states = {"mlx-lm KVCache": (*decode.start(model, None, args.context, 1)[:2], True)}
    for method in args.methods:
        for on in (False, True):
            with kernels(on):
                cache, y, _ = decode.start(model, KVCacheConfig(method=method), args.context, 1)
            states[(method, on)] = (cache, y, on)
            print(f"prefilled {method} (kernels {'on' if on else 'off'})", flush=True)
    steps = {name: [] for name in states}
    for r in range(args.rounds + 1):
        for name, (cache, y, on) in states.items():
            with kernels(on):
                y, t = decode.overlapped_steps(model, cache, y, args.steps)
            states[name] = (cache, y, on)
            if r:  # the first round warms every cache up
                steps[name].append(sum(t[0]))  # host + the rest: the wall time a token
    base = statistics.median(steps["mlx-lm KVCache"])
    print(f"\n{args.preset}, {args.context} tokens, {args.rounds} rounds of {args.steps} overlapped steps, "
          f"{mx.default_device()}; ms a token, median of the rounds; KVCache {base * 1e3:.2f} ms\n")
    print("| cache | kernels off ms | on ms | off / on (above 1: on is faster) | off vs KVCache | on vs KVCache |")
    print("|---|---:|---:|---:|---:|---:|")
    for method in args.methods:
        off, on = (statistics.median(steps[(method, k)]) for k in (False, True))
        print(f"| {method} | {off * 1e3:.2f} | {on * 1e3:.2f} | {off / on:.3f} | "
              f"{base / off:.2f}x | {base / on:.2f}x |")


if __name__ == "__main__":
    main()
