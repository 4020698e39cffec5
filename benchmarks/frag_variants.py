"""A/B of the frag kernel's build options on one GPU, in one process.

The timing noise of the H200 between runs (the same configuration at 164 and 198 us in
one run of fused_attention.py) hides 5-15% effects, so the variants are checked and
then timed in interleaved rounds (every variant once per round, the median over rounds
reported next to the baseline's of the same rounds). Even so, runs disagreed; the
figures this session relied on come from Nsight Compute, whose clocks are locked:
``--profile`` runs each variant a few times for it to attach to, and ``--ncu-csv``
tabulates its CSV (same ``--variants``, ``--shapes`` and ``--calls``). ``--overheads``
times the whole call against its main kernel alone and MLX's one-kernel floor:

    python3 benchmarks/frag_variants.py --check --rounds 7 --overheads
    python3 benchmarks/frag_variants.py --rounds 5 --chained
    python3 benchmarks/frag_variants.py --check --long --rounds 0 --variants "1,6,528 2,6,528"
    ncu --kernel-name regex:frag --csv --metrics gpu__time_duration.sum,\\
        sm__cycles_active.avg,sm__cycles_elapsed.avg,smsp__inst_executed.sum \\
        python3 benchmarks/frag_variants.py --profile --calls 3 > ncu.csv
    python3 benchmarks/frag_variants.py --ncu-csv ncu.csv --calls 3

A variant is ``keep,min_blocks,target`` (KEEP of the frag kernel, its launch-bound
blocks per SM, its split target); ``--variants`` takes them separated by
spaces, the first being the baseline.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fused_attention as fa  # noqa: E402  (loads the kernels module on its own)
import mlx.core as mx  # noqa: E402

kd, kx = fa.kd, fa.kx
DEFAULT_VARIANTS = "1,6,792 0,6,792 3,6,792 1,5,660"
CHECK_CASES = [  # bits, group, gqa, n_kq (a multiple of the group), n_kres, n_vres
    (4, 64, 4, 4992, 37, 131), (4, 32, 8, 2976, 64, 128), (4, 128, 1, 4096, 1, 300),
    (8, 64, 4, 2944, 17, 128), (8, 128, 3, 1920, 64, 64), (2, 32, 4, 2048, 5, 33),
    (2, 64, 8, 2944, 64, 128),
]


def parse(v: str):
    try:
        keep, mb, target = (int(x) for x in v.split(","))
    except ValueError:
        raise SystemExit(f"--variants: {v!r} is not keep,min_blocks,target (three integers)")
    if keep not in (0, 1, 2, 3) or mb < 1 or target < 1:
        raise SystemExit(f"--variants: {v!r}: keep must be 0-3, min_blocks and target >= 1")
    return keep, mb, target


def label(v) -> str:
    keep, mb, target = v
    return f"keep {keep}, {mb} blocks/SM, target {target}"


def knobs(v):
    """The frag knobs of kernels_extra for variant v: KEEP, launch bounds (for every
    batch), split target."""
    keep, mb, target = v
    return dict(algo="frag", keep=keep, min_blocks=mb, target_blocks=target)


#: the batch-8 128k shape: with the split target of 64 kv heads (528), 128 tiles a warp
LONG_CASE = (4, 64, 4, 131008, 64, 128, 8, 8)


def check(variants, long=False) -> bool:
    """Every case for the first variant and those with another KEEP (the arithmetic), the
    first two for those that only change the schedule (launch bounds, split target); with
    ``long``, LONG_CASE too (every variant: KEEP's error grows with a warp's tiles)."""
    ok_all = True
    cases = [(*c, 2, 2) for c in CHECK_CASES] + ([LONG_CASE] if long else [])
    for n, (bits, G, R, n_kq, n_kres, n_vres, B, H) in enumerate(cases):
        D = 128
        n = 0 if n >= len(CHECK_CASES) else n
        K, V = fa.random_kv(B, H, n_kq + n_kres, D, mx.float16)
        cache = fa.make_cache(K, V, n_kres, n_vres, bits, G)
        q = mx.random.normal((B, H * R, 1, D)).astype(mx.float16)
        kw = dict(scale=D ** -0.5, bits=bits, group_size=G)
        ref = kd.kivi_decode_attention_reference(q.astype(mx.float32), *cache, **kw)
        mx.eval(ref)
        errs = []
        for v in variants:
            if n >= 2 and v[0] == variants[0][0] and v != variants[0]:
                errs.append("   -   ")
                continue
            out = kx.attention(q, *cache, **kw, **knobs(v), out_dtype=mx.float32, poison=True)
            mx.eval(out)
            e = fa.rel_err(out, ref)
            ok = bool(mx.all(mx.isfinite(out)).item()) and e < 1e-3
            ok_all &= ok
            errs.append(f"{e:.1e}{'' if ok else ' FAIL'}")
        fa.log(f"  bits {bits} G {G:3d} gqa {R} n_kq {n_kq} B {B} H {H}: " + "  ".join(errs))
    return ok_all


def shapes_data(B, T, bits=4, G=64, D=128):
    sets, nbytes = fa.timing_sets(B, T, bits, G, D=D)
    return sets, nbytes, dict(scale=D ** -0.5, bits=bits, group_size=G)


def main_kernel_only(q, cache, kw, v):
    """Variant v's frag launch without the merge kernel (lazy)."""
    keep, mb, target = v
    main = kx.main_kernel("cuda", "frag", mb)
    return kx.frag_call(main, q, cache, **kw, target_blocks=target, keep=keep)[0][0]


