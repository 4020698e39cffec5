"""MiniCache: never merges across the threshold, the card's invariants (identical and
parallel rows exact, norms kept, t = 0 / 1 give either layer, threshold > 1 exact, layers
below the start and an odd last layer exact, per-step merging equals merging at once),
decode over merged rows in place, and memory. The decode tokens are one flush's worth
(``FLUSH``) plus 6 held exact: the merged state covers the first ``merged_rows`` tokens."""

import mlx.core as mx
import pytest

from cross_layer_util import feed, kv, layered, reference_attention
from veloxquant_mlx.methods.minicache.cache import FLUSH
from veloxquant_mlx.methods.minicache.slerp import MergedRows

T, HELD = 120, 6
DECODE = FLUSH + HELD


def _noisy(x0, i):
    """Layer 1 as layer 0 plus noise of its channels' size: cosines spread over (0, 1)."""
    size = mx.sqrt((x0 * x0).mean(axis=-2, keepdims=True))
    return x0 + 1.2 * mx.random.normal(x0.shape, key=mx.random.key(7)) * size


def _run(related=_noisy, n_layers=2, chunks=(64, 1), **options):
    options = {"minicache_start_frac": 0.0, **options}
    caches = layered("minicache", n_layers, **options)
    ks, vs = kv(T + DECODE, n_layers, related=related)
    feed(caches, ks, vs, chunks[0], stop=T)
    outs = feed(caches, ks, vs, chunks[1], start=T)
    return caches, ks, vs, outs


def retained(cache, x):
    """The (row, token) pairs a second layer keeps apart (its table's used rows)."""
    used = getattr(cache, f"ret_{x}_used")
    return getattr(cache, f"ret_{x}_where").view()[: 0 if used is None else used.item()]


def _rebuilt(cache, x):
    return cache.merged(x).dense(mx.float32)


def _cos(a, b):
    return (a * b).sum(-1) / (mx.linalg.norm(a, axis=-1) * mx.linalg.norm(b, axis=-1))


@pytest.mark.parametrize("threshold", [0.35, 0.5, 0.8])
def test_pairs_below_the_threshold_are_kept_apart_and_only_those(threshold):
    caches, ks, vs, _ = _run(minicache_retention_threshold=threshold)
    first, second = caches
    n = second.merged_rows
    assert n == T + FLUSH and second.held_k.length == HELD
    for x, a, b in (("k", ks[0][:, :, :n], ks[1][:, :, :n]), ("v", vs[0][:, :, :n], vs[1][:, :, :n])):
        cos = _cos(a, b)  # (1, H, n)
        where = retained(second, x)
        kept = mx.zeros(cos.shape, mx.bool_).reshape(-1, cos.shape[-1])
        kept[where[:, 0], where[:, 1]] = True
        kept = kept.reshape(cos.shape)
        assert 0 < int(kept.sum()) < kept.size  # both kinds occur
        assert mx.array_equal(kept, cos < threshold)
        x1, x2 = _rebuilt(first, x), _rebuilt(second, x)
        assert mx.allclose(mx.where(kept[..., None], x1, a), a, atol=1e-5)  # retained: originals
        assert mx.allclose(mx.where(kept[..., None], x2, b), b, atol=1e-5)
        merged = ~kept
        assert mx.allclose(mx.linalg.norm(x1, axis=-1), mx.linalg.norm(a, axis=-1), rtol=1e-5)  # norms kept
        assert mx.allclose(mx.linalg.norm(x2, axis=-1), mx.linalg.norm(b, axis=-1), rtol=1e-5)
        same = mx.abs(_cos(x1, x2) - 1) < 1e-5  # a merged pair shares one direction
        assert mx.all(same | kept)
        assert not mx.allclose(mx.where(merged[..., None], x2, 0), mx.where(merged[..., None], b, 0), atol=1e-3)


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_identical_or_parallel_rows_merge_exactly(scale):
    caches, ks, vs, _ = _run(related=lambda x0, i: x0 * scale, minicache_retention_threshold=-1.0)
    n = caches[1].merged_rows
    for layer, c in enumerate(caches):
        assert retained(caches[1], "k").shape[0] == 0  # everything merged
        assert mx.allclose(_rebuilt(c, "k"), ks[layer][:, :, :n], atol=1e-4, rtol=1e-5)
        assert mx.allclose(_rebuilt(c, "v"), vs[layer][:, :, :n], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("t, exact_layer", [(0.0, 0), (1.0, 1)])
def test_slerp_t_at_either_end_gives_that_layers_direction(t, exact_layer):
    caches, ks, vs, _ = _run(minicache_retention_threshold=-1.0, minicache_slerp_t=t)
    c, n = caches[exact_layer], caches[1].merged_rows
    assert mx.allclose(_rebuilt(c, "k"), ks[exact_layer][:, :, :n], atol=1e-4, rtol=1e-5)
    other = caches[1 - exact_layer]
    assert not mx.allclose(_rebuilt(other, "k"), ks[1 - exact_layer][:, :, :n], atol=1e-2)


def test_a_threshold_above_one_retains_everything_and_attention_is_exact():
    caches, ks, vs, outs = _run(minicache_retention_threshold=1.5)
    for i in range(2):
        for step, out in enumerate(outs[i]):
            n = T + step + 1
            q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(5 + T + step + 100 * i))
            assert mx.allclose(out, reference_attention(q, ks[i][:, :, :n], vs[i][:, :, :n], 32 ** -0.5),
                               atol=1e-5)


