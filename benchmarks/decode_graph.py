"""Node counts of one steady-state decode step per method, per layer as a ratio to the full
cache's, each step built and counted as MLX's CUDA back-end builds it (issue 30's CPU
guard: tests/decode_steps.steps_as_on_cuda), and the cache operations generate_step's loop leaves unevaluated.

    MLX_DEFAULT_DEVICE=cpu .venv/bin/python benchmarks/decode_graph.py > benchmarks/notes/decode_graph.md
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from decode_steps import decode_guards, per_layer_ratio, step_graph  # noqa: E402
from veloxquant_mlx.registry import implemented_methods  # noqa: E402


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    warnings.simplefilter("ignore")
    full = step_graph("full")
    print("# Decode-step graph size (tiny llama, 2 layers, CPU)\n")
    print("Command: `MLX_DEFAULT_DEVICE=cpu .venv/bin/python benchmarks/decode_graph.py`\n")
    print(textwrap.dedent("""\
        Each method at its compressing settings of tests/conformance.py, a 200-token prompt,
        4 warm-up steps, 40 steps run as mlx-lm's generate_step runs them, then 40 steps each
        built from an evaluated state, as MLX's CUDA back-end builds them (fused operations and
        kernel launches one node each, the package's GPU paths). *nodes*: operations in the
        step's graph (the next token, its log-probabilities and every cache array it leaves
        unevaluated; median of the 40, whole model); *max*: the largest of the 40 (a flush, an
        eviction, a refit); *ratio*, *max ratio*: per layer, to the full cache's steady step,
        the nodes outside the layers taken out; *extra / layer*: nodes beyond the full cache's
        per layer. *pending*: cache operations the overlapped loop leaves unevaluated after 10,
        20 and 30 of its steps; growing from one to the next is a lazy graph that lengthens
        every step. *graphs*: distinct graph structures among the 40 (operations in order
        and edges: what MLX's CUDA back-end keys its cached graphs by; steady steps build
        one). *host reads*: the sync detector's findings (tests/test_decode_step_guards.py).
        """))
    print("| method | nodes | max | ratio | max ratio | extra / layer | pending | grows | graphs | host reads |")
    print("|---|---:|---:|---:|---:|---:|---|---|---:|---|")
    for method in implemented_methods():
        reads, g = decode_guards(method)
        where = ", ".join(sorted({str(r) for r in reads})) or "-"
        print(f"| {method} | {g.nodes} | {g.largest} | {per_layer_ratio(method):.2f} | "
              f"{per_layer_ratio(method, largest=True):.2f} | {(g.nodes - full.nodes) / g.layers:+.0f} | {'/'.join(map(str, g.pending))} | "
              f"{'yes' if g.grows else ''} | {len(set(g.structures))} | {where} |")


if __name__ == "__main__":
    main()
