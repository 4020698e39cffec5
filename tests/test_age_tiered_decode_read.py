"""AgeTieredKV's decode read (issue 30's host time): the tiers' decode parts kept between
settles (``TieredStore._views``), the tail passed as its whole buffer with its row counts
(``tail_rows``), and a decode step between blocks that settles nothing (``_moves``: where a
boundary next moves). Over 60 decode steps after a chunked prompt (flushes of the tail into
the tiers and demotions between them, including a boundary that is not a multiple of the
block), each step's output is bit for bit the output of ``decode_attention`` over parts
built the straightforward way from the store as it stands (every tier's layout and the
tail's valid rows, sliced, rebuilt each step), on the CPU's read and on a GPU's pure read;
the tiers hold what ``tier_ends`` gives them after every step. No arithmetic is reordered:
the parts hold the same arrays and counts."""

from __future__ import annotations

import mlx.core as mx
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.kernels.decode import DecodePart, decode_attention
from veloxquant_mlx.methods.age_tiered.tiers import RawTokens, TieredStore, tier_ends

PROMPT, STEPS, H, GQA, D = 150, 60, 2, 2, 64


def plain_parts(s: TieredStore, empty) -> list[DecodePart]:
    """The store's parts as the read was built before: every layout rebuilt, the tail sliced."""
    parts = []
    for t in s.tiers:
        if not t.keys.count:
            continue
        if isinstance(t.keys, RawTokens):
            parts.append(DecodePart(None, t.keys.rows.view(), None, t.values.rows.view()))
        else:
            parts.append(DecodePart(t.keys.layout(empty), None, t.values.layout(empty), None))
    if s.k_tail.length:
        tail_k, tail_v = s.k_tail.view(), s.v_tail.view()
        if parts and parts[-1].key_tail is None:
            last = parts[-1]
            parts[-1] = DecodePart(last.keys, tail_k, last.values, tail_v)
        else:
            parts.append(DecodePart(None, tail_k, None, tail_v))
    return parts


@pytest.mark.parametrize("bits, ages", [((2, 4, 8), [96, 32]), ((3, 8, 16), [80, 40]), ((2, 4, 16), [70, 32])])
@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's read, and a GPU's
def test_decode_read_is_the_plain_read_bit_for_bit(bits, ages, pure_path, monkeypatch):
    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", pure_path)
    s = TieredStore(bits=list(bits), ages=ages, block=32)
    total = PROMPT + STEPS
    keys = mx.random.normal((1, H, total, D), key=mx.random.key(1))
    values = mx.random.normal((1, H, total, D), key=mx.random.key(2))
    s.commit(keys[:, :, :100], values[:, :, :100])
    s.commit(keys[:, :, 100:PROMPT], values[:, :, 100:PROMPT])
    empty = mx.zeros((0,), mx.float32)
    for t in range(PROMPT, total):
        q = mx.random.normal((1, H * GQA, 1, D), key=mx.random.key(100 + t))
        s.commit(keys[:, :, t : t + 1], values[:, :, t : t + 1])
        n = t + 1
        ends = tier_ends(n, s.ages, s.block)
        assert s.counts == [b - a for a, b in zip([0] + ends, ends)] and s.k_tail.length == n - ends[-1], t
        out = decode_attention(q, s.decode_parts(empty), scale=D**-0.5)
        ref = decode_attention(q, plain_parts(s, empty), scale=D**-0.5)
        assert mx.array_equal(out, ref).item(), t


def test_the_tail_is_passed_whole_with_its_counts():
    s = TieredStore(bits=[2, 4, 8], ages=[96, 32], block=32)
    k = mx.random.normal((1, H, 140, D), key=mx.random.key(3))
    s.commit(k, k)
    *_, last = s.decode_parts(mx.zeros((0,)))
    assert last.key_tail is s.k_tail.buffer and last.value_tail is s.v_tail.buffer
    assert last.tail_counts == (140 % 32, 140 % 32)


