"""Which CUDA graphs a decode step commits, and whether the next steps meet them again.

MLX's CUDA back-end records a stream's kernels into a graph, commits it every 100 nodes, and
looks the graph up in a cache keyed by its structure (node kinds, child graphs' nodes,
edges): a graph whose key was not seen before is instantiated, a millisecond-scale cost
(``notes/cuda_graphs.md``). This runs one method's decode steps one at a time
(``MLX_SAVE_CUDA_GRAPHS_DOT_FILE`` set: MLX writes every committed graph), and reports per
step how many graphs it committed and how many of their structures no earlier decode
step had. A structure is each node's label with addresses, node and graph numbers removed, in
order, plus the edges. Steady steps whose graphs keep being new pay an instantiation each.
A window that grows after the prompt, or flushes every 32 steps, meets its structures once
and then again: ``--warm`` steps count them as seen before the steady steps are counted.

    MLX_SAVE_CUDA_GRAPHS_DOT_FILE=/tmp/g/cg python benchmarks/cuda_graph_structures.py \
        --preset llama3-8b --layers 4 --context 4096 --steps 48 --method cachegen
(one process per method: MLX reads the variable once)
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode as bench  # noqa: E402  (imports veloxquant_mlx before mlx)

import mlx.core as mx  # noqa: E402

# addresses, node numbers and graph numbers (a cluster's label, a child graph's node) differ
# between two commits of the same structure
_NOISE = re.compile(r"0x[0-9a-fA-F]+|graph_\d+(?:_node_\d+)?|\bnode_\d+\b|\b\d+\\n")


def structure(path: str) -> tuple[str, str, list[str]]:
    """(a digest of the graph's structure, a digest of its node kinds alone, its kernels'
    names in order) from a dot file. The first holds each node's label (a kernel's name); the
    second only each node's kind (a kernel, a child graph, ...) in order, and the edges: the
    coarser key MLX looks its instantiated graphs up by, where a hit is patched in place."""
    text = open(path, errors="replace").read()
    # plain ("...") or HTML (<...>) labels, whichever the CUDA version writes
    found = re.findall(r'label\s*=\s*(?:"((?:[^"\\]|\\.)*)"|<(.*?)>\s*[\],;])', text, flags=re.S)
    labels = [_NOISE.sub("", a or b) for a, b in found]
    edges = len(re.findall(r"->", text))
    kernels = [m.replace("\\n", " | ")[:160] for m in labels if m]
    digest = hashlib.sha1(("\n".join(labels) + f"|{edges}").encode()).hexdigest()[:12]
    kinds = re.findall(r'shape\s*=\s*"?(\w+)', text)
    kinds_digest = hashlib.sha1((" ".join(kinds) + f"|{edges}").encode()).hexdigest()[:12]
    return digest, kinds_digest, kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=list(bench.PRESETS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--warm", type=int, default=0,
                    help="steps whose graphs count as seen but not as steady (a window's growths after the "
                         "prompt, the first flush: decode.py runs 64 before it times); 0: the first third")
    ap.add_argument("--method", required=True)
    ap.add_argument("--keep", type=int, default=6, help="dot files of the first decode steps kept (for reading)")
    ap.add_argument("--out", required=True, help="a JSON file; kept dot files go beside it")
    args = ap.parse_args()
    prefix = os.environ.get("MLX_SAVE_CUDA_GRAPHS_DOT_FILE")
    if not prefix:
        ap.error("set MLX_SAVE_CUDA_GRAPHS_DOT_FILE=<dir>/<prefix> (MLX reads it once, at its first commit)")
    if args.method in bench.implemented_methods():
        bench.METHODS.setdefault(args.method, bench.KVCacheConfig(method=args.method))
    model = bench.build_model(args.preset, mx.float16, args.layers)
    cache, y, _ = bench.start(model, bench.METHODS[args.method], args.context, prefill_repeats=1)
    mx.eval(y)

    def written():
        return set(glob.glob(f"{prefix}_*.dot"))

    seen_before = written()
    for f in seen_before:
        os.remove(f)
    known, known_kinds, steps, kept = {}, {}, [], Path(args.out).with_suffix("")
    kept.mkdir(parents=True, exist_ok=True)
    for i in range(args.warm + args.steps):
        y, _ = bench.step(model, cache, y)  # evaluated: its commits are its own
        files = sorted(written(), key=lambda f: int(re.search(r"_(\d+)\.dot$", f).group(1)))
        keys, kind_keys = [], []
        for f in files:
            digest, kinds, kernels = structure(f)
            keys.append(digest)
            kind_keys.append(kinds)
            known.setdefault(digest, {"first_step": i, "kernels": kernels})
            known_kinds.setdefault(kinds, i)
            if i < args.keep:
                os.replace(f, kept / f"step{i:02d}_{Path(f).name}")
            else:
                os.remove(f)
        new = sum(1 for k in keys if known[k]["first_step"] == i)
        new_kinds = sum(1 for k in kind_keys if known_kinds[k] == i)
        steps.append({"step": i, "graphs": len(keys), "new": new, "new_by_kind": new_kinds, "keys": keys,
                      "kind_keys": kind_keys})
        print(f"step {i:3d}: {len(keys):3d} graphs, {new:3d} new, {new_kinds:3d} new by kind", flush=True)
    steady = steps[args.warm:] if args.warm else steps[len(steps) // 3:]
    where = f"after {args.warm} warm steps" if args.warm else "in the last two thirds"
    report = {"method": args.method, "preset": args.preset, "layers": args.layers, "context": args.context,
              "warm": args.warm, "graphs_a_step": [s["graphs"] for s in steps], "new_a_step": [s["new"] for s in steps],
              "distinct": len(known), "distinct_by_kind": len(known_kinds),
              "steady_new_share": sum(s["new"] for s in steady) / max(1, sum(s["graphs"] for s in steady)),
              "steady_new_by_kind_share": sum(s["new_by_kind"] for s in steady) / max(1, sum(s["graphs"] for s in steady)),
              "steps": steps, "structures": known}
    Path(args.out).write_text(json.dumps(report))
    print(f"{args.method}: {len(known)} distinct graphs over {args.warm + args.steps} steps ({len(known_kinds)} by node "
          f"kinds); {where} {report['steady_new_share']:.0%} of committed graphs were new "
          f"({report['steady_new_by_kind_share']:.0%} by node kinds)")


if __name__ == "__main__":
    main()
