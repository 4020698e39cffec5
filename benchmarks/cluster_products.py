"""Which of a decode step's matrix products cuBLAS runs with a thread-block cluster taller
than 1 in y or z, on a CUDA machine under Nsight Compute.

MLX re-instantiates, at every commit, a CUDA graph that holds such a kernel (it cannot
update it in place: ``benchmarks/notes/cuda_graphs.md``; ``subgraph_to_key`` and ``commit``
in ``mlx/backend/cuda/device.cpp``), a millisecond-scale cost per layer and step.
``decode_kernels.py`` names the kernel but not the product that launched it. Here each
product runs alone, preceded by a marker kernel (``mx.sin`` of four numbers), so the
profile tells which product launched which kernel: by default spectral's decode products
at the 8B shape (8 KV heads of 128, 4 query rows a head, ``--tokens`` rows of history) and
candidate rewrites of them; with ``--shapes``, the products of a ``decode_products.py``
census (the flagged ones, or ``--all``).

    # on the device (ncu), then the table
    ncu --metrics gpu__time_duration.sum,launch__cluster_dim_y,launch__cluster_dim_z --csv \\
        python3 benchmarks/cluster_products.py --tokens 4352 > products.csv
    python3 benchmarks/cluster_products.py --report products.csv
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MARKER = "Sin"  # the marker kernel, launched alone before each product: the k-th starts product k


def products(tokens: int, heads: int = 8, dim: int = 128, rows: int = 4):
    """(label, thunk) for each product, float32 unless named."""
    from veloxquant_mlx.kernels.kivi_decode import token_mix  # first: it may load OpenBLAS

    import mlx.core as mx

    f16 = mx.float16
    basis = mx.random.normal((1, heads, dim, dim))
    z = mx.random.normal((1, heads, tokens, dim))
    zt = mx.contiguous(z.swapaxes(-1, -2))
    q = mx.random.normal((1, heads, rows, dim))
    p = mx.random.normal((1, heads, rows, tokens))
    half = dim // 2
    signs = mx.where(mx.random.normal((1, heads, tokens, 4)) > 0, 1.0, -1.0)
    sketch = mx.random.normal((4, 4))
    mx.eval(basis, z, zt, q, p, signs, sketch)
    return [
        ("basis @ z^T (keys rebuilt, the z view transposed)", lambda: basis @ z.swapaxes(-1, -2)),
        ("basis @ z^T, z^T contiguous", lambda: basis @ zt),
        ("z @ basis^T (keys rebuilt as rows)", lambda: z @ basis.swapaxes(-1, -2)),
        ("basis @ z^T, float16", lambda: basis.astype(f16) @ z.swapaxes(-1, -2).astype(f16)),
        ("z @ basis^T, float16", lambda: z.astype(f16) @ basis.swapaxes(-1, -2).astype(f16)),
        ("q half @ keys half (turned scores)", lambda: q[..., :half] @ zt[..., :half, :]),
        ("addmm of the other half", lambda: mx.addmm(q[..., :half] @ zt[..., :half, :], q[..., half:],
                                                     zt[..., half:, :])),
        ("q @ z^T (scores in the basis)", lambda: q @ z.swapaxes(-1, -2)),
        ("p @ z (values mixed)", lambda: p @ z),
        ("out @ basis^T (mix back out of the basis)", lambda: q @ basis.swapaxes(-1, -2)),
        ("basis halves @ z^T (the two rotary halves apart, M = 64 each)",
         lambda: [basis[..., :half, :] @ z.swapaxes(-1, -2), basis[..., half:, :] @ z.swapaxes(-1, -2)]),
        ("float32 basis @ z^T over each head alone", lambda: mx.concatenate(
            [basis[:, h : h + 1] @ z[:, h : h + 1].swapaxes(-1, -2) for h in range(heads)], axis=1)),
    ] + [(f"basis @ z^T over {n} tokens", lambda n=n: basis @ z[:, :, :n].swapaxes(-1, -2))
         for n in (256, 512, 1024, 2048)] + [
        ("basis @ z^T in token blocks of 512", lambda: [basis @ z[:, :, i : i + 512].swapaxes(-1, -2)
                                                        for i in range(0, tokens, 512)]),
        ("basis @ z^T, bfloat16", lambda: basis.astype(mx.bfloat16) @ z.swapaxes(-1, -2).astype(mx.bfloat16)),
        ("QJL signs @ sketch (n x 4 by 4 x 4, the keys' correction)", lambda: signs @ sketch),
        ("p @ z with the token axis cut in 512s (token_mix on CUDA)", lambda: token_mix(p, z)),
    ]


def census_products(path: str, everything: bool):
    """(label, thunk) for each product of a ``decode_products.py --out`` census: random
    operands of each recorded shape and dtype, flagged ones only unless ``everything``; a
    product of one row (the model's projections: MLX's own gemv) is left out."""
    import json

    from decode_products import flagged  # first: it imports veloxquant_mlx, which may load OpenBLAS

    import mlx.core as mx

    cases, seen = [], set()
    for method, products in json.loads(open(path).read()).items():
        for p in products:
            a, b, dtypes = tuple(p["a"]), tuple(p["b"]), p["dtypes"]
            key = (p["kind"], a, b, tuple(dtypes))
            if key in seen or math.prod(a[:-1]) == 1 or not (everything or flagged(a, b, dtypes)):
                continue
            seen.add(key)
            x = mx.random.normal(a).astype(getattr(mx, dtypes[0]))
            y = mx.random.normal(b).astype(getattr(mx, dtypes[1]))
            mx.eval(x, y)
            cases.append((f"{method}: {a} x {b} {'/'.join(dtypes)}", lambda x=x, y=y: x @ y))
    return cases


def run(cases) -> None:
    import mlx.core as mx

    marker_input = mx.full((4,), 0.5)
    mx.eval(marker_input)
    for _, thunk in cases:  # every kernel chosen and compiled before the profiled pass
        mx.eval(thunk())
    mx.synchronize()
    for k, (label, thunk) in enumerate(cases):
        mx.eval(getattr(mx, MARKER.lower())(marker_input))
        mx.synchronize()
        mx.eval(thunk())
        mx.synchronize()
        print(f"# {k}: {label}", flush=True)


def report(path: str) -> None:
    """One line per product: its kernels, grid, cluster (y, z) and microseconds."""
    text = open(path).read()
    labels = [line[2:].split(": ", 1)[1] for line in text.splitlines() if line.startswith("# ")]
    body = "\n".join(line for line in text.splitlines() if line.startswith('"'))
    launches: dict[str, dict] = {}
    order: list[str] = []
    for row in csv.DictReader(io.StringIO(body)):
        key = row["ID"]
        if key not in launches:
            launches[key] = {"name": row["Kernel Name"], "grid": row["Grid Size"]}
            order.append(key)
        launches[key][row["Metric Name"]] = row["Metric Value"]
    print("| product | kernel | grid | cluster y, z | us |")
    print("|---|---|---|---|---:|")
    current, markers = None, 0
    for key in order:
        launch = launches[key]
        if MARKER in re.findall(r"mlx::(?:cu::)?(\w+)[,>]", launch["name"]):  # whole names: Sin is not Sinh
            current = labels[markers] if markers < len(labels) else None
            markers += 1
            continue
        if current is None:
            continue
        us = float(launch.get("gpu__time_duration.sum", "0").replace(",", "")) / 1e3
        cluster = f"{launch.get('launch__cluster_dim_y', '?')}, {launch.get('launch__cluster_dim_z', '?')}"
        name = launch["name"].split("(")[0][:70]
        print(f"| {current} | {name} | {launch['grid']} | {cluster} | {us:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4352, help="rows of history (4,352: a 4k prompt's buffer)")
    ap.add_argument("--report", metavar="CSV", help="print the table of a finished ncu run")
    ap.add_argument("--shapes", metavar="JSON", help="the products of a decode_products.py census instead "
                                                     "(its flagged ones; --all: every one)")
    ap.add_argument("--all", action="store_true")
    args = ap.parse_args()
    if args.report:
        report(args.report)
    else:
        run(census_products(args.shapes, args.all) if args.shapes else products(args.tokens))


if __name__ == "__main__":
    main()
