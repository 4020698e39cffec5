"""Memory a batch holds step after step: active memory after each decode step of a batch
(copies of one prefilled prompt, merged as ``serve_capacity.py`` merges them, each step's
tokens evaluated as mlx-lm's batch loop evaluates them), against what its caches say they
hold (``nbytes``). A layout that leaves a step's writes lazy grows here while its
``nbytes`` stays flat (tests/test_batch_lazy_state.py is the CPU guard).

    python benchmarks/batch_step_memory.py --preset tiny --batch 16 --context 4096 \
        --methods "keyformer 2048" "snapkv 2048"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from veloxquant_mlx import KVCacheConfig  # noqa: E402  first: it may load OpenBLAS

import mlx.core as mx  # noqa: E402

import serve_capacity as sc  # noqa: E402
from decode import PRESETS, build_model, make_cache  # noqa: E402
from veloxquant_mlx.bench.runner import prefill  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", choices=list(PRESETS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--methods", nargs="+", required=True,
                    help="serve_capacity.py's row names, or method keys at their defaults")
    args = ap.parse_args()
    model = build_model(args.preset, mx.float16)
    tokens = mx.random.randint(0, model.args.vocab_size, (args.context,), key=mx.random.key(1))
    print(f"# {args.preset}, {args.batch} copies of a {args.context}-token prompt, {mx.default_device()}: "
          "MB held past the batch's start after each decode step\n")
    print("| cache | nbytes MB | " + " | ".join(f"step {i}" for i in range(1, args.steps + 1)) + " |")
    print("|---|---:|" + "---:|" * args.steps)
    for name in args.methods:
        config = sc.METHODS.get(name) or KVCacheConfig(method=name)
        cache = make_cache(model, config)
        logits = prefill(model, cache, tokens)
        batch = sc.batched([cache], args.batch)
        del cache
        mx.eval([c.state for c in batch])
        base = mx.get_active_memory()
        y, held = mx.stack([mx.argmax(logits)] * args.batch), []
        for _ in range(args.steps):
            y = mx.argmax(model(y[:, None], cache=batch)[:, -1], axis=-1)
            mx.eval(y)
            held.append((mx.get_active_memory() - base) / 1e6)
        nbytes = sum(c.nbytes for c in batch) / 1e6
        print(f"| {name} | {nbytes:.1f} | " + " | ".join(f"{m:.1f}" for m in held) + " |", flush=True)


if __name__ == "__main__":
    main()
