"""Scoring every prompt query (H2O's accumulated mass): what each pass costs, against SDPA.

Issue 31: h2o's warm 4k prefill was 5.8-6.4x mlx-lm's KVCache on the H200 and keyformer's
11x (`results/decode_overlapped_4k_s46.md`); both weigh every key by the softmax of every
prompt query (``evict/attention.attention_mass``, keyformer's ``gumbel_mass``), while the
others score a window or one query. This times one layer's prompt chunk (``--chunk``
queries at the end of ``--context`` keys, the 8B layer's heads) for the scoring as it is
and for variants of it: median of ``--repeats`` warm evaluations, and each variant's
largest error over the keys' masses relative to the current function's. SDPA over the same chunk is the yardstick.

    python benchmarks/prompt_mass.py                                   # GPU: 2,048 queries x 4,096 keys, float16
    python benchmarks/prompt_mass.py --only "MLX ops" "mass kernels"   # the kernels against MLX's ops
    python benchmarks/prompt_mass.py --only fused "2^23 (the"          # the fused kernels against written logits
    MLX_DEFAULT_DEVICE=cpu python benchmarks/prompt_mass.py --context 1024 --chunk 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import veloxquant_mlx  # noqa: F401  first: it may load OpenBLAS

import mlx.core as mx  # noqa: E402

from veloxquant_mlx.evict import attention, fused_mass_kernel, mass_kernel  # noqa: E402
from veloxquant_mlx.methods import keyformer  # noqa: E402


def timed(fn, repeats):
    mx.eval(fn())
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def print_parts(parts: dict, repeats: int) -> None:
    """A "| part | ms |" table: each callable's ``timed`` median, printed as it comes."""
    print("| part | ms |")
    print("|---|---:|")
    for name, fn in parts.items():
        print(f"| {name} | {timed(fn, repeats) * 1e3:.2f} |", flush=True)


