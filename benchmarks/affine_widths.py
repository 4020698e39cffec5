"""Group-affine packing on this device against the CPU, every width the stores use.

svdq keeps its key latents per channel in 8, 4, 2 and 1-bit segments (``mx.quantize`` along
the tokens, blocks appended word by word); on the H200 its logits left the CPU run's even in
float32 (benchmarks/results/cuda_paths.md) while no near-tie explained it. This script
checks, for widths 1-8 and groups 32/64/128, in float16 and float32:

1. ``mx.quantize`` on the default device against the CPU stream: the codes bit for bit, the
   scales and biases to the input dtype's rounding;
2. ``mx.dequantize`` of the CPU's codes on the device against the CPU, and ours
   (``quant.affine.dequantize``, which unpacks 1-bit words itself);
3. blocks quantized apart and joined along the words (a store's flushes), read back;
4. ``kivi_decode.affine_key_scores`` (the pure path a GPU takes, through ours) against the CPU's.

Columns are the largest differences, relative to the largest magnitude compared; "codes
equal" is exact. Run on a GPU: ``python benchmarks/affine_widths.py``.
"""

from __future__ import annotations

import argparse

import veloxquant_mlx  # noqa: F401  first: it may load OpenBLAS

import mlx.core as mx  # noqa: E402

from veloxquant_mlx.kernels import kivi_decode as kd  # noqa: E402
from veloxquant_mlx.quant import affine  # noqa: E402

WIDTHS = (1, 2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)


def rel(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / mx.maximum(mx.abs(b).max(), 1e-30)).item()


def check(bits: int, group: int, dtype) -> dict:
    mx.random.seed(bits * 1000 + group)
    # (B, G, channels, tokens): keys stored transposed, quantized along the tokens
    x = (mx.random.normal((1, 4, 16, 512)) * 3).astype(dtype)
    dev = mx.quantize(x, group_size=group, bits=bits)
    cpu = mx.quantize(x, group_size=group, bits=bits, stream=mx.cpu)
    row = {"bits": bits, "group": group, "dtype": str(dtype).split(".")[-1],
           "codes shape equal": dev[0].shape == cpu[0].shape,
           "codes equal": dev[0].shape == cpu[0].shape and mx.array_equal(dev[0], cpu[0]).item(),
           "scales": rel(dev[1], cpu[1]), "biases": rel(dev[2], cpu[2])}
    deq_dev = mx.dequantize(*cpu, group_size=group, bits=bits)
    deq_cpu = mx.dequantize(*cpu, group_size=group, bits=bits, stream=mx.cpu)
    row["dequantize"] = rel(deq_dev, deq_cpu)
    row["ours"] = rel(affine.dequantize(*cpu, group, bits), deq_cpu)
    halves = [mx.quantize(x[..., s:s + 256], group_size=group, bits=bits, stream=mx.cpu) for s in (0, 256)]
    joined = [mx.concatenate([h[i] for h in halves], axis=-1) for i in range(3)]
    row["joined blocks"] = rel(mx.dequantize(*joined, group_size=group, bits=bits),
                               mx.dequantize(*joined, group_size=group, bits=bits, stream=mx.cpu))
    q = mx.random.normal((1, 4, 3, 16)).astype(mx.float32)
    room = [mx.pad(a, [(0, 0)] * 3 + [(0, a.shape[-1])]) for a in cpu]  # spare capacity
    on_dev = kd.affine_key_scores(q, *room, 512, bits, group)
    with mx.stream(mx.cpu):
        on_cpu = q @ mx.dequantize(*cpu, group_size=group, bits=bits).astype(mx.float32)
    row["key scores"] = rel(on_dev, on_cpu)
    return row


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(f"device {mx.default_device()}, MLX {mx.__version__}", flush=True)
    rows = []
    for dtype in (mx.float16, mx.float32):
        for bits in WIDTHS:
            for group in GROUPS:
                try:
                    rows.append(check(bits, group, dtype))
                except Exception as exc:  # noqa: BLE001 - a width this device refuses is a row
                    rows.append({"bits": bits, "group": group, "dtype": str(dtype).split(".")[-1],
                                 "error": f"{type(exc).__name__}: {exc}"[:120]})
    cols = ["dtype", "bits", "group", "codes shape equal", "codes equal", "scales", "biases",
            "dequantize", "ours", "joined blocks", "key scores"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        if "error" in r:
            print(f"| {r['dtype']} | {r['bits']} | {r['group']} | failed: {r['error']} |")
            continue
        print("| " + " | ".join(f"{r[c]:.2e}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
