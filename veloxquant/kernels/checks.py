"""What the custom kernels share: how one is made for a back-end, the self-check made once
a process, and the tolerance where a kernel's arithmetic may round once more than MLX's."""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Optional

import mlx.core as mx

from . import kivi_decode as kd
from .names import source_tagged


@functools.lru_cache(maxsize=None)
def gpu_kernel(backend: str, name: str, inputs: tuple, outputs: tuple, sources: tuple, headers: tuple = ("", ""),
               row_contiguous: bool = True):
    """The kernel ``name`` for ``backend`` ("cuda": ``sources[0]`` and ``headers[0]``, else
    Metal's twins ``sources[1]`` and ``headers[1]``), made once a process, its name tagged with
    its text (``names.source_tagged``). ``row_contiguous``:
    MLX copies every input that is not row-contiguous before each launch (False: the source
    reads its inputs' strides, and the caller makes the others contiguous)."""
    cuda = backend == "cuda"
    make = mx.fast.cuda_kernel if cuda else mx.fast.metal_kernel
    source, header = sources[0 if cuda else 1], headers[0 if cuda else 1]
    return make(name=source_tagged(name, source, header), input_names=list(inputs), output_names=list(outputs),
                source=source, header=header, ensure_row_contiguous=row_contiguous)


def within_a_rounding(got: mx.array, ref: mx.array) -> bool:
    """Equal up to one float32 rounding before the cast to ``got``'s dtype (CUDA may fuse a
    product and a sum into one multiply-add that MLX rounds twice): at most one unit in the
    last place of the output dtype, relative to the values, plus one float32 rounding of a
    term as large as the largest value (a multiply-add whose terms cancel to near zero keeps
    its product's rounding, which is not small relative to the result: the float32 layouts'
    self-checks failed on CUDA for it). A host read: a self-check's."""
    ulp = {mx.float16: 2.0 ** -10, mx.bfloat16: 2.0 ** -7}.get(got.dtype, 2.0 ** -22)
    ref = ref.astype(mx.float32)
    diff = mx.abs(got.astype(mx.float32) - ref)
    bound = ulp * mx.maximum(mx.abs(ref), 1e-30) + 2.0 ** -23 * mx.abs(ref).max()
    return bool((diff <= bound).all().item())


def checked_once(table: dict, backend: str, key: tuple, problem: Callable[[], Optional[str]], kernel: str,
                 instead: str) -> bool:
    """Whether ``problem()`` (a kernel against its MLX reference) found nothing, asked once a
    process and ``key`` (kept in ``table``; a problem warns once, naming the ``kernel`` and what
    runs ``instead``). A process whose back-end is not ``backend`` (a test that takes a GPU's
    paths on the CPU) has no kernel to check: False, without a warning and without asking."""
    if kd._gpu_kind() != backend:
        return False
    if key not in table:
        table[key] = found = problem()
        if found is not None:
            warnings.warn(f"veloxquant: the {backend} {kernel} failed its self-check: {found}; {instead}",
                          RuntimeWarning, stacklevel=3)
    return table[key] is None
