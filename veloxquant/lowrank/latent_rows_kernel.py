"""A run's latent rows in one launch: what a CUDA decode step of a latent store attends over.

``LatentStore._fused_attention`` runs one fused attention in the latent space over every
latent of a run, in the queries' dtype, zero-padded to a fused width. In MLX ops the rows
are a dequantization of each stored span (over its buffers' room), a cut to the tokens held,
a join along the channels with zeros where channels are dropped and past the rank, and a
join along the tokens with the full-precision window: on an H100, 153 us of copies a layer
and step for palu and 89 for svdq (``benchmarks/results/h200_s79``). This kernel writes the
rows in one pass, for keys or for values:

- a thread owns channel c of token t of one row of the lead (batch row and head group);
- a token of the window (t at or past ``flushed``) reads its row of the window's buffer
  (from the window's first row ``start``), 0 past the rank;
- any other token reads the span that holds channel c: a packed span its code (little-endian
  in the channel's words, at ``t * BITS`` bits), then ``code * scale + min`` with its token
  group's scale and minimum, in float32, then the output dtype; an unquantized span its row;
  a dropped channel, or one past the rank, 0;
- the spans' channel bounds, widths and kinds are constants of the kernel's source (a
  layout is one kernel); the counts and the buffers' rooms are parameters, so a step or a
  buffer that grows makes no new kernel.

The values are the float32 pass's, rounded once to the output dtype (the MLX pass in float16
rounds the product and the sum each); CUDA may fuse the product and the sum, so a value may
differ from the float32 pass by one float32 rounding before the cast
(``kernels/checks.within_a_rounding``). Packed widths 1, 2, 4 and 8 (a code never crosses a
word); other layouts keep MLX's ops. The first use of a layout checks the kernel against
the float32 pass on a random case of that layout, once a process; a failure keeps MLX's ops.
It runs only with ``VQ_LATENT_ROWS_KERNEL=1``: on an H100 it passed its checks but did not
make a whole decode step faster, and each process compiles a kernel a layout
(``benchmarks/notes/latent_decode.md``).
The CUDA source is run on the CPU by emulation (tests). The Metal twin mirrors it line for
line: UNTESTED ON HARDWARE.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from ..kernels import kivi_decode as kd
from ..kernels.checks import checked_once, gpu_kernel, within_a_rounding

NT = 256
KERNEL_BITS = (1, 2, 4, 8)  # packed widths whose codes never cross a word
# "1" runs the kernel on a GPU; off by default until a device times it against MLX's ops
# (benchmarks/latent_rows.py, results/h200_s80/run62.sh); read at import
SWITCH = "VQ_LATENT_ROWS_KERNEL"
_SWITCHED_ON = os.environ.get(SWITCH) == "1"


@dataclass(frozen=True)
class Span:
    """Channels [start, stop) of a run: ``bits`` 0 dropped, 1-8 packed, 16 or more unquantized."""

    start: int
    stop: int
    bits: int

    @property
    def kind(self) -> str:
        return "dropped" if self.bits == 0 else ("packed" if self.bits < 16 else "exact")


@dataclass(frozen=True)
class RowsLayout:
    """A run as the kernel reads it: its spans, the rank, the token group and the window's
    dtype-free shape facts; ``source``'s constants."""

    spans: tuple[Span, ...]
    rank: int
    group: int

    def takes(self) -> bool:
        return all(s.kind != "packed" or s.bits in KERNEL_BITS for s in self.spans)

    @property
    def name(self) -> str:
        parts = "_".join(f"{s.start}x{s.stop}b{s.bits}" for s in self.spans)
        return f"vq_latent_rows_r{self.rank}_g{self.group}_{parts}"

    def input_names(self) -> list[str]:
        names = ["window"]
        for j, s in enumerate(self.spans):
            names += [f"s{j}_codes", f"s{j}_scales", f"s{j}_minima"] if s.kind == "packed" else \
                [f"s{j}_rows"] if s.kind == "exact" else []
        return names + ["params"]


