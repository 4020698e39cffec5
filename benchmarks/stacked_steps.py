"""A batch's decode step, stacked (``cache/stacked.py``) against per sequence, per method.

Copies of one prefilled prompt are merged into a batch as ``serve_capacity.py`` merges them
(``batched``) and decoded the way ``generate_step`` runs steps (``overlapped``), once with
the stacked layout and once per sequence, in one process; the table gives ms a step. A
method that batches per sequence is made to stack for the measurement (its rows must
not mix: tests/test_stacked_batches.py's check).

    python benchmarks/stacked_steps.py --preset tiny --batch 8 --context 4096 \
        --methods kitty spectral turboquant

``--peak``: also the peak memory of the timed steps above what the batch holds before them
(``mx.get_peak_memory``), MB, for each layout.
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
from veloxquant_mlx.cache import batch as batch_module  # noqa: E402


def step_ms(model, cache, logits, n: int, stacked: bool, steps: int) -> tuple[float, float]:
    """ms a step of ``n`` copies of ``cache``: stacked (a method that batches per sequence is
    made to stack for the measurement, as ``batchable = "stacked"`` would), or per sequence;
    and the timed steps' peak memory above what the batch held before them, MB."""
    cls = type(cache[0])
    declared = cls.__dict__.get("batchable")
    if stacked:
        cls.batchable = "stacked"
    batch_module.packer_for = sc._packer_for if stacked else (lambda cls: None)
    try:
        batch = sc.batched([cache], n)
        y = mx.stack([mx.argmax(logits)] * n)
        y, _ = sc.overlapped(model, batch, y, 2)  # packs the batch, first-use work
        assert all(c.mode == ("packed" if stacked else "per_sequence") for c in batch)
        mx.eval(y, [c.state for c in batch])
        held = mx.get_active_memory()
        mx.reset_peak_memory()
        ms = sc.overlapped(model, batch, y, steps)[1] * 1e3
        return ms, (mx.get_peak_memory() - held) / 1e6
    finally:
        batch_module.packer_for = sc._packer_for
        cls.batchable = declared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", choices=list(PRESETS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--methods", nargs="+", required=True)
    ap.add_argument("--peak", action="store_true", help="also each layout's peak memory above what it holds")
    args = ap.parse_args()
    model = build_model(args.preset, mx.float16)
    tokens = mx.random.randint(0, model.args.vocab_size, (args.context,), key=mx.random.key(1))
    print(f"# {args.preset}, {args.batch} copies of a {args.context}-token prompt, {mx.default_device()}, "
          f"ms a decode step ({args.steps} steps run as generate_step runs them)\n")
    peak = " | stacked peak MB | per sequence peak MB | stacked / per sequence" if args.peak else ""
    print(f"| method | stacked | per sequence | per sequence / stacked{peak} |\n|---|---:|---:|---:|"
          + "---:|---:|---:|" * args.peak)
    for method in args.methods:
        cache = make_cache(model, KVCacheConfig(method=method))
        logits = prefill(model, cache, tokens)
        stacked, stacked_mb = step_ms(model, cache, logits, args.batch, True, args.steps)
        alone, alone_mb = step_ms(model, cache, logits, args.batch, False, args.steps)
        peak = f" {stacked_mb:.1f} | {alone_mb:.1f} | {stacked_mb / alone_mb:.2f}x |" if args.peak else ""
        print(f"| {method} | {stacked:.1f} | {alone:.1f} | {alone / stacked:.2f}x |{peak}", flush=True)


if __name__ == "__main__":
    main()
