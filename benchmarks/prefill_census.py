"""What each method's prefill asks of a GPU, counted on the CPU: graph nodes and host reads
per prompt chunk and layer (issue 31).

On a GPU a prefill chunk's time past the model's own is launches and waits: each graph
node is a kernel launch, and each host read of an array value (``.item()``, ``int()``,
numpy, ``mx.eval`` from package code) drains the queue and stalls until the GPU catches up.
Neither needs a GPU to count: the chunks are built as MLX's CUDA back-end builds them
(``tests/decode_steps.steps_as_on_cuda``: fused operations and kernel launches one node
each, the package's GPU paths taken), on the conformance suite's tiny llama under each
method's compressing settings (budgets of 48 tokens, a 200-token prompt), fed as
``generate_step`` feeds a prompt (chunks of ``--chunk`` tokens, the caches' state evaluated
after each). The values computed meanwhile are wrong; only counts are read.

Columns: kernels a chunk and layer (graph nodes less the views: reshapes, broadcasts,
slices; median over the chunks), as a ratio to the ``full`` cache's; the largest chunk's (the first fit, say); host reads over the whole prefill a
layer, and where the most frequent ones come from. These rank methods; the GPU figures
come from ``decode.py --prefill-repeats``.

    python benchmarks/prefill_census.py                      # every method and composition
    python benchmarks/prefill_census.py --methods palu h2o    # some
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

import veloxquant_mlx  # noqa: F401  first: it may load OpenBLAS

import mlx.core as mx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conformance import COMPOSED, PROMPT, config, profile  # noqa: E402
import contextlib  # noqa: E402

import numpy as np  # noqa: E402

import decode_steps  # noqa: E402
from decode_steps import HOST_READS, HostRead, graph_nodes, steps_as_on_cuda  # noqa: E402
from tiny_models import prompt, tiny_model  # noqa: E402
from veloxquant_mlx import make_prompt_cache  # noqa: E402
from veloxquant_mlx.quant.store import end_pacing  # noqa: E402
from veloxquant_mlx.registry import implemented_methods  # noqa: E402


@contextlib.contextmanager
def counting_evaluations():
    """Every evaluation made from package code (a host read, ``mx.eval``, ``mx.async_eval``
    made synchronous) counts the graph nodes it runs before running them; host reads are
    recorded with where they come from. Returns (reads, nodes), nodes a one-item list."""
    reads: list[HostRead] = []
    nodes = [0]
    patches = [(mx.array, name, getattr(mx.array, name)) for name in HOST_READS]
    patches += [(mx, "eval", mx.eval), (mx, "async_eval", mx.async_eval), (np, "array", np.array),
                (np, "asarray", np.asarray)]

    def wrap(label, original, is_read):
        def counted(*args, **kwargs):
            stub = sys._getframe(1).f_code.co_filename == decode_steps.__file__  # a stand-in's own
            where = None if stub else decode_steps._package_frame()
            if where is not None:
                arrays = [a for a in args if isinstance(a, mx.array)]
                arrays += [a for x in args if isinstance(x, (list, tuple)) for a in x if isinstance(a, mx.array)]
                nodes[0] += kernel_nodes(arrays)
                if is_read and arrays:
                    reads.append(HostRead(label, where))
            if label == "mx.async_eval":  # scheduled now and run here: its nodes are counted once
                return mx.eval.__wrapped__(*args, **kwargs)
            return original(*args, **kwargs)

        counted.__wrapped__ = original
        return counted

    try:
        for owner, name, original in patches:
            label = f"numpy.{name}" if owner is np else (f"mx.{name}" if owner is mx else name)
            setattr(owner, name, wrap(label, original, is_read=label not in ("mx.async_eval",)))
        yield reads, nodes
    finally:
        for owner, name, original in patches:
            setattr(owner, name, original)


# primitives that make a view of their input (no kernel on a GPU when the input allows it)
VIEWS = frozenset({"Broadcast", "Reshape", "Squeeze", "ExpandDims", "Transpose", "Flatten", "Unflatten", "Slice",
                   "AsStrided"})


def kernel_nodes(outputs) -> int:
    """``graph_nodes`` less the views (``VIEWS``): what launches a kernel."""
    return graph_nodes(outputs, skip=VIEWS)


def census(method: str, chunk: int, layers: int) -> dict:
    end_pacing()  # no layer of the method before is still paced: its wait is not this one's
    model = tiny_model("llama", num_hidden_layers=layers)
    with steps_as_on_cuda(), counting_evaluations() as (reads, counted):
        cache = make_prompt_cache(model, config(method, profile(method).compressing))
        tokens = prompt(PROMPT)
        nodes, start = [], 0
        while PROMPT - start > 1:
            stop = min(start + chunk, PROMPT - 1)
            counted[0] = 0
            out = model(tokens[start:stop][None], cache=cache)
            built = kernel_nodes([out, *[a for c in cache for a in _state_arrays(c)]])
            nodes.append(counted[0] + built)
            mx.eval.__wrapped__(out, [c.state for c in cache])
            start = stop
    where = collections.Counter(str(r) for r in reads)
    return {"method": method, "chunks": len(nodes), "layers": layers,
            "nodes_per_layer": statistics.median(nodes) / layers, "largest_per_layer": max(nodes) / layers,
            "host_reads_per_layer": len(reads) / layers, "where": where.most_common(4)}


def _state_arrays(cache) -> list:
    state = cache.state
    flat, stack = [], [state]
    while stack:
        item = stack.pop()
        if isinstance(item, mx.array):
            flat.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return flat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=None, help="default: every implemented method and composition")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    methods = args.methods or ["full", *[m for m in implemented_methods() if m != "full"], *COMPOSED]
    rows = []
    full = census("full", args.chunk, args.layers)
    print("| method | kernels a chunk and layer | vs full | largest chunk | host reads a layer | most frequent reads |")
    print("|---|---:|---:|---:|---:|---|")
    for method in methods:
        try:
            row = full if method == "full" else census(method, args.chunk, args.layers)
        except Exception as exc:  # one method's failure must not lose the table
            print(f"| {method} | failed: {type(exc).__name__}: {exc} | | | | |", flush=True)
            continue
        row["vs_full"] = row["nodes_per_layer"] / full["nodes_per_layer"]
        rows.append(row)
        where = "; ".join(f"{n}x {w}" for w, n in row["where"])
        print(f"| {method} | {row['nodes_per_layer']:.0f} | {row['vs_full']:.2f} | {row['largest_per_layer']:.0f} | "
              f"{row['host_reads_per_layer']:g} | {where} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"chunk": args.chunk, "layers": args.layers, "prompt": PROMPT,
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
