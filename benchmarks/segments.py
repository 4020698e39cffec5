"""Check, then time, decode attention over stores of several packed parts on a GPU.

    python3 benchmarks/segments.py            # check, then the table (H200: ~1 min)
    python3 benchmarks/segments.py --check    # the check only

A store may hold its history in parts of different bit widths (precision by age or by
epoch, per-head widths); ``veloxquant_mlx.kernels.decode.decode_attention`` attends part
by part and merges the partial softmax states of all parts by log-sum-exp (the fused
kernel's partials for the parts it reads, pure-MLX partials for the others).

1. Check, on fresh random inputs, every store shape below against float32 attention over
   the dequantized tokens: ||out - ref|| / ||ref|| < 1e-3 (the kernels' bound).
2. Table: chained decode calls (each call's query depends on the previous output, as in
   decoding), median time per call over 7 batches, for fp16 SDPA over the same tokens and
   for each store, as a ratio to fp16 SDPA measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("MLX_ENABLE_TF32", "0")  # the float32 reference must be float32

import mlx.core as mx  # noqa: E402

from veloxquant_mlx.kernels.decode import DecodePart, decode_attention  # noqa: E402
from veloxquant_mlx.quant.packed import GroupAffine, PackedTokens  # noqa: E402

H, HQ, D, G = 8, 32, 128, 64


def packed(x, bits, axis):
    p = PackedTokens(GroupAffine(bits, G, axis))
    p.append(x)
    return p


def store(kind: str, batch: int, tokens: int, dtype=mx.float16):
    """(parts, float32 keys, float32 values) of one store shape over ``tokens`` tokens."""
    k = (mx.random.normal((batch, H, tokens, D)) * (0.5 + 2 * mx.random.uniform(shape=(1, H, 1, D)))).astype(dtype)
    v = mx.random.normal((batch, H, tokens, D)).astype(dtype)
    empty = mx.zeros((0,), dtype)
    tail = 40  # a KIVI-like open part: at least 40 exact keys (whole groups packed), 64 exact values
    splits = {"kivi-4bit": [4], "age 2+4+8": [2, 4, 8], "epochs 2+4": [2, 4], "3-bit+4": [3, 4]}
    parts, ks, vs = [], [], []
    if kind == "heads 2|4":  # half the heads at 2 bits, half at 4 (per-head widths)
        body = (tokens - tail) // G * G
        for bits, heads in ((2, mx.arange(0, H, 2)), (4, mx.arange(1, H, 2))):
            pk, pv = packed(k[:, heads, :body], bits, "channel"), packed(v[:, heads, :body], bits, "token")
            parts.append(DecodePart(pk.layout(empty), None, pv.layout(empty), None, heads=heads))
        hist_k, hist_v = mx.zeros((batch, H, body, D)), mx.zeros((batch, H, body, D))
        for p in parts:
            hist_k[:, p.heads] = _layout_tokens(p.keys, "channel")
            hist_v[:, p.heads] = _layout_tokens(p.values, "token")
        parts.append(DecodePart(None, k[:, :, body:], None, v[:, :, body:]))
        return parts, mx.concatenate([hist_k, k[:, :, body:].astype(mx.float32)], 2), \
            mx.concatenate([hist_v, v[:, :, body:].astype(mx.float32)], 2)
    widths = splits[kind]
    body = (tokens - tail) // G // len(widths) * G
    start = 0
    for i, bits in enumerate(widths):
        last = i == len(widths) - 1
        stop = (tokens - tail) // G * G if last else start + body
        if last:  # the open part: packed keys to stop, exact keys after; values 64 later
            pk, pv = packed(k[:, :, start:stop], bits, "channel"), packed(v[:, :, start:stop - 64], bits, "token")
            parts.append(DecodePart(pk.layout(empty), k[:, :, stop:], pv.layout(empty), v[:, :, stop - 64:]))
            ks += [_f32(pk), k[:, :, stop:].astype(mx.float32)]
            vs += [_f32(pv), v[:, :, stop - 64:].astype(mx.float32)]
        else:
            pk, pv = packed(k[:, :, start:stop], bits, "channel"), packed(v[:, :, start:stop], bits, "token")
            parts.append(DecodePart(pk.layout(empty), None, pv.layout(empty), None))
            ks.append(_f32(pk))
            vs.append(_f32(pv))
        start = stop
    return parts, mx.concatenate(ks, 2), mx.concatenate(vs, 2)


def _f32(p: PackedTokens) -> mx.array:
    """The packed tokens dequantized in float32 (scales and minima upcast first)."""
    return _layout_tokens(p.layout(mx.zeros((0,))), p.codec.axis)


def _layout_tokens(layout, axis):
    n, g, bits = layout.count, layout.group, layout.bits
    if axis == "channel":
        codes, scales, biases = layout.codes[..., : n * bits // 32], layout.scales[..., : n // g], layout.biases[..., : n // g]
    else:
        codes, scales, biases = layout.codes[:, :, :n], layout.scales[:, :, :n], layout.biases[:, :, :n]
    x = mx.dequantize(codes, scales.astype(mx.float32), biases.astype(mx.float32), group_size=g, bits=bits)
    return x.swapaxes(-1, -2) if axis == "channel" else x


KINDS = ["kivi-4bit", "epochs 2+4", "age 2+4+8", "heads 2|4", "3-bit+4"]


def check(contexts, batches) -> bool:
    ok = True
    for kind in KINDS:
        for batch in batches:
            for tokens in contexts:
                parts, kf, vf = store(kind, batch, tokens)
                q = mx.random.normal((batch, HQ, 1, D)).astype(mx.float16)
                out = decode_attention(q, parts, scale=D**-0.5).astype(mx.float32)
                ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), kf, vf, scale=D**-0.5)
                err = float(mx.linalg.norm((out - ref).flatten()) / mx.linalg.norm(ref.flatten()))
                passed = err < 1e-3 and bool(mx.all(mx.isfinite(out)))
                ok &= passed
                print(f"check {kind:11s} batch {batch} {tokens:6d} tokens: rel err {err:.2e} "
                      f"{'ok' if passed else 'FAILED'}", flush=True)
    return ok


def chained_us(fn, q0, calls=64, batches=7) -> float:
    def run():
        q = q0
        for _ in range(calls):
            q = fn(q).astype(q0.dtype)
        return q

    mx.eval(run())
    times = []
    for _ in range(batches):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(run())
        mx.synchronize()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def table(contexts, batches) -> list[str]:
    rows = ["| store | batch | tokens | us per call | fp16 SDPA us | ratio |", "|---|---:|---:|---:|---:|---:|"]
    for batch in batches:
        for tokens in contexts:
            k = mx.random.normal((batch, H, tokens, D)).astype(mx.float16)
            v = mx.random.normal((batch, H, tokens, D)).astype(mx.float16)
            q0 = mx.random.normal((batch, HQ, 1, D)).astype(mx.float16)
            sdpa = chained_us(lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5), q0)
            for kind in KINDS:
                parts, _, _ = store(kind, batch, tokens)
                us = chained_us(lambda q: decode_attention(q, parts, scale=D**-0.5), q0)
                rows.append(f"| {kind} | {batch} | {tokens} | {us:.1f} | {sdpa:.1f} | {sdpa / us:.2f}x |")
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="the check only")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    print(f"mlx {mx.__version__}, device {mx.default_device()}", flush=True)
    ok = check([1024, 8192], [1, 2])
    if not args.check:
        rows = table(args.contexts, args.batches)
        text = "\n".join(rows)
        print("\n" + text)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "segments.md"), "w") as f:
                f.write(text + "\n")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
