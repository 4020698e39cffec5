"""The fused kernel's packed-batch launch (``kivi_decode_attention_rows``, issue 32) on this
machine's GPU: checked against its reference (each sequence attended alone, in float32),
then timed against the per-sequence launches it replaces, at the 8B layer's shape (32
query / 8 KV heads of 128, float16).

Per case, a batch whose sequences hold ``rows`` (n_kq, n_kres, n_vq, n_vres, ring start):
``copies``, every sequence at ``--context`` tokens (serve_capacity.py's batch); ``mixed``,
lengths spread evenly from 1k to ``--context`` (continuous batching). Printed: the largest
relative error per case, then milliseconds for ``--layers`` launches in one evaluation
(a decode step's attention): the packed launch, and one launch per sequence (what the
batch ran before: the dispatcher's kernel on each sequence's own rows). Exit status 1
where an error passes ``--tolerance``.

    python benchmarks/check_kivi_rows.py --bits 4 --batch 29 --context 32768   # the device
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import veloxquant_mlx  # noqa: F401  (first: it may load OpenBLAS)
import mlx.core as mx  # noqa: E402

from veloxquant_mlx.kernels import kivi_decode as kd  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompt_mass import timed  # noqa: E402  (median seconds after one warm-up call)


def sequence_rows(length: int, group: int, window: int, ring: int):
    """KIVI's split of ``length`` tokens: keys packed by whole groups with 1..group in the
    window, values packed past a ``window``-token window (its ring turned by ``ring``)."""
    n_kres = (length - 1) % group + 1
    n_vres = min(window, length)
    return (length - n_kres, n_kres, length - n_vres, n_vres, ring)


def cases(batch: int, context: int, group: int, window: int):
    copies = tuple(sequence_rows(context, group, window, 5) for _ in range(batch))
    lengths = [1024 + (context - 1024) * i // max(batch - 1, 1) for i in range(batch)]
    mixed = tuple(sequence_rows(n + i, group, window, (7 * i) % window) for i, n in enumerate(lengths))
    return {"copies": copies, "mixed": mixed}


def per_sequence(queries, buffers, rows, kw):
    """The launches the batch ran before: the dispatcher's kernel on each sequence alone."""
    kc, ks, kb, kr, vc, vs, vb, vr = buffers
    outs = []
    for b, (n_kq, n_kres, n_vq, n_vres, ring) in enumerate(rows):
        one = slice(b, b + 1)
        v_win = vr[one][:, :, (ring + mx.arange(n_vres)) % vr.shape[2]]  # alone: from row 0
        outs.append((queries[one], kc[one], ks[one], kb[one], n_kq, kr[one], n_kres, vc[one],
                     vs[one], vb[one], n_vq, mx.contiguous(v_win), n_vres))
    mx.eval(outs)
    return lambda: [kd.kivi_decode_attention(*a, **kw) for a in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--window", type=int, default=128, help="value window rows (KIVI's residual)")
    ap.add_argument("--batch", type=int, default=29)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32, help="launches timed in one evaluation")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tolerance", type=float, default=kd.self_check_tolerance(mx.float16))
    ap.add_argument("--sweep", nargs="*", default=[], metavar="TARGET:MIN_BLOCKS",
                    help="then time the copies' packed launch at these split targets and launch "
                         "bounds of frag's many-heads calls (FRAG_TARGET_BLOCKS_MANY_HEADS, "
                         "FRAG_MIN_BLOCKS_MANY_HEADS)")
    ap.add_argument("--launch-only", action="store_true",
                    help="only launch the copies' packed kernel a few times (for ncu)")
    args = ap.parse_args()
    kw = dict(scale=128 ** -0.5, bits=args.bits, group_size=args.group)
    if args.launch_only:
        rows = cases(args.batch, args.context, args.group, args.window)["copies"]
        queries, buffers = kd.rows_case(128, 4, args.bits, args.group, mx.float16, rows=rows,
                                        n_kv_heads=8, value_room=args.window // 4)
        for _ in range(3):
            mx.eval(kd.kivi_decode_attention_rows(queries, *buffers, rows, **kw))
        return 0
    failed = False
    print(f"{mx.default_device()} MLX {mx.__version__}; {args.bits}-bit group {args.group}, "
          f"batch {args.batch}, context {args.context}")
    print("| case | max rel error | packed launch ms | per-sequence launches ms | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, rows in cases(args.batch, args.context, args.group, args.window).items():
        queries, buffers = kd.rows_case(128, 4, args.bits, args.group, mx.float16, rows=rows,
                                        n_kv_heads=8, value_room=args.window // 4)
        mx.eval(queries, buffers)
        out = kd.kivi_decode_attention_rows(queries, *buffers, rows, **kw)
        if out is None:
            print(f"| {name} | no packed launch here |||")
            return 1
        ref = kd.kivi_decode_attention_rows_reference(queries, *buffers, rows, **kw)
        error = (mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max()
                 / mx.abs(ref.astype(mx.float32)).max()).item()
        failed |= not error <= args.tolerance
        del ref
        packed = timed(lambda: [kd.kivi_decode_attention_rows(queries, *buffers, rows, **kw)
                                for _ in range(args.layers)], args.repeats)
        one_step = per_sequence(queries, buffers, rows, kw)
        alone = timed(lambda: [one_step() for _ in range(args.layers)], args.repeats)
        print(f"| {name} | {error:.2e} | {packed * 1e3:.2f} | {alone * 1e3:.2f} | "
              f"{alone / packed:.2f}x |", flush=True)
        mx.clear_cache()
    if args.sweep:
        rows = cases(args.batch, args.context, args.group, args.window)["copies"]
        queries, buffers = kd.rows_case(128, 4, args.bits, args.group, mx.float16, rows=rows,
                                        n_kv_heads=8, value_room=args.window // 4)
        mx.eval(queries, buffers)
        print("\n| split target | blocks an SM | packed launch ms |\n|---:|---:|---:|")
        for point in args.sweep:
            target, min_blocks = map(int, point.split(":"))
            kd.FRAG_TARGET_BLOCKS_MANY_HEADS, kd.FRAG_MIN_BLOCKS_MANY_HEADS = target, min_blocks
            packed = timed(lambda: [kd.kivi_decode_attention_rows(queries, *buffers, rows, **kw)
                                    for _ in range(args.layers)], args.repeats)
            print(f"| {target} | {min_blocks} | {packed * 1e3:.2f} |", flush=True)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
