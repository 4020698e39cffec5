"""Check, then time, the fused KIVI decode-attention kernel on MLX's CUDA back-end.

    python3 benchmarks/fused_attention.py            # full run: check, sweep, table
    python3 benchmarks/fused_attention.py --quick    # fewer checks, 32k only, no sweep
    python3 benchmarks/fused_attention.py --lean     # fewer checks, full table, no sweep
    python3 benchmarks/fused_attention.py --cpu-paths  # the two pure-mlx paths, on the CPU

1. Check: for every bit width x group size x GQA ratio, and residual lengths that are 0,
   not multiples of the chunk, longer than a chunk, fresh random inputs (never zeros;
   spare buffer capacity filled with NaN scales / random codes so stray reads show), each
   CUDA kernel's (frag, folded, simt and mma) float32 output (every output poisoned with NaN first, then checked fully
   written) against the float32 reference computed from the dequantized cache:
   ||out - ref|| / ||ref|| < 1e-3. One failing configuration is printed and skipped.
2. Table: bits {2,4,8} x context {4k,32k,128k} x batch {1,8}, 32 query / 8 kv heads,
   head_dim 128, group 64: median time, bandwidth on the packed bytes actually read
   (codes + scales + biases + residual rows + queries), fraction of the copy roofline,
   and the ratio to fp16 mx.fast.scaled_dot_product_attention on the same shape, for the
   dispatcher's kernel (the other kernels' times alongside).
3. Sweep: kernel variants (per-thread tile, unrolls, chunk, split target) at 32k, 4-bit,
   and stage timings of simt and mma (packed values or packed keys left out).
   --check-algos / --sweep-only narrow the check and the sweep to some kernels.

The kernels run through kernels_extra.py (next to this script): the undispatched mma
kernel, NaN-poisoned outputs and the sweeps' knobs are there, not in the runtime.

Timing: inputs rotate over enough copies that they do not sit in the 50 MB L2; a batch of
N calls is built lazily, then evaluated with mx.eval + mx.synchronize around the host
clock (N chosen so a batch lasts >= 3 ms); warm-up first; median of 7 batches. The table
is printed last and written as Markdown to $OUT/fused_attention.md when OUT is set.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

# MLX's CUDA float32 matmuls use TF32 unless told otherwise (MLX_ENABLE_TF32, default 1):
# the float32 reference must not, or its own error (~1e-3) swamps the kernel's.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
# loads the kernels folder as a package of its own (the device machines have MLX only)
import kernels_extra as kx  # noqa: E402

kd = kx.kd
ALGOS = kx.ALGOS
CHECK_ALGOS = list(ALGOS)  # --check-algos narrows the check
SWEEP_ALGOS = list(ALGOS)  # --sweep-only narrows the sweep
TABLE_ALGOS = list(ALGOS)  # --table-algos narrows the table (the dispatcher's always runs)
SWEEP_STAGE_ALGOS = kx.STAGE_ALGOS  # kernels with stage-skipping modes
#: frag's KEEP for every frag call of the check, table and sweep (--frag-keep; None: the
#: dispatcher's FRAG_KEEP_OFFSET)
FRAG_KEEP = None
ROOFLINE_TBS = 4.3  # H200 copy roofline (TB/s), /work/shared/ARCHITECTURE.md
L2_BYTES = 50e6


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------


def make_cache(K, V, n_kres, n_vres, bits, G, spare=True):
    """KIVI-layout buffers of (B, H, T, D) keys/values; spare capacity poisoned."""
    B, H, T, D = K.shape
    dt = K.dtype
    n_kq, n_vq = T - n_kres, T - n_vres
    P = 32 // bits
    nan = float("nan")
    if n_kq:
        kc, ks, kb = mx.quantize(K[:, :, :n_kq].transpose(0, 1, 3, 2), group_size=G, bits=bits)
    else:
        kc, ks, kb = (mx.zeros((B, H, D, 0), mx.uint32), mx.zeros((B, H, D, 0), dt),
                      mx.zeros((B, H, D, 0), dt))
    if n_vq:
        vc, vs, vb = mx.quantize(V[:, :, :n_vq], group_size=G, bits=bits)
    else:
        vc, vs, vb = (mx.zeros((B, H, 0, D // P), mx.uint32), mx.zeros((B, H, 0, D // G), dt),
                      mx.zeros((B, H, 0, D // G), dt))
    kr, vr = K[:, :, n_kq:], V[:, :, n_vq:]
    if spare:
        sg = 2
        kc = mx.concatenate([kc, mx.random.randint(0, 2**31 - 1, (B, H, D, sg * G // P))
                             .astype(mx.uint32)], -1)
        ks = mx.concatenate([ks, mx.full((B, H, D, sg), nan, dt)], -1)
        kb = mx.concatenate([kb, mx.full((B, H, D, sg), nan, dt)], -1)
        vc = mx.concatenate([vc, mx.random.randint(0, 2**31 - 1, (B, H, 5, D // P))
                             .astype(mx.uint32)], 2)
        vs = mx.concatenate([vs, mx.full((B, H, 5, D // G), nan, dt)], 2)
        vb = mx.concatenate([vb, mx.full((B, H, 5, D // G), nan, dt)], 2)
        kr = mx.concatenate([kr, mx.full((B, H, 3, D), nan, dt)], 2)
        vr = mx.concatenate([vr, mx.full((B, H, 9, D), nan, dt)], 2)
    else:
        kr, vr = mx.contiguous(kr), mx.contiguous(vr)
    return (kc, ks, kb, n_kq, kr, n_kres, vc, vs, vb, n_vq, vr, n_vres)


def random_kv(B, H, T, D, dtype):
    K = mx.random.normal((B, H, T, D)) * (0.5 + 3 * mx.random.uniform(shape=(1, H, 1, D)))
    V = mx.random.normal((B, H, T, D))
    return K.astype(dtype), V.astype(dtype)


def rel_err(out, ref):
    o = out.astype(mx.float32)
    r = ref.astype(mx.float32)
    return (mx.linalg.norm((o - r).reshape(-1)) / mx.linalg.norm(r.reshape(-1))).item()


# ----------------------------------------------------------------------------------
# 1. check
# ----------------------------------------------------------------------------------


def check(quick: bool):
    log("\n== check: fused CUDA kernel vs float32 reference from the dequantized cache ==")
    D, B, H = 128, 2, 2
    residuals = [(0, 0), (37, 128), (127, 1), (64, 255), (1, 300)]
    cases = []
    i = 0
    for bits in (2, 4, 8):
        for G in (32, 64, 128):
            for R in (1, 4, 8):
                for k in range(1 if quick else 2):
                    n_kres, n_vres = residuals[(i + 2 * k) % len(residuals)]
                    n_kq = G * (7 + 13 * ((i + k) % 4))  # 224 .. 5k tokens, rarely chunk-aligned
                    cases.append((mx.float16, bits, G, R, n_kq, n_kres, n_vres, None, None))
                i += 1
    # dtypes, several chunks per block, chunk sizes, residual-only, long context
    cases += [
        (mx.bfloat16, 4, 64, 4, 4096, 70, 128, None, None),
        (mx.float32, 2, 32, 8, 2048, 5, 33, None, None),
        (mx.float16, 4, 64, 4, 8192, 100, 128, None, 4),
        (mx.float16, 8, 32, 4, 3072, 17, 128, 128, None),
        (mx.float16, 2, 128, 4, 3072, 17, 128, 512, None),
        (mx.float16, 4, 32, 4, 3072, 17, 128, 512, None),
        (mx.bfloat16, 2, 64, 8, 2048, 3, 200, None, 3),
        (mx.float16, 4, 64, 4, 0, 100, 100, None, None),
        (mx.float16, 4, 64, 4, 40000, 77, 128, None, None),
    ]
    n_ok = n_fail = 0
    worst = {}
    for dtype, bits, G, R, n_kq, n_kres, n_vres, chunk, target in cases:
        name = (f"{str(dtype).split('.')[-1]:8s} bits={bits} G={G:3d} gqa={R} n_kq={n_kq:5d} "
                f"n_kres={n_kres:3d} n_vres={n_vres:3d} chunk={chunk or 'default'} "
                f"target={target or 'default'}")
        try:
            T = n_kq + n_kres
            K, V = random_kv(B, H, T, D, dtype)
            cache = make_cache(K, V, n_kres, n_vres, bits, G)
            q = mx.random.normal((B, H * R, 1, D)).astype(dtype)
            kw = dict(scale=D ** -0.5, bits=bits, group_size=G)
            ref = kd.kivi_decode_attention_reference(q.astype(mx.float32), *cache, **kw)
            mx.eval(ref)
        except Exception as exc:
            n_fail += 1
            log(f"  ERROR preparing {name}: {type(exc).__name__}: {exc}")
            continue
        for algo in CHECK_ALGOS:
            if not kx.supports(D, R, bits, G, dtype, chunk, algo=algo):
                continue
            if quick and algo != kd.default_algo(D, R, bits, G, dtype) and (
                    bits + G // 32 + R) % 3:
                continue  # quick: every config for the default kernel, a third for the other
            try:
                out = kx.attention(q, *cache, **kw, chunk=chunk, target_blocks=target,
                                   algo=algo, keep=FRAG_KEEP, out_dtype=mx.float32,
                                   poison=True)
                nat = kx.attention(q, *cache, **kw, chunk=chunk, target_blocks=target,
                                   algo=algo, keep=FRAG_KEEP, poison=True)
                mx.eval(out, nat)
                finite = bool(mx.all(mx.isfinite(out)).item()) and bool(
                    mx.all(mx.isfinite(nat)).item())
                e = rel_err(out, ref)
                en = rel_err(nat, ref)
                # the native-dtype output adds one rounding to the output dtype (bf16: 2^-8)
                tol_nat = 1e-3 if dtype != mx.bfloat16 else 2.0**-8 + 1e-4
                ok = finite and e < 1e-3 and en < tol_nat and nat.dtype == dtype
                worst[algo] = max(worst.get(algo, 0.0), e)
                n_ok += ok
                n_fail += not ok
                log(f"  {'OK  ' if ok else 'FAIL'} {algo:4s} {name}  rel_err f32-out {e:.2e}"
                    f"  {str(dtype).split('.')[-1]}-out {en:.2e}  all-written {finite}")
            except Exception as exc:  # keep going: report and continue
                n_fail += 1
                log(f"  ERROR {algo} {name}: {type(exc).__name__}: {exc}")
                traceback.print_exc(limit=2)
    try:  # the dispatcher routes to the CUDA kernel on this back-end
        K, V = random_kv(1, 8, 5000, 128, mx.float16)
        cache = make_cache(K, V, 8, 128, 4, 64)
        q = mx.random.normal((1, 32, 1, 128)).astype(mx.float16)
        kw = dict(scale=128 ** -0.5, bits=4, group_size=64)
        a = kd.kivi_decode_attention(q, *cache, **kw)
        algo = kd.default_algo(128, 4, 4, 64, mx.float16)
        b = kd.kivi_decode_attention_cuda(q, *cache, **kw, algo=algo)
        same = bool(mx.array_equal(a, b).item())
        log(f"  dispatcher kivi_decode_attention == CUDA {algo} kernel: {same}")
        n_ok += same
        n_fail += not same
    except Exception as exc:
        n_fail += 1
        log(f"  ERROR dispatcher: {exc}")
    wtxt = ", ".join(f"{a} {w:.1e}" for a, w in sorted(worst.items()))
    log(f"check: {n_ok} passed, {n_fail} failed; worst float32-output rel err: {wtxt}")
    return n_ok, n_fail, wtxt


# ----------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------


def _time_per_call(build, n_sets, min_batch_s, reps):
    """(median seconds per call, spread) of build(n), n lazy calls evaluated at once: a
    warm-up, an estimate that sizes n so a batch lasts >= min_batch_s, reps batches."""
    mx.eval(build(n_sets))  # warm-up (compile, allocate)
    mx.synchronize()
    t = time.perf_counter()
    mx.eval(build(n_sets))
    mx.synchronize()
    est = max((time.perf_counter() - t) / n_sets, 1e-6)
    n = int(min(4000, max(n_sets, math.ceil(min_batch_s / est))))
    times = []
    for _ in range(reps):
        outs = build(n)
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        times.append((time.perf_counter() - t) / n)
        del outs
    return statistics.median(times), (max(times) - min(times)) / statistics.median(times)


def time_batches(make, n_sets, min_batch_s=3e-3, reps=7):
    """Median seconds per call; make(i) builds one lazy call on input set i."""
    return _time_per_call(lambda n: [make(i % n_sets) for i in range(n)], n_sets,
                          min_batch_s, reps)


def time_chain(step, n_sets, q0, min_batch_s=2e-2, reps=7):
    """Median seconds per call when each call's queries are the previous call's output, as
    in decoding (a layer's attention waits for the layer before): no two calls overlap on
    the GPU, where the independent calls of time_batches may (MLX puts up to 100 ops in
    one CUDA graph, and only data dependencies order its nodes). step(q, i) builds one
    lazy call on input set i; its output has the queries' shape and dtype. Chains of >= 20
    ms: MLX commits its CUDA graphs every ~1 GB of inputs, and short chains moved by
    +-25% between rounds."""
    def chain(n):
        q = q0
        for i in range(n):
            q = step(q, i % n_sets)
        return q

    return _time_per_call(chain, n_sets, min_batch_s, reps)


def copy_bandwidth():
    x = mx.random.uniform(shape=(2**28,))  # 1 GiB float32
    mx.eval(x)
    s, _ = time_batches(lambda i: x + 1.0, 1, min_batch_s=0.05, reps=5)
    return 2 * x.nbytes / s / 1e12


def call_floor():
    """Seconds per call of a one-kernel op on a tiny array: what a call costs at least."""
    xs = [mx.random.normal((1024,)) for _ in range(4)]
    mx.eval(xs)
    s, _ = time_batches(lambda i: xs[i] * 2.0, 4)
    return s


def n_sets_for(bytes_per_set):
    return int(min(32, max(2, math.ceil(4 * L2_BYTES / bytes_per_set))))


def timing_sets(B, T, bits, G, H=8, R=4, D=128, n_kres=64, n_vres=128):
    """Input sets (queries, KIVI buffers) of one shape for time_batches, enough of them to
    stay out of L2, and the bytes a call must read."""
    nbytes = kx.packed_bytes_read(B, H, H * R, D, T - n_kres, n_kres, T - n_vres, n_vres,
                                  bits, G)
    sets = []
    for _ in range(n_sets_for(nbytes)):
        K, V = random_kv(B, H, T, D, mx.float16)
        c = make_cache(K, V, n_kres, n_vres, bits, G, spare=False)
        q = mx.random.normal((B, H * R, 1, D)).astype(mx.float16)
        mx.eval(q, *[a for a in c if isinstance(a, mx.array)])
        sets.append((q, c))
        del K, V
    return sets, nbytes


def sweep(shapes=((1, 32768), (8, 32768))):
    log("\n== sweep: kernel variants, 4-bit, group 64, 32 q-heads / 8 kv-heads, d=128 ==")
    D, H, R, G, bits = 128, 8, 4, 64, 4
    variants = [  # (algo, (TW, KU, VU), chunk, target blocks)
        # frag: variant = resident blocks an SM in its launch bounds (register budget)
        ("frag", 6, None, 792), ("frag", 6, None, 1188), ("frag", 5, None, 660),
        ("folded", None, 128, 132), ("folded", None, 128, 264), ("folded", None, 128, 396),
        ("folded", None, 128, 528), ("folded", None, 128, 792), ("folded", None, 128, 1056),
        ("folded", None, 128, 2112), ("folded", None, 64, 528), ("folded", None, 64, 1056),
        ("mma", None, 256, 1024), ("mma", None, 512, 1024), ("mma", None, 128, 1024),
        ("mma", None, 256, 512), ("mma", None, 256, 2048), ("mma", None, 256, 4096),
        ("simt", (4, 16, 8), 256, 1024), ("simt", (8, 8, 8), 256, 1024),
        ("simt", (8, 8, 8), 256, 4096),
    ]
    rows = []
    for B, T in shapes:
        sets, bytes_set = timing_sets(B, T, bits, G, H, R, D)
        ns = len(sets)
        for algo, variant, chunk, target in variants:
            if algo not in SWEEP_ALGOS:
                continue
            label = f"{algo} {variant or ''}".strip()
            min_blocks = None
            if algo == "frag":
                label = f"frag, {variant} blocks/SM bound"
                min_blocks, variant = variant, None
            try:
                s, spread = time_batches(
                    lambda i: kx.attention(
                        sets[i][0], *sets[i][1], scale=D ** -0.5, bits=bits, group_size=G,
                        chunk=chunk, target_blocks=target, variant=variant, algo=algo,
                        keep=FRAG_KEEP, min_blocks=min_blocks), ns)
                rows.append((B, T, label, chunk, target, s, bytes_set / s / 1e9))
                log(f"  B={B} T={T:6d} {label} chunk={chunk} target={target}: "
                    f"{s * 1e6:8.1f} us  {bytes_set / s / 1e9:7.0f} GB/s  (spread {spread:.0%})")
            except Exception as exc:
                log(f"  ERROR {label} chunk={chunk} target={target}: {exc}")
        for algo in [a for a in SWEEP_STAGE_ALGOS if a in SWEEP_ALGOS]:
            for mode, what in ((1, "packed values skipped"), (2, "packed keys skipped")):
                try:  # stage timing: leave one stage out (outputs meaningless, time only)
                    s, spread = time_batches(
                        lambda i: kx.attention(
                            sets[i][0], *sets[i][1], scale=D ** -0.5, bits=bits,
                            group_size=G, algo=algo, mode=mode), ns)
                    rows.append((B, T, f"{algo}, {what}", "default",
                                 kd.DEFAULT_TARGET_BLOCKS, s, bytes_set / s / 1e9))
                    log(f"  B={B} T={T:6d} {algo} default, {what}: {s * 1e6:8.1f} us")
                except Exception as exc:
                    log(f"  ERROR stage timing {algo} mode {mode}: {exc}")
        del sets
    return rows


def table(quick: bool, contexts=(4096, 32768, 131072), batches=(1, 8)):
    log("\n== table: 32 q-heads / 8 kv-heads, head_dim 128, group 64, fp16 ==")
    D, H, R, G = 128, 8, 4, 64
    n_kres, n_vres = 64, 128
    rows = []
    contexts = contexts if not quick else (32768,)
    for B in batches:
        for T in contexts:
            # fp16 SDPA baseline on the same shape
            kvb = 2 * B * H * T * D * 2
            ns_f = n_sets_for(kvb)
            raw = []
            for _ in range(ns_f):
                K, V = random_kv(B, H, T, D, mx.float16)
                q = mx.random.normal((B, H * R, 1, D)).astype(mx.float16)
                mx.eval(K, V, q)
                raw.append((q, K, V))
            try:
                t_sdpa, _ = time_batches(
                    lambda i: mx.fast.scaled_dot_product_attention(
                        raw[i][0], raw[i][1], raw[i][2], scale=D ** -0.5), ns_f)
            except Exception as exc:
                log(f"  ERROR sdpa B={B} T={T}: {exc}")
                t_sdpa = float("nan")
            try:
                t_sdpa_c, _ = time_chain(
                    lambda q, i: mx.fast.scaled_dot_product_attention(
                        q, raw[i][1], raw[i][2], scale=D ** -0.5), ns_f, raw[0][0])
            except Exception as exc:
                log(f"  ERROR sdpa chained B={B} T={T}: {exc}")
                t_sdpa_c = float("nan")
            log(f"  fp16 SDPA B={B} T={T:6d}: {t_sdpa * 1e6:8.1f} us "
                f"({kvb / t_sdpa / 1e9:.0f} GB/s on fp16 K+V); chained {t_sdpa_c * 1e6:.1f} us")
            for bits in (2, 4, 8):
                n_kq, n_vq = T - n_kres, T - n_vres
                pb = kx.packed_bytes_read(B, H, H * R, D, n_kq, n_kres, n_vq, n_vres, bits, G)
                ns = n_sets_for(pb)
                sets = []
                for i in range(ns):
                    q, K, V = raw[i % ns_f]
                    if i >= ns_f:  # more sets than raw copies: fresh data
                        K, V = random_kv(B, H, T, D, mx.float16)
                        q = mx.random.normal((B, H * R, 1, D)).astype(mx.float16)
                    c = make_cache(K, V, n_kres, n_vres, bits, G, spare=False)
                    mx.eval(*[a for a in c if isinstance(a, mx.array)])
                    sets.append((q, c))
                times = {}
                default = kd.default_algo(D, R, bits, G, mx.float16)
                for algo in [a for a in ALGOS if a in TABLE_ALGOS or a == default]:
                    try:
                        t_a, spread = time_batches(
                            lambda i: kx.attention(
                                sets[i][0], *sets[i][1], scale=D ** -0.5, bits=bits,
                                group_size=G, algo=algo, keep=FRAG_KEEP), ns)
                    except Exception as exc:
                        log(f"  ERROR {algo} kernel bits={bits} B={B} T={T}: {exc}")
                        t_a, spread = float("nan"), float("nan")
                    try:
                        t_c, _ = time_chain(
                            lambda q, i: kx.attention(
                                q, *sets[i][1], scale=D ** -0.5, bits=bits, group_size=G,
                                algo=algo, keep=FRAG_KEEP), ns, sets[0][0])
                    except Exception as exc:
                        log(f"  ERROR {algo} chained bits={bits} B={B} T={T}: {exc}")
                        t_c = float("nan")
                    times[algo] = (t_a, spread, t_c)
                t_k, spread, t_kc = times[default]
                others = [a for a in times if a != default]
                extra = ""
                if bits == 4 and T == 32768 and B == 1:
                    try:  # the pure-mlx quantized_matmul path, for context
                        t_q, _ = time_batches(
                            lambda i: kd.kivi_decode_attention_qmm(
                                sets[i][0], *sets[i][1], scale=D ** -0.5, bits=bits,
                                group_size=G, compute_dtype=mx.float16), ns)
                        extra = f"; quantized_matmul path {t_q * 1e6:.1f} us"
                    except Exception as exc:
                        extra = f"; quantized_matmul path failed: {exc}"
                gbs = pb / t_k / 1e9
                otxt = ", ".join(f"{a} {times[a][0] * 1e6:.1f} / {times[a][2] * 1e6:.1f} chained"
                                 for a in others)
                rows.append((bits, T, B, default, t_k, otxt, pb, t_sdpa, t_kc, t_sdpa_c))
                log(f"  bits={bits} B={B} T={T:6d}: fused {default} {t_k * 1e6:8.1f} us  "
                    f"{pb / 1e6:8.1f} MB  {gbs:7.0f} GB/s  ({gbs / 1e3 / ROOFLINE_TBS:.0%} of "
                    f"{ROOFLINE_TBS} TB/s)  SDPA/fused {t_sdpa / t_k:5.2f}x  "
                    f"(spread {spread:.0%}); chained {t_kc * 1e6:.1f} us, SDPA/fused "
                    f"{t_sdpa_c / t_kc:5.2f}x; others (us): {otxt}{extra}")
                del sets
            del raw
    return rows


def render(n_ok, n_fail, worst, bw, sw, rows):
    md = []
    md.append(f"check: {n_ok} passed, {n_fail} failed (worst float32-output relative error "
              f"{worst}; bound 1e-3); MLX copy bandwidth {bw:.2f} TB/s; roofline "
              f"{ROOFLINE_TBS} TB/s\n")
    if sw:
        md.append("| batch | context | kernel (simt: TW/KU/VU) | chunk | target blocks | time (us) "
                  "| GB/s |")
        md.append("|---:|---:|---|---:|---:|---:|---:|")
        for B, T, v, ch, tg, s, g in sw:
            md.append(f"| {B} | {T} | {v} | {ch} | {tg} | {s * 1e6:.1f} | {g:.0f} |")
        md.append("")
    md.append("Independent calls (time_batches: MLX may run them concurrently on the GPU) "
              "and chained calls (time_chain: each call's queries are the previous call's "
              "output, as in decoding). GB/s: packed bytes read a call / time; % of the "
              f"{ROOFLINE_TBS} TB/s roofline in brackets.\n")
    md.append("| bits | context | batch | kernel | packed MB | fused (us) | GB/s | fp16 SDPA (us) "
              "| SDPA / fused | fused, chained (us) | GB/s, chained | SDPA, chained (us) | "
              "SDPA / fused, chained | other kernels (us) |")
    md.append("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")

    def gb(t, pb):
        g = pb / t / 1e9
        return f"{g:.0f} ({g / 1e3 / ROOFLINE_TBS:.0%})"

    for bits, T, B, dal, t_k, otxt, pb, t_s, t_kc, t_sc in sorted(
            rows, key=lambda r: (r[0], r[2], r[1])):
        md.append(f"| {bits} | {T // 1024}k | {B} | {dal} | {pb / 1e6:.1f} | {t_k * 1e6:.1f} | "
                  f"{gb(t_k, pb)} | {t_s * 1e6:.1f} | {t_s / t_k:.2f}x | {t_kc * 1e6:.1f} | "
                  f"{gb(t_kc, pb)} | {t_sc * 1e6:.1f} | {t_sc / t_kc:.2f}x | {otxt} |")
    return "\n".join(md)


def cpu_paths(contexts=(4096, 16384), reps=5):
    """Time the two pure-mlx paths (what the dispatcher falls back to) on the CPU."""
    D, H, R, G = 128, 8, 4, 64
    lines = ["| dtype | bits | context | reference (ms) | qmm, float32 compute (ms) | "
             "qmm, cache dtype compute (ms) |", "|---|---:|---:|---:|---:|---:|"]
    with mx.stream(mx.cpu):
        for dtype in (mx.float16, mx.bfloat16, mx.float32):
            for bits in (4, 2):
                for T in contexts:
                    K, V = random_kv(1, H, T, D, dtype)
                    c = make_cache(K, V, 64, 128, bits, G, spare=False)
                    q = mx.random.normal((1, H * R, 1, D)).astype(dtype)
                    mx.eval(q, *[a for a in c if isinstance(a, mx.array)])
                    kw = dict(scale=D ** -0.5, bits=bits, group_size=G)
                    res = []
                    for fn, extra in ((kd.kivi_decode_attention_reference, {}),
                                      (kd.kivi_decode_attention_qmm, {}),
                                      (kd.kivi_decode_attention_qmm, {"compute_dtype": dtype})):
                        mx.eval(fn(q, *c, **kw, **extra))
                        ts = []
                        for _ in range(reps):
                            t = time.perf_counter()
                            mx.eval(fn(q, *c, **kw, **extra))
                            ts.append(time.perf_counter() - t)
                        res.append(statistics.median(ts))
                    line = (f"| {str(dtype).split('.')[-1]} | {bits} | {T // 1024}k | "
                            + " | ".join(f"{x * 1e3:.1f}" for x in res) + " |")
                    lines.append(line)
                    log(line)
    return "\n".join(lines)


def main():
    global FRAG_KEEP
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--lean", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--cpu-paths", action="store_true")
    ap.add_argument("--check-algos", default=",".join(ALGOS),
                    help="kernels the check runs (comma-separated)")
    ap.add_argument("--sweep-only", default=None,
                    help="sweep only these kernels (comma-separated)")
    ap.add_argument("--table-algos", default=",".join(ALGOS),
                    help="kernels timed in the table besides the dispatcher's")
    ap.add_argument("--frag-keep", type=int, choices=(0, 1, 2, 3), default=None,
                    help="frag: which codes keep their float16 offset (KEEP of "
                         "kivi_decode_cuda_frag_src.py); default: FRAG_KEEP_OFFSET")
    args = ap.parse_args()
    CHECK_ALGOS[:] = args.check_algos.split(",")
    TABLE_ALGOS[:] = args.table_algos.split(",")
    FRAG_KEEP = args.frag_keep
    log(f"frag: KEEP {kd.FRAG_KEEP_OFFSET if FRAG_KEEP is None else FRAG_KEEP} (0 past "
        f"{kd.FRAG_KEEP_MAX_TILES} tiles a block)")
    if args.sweep_only:
        keep = set(args.sweep_only.split(","))
        SWEEP_ALGOS[:] = [a for a in SWEEP_ALGOS if a in keep]
    if args.cpu_paths:
        log(f"mlx {mx.__version__}; pure-mlx paths on the CPU, 1 x 32 q-heads / 8 kv-heads, "
            f"head_dim 128, group 64, median of 5")
        text = cpu_paths()
        log("\n" + text)
        return 0
    log(f"mlx {mx.__version__}; default device {mx.default_device()}; "
        f"cuda available {mx.cuda.is_available()}")
    if not mx.cuda.is_available():
        log("MLX's CUDA back-end is not available: nothing to check or time here.")
        return 2
    mx.set_default_device(mx.gpu)
    t0 = time.time()
    n_ok, n_fail, worst = check(args.quick or args.lean)
    log(f"[{time.time() - t0:.0f}s]")
    bw = copy_bandwidth()
    log(f"MLX elementwise copy (x + 1, 1 GiB f32, read + write): {bw:.2f} TB/s")
    floor = call_floor()
    log(f"MLX per-call floor of this timing (x * 2 on 4 KiB, one kernel): {floor * 1e6:.1f} us")
    rows = table(args.quick)
    log(f"[{time.time() - t0:.0f}s]")
    do_sweep = args.sweep_only is not None or not (args.quick or args.lean or args.no_sweep)
    sw = sweep() if do_sweep else []
    log(f"[{time.time() - t0:.0f}s]")

    text = render(n_ok, n_fail, worst, bw, sw, rows)
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "fused_attention.md").write_text(text + "\n")
    log("\n" + text)
    return 0 if n_fail == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
