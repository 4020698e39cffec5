"""The matrix products of each method's steady decode step, with their shapes, on the CPU.

On an H100, cuBLAS ran spectral's QJL correction (a float32 product of 34,816 rows of 4 by
a 4 x 4 sketch) with a thread-block cluster of 3 in y, and MLX instantiates a CUDA graph that
holds such a kernel anew at every commit (``notes/cuda_graphs.md``, session 78). Which kernel
cuBLAS picks can only be seen on the device; this lists, for every method, the products its
step builds, so that the device's ``cluster_products.py --shapes`` can run each shape alone
under ncu. The steps are built as on MLX's CUDA back-end
(``tests/decode_steps.steps_as_on_cuda``): the package sees a GPU as the default device, so
reads that choose their path by it take the GPU's (session 78's census stubbed only the
kernels, and recorded the CPU's reads of cachegen, gear and the other stores that choose by
``kivi_decode._pure_path``). A product is flagged when it is float32 with an inner
dimension of at most ``--max-inner`` over at least ``--min-rows`` rows: the QJL product's
kind.

The model: ``--layers`` layers of Llama-3-8B's attention shape (``host_time.build_model``),
float16, a ``--context``-token prompt, ``--warm`` decode steps, then ``--steps`` steps with
``mx.compile`` off (so that compiled reads run their Python) and every ``@``,
``mx.matmul`` and ``mx.addmm`` recorded; ``--prefill``: the products of the prompt's
prefill instead (2,048-token chunks, as the device's benchmarks prefill).

    python benchmarks/decode_products.py --methods spectral gear --out products.json
    python benchmarks/decode_products.py --flagged-only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_time  # noqa: E402  (imports veloxquant_mlx before mlx; puts tests/ on the path)
from decode_steps import steps_as_on_cuda  # noqa: E402

import mlx.core as mx  # noqa: E402

from veloxquant_mlx import KVCacheConfig  # noqa: E402
from veloxquant_mlx.bench.runner import prefill  # noqa: E402
from veloxquant_mlx.registry import implemented_methods  # noqa: E402


class ProductLog:
    """Records the operands of every product built while ``active``."""

    def __init__(self):
        self.active, self.seen = False, {}
        self._real = (mx.array.__matmul__, mx.matmul, mx.addmm)

    def _note(self, kind, a, b):
        if self.active:
            key = (kind, tuple(a.shape), tuple(b.shape), str(a.dtype).split(".")[-1],
                   str(b.dtype).split(".")[-1])
            self.seen[key] = self.seen.get(key, 0) + 1

    def __enter__(self):
        matmul_op, matmul, addmm = self._real

        def at(a, b):
            self._note("@", a, b)
            return matmul_op(a, b)

        def mm(a, b, **kw):
            self._note("matmul", a, b)
            return matmul(a, b, **kw)

        def add_mm(c, a, b, **kw):
            self._note("addmm", a, b)
            return addmm(c, a, b, **kw)

        mx.array.__matmul__, mx.matmul, mx.addmm = at, mm, add_mm
        return self

    def __exit__(self, *exc):
        mx.array.__matmul__, mx.matmul, mx.addmm = self._real

    @contextlib.contextmanager
    def recording(self):
        """Record inside: ``mx.compile`` off, so that compiled passes run their Python."""
        mx.disable_compile()
        self.active = True
        try:
            yield
        finally:
            self.active = False
            mx.enable_compile()


MAX_INNER, MIN_ROWS = 16, 1024  # a flagged product: float32, inner dimension <= MAX_INNER, rows >= MIN_ROWS


def flagged(a_shape, b_shape, dtypes, max_inner: int = MAX_INNER, min_rows: int = MIN_ROWS) -> bool:
    inner = a_shape[-1]
    rows = math.prod(a_shape[:-1]) if len(b_shape) == 2 else a_shape[-2]
    return "float32" in dtypes and inner <= max_inner and rows >= min_rows


def census(names, context: int, layers: int, warm: int, steps: int, of_prefill: bool = False) -> dict[str, list]:
    """Per method, the products of ``steps`` steady decode steps (per step), or with
    ``of_prefill`` those of the prompt's prefill in 2,048-token chunks (per prefill)."""
    model = host_time.build_model(layers, mx.float16)
    tokens = mx.random.randint(0, model.args.vocab_size, (context,), key=mx.random.key(1))
    found = {}
    for name in names:
        config = host_time.METHODS.get(name) or KVCacheConfig(method=name)
        cache = host_time.make_cache(model, config)
        y = None if of_prefill else mx.argmax(prefill(model, cache, tokens, chunk=512))[None]
        with steps_as_on_cuda(), ProductLog() as log:
            if of_prefill:
                with log.recording():
                    mx.eval(prefill(model, cache, tokens, chunk=2048))
            else:
                for _ in range(warm):
                    y, _ = host_time.timed_step(model, cache, y)
                with log.recording():
                    for _ in range(steps):
                        y, _ = host_time.timed_step(model, cache, y)
        per = 1 if of_prefill else steps
        found[name] = [dict(kind=k, a=list(a), b=list(b), dtypes=[da, db], per_step=n / per)
                       for (k, a, b, da, db), n in log.seen.items()]
        print(f"{name}: {len(found[name])} product shapes", file=sys.stderr, flush=True)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=None, help="method keys (default: every implemented method)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--warm", type=int, default=40, help="steps before the recorded ones (past the first flush)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--max-inner", type=int, default=MAX_INNER)
    ap.add_argument("--min-rows", type=int, default=MIN_ROWS)
    ap.add_argument("--flagged-only", action="store_true")
    ap.add_argument("--prefill", action="store_true", help="the products of the prompt's prefill instead "
                                                           "(2,048-token chunks; the 'a step' column: a prefill)")
    ap.add_argument("--out", help="write the census as JSON (cluster_products.py --shapes reads it)")
    args = ap.parse_args()
    names = args.methods or implemented_methods()
    found = census(names, args.context, args.layers, args.warm, args.steps, args.prefill)
    if args.out:
        Path(args.out).write_text(json.dumps(found, indent=1))
    print(f"| method | product | operands | dtypes | a step | flagged (float32, inner <= {args.max_inner}, "
          f"rows >= {args.min_rows}) |")
    print("|---|---|---|---|---:|---|")
    for name, products in found.items():
        for p in products:
            mark = flagged(p["a"], p["b"], p["dtypes"], args.max_inner, args.min_rows)
            if mark or not args.flagged_only:
                print(f"| {name} | {p['kind']} | {tuple(p['a'])} x {tuple(p['b'])} | {'/'.join(p['dtypes'])} | "
                      f"{p['per_step']:g} | {'yes' if mark else ''} |")


if __name__ == "__main__":
    main()
