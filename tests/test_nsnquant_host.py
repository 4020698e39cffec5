"""Issue 30 (host time of a decode step), NSNQuant: the step keeps its coded readers
between flushes (``NSNStore.decode_parts``) and checks the sub-vector and rotation fields
once per head_dim (``NSNQuantCache.update_and_fetch``). Neither reorders arithmetic: over 40
decode steps that flush (R = 16) and outgrow the buffers, every step's output is the one of
the step written the straightforward way (readers built each step, the checks each step),
bit for bit, on the CPU's path and a GPU's pure path, at 1 and 2 bits."""

from __future__ import annotations

import mlx.core as mx
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import NSNQuantOptions
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.kernels.decode import DecodePart
from veloxquant_mlx.methods.nsnquant import NSNQuantCache
from veloxquant_mlx.methods.nsnquant import nsn as nsn_module
from veloxquant_mlx.quant.vq_store import CodebookCache

PROMPT, STEPS, R, GQA, D = 250, 40, 16, 2, 64


class StraightforwardStore(nsn_module.NSNStore):
    def decode_parts(self, empty):
        keys = values = None
        if self.keys.count:
            keys, values = nsn_module.NSNKeys(self.keys, self.dims[0]), nsn_module.NSNValues(self.values, self.dims[1])
        tail = lambda g: g.view() if g.length else None  # noqa: E731
        return [DecodePart(keys, tail(self.k_tail), values, tail(self.v_tail))]


class Straightforward(NSNQuantCache):
    def make_store(self):
        store = super().make_store()
        plain = StraightforwardStore(store.keys.codec, store.chunk, store.limit)
        return plain

    def update_and_fetch(self, keys, values):
        return CodebookCache.update_and_fetch(self, keys, values)


def _cache(cls, bits):
    options = NSNQuantOptions(nsn_bits=bits, nsn_residual_length=R)
    return cls(KVCacheConfig(method="nsnquant", options=options), None, 0)


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's read, and a GPU's
def test_the_kept_readers_read_bit_for_bit(bits, pure_path, monkeypatch):
    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", pure_path)
    h, total = 2, PROMPT + STEPS
    keys = mx.random.normal((1, h, total, D), key=mx.random.key(1)) * mx.where(mx.arange(D) < 3, 6.0, 1.0)
    values = mx.random.normal((1, h, total, D), key=mx.random.key(2))
    caches = [_cache(NSNQuantCache, bits), _cache(Straightforward, bits)]
    for c in caches:
        q = mx.random.normal((1, h * GQA, PROMPT, D), key=mx.random.key(3))
        c.update_and_fetch(keys[:, :, :PROMPT], values[:, :, :PROMPT])
        c.attend(q, keys[:, :, :PROMPT], values[:, :, :PROMPT], scale=D**-0.5, mask="causal")
    flushes, readers = 0, []
    for t in range(PROMPT, total):
        q = mx.random.normal((1, h * GQA, 1, D), key=mx.random.key(100 + t))
        k, v = keys[:, :, t : t + 1], values[:, :, t : t + 1]
        outs = []
        for c in caches:
            c.update_and_fetch(k, v)
            outs.append(c.attend(q, k, v, scale=D**-0.5, mask=None))
        mx.eval(outs)
        assert outs[0].dtype == outs[1].dtype and mx.array_equal(outs[0], outs[1]).item(), t
        flushes += caches[0].store.k_tail.length == 0
        kept = caches[0].store._readers
        if not readers or readers[-1] is not kept:
            readers.append(kept)
    assert flushes >= 2 and len(readers) == flushes + 1  # new readers at each flush only
    assert caches[0].store.keys.capacity > nsn_module.GROWTH_TOKENS  # the buffers grew


def test_the_checks_still_refuse_a_sub_vector_that_does_not_divide_head_dim():
    cache = NSNQuantCache(KVCacheConfig(method="nsnquant", options=NSNQuantOptions(nsn_subvector_dim=8)), None, 0)
    x = mx.zeros((1, 2, 1, 60))
    with pytest.raises(ValueError, match="nsn_subvector_dim"):
        cache.update_and_fetch(x, x)
