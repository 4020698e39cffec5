"""Small eigenproblems spread over several CPU streams (issue 31: fits on the prefill path).

MLX runs ``eigh`` on the CPU only, and a batch of them (a layer's head groups or heads) as
one operation on one stream: one core. Each MLX stream has a thread of its own, so a batch
split over ``fit_streams()`` CPU streams runs on as many cores (``cpu_eigh``).

OpenBLAS's pthread build must then share the cores out: several calls at once, each asking
for all the cores, thrash (on a 2-core machine, 48 eigenproblems of 256 x 256 took 0.16 s on
one stream, 0.8 s on two and 13 s on four at OpenBLAS's default thread count, 0.07 s on two
at one thread a call). So while more than one stream is in use, OpenBLAS runs the cores
divided by the streams, at least one, threads a call (``_blas.set_threads``): a fit of one
large matrix (kvtc's) keeps some threads for its products. Going back to one stream
restores OpenBLAS's count.

How many streams: ``VQ_FIT_STREAMS`` when set; else one where the default device is the CPU
(there the model's products run on OpenBLAS too and need its threads), else half the cores,
at most ``MAX_STREAMS``. ``set_fit_streams`` changes it in a running process (tests, A/B
benchmarks). At one OpenBLAS thread count the split changes no result: each matrix is
decomposed alone either way. OpenBLAS's thread count itself moves the rounding (an
eigenvector's sign can flip), so fits on several streams can differ in their last bits
from fits on one at OpenBLAS's default count.
"""

from __future__ import annotations

import math
import os

import mlx.core as mx

from .. import _blas

ENV = "VQ_FIT_STREAMS"
MAX_STREAMS = 8

_streams: list | None = None
_made: list = []  # every CPU stream made so far, reused (MLX keeps a stream's thread for good)
_threads_before: int | None = None
_turn = 0  # the stream the last single matrix went to


def _default_count() -> int:
    raw = os.environ.get(ENV)
    if raw is not None:
        try:
            count = int(raw)
        except ValueError:
            count = 0
        if count < 1:
            raise ValueError(f"{ENV}={raw!r}: the CPU streams for fits must be a whole number >= 1")
        return count
    if mx.default_device() == mx.cpu:
        return 1
    return max(1, min(MAX_STREAMS, (os.cpu_count() or 2) // 2))


def set_fit_streams(count: int | None) -> list:
    """Use ``count`` CPU streams for fits from now on (None: the default rule); returns them."""
    global _streams, _threads_before
    if count is None:
        count = _default_count()
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"fit streams: {count!r}; expected a whole number >= 1")
    if count == 1:
        if _threads_before is not None:
            _blas.set_threads(_threads_before)
            _threads_before = None
        _streams = [mx.cpu]
    else:
        threads = max(1, (os.cpu_count() or 1) // count)
        before = _blas.set_threads(threads)
        if _threads_before is None:
            _threads_before = before
        _made.extend(mx.new_stream(mx.cpu) for _ in range(count - len(_made)))
        _streams = _made[:count]
    return _streams


def fit_streams() -> list:
    """The CPU streams fits spread over (the first use picks them: ``set_fit_streams``)."""
    return _streams if _streams is not None else set_fit_streams(None)


def on_fit_streams(fn, a: mx.array, matrix_dims: int = 2):
    """``fn(a)`` on the CPU, for a function of a batch of matrices ``a`` (..., m, n) whose
    outputs keep the batch in front: the batch split over ``fit_streams()``, each part's
    ``fn`` run with its stream as the default, the outputs joined again (a tuple for a
    tuple). A single matrix goes to the next stream in turn."""
    global _turn
    streams = fit_streams()
    lead, tail = a.shape[: a.ndim - matrix_dims], a.shape[a.ndim - matrix_dims:]
    count = math.prod(lead)
    if len(streams) == 1 or count < 2:  # one matrix: the streams take turns, so that fits
        _turn = (_turn + 1) % len(streams)  # started one after another run side by side
        with mx.stream(streams[_turn]):
            return fn(a)
    flat = a.reshape(count, *tail)
    parts = min(count, len(streams))
    bounds = [count * i // parts for i in range(parts + 1)]
    outs = []
    for lo, hi, s in zip(bounds, bounds[1:], streams):
        with mx.stream(s):
            outs.append(fn(flat[lo:hi]))
    if not isinstance(outs[0], tuple):
        return mx.concatenate(outs).reshape(*lead, *outs[0].shape[1:])
    return tuple(mx.concatenate(col).reshape(*lead, *col[0].shape[1:]) for col in zip(*outs))


def cpu_eigh(a: mx.array) -> tuple[mx.array, mx.array]:
    """``mx.linalg.eigh`` of the symmetric matrices ``a`` (..., n, n) on the CPU: eigenvalues
    ascending, eigenvectors in columns; the batch split over ``fit_streams()``."""
    return on_fit_streams(mx.linalg.eigh, a)
