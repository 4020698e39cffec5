"""A prompt chunk's encoder compiled once for each shape it meets, a few shapes kept.

A prompt chunk's encoding is dozens of elementwise operations, each a kernel launch on a
GPU, where one compiled pass fuses them into a handful. A shapeless trace would serve any
chunk length, but MLX 0.32's shapeless compile breaks on some of these graphs (reductions
over one element, sorts) and runs its kernels slower (``quant/codebook.py``); a trace per
shape has neither problem, but MLX keeps every shape's trace for as long as the compiled
function lives, and a server meets a new last-chunk length with nearly every prompt.
``PerShape`` compiles a fresh function for each input signature and keeps the ``keep``
most recently used: dropping the oldest drops its trace with it (MLX erases a compiled
function's traces when it is freed). mlx-lm feeds prompts in chunks of one length plus a
remainder, so a few shapes cover a prompt.

``VQ_COMPILED_PROMPT=0`` runs the functions uncompiled (an A/B switch for timing).
"""

from __future__ import annotations

import functools
import os
import threading
from collections import OrderedDict
from typing import Callable

import mlx.core as mx

KEEP_SHAPES = 4


@functools.lru_cache(maxsize=64)
def index_range(n: int) -> mx.array:
    """``mx.arange(n)`` (int32) made from a list: it holds its data, so a graph reads it as a
    leaf (a compiled pass as a constant) where ``arange`` is a kernel at every call."""
    return mx.array(list(range(n)), mx.int32)


@functools.lru_cache(maxsize=None)
def code_shifts(bits: int) -> mx.array:
    """The shift of each of a word's ``32 // bits`` codes of ``bits`` bits (uint32), a constant
    like ``index_range``."""
    return mx.array([i * bits for i in range(32 // bits)], mx.uint32)


def _signature(args) -> tuple:
    """Shapes and dtypes of the arrays in ``args`` (lists and tuples of them too), and any
    other argument as it is (a constant of the trace)."""
    return tuple((a.shape, a.dtype) if isinstance(a, mx.array)
                 else _signature(a) if isinstance(a, (list, tuple)) else (None, a) for a in args)


class PerShape:
    """``fn(*args)`` compiled per input signature (the arrays' shapes and dtypes, in lists
    and tuples too; ``None`` in place of an array), the ``keep`` most recently used
    compiled functions kept."""

    def __init__(self, fn: Callable, keep: int = KEEP_SHAPES):
        if keep < 1:
            raise ValueError(f"PerShape keep={keep}: at least one compiled shape must be kept")
        self.fn, self.keep = fn, keep
        self._compiled: OrderedDict[tuple, Callable] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, *args):
        if os.environ.get("VQ_COMPILED_PROMPT", "1") == "0":
            return self.fn(*args)
        key = _signature(args)
        with self._lock:  # a server's threads may share one
            compiled = self._compiled.get(key)
            if compiled is None:
                fn = self.fn
                # a function object of its own per shape: MLX keys its traces by the function's identity
                compiled = self._compiled[key] = mx.compile(lambda *a: fn(*a))
                while len(self._compiled) > self.keep:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
        return compiled(*args)

    @property
    def shapes(self) -> list[tuple]:
        """The signatures whose compiled functions are kept, oldest first."""
        return list(self._compiled)
