"""Which custom-kernel launches (and fused attention calls) get an input that MLX copies
before running them, per method.

``mx.fast.cuda_kernel`` (and ``metal_kernel``) with ``ensure_row_contiguous`` (the default)
copy every input that is not row-contiguous (a view of a larger buffer, a transpose, a
broadcast) before each launch, and keep the copy until the command buffer ends
(``CustomKernel::eval_gpu``). The copy is no node of the step's graph, so the graph census
(``decode_graph.py``) does not see it; in a decode step it is a pass over whatever the input
holds (a store's history: O(context) work a step), and in a prefill a buffer that outlives
its launch. This runs each method on the tiny model as the CUDA path builds its steps
(``tests/decode_steps.steps_as_on_cuda``: the package's dispatchers see CUDA; a launch is one
node, its values wrong), records every launch's inputs, evaluates them and reads their layout
(``np.from_dlpack``: strides), over the prompt's chunks and 40 decode steps after the warm-up.
Views are made by the same primitives on the CPU as on a GPU, so the layouts are the GPU's.
The inputs of each ``mx.fast.scaled_dot_product_attention`` call are held to the CUDA
back-end's own copy rules (``attention_copies``), outside compiled functions (a trace has no
layouts to read).

    python benchmarks/kernel_input_copies.py                  # every method
    python benchmarks/kernel_input_copies.py kivi palu        # these
"""

from __future__ import annotations

import argparse
import collections
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import veloxquant_mlx  # noqa: E402,F401  (first: it may load OpenBLAS)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import decode_steps as ds  # noqa: E402
from veloxquant_mlx.registry import implemented_methods  # noqa: E402


def _as_numpy(x: mx.array) -> np.ndarray | None:
    """``x`` evaluated and seen through numpy with MLX's own strides (bfloat16 as its 16-bit
    words); None inside a compiled function's trace (no layout to read) or for a dtype numpy
    cannot take."""
    try:
        mx.eval(x)
        return np.from_dlpack(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x)
    except Exception:  # noqa: BLE001
        return None


def row_contiguous(x: mx.array) -> bool | None:
    """Whether ``x`` is row-contiguous as MLX lays it out (None: not known, ``_as_numpy``)."""
    a = _as_numpy(x)
    return None if a is None else bool(a.flags.c_contiguous)