def overheads(v, shapes, reps=5):
    """Variant v's whole call (its KEEP and launch bounds, the dispatcher's split target)
    against its main kernel alone and MLX's floor for a one-kernel op."""
    fa.log("\nwhere a call's time goes (first variant; medians of %d)" % reps)
    v = (v[0], v[1], None)
    for B, T, bits in shapes:
        sets, _, kw = shapes_data(B, T, bits)
        full, main = [], []
        for _ in range(reps):
            full.append(fa.time_batches(lambda i: kx.attention(
                sets[i][0], *sets[i][1], **kw, **knobs(v)), len(sets), reps=3)[0])
            main.append(fa.time_batches(lambda i: main_kernel_only(
                sets[i][0], sets[i][1], kw, v), len(sets), reps=3)[0])
        floor = fa.call_floor()
        fa.log(f"  {bits}-bit B={B} T={T}: whole call {statistics.median(full) * 1e6:.1f} us, "
               f"main kernel alone {statistics.median(main) * 1e6:.1f} us, one-kernel floor "
               f"{floor * 1e6:.1f} us")
        del sets


def time_rounds(variants, shapes, rounds, chained=False):
    for B, T, bits in shapes:
        sets, nbytes, kw = shapes_data(B, T, bits)
        times = {v: [] for v in variants}
        for r in range(rounds):
            for v in variants:
                if chained:
                    s, _ = fa.time_chain(lambda q, i: kx.attention(
                        q, *sets[i][1], **kw, **knobs(v)), len(sets), sets[0][0], reps=3)
                else:
                    s, _ = fa.time_batches(lambda i: kx.attention(
                        sets[i][0], *sets[i][1], **kw, **knobs(v)), len(sets), reps=3)
                times[v].append(s)
        base = statistics.median(times[variants[0]])
        fa.log(f"\n{bits}-bit B={B} T={T}: median / min of {rounds} interleaved rounds"
               + (", chained calls" if chained else ""))
        fa.log("| variant | median (us) | min (us) | GB/s | vs first |")
        fa.log("|---|---:|---:|---:|---:|")
        for v in variants:
            med = statistics.median(times[v])
            fa.log(f"| {label(v)} | {med * 1e6:.1f} | {min(times[v]) * 1e6:.1f} | "
                   f"{nbytes / med / 1e9:.0f} | {base / med:.3f}x |")
        del sets


def profile(variants, shapes, calls):
    for B, T, bits in shapes:
        sets, _, kw = shapes_data(B, T, bits)
        for v in variants:
            for _ in range(calls):
                mx.eval(kx.attention(sets[0][0], *sets[0][1], **kw, **knobs(v)))
            mx.synchronize()
            fa.log(f"profiled: {bits}-bit B={B} T={T} {label(v)} x {calls}")
        del sets


def ncu_summary(path, variants, shapes, calls):
    """Median gpu__time_duration (and SM-active share, instructions) per variant and shape
    from the CSV of an ``ncu --csv ... --profile`` run of this script."""
    import csv
    rows = [r for r in csv.reader(open(path)) if r]
    hdr = next(r for r in rows if r[0] == "ID")
    by_id = {}
    for r in rows:
        if len(r) == len(hdr) and r[0] != "ID":
            d = dict(zip(hdr, r))
            by_id.setdefault(int(d["ID"]), {})[d["Metric Name"]] = float(
                d["Metric Value"].replace(",", ""))
    ids = sorted(by_id)
    n = 0
    for B, T, bits in shapes:
        fa.log(f"\n{bits}-bit B={B} T={T} (ncu, clocks locked)")
        fa.log("| variant | kernel (us) | SMs active | M warp-instr. | vs first |")
        fa.log("|---|---:|---:|---:|---:|")
        base = None
        for v in variants:
            ms = [by_id[i] for i in ids[n:n + calls]]
            n += calls
            t = statistics.median(m["gpu__time_duration.sum"] for m in ms) / 1e3
            act = statistics.median(m.get("sm__cycles_active.avg", 0) / m.get(
                "sm__cycles_elapsed.avg", 1) for m in ms)
            ins = statistics.median(m.get("smsp__inst_executed.sum", 0) for m in ms) / 1e6
            base = base or t
            fa.log(f"| {label(v)} | {t:.1f} | {act:.0%} | {ins:.1f} | {base / t:.3f}x |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--shapes", default="1,32768,4 8,32768,4",
                    help="batch,context,bits triples separated by spaces")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--long", action="store_true", help="--check: also LONG_CASE")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--overheads", action="store_true")
    ap.add_argument("--chained", action="store_true",
                    help="time chains (each call's queries the previous output) in --rounds")
    ap.add_argument("--ncu-csv", default=None, help="summarize this ncu CSV of --profile")
    args = ap.parse_args()
    variants = [parse(v) for v in args.variants.split()]
    try:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split()]
    except ValueError:
        shapes = []
    if not shapes or any(len(sh) != 3 or sh[2] not in (2, 4, 8) for sh in shapes):
        raise SystemExit(f"--shapes: {args.shapes!r} is not batch,context,bits triples "
                         "(bits 2, 4 or 8) separated by spaces")
    if args.ncu_csv:
        ncu_summary(args.ncu_csv, variants, shapes, args.calls)
        return
    mx.set_default_device(mx.gpu)
    if args.profile:
        profile(variants, shapes, args.calls)
        return
    if args.check:
        fa.log("check, float32-output relative error per variant (bound 1e-3):")
        fa.log("  variants: " + " | ".join(label(v) for v in variants))
        if not check(variants, args.long):
            fa.log("check FAILED")
    if args.rounds:
        time_rounds(variants, shapes, args.rounds, args.chained)
    if args.overheads:
        overheads(variants[0], shapes)


if __name__ == "__main__":
    main()
