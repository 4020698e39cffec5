"""Attention of the packed batch layouts where the sequences' lengths differ (kernels/decode.py's
``RowsByLength``: the full cache's and StreamingLLM's; the eviction base's padded slots,
evict/batch.py): the masked
decode attention equals MLX's fused attention under the same mask, and a batch of
different lengths decodes through it with each sequence's tokens as alone."""

from __future__ import annotations

import mlx.core as mx
import pytest

import batching
from veloxquant_mlx.kernels import decode as decode_module
from veloxquant_mlx.evict import batch as evict_batch


@pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-5), (mx.float16, 4 * 2.0 ** -11)])
def test_masked_decode_attention_equals_the_fused_attention_under_the_same_mask(dtype, tol):
    k = mx.random.split(mx.random.key(3), 3)
    B, H, R, T, D = 3, 2, 4, 1100, 64  # T past two of token_mix's pieces on CUDA
    q = mx.random.normal((B, H * R, 1, D), key=k[0]).astype(dtype)
    keys = mx.random.normal((B, H, T, D), key=k[1]).astype(dtype)
    values = mx.random.normal((B, H, T, D), key=k[2]).astype(dtype)
    visible = (mx.arange(T)[None] < mx.array([T, 700, 5])[:, None])[:, None, None, :]
    ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=D ** -0.5, mask=visible)
    out = decode_module.masked_decode_attention(q, keys, values, visible, scale=D ** -0.5)
    assert out.shape == ref.shape and out.dtype == dtype
    error = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max() / mx.abs(ref).max()
    assert error.item() < tol
    # a row past a sequence's length moves nothing: its keys and values are not read
    garbage = values.at[2, :, 5:].add(1e3)
    again = decode_module.masked_decode_attention(q, keys, garbage, visible, scale=D ** -0.5)
    assert mx.array_equal(again[2], out[2])


@pytest.mark.parametrize("method,settings", [
    ("full", {}),
    # a prompt under the budget leaves its sequence fewer slots than the others: padding
    ("snapkv", {"snap_budget": 48, "snap_obs_window": 8}),
])
def test_a_batch_of_different_lengths_decodes_packed_through_the_masked_attention(monkeypatch, method, settings):
    model, make = batching.rowwise_setup(method, settings)
    prompts = [list(range(3, 3 + n)) for n in (30, 90, 55)]
    max_tokens = (9, 7, 8)
    alone = [batching.run_alone(model, make, p, m) for p, m in zip(prompts, max_tokens)]
    calls = []

    def counted(read):
        return lambda q, *a, **kw: calls.append(q.shape[0]) or read(q, *a, **kw)

    # a dense packed batch masks by lengths, an eviction store's by its padding slots
    monkeypatch.setattr(decode_module, "masked_decode_attention", counted(decode_module.masked_decode_attention))
    monkeypatch.setattr(evict_batch, "held_rows_decode_attention", counted(decode_module.held_rows_decode_attention))
    got = batching.run_batched(model, prompts, max_tokens, join_at=3)
    assert calls and max(calls) >= 2
    batching.assert_batch_equals_alone(got, alone)