def test_layers_below_the_start_and_an_odd_last_layer_are_left_exact():
    caches, ks, vs, _ = _run(n_layers=5, minicache_start_frac=0.4)  # S = 2: pair (2, 3)
    assert [c.role for c in caches] == ["alone", "alone", "first", "second", "alone"]
    for i in (0, 1, 4):
        assert mx.array_equal(caches[i].keys.view(), ks[i]) and mx.array_equal(caches[i].values.view(), vs[i])
        assert not caches[i].shared.arrays()
    assert caches[3].n_merged == T + DECODE and caches[2].pending_k is None


def test_merging_step_by_step_equals_merging_the_whole_run_at_once():
    step, _, _, _ = _run(chunks=(64, 1), minicache_retention_threshold=0.5)
    once, _, _, _ = _run(chunks=(T, DECODE), minicache_retention_threshold=0.5)
    n = step[1].merged_rows
    for name in ("e_k", "e_v"):
        assert mx.allclose(step[1].shared[name].view(), once[1].shared[name].view()[:, :, :n], atol=1e-6)
    for x in ("k", "v"):
        a, b = retained(step[1], x).tolist(), retained(once[1], x).tolist()
        assert sorted(a) == sorted(e for e in b if e[1] < n)


def test_decode_reads_the_merged_rows_in_place_as_the_rebuilt_history():
    caches, *_ = _run(minicache_retention_threshold=0.5)
    for c in caches:
        rows = c.merged("k")
        assert isinstance(rows, MergedRows) and (rows.where is None) == (c.role == "first")
        q = mx.random.normal((1, 2, 2, 32))
        dense = rows.dense(mx.float32)
        assert mx.allclose(rows.scores(q), q @ dense.swapaxes(-1, -2), atol=1e-4)
        p = mx.softmax(mx.random.normal((1, 2, 2, rows.count)), axis=-1)
        assert mx.allclose(rows.mix(p), p @ dense, atol=1e-5)


def test_memory_of_a_pair_is_the_card_formula_within_the_growth_step():
    t = 600
    caches = layered("minicache", 2, minicache_start_frac=0.0, minicache_retention_threshold=0.5)
    ks, vs = kv(t, 2, related=_noisy)
    feed(caches, ks, vs, 200)
    h, d, s = 2, 32, 4
    n_ret = sum(getattr(caches[1], f"ret_{x}_where").length for x in ("k", "v"))
    formula = 2 * h * t * (d * s + 2 * s) + n_ret * (d * s + 8)  # e + m1 + m2 per tensor; retained
    room = 2 * h * 256 * (d * s + 2 * s) + 2 * 256 * (d * s + 8)
    total = caches[0].nbytes + caches[1].nbytes
    assert formula <= total <= formula + room
    assert caches[0].nbytes == sum(g.nbytes for g in (caches[0].m_k, caches[0].m_v))


