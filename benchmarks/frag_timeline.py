"""When each block of the frag kernel starts and ends, and on which SM.

Nsight Compute said the SMs were idle ~30% of the frag kernel's time at batch 8 (every SM,
not a few), which a split plan alone did not explain. This script compiles a copy of the
kernel with two reads of %globaltimer (block start, block end) and %smid, written to an
extra output, runs it on the benchmark shape and prints the spread of starts, ends and
durations of the blocks (those with a tail chunk apart) and how busy each SM was:

    python3 benchmarks/frag_timeline.py --batch 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fused_attention as fa  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

kd, kx = fa.kd, fa.kx
#: CUDA: the GPU's clock (%globaltimer, ns) into the named variable
TIMER = 'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"({}));\n'
_FIRST = "  const int g = lane >> 2;\n"
_T0 = "  unsigned long long vq_t0, vq_tm = 0;\n  " + TIMER.format("vq_t0")
_TILES = "    for (; k < k_end; k += NW) {\n"
_TM = "    " + TIMER.format("vq_tm")
_END = r"""
  __syncthreads();
  if (tid == 0) {
    unsigned long long t1;
    """ + TIMER.format("t1") + r"""    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    const size_t i = ((size_t)bh * NS + split) * 4;
    stamps[i] = vq_t0;
    stamps[i + 1] = t1;
    stamps[i + 2] = sm;
    stamps[i + 3] = vq_tm;
  }
"""


def stamped_kernel(min_blocks):
    """The frag kernel (launch bounds ``min_blocks``) with an extra output ``stamps``: 4
    uint64 a block at (kv head * blocks + block) * 4: start, end (%globaltimer, ns), SM,
    start of the first warp's tiles (after the tail chunks, in blocks with some)."""
    src = kd.CUDA_FRAG_SOURCE
    assert src.count(_FIRST) == 1 and src.count(_TILES) == 1
    src = src.replace(_FIRST, _T0 + _FIRST).replace(_TILES, _TM + _TILES) + _END
    return mx.fast.cuda_kernel(name=f"vq_kivi_decode_frag_stamped_mb{min_blocks}",
                               input_names=kd._INPUT_NAMES,
                               output_names=["o_part", "ml_part", "stamps"],
                               source=src, header=kd.cuda_header(min_blocks))


def stamp_outputs(BH):
    """kernels_extra.frag_call's extra_outputs for a stamped kernel over BH kv heads: its
    stamps."""
    return lambda ns: [((BH * ns * 4,), mx.uint64)]


def run(kernel, q, cache, bits, G, target, keep=None, calls=10):
    """The last of ``calls`` calls' stamps (kv head, block, 4) and the blocks with tail
    chunks."""
    BH = q.shape[0] * cache[0].shape[1]
    # only the last call's stamps are read: MLX's CUDA memory is managed, and a buffer the
    # CPU has read faults back to the GPU when a later call reuses it (blocks that wrote
    # there ran ~5x longer)
    for _ in range(calls):
        outs, ns, tail0, ns_tail = kx.frag_call(
            kernel, q, cache, scale=q.shape[3] ** -0.5, bits=bits, group_size=G,
            target_blocks=target, keep=keep, extra_outputs=stamp_outputs(BH))
        mx.eval(outs)
    return np.array(outs[2]).reshape(BH, ns, 4), slice(tail0, tail0 + ns_tail)


