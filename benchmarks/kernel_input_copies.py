"""Which custom-kernel launches get an input that MLX copies before the launch, per method.

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


def row_contiguous(x: mx.array) -> bool | None:
    """Whether ``x`` (evaluated) is row-contiguous as MLX lays it out; None where numpy cannot
    take its dtype."""
    mx.eval(x)
    try:
        return bool(np.from_dlpack(x).flags.c_contiguous)
    except (TypeError, RuntimeError, BufferError, ValueError):
        try:
            return bool(np.from_dlpack(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x).flags.c_contiguous)
        except Exception:  # noqa: BLE001
            return None


class Recorder:
    """``mx.fast.cuda_kernel`` as a factory of launch nodes that record, per phase, each launch
    whose inputs MLX would copy: (kernel, input) -> [launches, largest bytes copied]."""

    def __init__(self):
        self.phase = "prefill"
        self.copies = {"prefill": collections.defaultdict(lambda: [0, 0]),
                       "decode": collections.defaultdict(lambda: [0, 0])}
        self.launches = collections.Counter()
        self.kernels = {}  # name -> (source, header) of each kernel made

    def factory(self, *, name, input_names, source="", header="", ensure_row_contiguous=True, **_):
        recorder = self
        self.kernels[name] = (source, header)

        class Launch(ds._LaunchNode):
            def __call__(self, *, inputs, output_shapes, output_dtypes, **kw):
                recorder.launches[recorder.phase] += 1
                if ensure_row_contiguous:
                    for input_name, x in zip(input_names, inputs):
                        if isinstance(x, mx.array) and x.ndim and row_contiguous(x) is False:
                            entry = recorder.copies[recorder.phase][(name, input_name, x.shape)]
                            entry[0] += 1
                            entry[1] = max(entry[1], x.nbytes)
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
    print("| method | launches (prefill / decode) | copied inputs: kernel, input, shape, phase, launches, "
          "largest bytes |")
    print("|---|---:|---|")
    for method in args.methods or implemented_methods():
        r = audit(method, getattr(mx, args.dtype))
        found = [f"{k} `{i}` {tuple(s)} {phase} x{n} ({b:,} B)"
                 for phase, table in r.copies.items() for (k, i, s), (n, b) in sorted(table.items())]
        print(f"| {method} | {r.launches['prefill']} / {r.launches['decode']} | {'; '.join(found) or '-'} |",
              flush=True)


if __name__ == "__main__":
    main()