def _six_layer_prompt_bytes(threshold):
    """nbytes of each layer of the reference-subword layout (6 layers, start_frac 0.5: pair
    (3, 4), layer 5 alone) after one prompt chunk of T tokens (buffers then hold it exactly)."""
    caches = layered("minicache", 6, minicache_start_frac=0.5, minicache_retention_threshold=threshold)
    ks, vs = kv(T, 6)
    feed(caches, ks, vs, T)
    assert [c.role for c in caches] == ["alone"] * 3 + ["first", "second", "alone"]
    return caches


def test_a_merged_pair_saves_exactly_one_layer_of_directions_less_two_magnitudes():
    """The merge runs on a prompt and keeps one copy: against the exact cache, a pair whose
    tokens are all merged saves (d - 2) elements per token, head and tensor, to the byte
    (the second layer's two () int32 row counters aside)."""
    h, d, s = 2, 32, 4
    caches = _six_layer_prompt_bytes(-1.0)
    exact = 2 * h * T * d * s  # one layer's keys and values
    assert [c.nbytes for c in caches[:3] + caches[5:]] == [exact] * 4
    assert caches[3].pending_k is None and caches[3].nbytes == 2 * h * T * s  # magnitudes only
    assert caches[4].ret_k_where.length == caches[4].ret_v_where.length == 0  # none retained
    assert sum(c.nbytes for c in caches) == 6 * exact - 2 * h * T * (d - 2) * s + 2 * 4


def test_a_threshold_no_pair_reaches_costs_more_than_the_exact_cache():
    """Every pair retained (cosine below the threshold everywhere, as 0.9 is on the reference
    models, whose adjacent layers' rows are near orthogonal): both originals are kept, plus
    two magnitudes and a (row, token) int32 index per token, head and tensor: more bytes
    than leaving the pair exact, nothing saved."""
    h, d, s = 2, 32, 4
    caches = _six_layer_prompt_bytes(1.5)
    assert caches[4].ret_k_where.length == caches[4].ret_v_where.length == h * T  # all retained
    exact = 2 * h * T * d * s
    assert sum(c.nbytes for c in caches) == 6 * exact + 2 * h * T * (2 * s + 8) + 2 * 4


def test_pairs_beyond_minicache_max_ctx_are_refused_naming_the_field():
    caches = layered("minicache", 2, minicache_start_frac=0.0, minicache_max_ctx=100)
    ks, vs = kv(T, 2)
    with pytest.raises(ValueError, match="minicache_max_ctx=100"):
        feed(caches, ks, vs, 64)


def _same_prompt_then_apart(x0, i):
    """Layer 1 equal to layer 0 over the prompt (nothing retained there), the negation over
    the decode tokens (cosine -1: every pair retained)."""
    return mx.where(mx.arange(x0.shape[2])[None, None, :, None] < T, x0, -x0)


def test_a_decode_step_keeps_its_retained_pairs_in_reserved_rows_and_counts_the_overflow():
    """No host read at a decode step (issue 30): rows are reserved ahead at the prompt's rate
    plus a margin, min(1, 2 * 0 + 1/16) of the 2 pairs a token for 64 tokens: 8 rows. The
    flush of the first 32 decode tokens retains all 64 pairs: the first 8 (tokens T..T+3,
    in head order) are kept exactly, the other 56 are merged after all and counted; the 6
    tokens held after them are not merged yet."""
    caches, ks, vs, _ = _run(related=_same_prompt_then_apart, minicache_retention_threshold=0.5)
    second = caches[1]
    n = second.merged_rows
    for x, a, b in (("k", ks[0], ks[1]), ("v", vs[0], vs[1])):
        assert getattr(second, f"ret_{x}_where").length == 8
        assert getattr(second, f"ret_{x}_dropped").item() == 2 * FLUSH - 8
        assert retained(second, x).tolist() == [[h, t] for t in range(T, T + 4) for h in range(2)]
        x2 = _rebuilt(second, x)
        assert mx.allclose(x2[:, :, T:T + 4], b[:, :, T:T + 4], atol=1e-5)  # kept apart: exact
        assert not mx.allclose(x2[:, :, T + 4:], b[:, :, T + 4:n], atol=1e-2)  # dropped: merged
