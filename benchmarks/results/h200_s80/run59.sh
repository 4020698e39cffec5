#!/bin/bash
# Session 80 (issue 30): the latent-rows kernel (lowrank/latent_rows_kernel.py) on CUDA: its
# self-check for palu's and svdq's layouts, then palu and svdq at 4k beside KVCache with the
# kernel and without it (VQ_LATENT_ROWS_KERNEL=0), each arm its own process. After the c1 and
# c2 calls, carry [".device/c3"]. About 8 minutes (a fresh machine compiles the first prefills).
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
python3 - <<'PY' 2>&1 | tee $OUT/latent_rows_check.txt
import veloxquant_mlx
import mlx.core as mx
from veloxquant_mlx.lowrank import latent_rows_kernel as lr
layouts = {"palu": lr.RowsLayout((lr.Span(0, 53, 4), lr.Span(53, 209, 2)), 209, 32),
           "svdq": lr.RowsLayout((lr.Span(0, 14, 8), lr.Span(14, 28, 4), lr.Span(28, 42, 2), lr.Span(42, 70, 1),
                                  lr.Span(70, 110, 0)), 110, 32)}
for name, layout in layouts.items():
    for dtype in (mx.float16, mx.bfloat16, mx.float32):
        print(name, dtype, "kernel runs:", lr.runs_for(layout, dtype))
    case = lr.random_case(layout, mx.float16, lead=(1, 8), flushed=4064, window_rows=31)
    got = lr.latent_rows(layout, *case, 256, mx.float16, (1, 8))
    ref = lr.reference(layout, *case, 256, mx.float16, (1, 8))
    print(name, "4k case within a rounding:", lr.within_a_rounding(got, ref))
PY
METHODS="palu svdq" TAG=rows CALL_S=${A_S:-230} bash benchmarks/results/h200_s74/run42.sh
VQ_LATENT_ROWS_KERNEL=0 METHODS="palu svdq" TAG=rows_off CALL_S=${B_S:-230} bash benchmarks/results/h200_s74/run42.sh
true
