"""Where a chained call's time goes, by the GPU's own clock.

In decoding a layer's attention waits for the layer before, so `fused_attention.py` also
times chains (each call's queries are the previous call's output). This script runs such
a chain of N calls of the frag kernel (frag_timeline.py's copy, which writes %globaltimer
at each block's start and end) followed by the merge kernel, as `kivi_decode_attention_cuda` does, and
the same for a one-block copy kernel (the floor of a custom-kernel call), then prints per
call: the main kernel's span on the GPU (first block start to last block end), the time
from its end to the next call's first block (the merge kernel and two launch gaps), and
the host's wall time per call, whose excess over the two is time the GPU spent idle:

    python3 benchmarks/chain_timeline.py --batch 1 8
    python3 benchmarks/chain_timeline.py --batch 8 --variants "1,528 1,792"  # split targets
    python3 benchmarks/chain_timeline.py --batch 1 --probe  # host cost of custom kernels
    python3 benchmarks/chain_timeline.py --batch 8 --tail-first 0  # tail after the tiles
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fused_attention as fa  # noqa: E402
import mlx.core as mx  # noqa: E402
from frag_timeline import TIMER, stamp_outputs, stamped_kernel  # noqa: E402
import numpy as np  # noqa: E402

kd, kx = fa.kd, fa.kx
_COPY = r"""
  unsigned long long vq_t0;
  """ + TIMER.format("vq_t0") + r"""
  for (int i = threadIdx.x; i < q_shape[0] * q_shape[1] * q_shape[3]; i += blockDim.x)
    out[i] = q[i];
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long vq_t1;
    """ + TIMER.format("vq_t1") + r"""
    stamps[0] = vq_t0;  // as the frag kernel's stamps: 4 a block, start and end first
    stamps[1] = vq_t1;
  }
