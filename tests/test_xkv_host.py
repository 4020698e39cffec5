"""Issue 30 (host time of a decode step): xKV's steady decode step reads its fields flat
from the config, never through ``config.options`` (which builds and validates an options
object at each read: three reads a layer a step were ~25 us of host time on the CPU), and
the group lookup it makes through ``group_shared`` is a cached one."""

from __future__ import annotations

import mlx.core as mx

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from cross_layer_util import kv, layered
from veloxquant_mlx.cache.config import KVCacheConfig
from veloxquant_mlx.methods import xkv

T, STEPS, H, D, GQA = 100, 6, 2, 32, 2


def _prefilled(n_layers=4):
    caches = layered("xkv", n_layers, xkv_rank=16, xkv_latent_bits=4)
    ks, vs = kv(T + STEPS, n_layers, h=H, d=D)
    for start in range(0, T, 50):
        for layer, c in enumerate(caches):
            k, v = ks[layer][:, :, start:start + 50], vs[layer][:, :, start:start + 50]
            c.update_and_fetch(k, v)
            q = mx.random.normal((1, H * GQA, 50, D), key=mx.random.key(start + layer))
            c.attend(q, k, v, scale=D**-0.5, mask="causal")
    for layer, c in enumerate(caches):  # the prompt's end: the groups' SVDs
        k, v = ks[layer][:, :, T:T + 1], vs[layer][:, :, T:T + 1]
        c.update_and_fetch(k, v)
        c.attend(mx.random.normal((1, H * GQA, 1, D)), k, v, scale=D**-0.5, mask=None)
    assert all(c.n_latent == T for c in caches)
    return caches, ks, vs


def test_decode_steps_build_no_options_object(monkeypatch):
    caches, ks, vs = _prefilled()
    built = []
    options = KVCacheConfig.options

    def counted(self):
        built.append(1)
        return options.fget(self)

    monkeypatch.setattr(KVCacheConfig, "options", property(counted, options.fset))
    for t in range(T + 1, T + STEPS):
        for layer, c in enumerate(caches):
            k, v = ks[layer][:, :, t:t + 1], vs[layer][:, :, t:t + 1]
            c.update_and_fetch(k, v)
            out = c.attend(mx.random.normal((1, H * GQA, 1, D)), k, v, scale=D**-0.5, mask=None)
            mx.eval(out)
    assert not built, f"{len(built)} options objects built in {STEPS - 1} decode steps"


def test_the_flat_fields_are_the_options(monkeypatch):
    """What the step reads flat is what ``config.options`` says: groups, codec, limit."""
    caches, _, _ = _prefilled()
    o = caches[0].config.options
    for c in caches:
        assert c.codec.bits == o.xkv_latent_bits and c.codec.group == o.xkv_group_quant_size
        assert c.layer_group == (c.layer - c.layer % o.xkv_group_size,
                                 c.layer - c.layer % o.xkv_group_size + 1)
        assert c.group_shared is caches[c.layer - c.layer % o.xkv_group_size].shared
    assert xkv.consecutive_groups((0, 1, 2), 2) == ((0, 1), (2,))