def with_block_size(module, elements, fn):
    """``fn`` run with ``module.SCORE_ELEMENTS`` (logits a scoring block holds) set to ``elements``."""
    def run():
        old = module.SCORE_ELEMENTS
        module.SCORE_ELEMENTS = elements
        try:
            return fn()
        finally:
            module.SCORE_ELEMENTS = old
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, nargs=2, default=(32, 8))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--only", nargs="+", default=None,
                   help="variants whose names contain one of these (the yardstick always runs)")
    a = p.parse_args()
    hq, hkv = a.heads
    dtype = getattr(mx, a.dtype)
    n, c, d = a.context, a.chunk, a.head_dim
    scale = d**-0.5
    k = mx.random.normal((1, hkv, n, d), key=mx.random.key(0)).astype(dtype)
    v = mx.random.normal((1, hkv, n, d), key=mx.random.key(1)).astype(dtype)
    q = mx.random.normal((1, hq, c, d), key=mx.random.key(2)).astype(dtype)
    qpos = mx.arange(n - c, n)
    kpos = mx.broadcast_to(mx.arange(n)[None, None], (1, hkv, n))
    qw = 0.98 ** mx.arange(c - 1, -1, -1, dtype=mx.float32)
    mx.eval(k, v, q, kpos, qw)
    g = hq // hkv

    def current():
        return attention.attention_mass(q, k, scale, qpos, kpos, qw)

    def with_env(settings: dict, fn):
        """``fn`` run with the environment's ``settings`` (restored after)."""
        def run():
            old = {name: os.environ.get(name) for name in settings}
            os.environ.update(settings)
            try:
                return fn()
            finally:
                for name, value in old.items():
                    if value is None:
                        del os.environ[name]
                    else:
                        os.environ[name] = value
        return run

    def written(fn):
        """``fn`` with the fused kernels off (``VQ_FUSED_MASS=0``): logits written, then scored."""
        return with_env({"VQ_FUSED_MASS": "0"}, fn)

    def mlx_ops(fn):
        """``fn`` with every scoring kernel off: MLX's ops over written logits."""
        return with_env({"VQ_FUSED_MASS": "0", "VQ_MASS_KERNEL": "0"}, fn)

    def before():  # attention_mass until session 48: a broadcast product, the keys cast a block
        def block(qb, start, stop):
            w = attention.attention_weights(qb, k, scale, qpos[start:stop], kpos)
            return (w * qw[start:stop, None]).sum(axis=3).mean(axis=2)
        return attention.reduce_query_blocks(q, n, block)

    def fp16_logits():
        return attention.attention_mass(q, k, scale, qpos, kpos, qw, dtype=None)

    def matvec_reduce(dtype_=mx.float32):
        def block(qb, start, stop):
            w = attention.attention_weights(qb, k, scale, qpos[start:stop], kpos, dtype_)
            wq = (qw[start:stop] / g)[None, None, None, :]
            wq = mx.broadcast_to(wq, (1, 1, g, stop - start)).reshape(1, 1, 1, -1)
            return (wq @ w.reshape(1, hkv, g * (stop - start), n))[:, :, 0]
        return attention.reduce_query_blocks(q, n, block)

    @mx.compile
    def fused_tail(logits, visible, wq):
        logits = mx.where(visible, logits, -float("inf"))
        w = mx.softmax(logits, axis=-1, precise=True)
        return (w * wq).sum(axis=3).mean(axis=2)

    def compiled_block():
        k32 = k.astype(mx.float32)[:, :, None].swapaxes(-1, -2)

        def block(qb, start, stop):
            qq = qb.reshape(1, hkv, g, stop - start, d).astype(mx.float32)
            logits = (qq * scale) @ k32
            visible = kpos[:, :, None, None, :] <= qpos[start:stop][None, None, None, :, None]
            return fused_tail(logits, visible, qw[start:stop, None])
        return attention.reduce_query_blocks(q, n, block)

    def stacked(logits_dtype, elements=None):
        """A KV group's query heads stacked into one product's rows (no broadcast batch), the
        keys cast once, the tail (mask, softmax, weights, sums) one compiled function."""
        kt = k.astype(logits_dtype).swapaxes(-1, -2)  # (1, Hkv, d, n)

        def block(qb, start, stop):
            rows = qb.reshape(1, hkv, g * (stop - start), d).astype(logits_dtype)
            logits = ((rows * scale) @ kt).reshape(1, hkv, g, stop - start, n)
            visible = kpos[:, :, None, None, :] <= qpos[start:stop][None, None, None, :, None]
            return fused_tail(logits.astype(mx.float32), visible, qw[start:stop, None])
        return lambda: attention.reduce_query_blocks(q, n, block, elements=elements)

    stream = keyformer.noise_stream(0, 0, 1, hq, hkv)

    def keyformer_mass():
        return keyformer.gumbel_mass(q, k, scale, n - c, kpos, 1.0, stream)

    def sdpa():
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")

    def sdpa_f32_matmul():  # the logits alone, float32, as the blocks make them
        return attention.reduce_query_blocks(
            q, n, lambda qb, s, e: ((qb.reshape(1, hkv, g, e - s, d).astype(mx.float32) * scale)
                                   @ k.astype(mx.float32)[:, :, None].swapaxes(-1, -2)).sum(axis=(2, 3)))

    ref = mlx_ops(current)()
    mx.eval(ref)
    kernels = "on" if mass_kernel.kernel_backend(mx.float32) else "off: no GPU, or failed its check"
    fused = "on" if with_env({"VQ_FUSED_MASS": "1"}, lambda: fused_mass_kernel.kernel_backend(q, k))() else (
        "off: no GPU, or failed its check")
    variants = {
        "attention_mass (current)": current,
        f"fused kernels ({fused}; VQ_FUSED_MASS=1)": with_env({"VQ_FUSED_MASS": "1"}, current),
        "MLX ops (VQ_FUSED_MASS=0 VQ_MASS_KERNEL=0)": mlx_ops(current),
        "MLX ops, blocks of 2^24": mlx_ops(with_block_size(attention, 2**24, current)),
        f"mass kernels ({kernels}), blocks of 2^23 (the default)": written(current),
        f"mass kernels ({kernels}), blocks of 2^24": written(with_block_size(attention, 2**24, current)),
        f"mass kernels ({kernels}), blocks of 2^25": written(with_block_size(attention, 2**25, current)),
        f"mass kernels ({kernels}), blocks of 2^26": written(with_block_size(attention, 2**26, current)),
        f"mass kernels ({kernels}), float16 logits": written(fp16_logits),
        "attention_mass before session 48": before,
        "blocks of 2^24 logits": written(with_block_size(attention, 2**24, current)),
        "blocks of 2^25 logits": written(with_block_size(attention, 2**25, current)),
        "blocks of 2^22 logits": written(with_block_size(attention, 2**22, current)),
        "float16 logits": fp16_logits,
        "float16 logits, 2^25": with_block_size(attention, 2**25, fp16_logits),
        "matvec reduce": matvec_reduce,
        "compiled tail": compiled_block,
        "logits alone (f32 matmul + sum)": sdpa_f32_matmul,
        "stacked f32, compiled tail": stacked(mx.float32),
        "stacked f32, compiled tail, 2^24": stacked(mx.float32, 2**24),
        "stacked f32, compiled tail, 2^25": stacked(mx.float32, 2**25),
        "stacked f16 logits, compiled tail": stacked(dtype),
        "stacked f16 logits, compiled tail, 2^25": stacked(dtype, 2**25),
        "keyformer gumbel_mass": keyformer_mass,
        f"keyformer gumbel_mass, fused kernels ({fused}; VQ_FUSED_MASS=1)": with_env({"VQ_FUSED_MASS": "1"},
                                                                                 keyformer_mass),
        "keyformer gumbel_mass, 2^21 (its blocks before session 48)": with_block_size(keyformer, 2**21, keyformer_mass),
        "keyformer gumbel_mass, 2^25": with_block_size(keyformer, 2**25, keyformer_mass),
        "SDPA, causal (yardstick)": sdpa,
    }
    if a.only:
        variants = {name: fn for name, fn in variants.items()
                    if "yardstick" in name or any(o in name for o in a.only)}
    print(f"{mx.default_device()}, {hq}/{hkv} heads x {d}, {a.dtype}: {c} queries over {n} keys, "
          f"median of {a.repeats} warm evaluations\n")
    print("| variant | ms | vs SDPA | max rel err vs MLX's ops |\n|---|---:|---:|---:|")
    times = {name: timed(fn, a.repeats) for name, fn in variants.items()}
    base = times["SDPA, causal (yardstick)"]
    for name, fn in variants.items():
        out = fn()
        err = "-"
        if out.shape == ref.shape and "keyformer" not in name and "logits alone" not in name:
            err = f"{(mx.abs(out - ref).max() / mx.abs(ref).max()).item():.1e}"
        print(f"| {name} | {times[name] * 1e3:.2f} | {times[name] / base:.1f}x | {err} |", flush=True)


if __name__ == "__main__":
    main()
