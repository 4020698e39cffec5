"""XQuant's decode read keeps a reuse layer's layout (``BorrowedCodes.layout``: whole
buffers, rebuilt only when a buffer is replaced or a count changes) between steps, and its
layer groups (``cross_layer.consecutive_groups``, kept per arguments): over 40 decode steps that flush (a key block
and values every step past the window), each step's output is bit for bit the one the
layout built afresh at every step gives (the same arithmetic on the same arrays), on the
CPU's path and on the GPU's pure path, with and without a residual."""

from __future__ import annotations

import mlx.core as mx
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from cross_layer_util import feed, kv, layered
from veloxquant_mlx.cache import cross_layer
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.xquant import borrowed
from veloxquant_mlx.methods.xquant import cache as xquant_cache


def _fresh_groups(layers, size, start=0):
    return cross_layer._consecutive_groups.__wrapped__(tuple(layers), size, start)

T, DECODE, LAYERS = 150, 40, 4


def _outputs(**options):
    caches = layered("xquant", LAYERS, {"residual_window": 32}, **options)
    ks, vs = kv(T + DECODE, LAYERS)
    feed(caches, ks, vs, 64, stop=T)
    outs = feed(caches, ks, vs, 1, start=T)
    mx.eval(outs)
    return caches, outs


@pytest.mark.parametrize("pure_path", ["qmm", "reference"])
@pytest.mark.parametrize("residual_bits", [0, 4])
def test_kept_layouts_and_groups_read_what_fresh_ones_read(monkeypatch, pure_path, residual_bits):
    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", pure_path)
    monkeypatch.setattr(kd, "_pure_path", lambda: pure_path)
    options = dict(xquant_group_size=2, xquant_residual_bits=residual_bits, xquant_group_quant_size=32)
    caches, kept = _outputs(**options)
    flushes = {c.store.keys.count for c in caches}
    assert all(c.store.keys.count > 64 for c in caches)  # blocks flushed while decoding
    with monkeypatch.context() as m:  # the straightforward read: built afresh at each step
        m.setattr(borrowed.BorrowedCodes, "layout", borrowed.BorrowedCodes._layout)
        m.setattr(xquant_cache, "consecutive_groups", _fresh_groups)
        _, fresh = _outputs(**options)
    assert flushes
    for layer, (a, b) in enumerate(zip(kept, fresh)):
        for step, (x, y) in enumerate(zip(a, b)):
            assert mx.array_equal(x, y), (layer, step)


def test_the_layer_group_follows_the_context():
    caches = layered("xquant", LAYERS, {"residual_window": 32}, xquant_group_size=2)
    assert [c.layer_group for c in caches] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    ctx = caches[3].context
    ctx.compressed_layers = (0, 1, 3)  # another context's layers: found again
    assert caches[3].layer_group == (3,)
    caches[1].context = None  # a layer alone: a group of one
    assert caches[1].layer_group == (1,)
