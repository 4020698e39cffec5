"""Palu's decode read (``lowrank/latent.py``: the query folded onto each run's basis and
scored span by span, the values mixed span by span in the latent space and lifted with
the mean in one product, the spans' valid tokens and the bases' per-head layouts kept as
views between flushes) against attention over the history rebuilt from what the store
holds, in float64, over 40 decode steps that flush and refit. The tolerance is derived in
``test_svdq_decode_read``'s docstring (float32 rounding of the read only)."""

from __future__ import annotations

import mlx.core as mx
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from test_svdq_decode_read import D, call, decode_against_reference, rows
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import PALUOptions
from veloxquant_mlx.methods.palu import PALUCache


def palu(**options):
    return PALUCache(KVCacheConfig(method="palu", options=PALUOptions(**options)), None, 0)


@pytest.mark.parametrize("heads, groups", [(2, 2), (4, 2)])  # a head a basis; two heads side by side
@pytest.mark.parametrize("bits", [(4, 2), (1, 8), (16, 3)])  # the default; 1 bit; an unquantized span
@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's read, and a GPU's
def test_decode_read_matches_attention_over_the_reconstruction(heads, groups, bits, pure_path, monkeypatch):
    g = heads // groups
    prompt = 40 * g  # fitted on g * 32 tokens: the refit falls in the 40th step
    cache = palu(palu_n_head_groups=groups, palu_hi_bit=bits[0], palu_lo_bit=bits[1], palu_hi_fraction=0.4)
    worst, flushes, runs = decode_against_reference(cache, monkeypatch, pure_path, heads=heads, prompt=prompt)
    assert flushes >= 1 and runs == (2 if g == 1 else 1) and worst < 1


@pytest.mark.parametrize("pure_path", ["qmm", "reference"])
def test_several_runs_and_exact_value_latents(pure_path, monkeypatch):
    """A short prompt refits early: the later steps read two runs (two parts, each with its
    mean terms); value latents kept unquantized (an unquantized span of their own)."""
    cache = palu(palu_n_head_groups=2, palu_quantize_values=False)
    worst, _, runs = decode_against_reference(cache, monkeypatch, pure_path, prompt=33)
    assert runs == 2 and cache.store.keys.runs[1].tokens.count and worst < 1
    assert len(cache.store.decode_parts(mx.zeros((0,)))) == 2


def test_the_bases_views_are_kept_per_run(monkeypatch):
    cache = palu(palu_n_head_groups=1)
    decode_against_reference(cache, monkeypatch, "reference", heads=2, prompt=80, batch=1)
    tokens = cache.store.values.tokens
    views = tokens._basis_views.value
    assert views is not None and views.basis.shape[1] == 2  # two heads' rows of one group basis
    k = rows((1, 2, 1, D), 50)
    call(cache, mx.random.normal((1, 4, 1, D), key=mx.random.key(51)), k, k, D**-0.5)
    assert tokens._basis_views.value is views