def _span_branches(layout: RowsLayout) -> str:
    """The source that sets ``v`` for a stored token (t < flushed) from the span of channel c."""
    out, param = [], 4  # params: count, flushed, the window's first row and room, then two a span
    for j, s in enumerate(layout.spans):
        width = s.stop - s.start
        head = "if" if not out else "} else if"
        if s.kind == "packed":
            mask = (1 << s.bits) - 1
            out.append(f"""  {head} (c < {s.stop}) {{
    const size_t row = (size_t)lead * {width} + (c - {s.start});
    const unsigned int word = s{j}_codes[row * params[{param}] + ((t * {s.bits}) >> 5)];
    const unsigned int code = (word >> ((t * {s.bits}) & 31)) & {mask}u;
    const size_t g = row * params[{param + 1}] + t / GROUP;
    v = (float)code * (float)s{j}_scales[g] + (float)s{j}_minima[g];""")
        elif s.kind == "exact":
            out.append(f"""  {head} (c < {s.stop}) {{
    v = (float)s{j}_rows[((size_t)lead * params[{param}] + t) * {width} + (c - {s.start})];""")
        else:  # dropped: v stays 0
            out.append(f"""  {head} (c < {s.stop}) {{""")
        param += 2
    return "\n".join(out) + "\n  }\n" if out else ""


def source(layout: RowsLayout, metal: bool = False) -> str:
    """The kernel body for ``layout`` (CUDA, or Metal's twin)."""
    if metal:
        index = "const size_t i = size_t(threadgroup_position_in_grid.x) * NT + thread_position_in_threadgroup.x;"
        lead = "const int lead = int(threadgroup_position_in_grid.y);"
    else:
        index = "const size_t i = (size_t)blockIdx.x * NT + threadIdx.x;"
        lead = "const int lead = (int)blockIdx.y;"
    body = f"""
  const int count = params[0];
  const int flushed = params[1];
  const int window_start = params[2];
  const int window_room = params[3];
  {index}
  if (i >= (size_t)count * WIDTH) return;
  {lead}
  const int t = (int)(i / WIDTH);
  const int c = (int)(i - (size_t)t * WIDTH);
  float v = 0.0f;  // past the rank and in dropped channels
  if (c < RANK && t >= flushed) {{
    v = (float)window[((size_t)lead * window_room + window_start + (t - flushed)) * RANK + c];
  }} else if (c < RANK) {{
{_span_branches(layout)}  }}
  out[(size_t)lead * count * WIDTH + i] = (T)v;
"""
    return body  # C-style casts and ``unsigned int`` are Metal's too: the rest is the same text


def _kernel(backend: str, layout: RowsLayout):
    return gpu_kernel(backend, layout.name, tuple(layout.input_names()), ("out",),
                      (source(layout), source(layout, metal=True)))


