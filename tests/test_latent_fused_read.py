"""The latent stores' CUDA decode read (``LatentStore._fused_attention``): the queries folded
onto the key basis, the latents decoded in the queries' dtype and zero-padded to a width MLX
fuses, one ``scaled_dot_product_attention`` in the latent space, the value latents lifted
with the mean. Against attention over the history rebuilt from what the store holds
(float64), over 40 decode steps that flush, with the bound of ``test_svdq_decode_read``:
the padded channels add exact zeros to each score and each mixed latent, so the read's
float32 rounding is that of the float32 read (a score of d then r terms, the mix of N rows,
the lift of r terms and the mean)."""

from __future__ import annotations

import mlx.core as mx
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from test_palu_decode_read import palu
from test_svdq_decode_read import decode_against_reference, svdq
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.lowrank import latent
from veloxquant_mlx.lowrank.latent import FUSED_WIDTHS
from sdpa_calls import one_row, recorded


def fused_widths(monkeypatch) -> list:
    """The CUDA branch on this device; the widths of the one-row attentions it runs."""
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    return recorded(monkeypatch)


def widths(calls) -> list[int]:
    return [c.width for c in one_row(calls)]


@pytest.mark.parametrize("schedule", [(8, 4, 2, 1, 1, 0, 0, 0), (4, 16, 1, 3, 0, 2)])  # the default; 16 and 0 bits inside
@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the spans' layouts of the CPU's path and a GPU's
def test_svdq_reads_one_fused_attention_at_the_head_dim(schedule, pure_path, monkeypatch):
    calls = fused_widths(monkeypatch)
    cache = svdq(svdq_bit_schedule=schedule, svdq_group_size=32)
    worst, flushes, runs = decode_against_reference(cache, monkeypatch, pure_path, prompt=80, d=64, dv=64)
    assert runs == 1 and flushes >= 1 and worst < 1
    assert widths(calls) == [64] * 40  # values kept exactly: the keys' latents padded to the head dim


@pytest.mark.parametrize("heads, groups", [(2, 2), (4, 2)])  # a head a basis; two heads side by side
@pytest.mark.parametrize("bits", [(4, 2), (1, 8), (16, 3)])  # the default; 1 bit; an unquantized span
def test_palu_reads_one_fused_attention_in_the_latent_space(heads, groups, bits, monkeypatch):
    calls = fused_widths(monkeypatch)
    g = heads // groups
    cache = palu(palu_n_head_groups=groups, palu_hi_bit=bits[0], palu_lo_bit=bits[1], palu_hi_fraction=0.4)
    worst, flushes, runs = decode_against_reference(cache, monkeypatch, "reference", heads=heads, prompt=48 * g,
                                                    seed=5)
    store = cache.store
    ranks = store.keys.runs[0].tokens.rank, store.values.runs[0].tokens.rank
    assert runs == 1 and flushes >= 1 and worst < 1
    assert widths(calls) == [next(w for w in FUSED_WIDTHS if w >= max(ranks))] * 40


def test_the_general_read_where_no_width_fuses(monkeypatch):
    """Values kept exactly at a head dim MLX does not fuse: the float32 read, no fused
    attention; after a refit (two runs, each with its mean term) likewise."""
    calls = fused_widths(monkeypatch)
    decode_against_reference(svdq(), monkeypatch, "reference", prompt=40, d=32)
    assert widths(calls) == []
    _, _, runs = decode_against_reference(palu(palu_n_head_groups=2), monkeypatch, "reference", prompt=33)
    assert runs == 2 and 0 < len(widths(calls)) < 40 and set(widths(calls)) == {64}  # fused until the refit


def test_the_rows_are_the_dense_latents_padded():
    """``LatentTokens.rows``: the dequantized latents (``dense``) in the order stored,
    dropped channels 0, padded with zeros to the width, bit for bit in float32."""
    tokens = latent.LatentTokens(latent.split_channels(20, (8, 0, 2, 16)), 32, 64, (1, 2))
    x = mx.random.normal((1, 2, 75, 20), key=mx.random.key(1))
    tokens.append(x[:, :, :70])
    for i in range(70, 75):
        tokens.append(x[:, :, i : i + 1])
    rows = tokens.rows(mx.float32, 64, iter(tokens.read_inputs()))
    dense = tokens.dense()
    assert rows.shape == (1, 2, 75, 64)
    assert mx.array_equal(rows[..., :20], dense).item() and not mx.any(rows[..., 20:]).item()