def strides(x: mx.array) -> list[int] | None:
    """``x``'s strides in elements as MLX lays it out (None: not known, ``_as_numpy``)."""
    a = _as_numpy(x)
    return None if a is None else [s // a.itemsize for s in a.strides]


def attention_copies(q: mx.array, k: mx.array, v: mx.array) -> list[str] | None:
    """Which of ``mx.fast.scaled_dot_product_attention``'s inputs MLX's CUDA back-end (0.32)
    copies before attending (``ScaledDotProductAttention::eval_gpu``): with at most 8 queries
    (its vector kernels) the queries unless row-contiguous (or, with one sequence or head, the
    model's transposed layout), keys and values unless their last axis is adjacent and their
    batch and head axes are one run; with more queries, any input whose last axis is not.
    None inside a compiled function's trace."""
    sq = strides(q)
    if sq is None:
        return None
    if q.shape[2] > 8:
        return [name for name, x in (("queries", q), ("keys", k), ("values", v))
                if (strides(x) or [1])[-1] != 1]
    copied = []
    b, h = q.shape[0], q.shape[1]
    lead = 1 if b == 1 else 0  # the singleton's other axis may be transposed with the tokens'
    if not (row_contiguous(q) or ((b == 1 or h == 1) and sq[3] == 1 and sq[2] == q.shape[3] * q.shape[lead]
                                  and sq[lead] == q.shape[3])):
        copied.append("queries")
    for name, x in (("keys", k), ("values", v)):
        sx = strides(x)
        if sx is not None and not (sx[-1] == 1 and (x.shape[0] == 1 or x.shape[1] == 1 or
                                                    sx[0] == sx[1] * x.shape[1])):
            copied.append(name)
    return copied


class Recorder:
    """``mx.fast.cuda_kernel`` as a factory of launch nodes that record, per phase, each launch
    whose inputs MLX would copy: (kernel, input) -> [launches, largest bytes copied]."""

    def __init__(self):
        self.phase = "prefill"
        self.copies = {"prefill": collections.defaultdict(lambda: [0, 0]),
                       "decode": collections.defaultdict(lambda: [0, 0])}
        self.launches = collections.Counter()
        self.kernels = {}  # name -> (source, header) of each kernel made
        self.attention = collections.Counter()  # fused attention calls whose inputs were read

    def note_copy(self, op: str, input_name: str, x: mx.array) -> None:
        entry = self.copies[self.phase][(op, input_name, x.shape)]
        entry[0] += 1
        entry[1] = max(entry[1], x.nbytes)

    def factory(self, *, name, input_names, source="", header="", ensure_row_contiguous=True, **_):
        recorder = self
        self.kernels[name] = (source, header)

        class Launch(ds._LaunchNode):
            def __call__(self, *, inputs, output_shapes, output_dtypes, **kw):
                recorder.launches[recorder.phase] += 1
                if ensure_row_contiguous:
                    for input_name, x in zip(input_names, inputs):
                        if isinstance(x, mx.array) and x.ndim and row_contiguous(x) is False:
                            recorder.note_copy(name, input_name, x)
                return super().__call__(inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes,
                                        **kw)

        return Launch()


def audit(method: str, dtype) -> Recorder:
    """One method's launches, the tiny model's weights in ``dtype`` (float16: the fused
    prompt-mass kernels' path, which takes 16-bit queries and keys only)."""
    from veloxquant_mlx.evict import fused_mass_kernel, mass_kernel
    from veloxquant_mlx.methods import keyformer

    recorder = Recorder()
    checks = (mass_kernel.kernel_checked, fused_mass_kernel.kernel_checked, keyformer._fused_backend)
    with ds.steps_as_on_cuda():
        mx.fast.cuda_kernel = recorder.factory
        attention = mx.fast.scaled_dot_product_attention  # the census's stand-in

        def recorded_attention(q, k, v, *args, **kwargs):
            copied = attention_copies(q, k, v)
            recorder.attention[recorder.phase] += copied is not None
            for name in copied or ():
                recorder.note_copy("scaled_dot_product_attention", name, {"queries": q, "keys": k, "values": v}[name])
            return attention(q, k, v, *args, **kwargs)

        mx.fast.scaled_dot_product_attention = recorded_attention
        # the prompt-mass kernels (not among the census's stand-ins: prefill only) run too,
        # keyformer's noise through them
        mass_kernel.kernel_checked = fused_mass_kernel.kernel_checked = lambda *key: True
        keyformer._fused_backend = fused_mass_kernel.kernel_backend
        try:
            model, cache, token = ds.prefilled(method, dtype=dtype)
            recorder.phase = "decode"
            y = ds.decode_overlapped(model, cache, token, ds.WARMUP + 40)
            mx.eval(y)
        finally:
            mass_kernel.kernel_checked, fused_mass_kernel.kernel_checked, keyformer._fused_backend = checks
    return recorder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("methods", nargs="*", help="method keys (default: every implemented method)")
    ap.add_argument("--dtype", choices=("float32", "float16"), default="float16")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    print("| method | kernel launches (prefill / decode) | attention calls read (prefill / decode) | copied inputs: "
          "kernel, input, shape, phase, launches, largest bytes |")
    print("|---|---:|---:|---|")
    for method in args.methods or implemented_methods():
        r = audit(method, getattr(mx, args.dtype))
        found = [f"{k} `{i}` {tuple(s)} {phase} x{n} ({b:,} B)"
                 for phase, table in r.copies.items() for (k, i, s), (n, b) in sorted(table.items())]
        print(f"| {method} | {r.launches['prefill']} / {r.launches['decode']} | "
              f"{r.attention['prefill']} / {r.attention['decode']} | {'; '.join(found) or '-'} |", flush=True)


if __name__ == "__main__":
    main()
