"""AMC's decode read on the CPU (``decode_step._dequantize``): the tiers' words unpacked in one
shift (``kivi_decode.unpacked_affine``) where ``mx.dequantize`` expands into a graph of one
shift per code in a word. The same values bit for bit, so over 40 decode steps (a flush of
the window among them, pre-RoPE Low keys and post-RoPE) each step's attention equals, bit
for bit, the step read through ``mx.dequantize`` (a GPU's read), and attention over the
dequantized history within float32 rounding; and the CPU's step graph is the smaller."""

from __future__ import annotations

import mlx.core as mx
import pytest

from decode_steps import graph_nodes
from test_amc_window import made, rotary_context
from veloxquant_mlx.methods.amc import decode_step

PROMPT, STEPS, D = 120, 40, 64


def kv(t, seed):
    return (mx.random.normal((1, 2, t, D), key=mx.random.key(seed)),
            mx.random.normal((1, 2, t, D), key=mx.random.key(seed + 1)))


@pytest.mark.parametrize("rotary", [False, True], ids=["post-rope", "pre-rope"])
def test_each_decode_step_equals_the_mx_dequantize_read_bit_for_bit(rotary, monkeypatch):
    cache = made(rotary_context() if rotary else None)
    k, v = kv(PROMPT + STEPS, 7)
    q = mx.random.normal((1, 4, PROMPT + STEPS, D), key=mx.random.key(9))
    cache.update_and_fetch(k[:, :, :PROMPT], v[:, :, :PROMPT])
    cache.attend(q[:, :, :PROMPT], k[:, :, :PROMPT], v[:, :, :PROMPT], scale=0.125, mask="causal")
    calls, read = [], decode_step.decode_attention
    monkeypatch.setattr(decode_step, "decode_attention", lambda *a: calls.append(a) or read(*a))
    flushed = 0
    for t in range(PROMPT, PROMPT + STEPS):
        held = cache.pending_k.length
        cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        out = cache.attend(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], scale=0.125, mask=None)
        flushed += cache.pending_k.length < held
        args = calls.pop()
        with monkeypatch.context() as m:  # the same step through mx.dequantize
            m.setattr(decode_step, "_unpacks_here", lambda: False)
            gpu = read(*args)
        assert mx.array_equal(out, gpu).item(), t
        k_hat, v_hat = cache.dequantized(mx.float32)  # after the step: a flushed window as stored
        want = mx.fast.scaled_dot_product_attention(q[:, :, t : t + 1], k_hat, v_hat, scale=0.125, mask=None)
        assert mx.allclose(out, want, atol=1e-5).item(), t
    assert flushed == 1 and cache.store.k_tiers[2].capacity  # a flush, and Low rows read


def test_the_cpus_step_graph_unpacks_each_tier_in_one_shift(monkeypatch):
    cache = made(rotary_context())
    k, v = kv(PROMPT + 1, 11)
    q = mx.random.normal((1, 4, PROMPT + 1, D), key=mx.random.key(12))
    cache.update_and_fetch(k[:, :, :PROMPT], v[:, :, :PROMPT])
    mx.eval(cache.attend(q[:, :, :PROMPT], k[:, :, :PROMPT], v[:, :, :PROMPT], scale=0.125, mask="causal"))
    cache.pending_k.append(k[:, :, PROMPT:])
    cache.pending_v.append(v[:, :, PROMPT:])
    window = (cache.pending_k.buffer, cache.pending_v.buffer, mx.array(1, mx.int32))
    mx.eval(window)
    cpu = graph_nodes([decode_step.decode_attention(cache.store, q[:, :, PROMPT:], 0.125, window)])
    monkeypatch.setattr(decode_step, "_unpacks_here", lambda: False)
    gpu = graph_nodes([decode_step.decode_attention(cache.store, q[:, :, PROMPT:], 0.125, window)])
    # mx.dequantize on the CPU: a shift node per code in a word (155 nodes at head_dim 64
    # against 123 here, MLX 0.32.4); here one unpack a tier
    assert cpu <= gpu - 30, (cpu, gpu)
