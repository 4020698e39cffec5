"""Check, then time, the frag kernel at 2 bits against folded, the 2-bit dispatcher default.

    python3 benchmarks/frag_2bit.py

1. Check: frag at 2 bits for groups 32, 64 and 128, GQA 1, 4 and 8, batch 1 and 2, three
   splits of the residual (none, short, long), outputs poisoned with NaN first and
   checked fully written, float32 output against the float32 reference: rel err < 1e-3.
2. Table: chained calls (each call's queries the previous output), frag and folded at 2
   bits, group 32 and 64, contexts 4k and 32k, batch 1 and 8: us per call, frag / folded.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fused_attention as fa  # noqa: E402
import kernels_extra as kx  # noqa: E402

kd = kx.kd
D = 128


def check() -> bool:
    ok_all = True
    for G in (32, 64, 128):
        for R in (1, 4, 8):
            for B in (1, 2):
                for n_kq, n_kres, n_vres in ((2048, 0, 0), (4096, 17, 128), (1024, 127, 300)):
                    K, V = fa.random_kv(B, 2, n_kq + n_kres, D, mx.float16)
                    cache = fa.make_cache(K, V, n_kres, n_vres, 2, G)
                    q = mx.random.normal((B, 2 * R, 1, D)).astype(mx.float16)
                    kw = dict(scale=D**-0.5, bits=2, group_size=G)
                    ref = kd.kivi_decode_attention_reference(q.astype(mx.float32), *cache, **kw)
                    out = kx.attention(q, *cache, **kw, algo="frag", out_dtype=mx.float32, poison=True)
                    e = fa.rel_err(out, ref)
                    ok = bool(mx.all(mx.isfinite(out)).item()) and e < 1e-3
                    ok_all &= ok
                    fa.log(f"  2-bit frag G {G:3d} gqa {R} B {B} n_kq {n_kq} n_kres {n_kres} "
                           f"n_vres {n_vres}: rel err {e:.1e} {'ok' if ok else 'FAIL'}")
    return ok_all


def table() -> list[str]:
    rows = ["| group | context | batch | frag chained (us) | folded chained (us) | frag / folded |",
            "|---:|---:|---:|---:|---:|---:|"]
    for G in (32, 64):
        for T in (4096, 32768):
            for B in (1, 8):
                sets, _ = fa.timing_sets(B, T, 2, G)
                kw = dict(scale=D**-0.5, bits=2, group_size=G)
                times = {}
                for algo in ("frag", "folded"):
                    step = lambda q, i, a=algo: kx.attention(q, *sets[i % len(sets)][1], **kw, algo=a)
                    times[algo] = fa.time_chain(step, len(sets), sets[0][0])[0] * 1e6  # (median, spread)
                rows.append(f"| {G} | {T} | {B} | {times['frag']:.1f} | {times['folded']:.1f} | "
                            f"{times['frag'] / times['folded']:.2f} |")
                fa.log(rows[-1])
    return rows


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    ok = check()
    rows = table()
    text = "\n".join(rows)
    print(f"\ncheck: {'all passed' if ok else 'FAILED'}\n\n{text}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "frag_2bit.md").write_text(text + "\n")
    raise SystemExit(0 if ok else 1)
