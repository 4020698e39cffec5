"""Host time to build a prompt chunk's graph, per layer, with the compiled prompt passes
(``kernels/compiled.py``) off and on (issue 31).

On a GPU a prompt chunk's Python runs on the host while the device runs the layer before
(``quant/store.paced``): what it costs the host to build a chunk's graph adds to the prefill
wherever the host is the slower side. The model call is lazy, so its wall time on the CPU is
the building alone (for methods whose chunk evaluates nothing mid-way: a fit's eigenproblems
do, and count here). The conformance suite's tiny llama under each method's compressing
settings, fed in chunks as ``generate_step`` feeds a prompt; the third chunk's call, the median
of ``--repeats`` fresh caches (the first, which traces the compiled passes, dropped), per layer;
``VQ_COMPILED_PROMPT`` 0 and 1 alternated ``--rounds`` times, the lower of each kept. The ``full`` cache's
row, which the switch does not touch, shows the runs' spread.

    python benchmarks/prompt_build_time.py                          # the methods with compiled prompt passes
    python benchmarks/prompt_build_time.py --methods full kvquant
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import veloxquant_mlx  # noqa: F401  first: it may load OpenBLAS

import mlx.core as mx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conformance import PROMPT, config, profile  # noqa: E402
from tiny_models import prompt, tiny_model  # noqa: E402
from veloxquant_mlx import make_prompt_cache  # noqa: E402

METHODS = ["full", "adakv", "amc", "cachegen", "gear", "kvquant", "kvtc", "nsnquant", "turboquant", "vecinfer",
           "zipcache"]


def build_ms(method: str, chunk: int, layers: int, repeats: int) -> float:
    """Median ms to build the third prompt chunk's graph, per layer."""
    model = tiny_model("llama", num_hidden_layers=layers)
    tokens = prompt(PROMPT)
    times = []
    for r in range(repeats + 1):
        cache = make_prompt_cache(model, config(method, profile(method).compressing))
        start = i = 0
        while PROMPT - start > 1:
            stop = min(start + chunk, PROMPT - 1)
            t = time.perf_counter()
            out = model(tokens[start:stop][None], cache=cache)
            if i == 2 and r:
                times.append(time.perf_counter() - t)
            mx.eval(out, [c.state for c in cache])
            start, i = stop, i + 1
    return statistics.median(times) * 1e3 / layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--chunk", type=int, default=48)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3, help="off/on alternations (the lower of each is kept)")
    args = ap.parse_args()
    print("| method | off ms | on ms | on / off |\n|---|---:|---:|---:|")
    for method in args.methods:
        runs = {"0": [], "1": []}
        for switch in ("0", "1") * args.rounds:
            os.environ["VQ_COMPILED_PROMPT"] = switch
            runs[switch].append(build_ms(method, args.chunk, args.layers, args.repeats))
        off, on = min(runs["0"]), min(runs["1"])
        print(f"| {method} | {off:.3f} | {on:.3f} | {on / off:.2f} |", flush=True)


if __name__ == "__main__":
    main()