def launch_args(layout: RowsLayout, window, window_start: int, span_arrays: list, flushed: int, count: int,
                width: int, dtype, lead: tuple[int, int]) -> dict:
    """The launch: ``window`` the window's buffer (B, G, room, rank) or None, its first row
    ``window_start``; ``span_arrays`` each span's buffers (packed: codes (B, G, C, words),
    scales and minima (B, G, C, groups); unquantized: rows (B, G, room, C); dropped: none);
    ``flushed`` tokens in the spans, ``count`` rows written: (B, G, count, width) in ``dtype``."""
    b, g = lead
    params = [count, flushed, window_start, 0 if window is None else window.shape[2]]
    inputs = [window if window is not None else mx.zeros((1,), dtype)]
    for s, arrays in zip(layout.spans, span_arrays):
        if s.kind == "packed":
            codes, scales, minima = arrays
            params += [codes.shape[-1], scales.shape[-1]]
            inputs += [codes, scales, minima]
        elif s.kind == "exact":
            (rows,) = arrays
            params += [rows.shape[2], 0]
            inputs.append(rows)
        else:
            params += [0, 0]
    inputs.append(mx.array(params, mx.int32))
    return dict(inputs=inputs,
                template=[("T", dtype), ("WIDTH", width), ("RANK", layout.rank), ("GROUP", layout.group), ("NT", NT)],
                grid=(-(-count * width // NT) * NT, b * g, 1), threadgroup=(NT, 1, 1),
                output_shapes=[(b, g, count, width)], output_dtypes=[dtype])


def reference(layout: RowsLayout, window, window_start: int, span_arrays: list, flushed: int, count: int,
              width: int, dtype, lead: tuple[int, int]) -> mx.array:
    """The rows by MLX's ops in float32, cast once to ``dtype``: what the kernel writes."""
    b, g = lead
    cols = []
    for s, arrays in zip(layout.spans, span_arrays):
        if s.kind == "packed":
            codes, scales, minima = arrays
            x = kd.unpacked_affine(codes, scales.astype(mx.float32), minima.astype(mx.float32), layout.group, s.bits)
            cols.append(x[..., :flushed].swapaxes(-1, -2))
        elif s.kind == "exact":
            cols.append(arrays[0][:, :, :flushed].astype(mx.float32))
        else:
            cols.append(mx.zeros((b, g, flushed, s.stop - s.start)))
    parts = [mx.concatenate(cols, axis=-1)] if flushed and cols else []
    if count > flushed:
        parts.append(window[:, :, window_start : window_start + count - flushed].astype(mx.float32))
    rows = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
    return mx.pad(rows, [(0, 0)] * 3 + [(0, width - layout.rank)]).astype(dtype)


def runs_for(layout: RowsLayout, dtype) -> bool:
    """Whether the kernel writes this layout's rows in ``dtype`` here: on a GPU, a layout it
    reads (``RowsLayout.takes``), a kernel that passed its check; else the caller runs MLX's ops."""
    if not _SWITCHED_ON:  # first: a decode step asks this of every run
        return False
    backend = kd.gpu_backend()
    return backend is not None and layout.takes() and kernel_checked(backend, layout, dtype)


def latent_rows(layout: RowsLayout, window, window_start: int, span_arrays: list, flushed: int, count: int,
                width: int, dtype, lead: tuple[int, int]) -> mx.array:
    """The rows through the kernel (where ``runs_for``)."""
    args = launch_args(layout, window, window_start, span_arrays, flushed, count, width, dtype, lead)
    return _kernel(kd.gpu_backend(), layout)(**args)[0]


_CHECKED: dict = {}


def kernel_checked(backend: str, layout: RowsLayout, dtype) -> bool:
    """Whether the kernel of ``layout`` passed its check for ``dtype``
    (``checks.checked_once``): a random case of the layout against ``reference``."""
    return checked_once(_CHECKED, backend, (backend, layout, str(dtype)),
                        lambda: _check_problem(backend, layout, dtype),
                        "latent-rows kernel", "latent rows are joined through MLX's ops instead")


def random_case(layout: RowsLayout, dtype, lead=(2, 3), flushed: int | None = None, window_rows: int = 5,
                seed: int = 0):
    """Buffers of ``layout`` with spare room (the way a store holds them): (window,
    window_start, span_arrays, flushed, count)."""
    g = layout.group
    flushed = 3 * g if flushed is None else flushed
    room_tokens = flushed + 2 * g
    keys = iter(mx.random.split(mx.random.key(seed), 4 * len(layout.spans) + 2))
    arrays = []
    for s in layout.spans:
        c = s.stop - s.start
        if s.kind == "packed":
            words = room_tokens * s.bits // 32
            codes = mx.random.randint(0, 1 << 30, (*lead, c, words), key=next(keys)).astype(mx.uint32)
            codes = codes * 3 + mx.random.randint(0, 3, codes.shape, key=next(keys)).astype(mx.uint32)
            scales = mx.random.uniform(0.01, 0.5, (*lead, c, room_tokens // g), key=next(keys)).astype(dtype)
            minima = mx.random.normal((*lead, c, room_tokens // g), key=next(keys)).astype(dtype)
            arrays.append((codes, scales, minima))
        elif s.kind == "exact":
            arrays.append((mx.random.normal((*lead, room_tokens, c), key=next(keys)).astype(dtype),))
        else:
            arrays.append(())
    window_start = 1
    window = mx.random.normal((*lead, window_start + window_rows + 3, layout.rank), key=next(keys))
    return window, window_start, arrays, flushed, flushed + window_rows


def _check_problem(backend: str, layout: RowsLayout, dtype) -> Optional[str]:
    width = layout.rank + 7
    window, start, arrays, flushed, count = random_case(layout, dtype)
    try:
        got = _kernel(backend, layout)(**launch_args(layout, window, start, arrays, flushed, count, width, dtype,
                                                     (2, 3)))[0]
        ref = reference(layout, window, start, arrays, flushed, count, width, dtype, (2, 3))
        same = got.shape == ref.shape and within_a_rounding(got, ref)
    except Exception as exc:  # a kernel that does not compile or launch fails its check
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None if same else "rows differ from the float32 pass's"