@pytest.mark.parametrize("bits, ages", [((2, 4, 8), [96, 32]), ((3, 8, 16), [80, 40])])
def test_on_cuda_the_decoded_rows_and_one_fused_attention_give_the_float32_read(bits, ages, monkeypatch):
    """On CUDA a step reads every stored row decoded in the queries' dtype through one fused
    attention (benchmarks/results/h200_s68): over 60 steps with flushes of the tail and
    demotions among them, what the tiers' float32 parts give on the CPU, to float32
    reassociation."""
    from sdpa_calls import recorded
    from test_kitty_decode_read import reassociation_bound

    s = TieredStore(bits=list(bits), ages=ages, block=32)
    total = PROMPT + STEPS
    keys = mx.random.normal((1, H, total, D), key=mx.random.key(4))
    values = mx.random.normal((1, H, total, D), key=mx.random.key(5))
    s.commit(keys[:, :, :PROMPT], values[:, :, :PROMPT])
    empty = mx.zeros((0,), mx.float32)
    fused = recorded(monkeypatch)
    for t in range(PROMPT, total):
        q = mx.random.normal((1, H * GQA, 1, D), key=mx.random.key(300 + t))
        s.commit(keys[:, :, t : t + 1], values[:, :, t : t + 1])
        ref = decode_attention(q, s.decode_parts(empty), scale=D**-0.5)  # the CPU's read
        monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
        before = len(fused)
        out = s.attend_parts(q, scale=D**-0.5, use_kernel=True, n_kv_heads=H)
        assert [c.keys for c in fused[before:]] == [t + 1]  # one fused attention over every row
        monkeypatch.setattr(kd, "gpu_backend", lambda: None)
        k_hat, v_hat = s.history(mx.float32)
        err, bound = float(mx.abs(out - ref).max()), reassociation_bound(q, k_hat, v_hat, D**-0.5)
        assert err <= bound, (t, err, bound)


def test_cuda_read_decodes_a_layers_history_only_once_its_queries_exist(monkeypatch):
    """Gated on its queries (``history_after``), a layer's rows are not decoded ahead of its
    attention beside the other layers': from 4 to 8 chained layers the step's peak grows by
    less than half of one layer's decoded rows (ungated, by several layers' rows)."""
    from chained_layers import layer_rows, peak_growth

    from veloxquant_mlx import KVCacheConfig
    from veloxquant_mlx.methods.age_tiered.cache import AgeTieredKVCache

    make = lambda: AgeTieredKVCache(KVCacheConfig(method="age_tiered"), None, 0)  # noqa: E731  (defaults)
    assert peak_growth(make, 4, 8, monkeypatch) < layer_rows() / 2


def test_cuda_read_of_unquantized_tiers_alone(monkeypatch):
    """Tiers of 16 bits only (nothing coded, nothing to gate): the rows and the tail, exactly
    the float32 read to reassociation."""
    from test_kitty_decode_read import reassociation_bound

    s = TieredStore(bits=[16, 16], ages=[64], block=32)
    keys = mx.random.normal((1, H, 150, D), key=mx.random.key(8))
    values = mx.random.normal((1, H, 150, D), key=mx.random.key(9))
    s.commit(keys[:, :, :149], values[:, :, :149])
    s.commit(keys[:, :, 149:], values[:, :, 149:])
    q = mx.random.normal((1, H * GQA, 1, D), key=mx.random.key(10))
    ref = decode_attention(q, s.decode_parts(mx.zeros((0,), mx.float32)), scale=D**-0.5)
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    out = s.attend_parts(q, scale=D**-0.5, use_kernel=True, n_kv_heads=H)
    k_hat, v_hat = s.history(mx.float32)
    assert float(mx.abs(out - ref).max()) <= reassociation_bound(q, k_hat, v_hat, D**-0.5)
