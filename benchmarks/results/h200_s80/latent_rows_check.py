"""The latent-rows kernel on the device: its self-check for palu's and svdq's layouts in three
dtypes, then a 4k case of each against the float32 pass (session 80)."""
import veloxquant_mlx
import mlx.core as mx
from veloxquant_mlx.lowrank import latent_rows_kernel as lr

lr._SWITCHED_ON = True  # the kernel itself, whatever VQ_LATENT_ROWS_KERNEL says
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