"""


def copy_kernel(extra_inputs=(), extra_outputs=()):
    return mx.fast.cuda_kernel(
        name=f"vq_stamped_copy{len(extra_inputs)}_{len(extra_outputs)}",
        input_names=["q", *extra_inputs], output_names=["out", "stamps", *extra_outputs],
        source=_COPY)


def frag_step(kernel, sets, bits, G, target=None, keep=None, tail_first=None):
    """One lazy call (q -> out, stamps) on input set i: the frag kernel, then the merge."""

    def step(q, i):
        cache = sets[i % len(sets)][1]
        BH = q.shape[0] * cache[0].shape[1]
        (o_part, ml_part, st), _, _, _ = kx.frag_call(
            kernel, q, cache, scale=q.shape[3] ** -0.5, bits=bits, group_size=G,
            target_blocks=target, keep=keep, tail_first=tail_first,
            extra_outputs=stamp_outputs(BH))
        return kd.merge_partials("cuda", o_part, ml_part, q.shape, q.dtype), st
    return step


def copy_step(kernel, sets=None, scratch=0, twice=False):
    """The copy kernel; given as many inputs as the frag kernel where sets is given (the 8
    cache buffers, a small params array), with an unwritten float32 output of ``scratch``
    elements (the frag kernel's partials), or run twice a call."""
    small = mx.zeros((8,), dtype=mx.int32)

    def step(q, i):
        extra = [] if sets is None else [*(a for a in sets[i % len(sets)][1]
                                           if isinstance(a, mx.array)), small]
        shapes, dtypes = [q.shape, (4,)], [q.dtype, mx.uint64]
        if scratch:
            shapes.append((scratch,))
            dtypes.append(mx.float32)
        outs = kernel(inputs=[q, *extra], grid=(256, 1, 1), threadgroup=(256, 1, 1),
                      output_shapes=shapes, output_dtypes=dtypes)
        if twice:
            outs = kernel(inputs=[outs[0], *extra], grid=(256, 1, 1),
                          threadgroup=(256, 1, 1), output_shapes=shapes,
                          output_dtypes=dtypes)
        return outs[0], outs[1]
    return step


def chain(step, q0, n, reps=5):
    """Wall time a call (median of reps) and the last rep's (first block start, last block
    end) per call, in ns of the GPU's clock."""
    walls = []
    for _ in range(reps):
        q, stamps = q0, []
        for i in range(n):
            q, st = step(q, i)
            stamps.append(st)
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(q, *stamps)
        mx.synchronize()
        walls.append((time.perf_counter() - t) / n * 1e6)
    spans = [(int(a[0::4].min()), int(a[1::4].max())) for a in map(np.array, stamps)]
    return statistics.median(walls), spans


def report(name, wall, spans):
    dur = [(b - a) / 1e3 for a, b in spans]
    gap = [(spans[i + 1][0] - spans[i][1]) / 1e3 for i in range(len(spans) - 1)]
    q = lambda x: "/".join(f"{np.percentile(x, p):.1f}" for p in (10, 50, 90))
    first_to_last = (spans[-1][1] - spans[0][0]) / 1e3 / (len(spans) - 1)
    fa.log(f"  {name}: wall {wall:.1f} us a call; main kernel span {q(dur)} us; its end to "
           f"the next call's first block {q(gap)} us (p10/median/p90; max {max(gap):.1f}); "
           f"GPU clock, first call's start to last call's end: {first_to_last:.1f} us a call")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--bits", type=int, default=4, choices=(2, 4, 8))
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--probe", action="store_true",
                    help="also time copy kernels with the frag call's output sizes / twice")
    ap.add_argument("--variants", default=None,
                    help="also time these frag variants, keep,target[,min_blocks] separated "
                         "by spaces (KEEP of the kernel, split target, launch-bound blocks)")
    ap.add_argument("--tail-first", type=int, nargs="*", default=[], choices=(0, 1),
                    help="also time the defaults with TAIL_FIRST forced to each of these")
    args = ap.parse_args()
    try:
        variants = [tuple(int(x) for x in v.split(",")) for v in (args.variants or "").split()]
    except ValueError:
        variants = [()]
    if any(len(v) not in (2, 3) or v[0] not in (0, 1, 2, 3) or min(v[1:]) < 1
           for v in variants):
        raise SystemExit(f"--variants: {args.variants!r} is not keep,target[,min_blocks] "
                         "(keep 0-3, the others >= 1) separated by spaces")
    mx.set_default_device(mx.gpu)
    G = 64
    cp = copy_kernel()
    cp10 = copy_kernel([f"x{i}" for i in range(9)])
    cp10s = copy_kernel([f"x{i}" for i in range(9)], ["scratch"])
    for B in args.batch:
        fa.log(f"\n{args.bits}-bit B={B} T={args.context}, chains of {args.calls} calls")
        sets, _ = fa.timing_sets(B, args.context, args.bits, G)
        q0 = sets[0][0]
        mb0 = kd.frag_launch_bounds(B * 8)  # timing_sets: 8 kv heads
        report(f"frag (defaults: target {kd.frag_target_blocks(B * 8)}, launch bounds {mb0})"
               " + merge kernel", *chain(frag_step(stamped_kernel(mb0), sets, args.bits, G),
                                         q0, args.calls))
        for tail_first in args.tail_first:
            report(f"frag defaults with TAIL_FIRST {tail_first} + merge kernel",
                   *chain(frag_step(stamped_kernel(mb0), sets, args.bits, G,
                                    tail_first=bool(tail_first)), q0, args.calls))
        for keep, target, *mb in variants:
            mb = mb[0] if mb else mb0
            report(f"frag KEEP {keep} target {target} launch bounds {mb} + merge kernel",
                   *chain(frag_step(stamped_kernel(mb), sets, args.bits, G, target, keep), q0,
                          args.calls))
        report("copy kernel (one block)", *chain(copy_step(cp), q0, args.calls))
        report("copy kernel, given the frag kernel's inputs too", *chain(
            copy_step(cp10, sets), q0, args.calls))
        if args.probe:  # which part of a frag call costs the host its time
            ns = kd._frag_launch_args(mx.float16, 128, 4, args.bits, G, 1, args.context - 64,
                                      64, args.context - 128, 128, B * 8, 1.0,
                                      kd.frag_target_blocks(B * 8))[0]
            report("  + an unwritten output the size of the partials", *chain(
                copy_step(cp10s, sets, B * 32 * ns * 128), q0, args.calls))
            report("  twice a call", *chain(copy_step(cp10, sets, twice=True), q0,
                                             args.calls))
        sets = None
        kv = [fa.random_kv(B, 8, args.context, 128, mx.float16) for _ in range(2)]
        mx.eval(kv)
        t, _ = fa.time_chain(lambda q, i: mx.fast.scaled_dot_product_attention(
            q, *kv[i], scale=128 ** -0.5), 2, q0)
        fa.log(f"  fp16 SDPA: wall {t * 1e6:.1f} us a call (time_chain)")
        kv = None


if __name__ == "__main__":
    main()
