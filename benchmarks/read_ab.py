"""A decode read off and on, alternated in one process: ``--switch row-kernels`` (vecinfer's
``kernels/codebook_rows.py``, nsnquant's, AdaKV's and kitty's ``methods/<key>/kernel.py``) or
``--switch composed-rows`` (an eviction method's packed slots on CUDA: every row decoded in
the model's dtype and one fused attention, ``QuantizedSlots._attend_rows``, against the
float32 read) or ``--switch slot-rows-kernel`` (those rows in one launch,
``evict/slot_rows_kernel.py``, against MLX's ops).

``decode.py --isolate`` times a method in a process of its own, and two processes' host times
differed by 2x on one H100 (``results/h200_s69``). Here one process holds, per method, two
caches prefilled alike. One reads its rows the other way (for the row kernels: through MLX's
ops, ``kernel_checked`` answering False while it prefills and steps). An mlx-lm
``KVCache`` runs beside them. They take turns, round after round, each round
``--steps`` overlapped steps as ``generate_step`` runs them (``decode.overlapped_steps``).
The table gives the medians and the ratios on/off and against KVCache. On a CPU neither
switch changes the read: both columns read the same way, so the ratio there is the spread.

    python benchmarks/read_ab.py --preset llama3-8b --context 4096 \
        --methods vecinfer nsnquant adakv kitty [--steps 16] [--rounds 6]
    python benchmarks/read_ab.py --switch composed-rows --preset llama3-8b --context 4096 \
        --methods "snapkv 2048 + kivi-4bit" "tova 2048 + kivi-4bit"
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

from veloxquant_mlx.evict import quantized_slots, slot_rows_kernel  # noqa: E402
from veloxquant_mlx.kernels import codebook_rows  # noqa: E402
from veloxquant_mlx.methods.adakv import kernel as adakv_kernel  # noqa: E402
from veloxquant_mlx.methods.kitty import kernel as kitty_kernel  # noqa: E402
from veloxquant_mlx.methods.nsnquant import kernel as nsnquant_kernel  # noqa: E402

ROW_KERNELS = (codebook_rows, nsnquant_kernel, adakv_kernel, kitty_kernel)


@contextlib.contextmanager
def refused(switches, on: bool):
    """``(module, name)`` functions as they are (``on``) or answering False."""
    saved = [getattr(m, name) for m, name in switches]
    try:
        if not on:
            for m, name in switches:
                setattr(m, name, lambda *args: False)
        yield
    finally:
        for (m, name), fn in zip(switches, saved):
            setattr(m, name, fn)


SWITCHES = {
    # the row kernels refused, as their failed check would refuse them
    "row-kernels": [(m, "kernel_checked") for m in ROW_KERNELS],
    # the packed slots' float32 read on CUDA
    "composed-rows": [(quantized_slots, "reads_rows_on_cuda")],
    # the packed slots' rows on CUDA through MLX's ops instead of one launch
    "slot-rows-kernel": [(slot_rows_kernel, "kernel_checked")],
}



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=list(decode.PRESETS))
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--switch", default="row-kernels", choices=list(SWITCHES))
    ap.add_argument("--methods", nargs="+", default=["vecinfer", "nsnquant", "adakv", "kitty"],
                    help="methods' keys at their defaults, or names of decode.py's METHODS")
    ap.add_argument("--steps", type=int, default=16, help="overlapped steps a cache takes a turn")
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds (one warm-up round first)")
    args = ap.parse_args()
    switch = SWITCHES[args.switch]
    methods = decode.resolve_methods(args.methods, ap, every_row=False)
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.float16
    model = decode.build_model(args.preset, dtype)
    states = {"mlx-lm KVCache": (*decode.start(model, None, args.context, 1)[:2], True)}
    for method in methods:
        for on in (False, True):
            with refused(switch, on):
                cache, y, _ = decode.start(model, decode.METHODS[method], args.context, 1)
            states[(method, on)] = (cache, y, on)
            print(f"prefilled {method} ({args.switch} {'on' if on else 'off'})", flush=True)
    steps = {name: [] for name in states}
    for r in range(args.rounds + 1):
        for name, (cache, y, on) in states.items():
            with refused(switch, on):
                y, t = decode.overlapped_steps(model, cache, y, args.steps)
            states[name] = (cache, y, on)
            if r:  # the first round warms every cache up
                steps[name].append(sum(t[0]))  # host + the rest: the wall time a token
    base = statistics.median(steps["mlx-lm KVCache"])
    print(f"\n{args.preset}, {args.context} tokens, {args.rounds} rounds of {args.steps} overlapped steps, "
          f"{mx.default_device()}; ms a token, median of the rounds; KVCache {base * 1e3:.2f} ms\n")
    print(f"| cache | {args.switch} off ms | on ms | off / on (above 1: on is faster) | off vs KVCache | on vs KVCache |")
    print("|---|---:|---:|---:|---:|---:|")
    for method in methods:
        off, on = (statistics.median(steps[(method, k)]) for k in (False, True))
        print(f"| {method} | {off * 1e3:.2f} | {on * 1e3:.2f} | {off / on:.3f} | "
              f"{base / off:.2f}x | {base / on:.2f}x |")


if __name__ == "__main__":
    main()