def summarize(st, tails):
    t0 = st[:, :, 0].astype(np.int64)
    t1 = st[:, :, 1].astype(np.int64)
    base = t0.min()
    t0, t1 = (t0 - base) / 1e3, (t1 - base) / 1e3  # us
    end = t1.max()
    fa.log(f"kernel span {end:.1f} us (first block start to last block end)")
    with_tail = np.zeros(st.shape[1], bool)
    with_tail[tails] = True
    for name, sl in (("with tail chunks", with_tail), ("without", ~with_tail)):
        a, b = t0[:, sl].ravel(), t1[:, sl].ravel()
        if a.size == 0:
            continue
        d = b - a
        q = lambda x: "/".join(f"{np.percentile(x, p):.1f}" for p in (0, 10, 50, 90, 100))
        fa.log(f"  {name} blocks ({a.size}): start {q(a)}  end {q(b)}  duration {q(d)} us "
               "(min/p10/median/p90/max)")
    tm = (st[:, tails, 3].astype(np.int64) - base) / 1e3
    if tm.size:
        tail = (tm - t0[:, tails]).ravel()
        fa.log("  time from the block's start to its tiles' start in blocks with tail chunks: "
               + "/".join(f"{np.percentile(tail, p):.1f}" for p in (0, 10, 50, 90, 100)) + " us")
    sm = st[:, :, 2].ravel()
    busy = []
    for s in np.unique(sm):
        m = sm == s
        iv = sorted(zip(t0.ravel()[m], t1.ravel()[m]))
        cov, cur_a, cur_b = 0.0, None, None
        for a, b in iv:  # union of the SM's block intervals
            if cur_b is None or a > cur_b:
                if cur_b is not None:
                    cov += cur_b - cur_a
                cur_a, cur_b = a, b
            else:
                cur_b = max(cur_b, b)
        cov += cur_b - cur_a
        busy.append((cov, m.sum(), max(b for _, b in iv)))
    cov = np.array([b[0] for b in busy])
    nblk = np.array([b[1] for b in busy])
    last = np.array([b[2] for b in busy])
    fa.log(f"  SMs used {len(busy)}; a block resident {cov.mean() / end:.0%} of the span on "
           f"average (min {cov.min() / end:.0%}); blocks per SM {nblk.min()}-{nblk.max()}; "
           f"an SM's last block ends at {np.percentile(last, 10):.1f} (p10) / "
           f"{statistics.median(last):.1f} (median) us")
    # how many tile blocks were running at each moment
    grid = np.linspace(0, end, 21)
    running = [int(((t0 <= x) & (t1 > x)).sum()) for x in grid]
    fa.log("  blocks running at 0, 5%, ..., 100% of the span: " + " ".join(map(str, running)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--bits", type=int, default=4, choices=(2, 4, 8))
    ap.add_argument("--residual", default="64,128", help="key,value residual tokens")
    ap.add_argument("--target", type=int, nargs="+", default=None,
                    help="split targets (default: the dispatcher's for the batch)")
    ap.add_argument("--keep", type=int, default=kd.FRAG_KEEP_OFFSET, choices=(0, 1, 2, 3))
    args = ap.parse_args()
    H, R, D, G = 8, 4, 128, 64
    try:
        n_kres, n_vres = (int(x) for x in args.residual.split(","))
    except ValueError:
        ap.error(f"--residual {args.residual!r}: want two integers, key,value")
    if not 0 <= n_kres <= args.context or not 0 <= n_vres <= args.context \
            or (args.context - n_kres) % G:
        ap.error(f"--residual {args.residual!r} with --context {args.context}: each in "
                 f"[0, context], and context minus the key residual a multiple of {G}")
    mx.set_default_device(mx.gpu)
    for B in args.batch:
        kernel = stamped_kernel(kd.frag_launch_bounds(B * H))
        K, V = fa.random_kv(B, H, args.context, D, mx.float16)
        cache = fa.make_cache(K, V, n_kres, n_vres, args.bits, G, spare=False)
        q = mx.random.normal((B, H * R, 1, D)).astype(mx.float16)
        mx.eval(q, *[a for a in cache if isinstance(a, mx.array)])
        del K, V
        for target in args.target or [kd.frag_target_blocks(B * H)]:
            st, tails = run(kernel, q, cache, args.bits, G, target, args.keep)
            fa.log(f"\n{args.bits}-bit B={B} T={args.context} residual {n_kres},{n_vres} "
                   f"target {target} keep {args.keep} launch bounds "
                   f"{kd.frag_launch_bounds(B * H)}: grid {st.shape[1]} x {st.shape[0]}")
            summarize(st, tails)


if __name__ == "__main__":
    main()
