"""The fused KIVI kernel at short contexts, batch 1: its split target against fp16 SDPA.

ncu put the frag kernel at 115 us a layer at 4k against SDPA's 28
(notes/decode_kernels.md), while at 32k it runs at about SDPA's speed. This sweeps the
frag kernel's split target (``FRAG_TARGET_BLOCKS``; the short-context rule off) per context. Each plan is first
checked against the float32 reference; then calls are timed chained (each call's queries
are the previous call's output, as a decode step's layers are).

    python benchmarks/kivi_short_context.py --contexts 1024 4096 16384 --targets 792 396 264 132
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fused_attention as fa  # noqa: E402  (sets MLX_ENABLE_TF32=0 before mlx loads)

mx, kd = fa.mx, fa.kd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 32768])
    ap.add_argument("--targets", type=int, nargs="+", default=[792, 528, 396, 264, 132])
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    ap.add_argument("--group", type=int, default=32)
    args = ap.parse_args()
    B, H, R, D = 1, 8, 4, 128
    scale = D ** -0.5
    default, short = kd.FRAG_TARGET_BLOCKS, kd.FRAG_TARGET_BLOCKS_SHORT
    rows = ["| context | bits | fp16 SDPA us | " + " | ".join(
        f"target {t} us" for t in args.targets) + " | best vs SDPA |",
            "|---:|---:|---:|" + "---:|" * len(args.targets) + "---:|"]
    for t_ctx in args.contexts:
        raw = []
        for _ in range(fa.n_sets_for(2 * B * H * t_ctx * D * 2)):
            K, V = fa.random_kv(B, H, t_ctx, D, mx.float16)
            q = mx.random.normal((B, H * R, 1, D)).astype(mx.float16)
            mx.eval(K, V, q)
            raw.append((q, K, V))
        sdpa, _ = fa.time_chain(lambda q, i: mx.fast.scaled_dot_product_attention(
            q, raw[i][1], raw[i][2], scale=scale), len(raw), raw[0][0])
        for bits in args.bits:
            sets = []
            for q, K, V in raw:
                c = fa.make_cache(K, V, 64, 128, bits, args.group, spare=False)
                mx.eval(*[a for a in c if isinstance(a, mx.array)])
                sets.append(c)
            times = []
            for target in args.targets:
                kd.FRAG_TARGET_BLOCKS, kd.FRAG_TARGET_BLOCKS_SHORT = target, {}
                try:
                    q = raw[0][0]
                    out = kd.kivi_decode_attention(q, *sets[0], scale=scale, bits=bits, group_size=args.group)
                    ref = kd.kivi_decode_attention_reference(q, *sets[0], scale=scale, bits=bits,
                                                             group_size=args.group)
                    err = fa.rel_err(out, ref)
                    if not err < 2e-2:
                        raise AssertionError(f"relative error {err:.2e} against the float32 reference")
                    s, _ = fa.time_chain(lambda q, i: kd.kivi_decode_attention(
                        q, *sets[i], scale=scale, bits=bits, group_size=args.group), len(sets), q)
                    times.append(s)
                except Exception as exc:  # a plan the kernel refuses: shown, not fatal
                    print(f"  T={t_ctx} bits={bits} target={target}: {exc}", flush=True)
                    times.append(float("nan"))
                finally:
                    kd.FRAG_TARGET_BLOCKS, kd.FRAG_TARGET_BLOCKS_SHORT = default, short
            best = min((x for x in times if x == x), default=float("nan"))
            rows.append(f"| {t_ctx} | {bits} | {sdpa * 1e6:.1f} | "
                        + " | ".join(f"{x * 1e6:.1f}" for x in times) + f" | {sdpa / best:.2f}x |")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
