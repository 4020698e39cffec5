"""GEAR: the card's invariants (lossless at full rank, outliers exact and chosen per vector,
error feedback never hurts, r=0/s=0 is plain group quantization, the energy rule and its
cap, factors against an SVD, streaming chunks), decode over the packed form, and memory."""

import math

import mlx.core as mx
import numpy as np
import pytest

from test_kivi import feed
from test_methods_exactness import run
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import GEAROptions
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.gear.chunked import CHUNK_STEP, ChunkedFactors, LowRankTerm
from veloxquant_mlx.lowrank.factors import energy_rank, rank_cap, svd_factors
from veloxquant_mlx.methods.gear import GEARCache
from veloxquant_mlx.quant.affine import quantize_per_channel, quantize_per_token
from veloxquant_mlx.methods.gear.error_feedback import RANK_CAP_FRACTION, ErrorFeedback, ErrorFeedbackTokens
from veloxquant_mlx.quant.packed import GROWTH_TOKENS, AffineLayout, GroupAffine
from veloxquant_mlx.quant.residual import ResidualScores
from veloxquant_mlx.quant.outliers import per_tail
from veloxquant_mlx.methods.gear.sparse import SparseTerm
from feeding import stored_decode_attention


def gear(window=64, **options):
    return GEARCache(KVCacheConfig(method="gear", options=GEAROptions(**options), residual_window=window), None, 0)


def kv(t, d=64, h=2, seed=0, dtype=mx.float32):
    k = mx.random.normal((1, h, t, d), key=mx.random.key(seed)) * (1 + mx.arange(d) % 5)  # uneven channels
    v = mx.random.normal((1, h, t, d), key=mx.random.key(seed + 1))
    return k.astype(dtype), v.astype(dtype)


def rel_err(a, b):
    return float(mx.sqrt(((a.astype(mx.float32) - b) ** 2).sum()) / mx.sqrt((b.astype(mx.float32) ** 2).sum()))


@pytest.mark.parametrize("rank", [64, 4096])
@pytest.mark.parametrize("sparse", [0.0, 0.1])
def test_rank_and_sparsity_at_their_maximum_are_lossless_to_float_precision(rank, sparse):
    keys, values = kv(300)
    cache = gear(gear_rank=rank, gear_sparse_fraction=sparse)
    feed(cache, keys[:, :, :200], values[:, :, :200], 100)  # two prompt chunks of 96, 8 buffered
    feed(cache, keys[:, :, 200:], values[:, :, 200:], 1)  # a decode chunk of 64, 44 buffered
    assert (cache.store.keys.count, cache.store.k_buf.length) == (256, 44)
    k_hat, v_hat = cache.dequantized(mx.float32)
    assert mx.allclose(k_hat, keys, atol=1e-5, rtol=1e-5) and mx.allclose(v_hat, values, atol=1e-5, rtol=1e-5)
    assert rel_err(k_hat, keys) < 1e-6 and rel_err(v_hat, values) < 1e-6
    lossy = gear(gear_rank=0, gear_sparse_fraction=sparse)
    feed(lossy, keys, values, 300)
    assert rel_err(lossy.dequantized(mx.float32)[0], keys) > 0.1  # the backbone alone is 2-bit


def test_the_models_logits_at_full_rank_equal_the_full_cache():
    model = tiny_model("llama")
    tokens = prompt(260)
    ref = run(model, make_prompt_cache(model, KVCacheConfig(method="full")), tokens, chunk=100, decode=70)
    config = KVCacheConfig(method="gear", options=GEAROptions(gear_rank=32), residual_window=32)
    cache = make_prompt_cache(model, config)
    out = run(model, cache, tokens, chunk=100, decode=70)
    assert cache[0].store.keys.count == 320  # prompt chunks of 96 + 64 + 96, two decode chunks
    assert mx.allclose(out, ref, atol=1e-5, rtol=1e-5), float(mx.abs(out - ref).max())


@pytest.mark.parametrize("sparse", [0.01, 0.05, 0.1])
def test_outliers_are_each_vectors_largest_and_smallest_entries_and_come_back_exactly(sparse):
    keys, values = kv(192, seed=3)
    cache = gear(window=64, gear_sparse_fraction=sparse, gear_rank=2)
    feed(cache, keys[:, :, :128], values[:, :, :128], 128)  # one prompt chunk of 128
    feed(cache, keys[:, :, 128:], values[:, :, 128:], 1)  # one decode chunk of 64
    k_hat, v_hat = (np.array(x) for x in cache.dequantized(mx.float32))
    kn, vn = np.array(keys), np.array(values)
    sp_k, sp_v = cache.store.keys.sparse, cache.store.values.sparse
    # Keys: per channel over each chunk's tokens, positions in the whole run (int32).
    pos, kept = np.array(sp_k.index.view()), np.zeros(kn.shape, bool)
    start = 0
    for n in (128, 64):
        k = per_tail(sparse, n)
        chunk = kn[:, :, start : start + n].transpose(0, 1, 3, 2)  # (B, H, D, n)
        order = np.argsort(chunk, axis=-1)
        expected = np.concatenate([order[..., :k], order[..., n - k :]], axis=-1) + start
        got = pos[..., : 2 * k] if start == 0 else pos[..., -2 * k :]
        assert np.array_equal(np.sort(got, -1), np.sort(expected, -1))
        start += n
    assert pos.shape[-1] == 2 * per_tail(sparse, 128) + 2 * per_tail(sparse, 64)
    np.put_along_axis(kept.transpose(0, 1, 3, 2), pos, True, axis=-1)
    # Values: per token over its channels (uint8 channel indices).
    idx = np.array(sp_v.index.view())
    assert sp_v.index.view().dtype == mx.uint8 and idx.shape == (1, 2, 192, 2 * per_tail(sparse, 64))
    order = np.argsort(vn, axis=-1)
    k = per_tail(sparse, 64)
    assert np.array_equal(np.sort(idx, -1), np.sort(np.concatenate([order[..., :k], order[..., 64 - k :]], -1), -1))
    v_kept = np.zeros(vn.shape, bool)
    np.put_along_axis(v_kept, idx.astype(np.int64), True, axis=-1)
    # Exact there (to float32 rounding), 2-bit elsewhere.
    assert np.allclose(k_hat[kept], kn[kept], atol=1e-5) and np.allclose(v_hat[v_kept], vn[v_kept], atol=1e-5)
    assert np.abs(k_hat[~kept] - kn[~kept]).mean() > 0.05
    # The backbone quantizes each vector with its outliers replaced by the vector's mean.
    first = np.where(kept[:, :, :128], kn[:, :, :128].mean(axis=2, keepdims=True), kn[:, :, :128])
    codes, scales, _ = quantize_per_channel(mx.array(first), 32, 2)
    base = cache.store.keys.base
    assert mx.array_equal(base.codes.view()[..., :8], codes) and mx.allclose(base.scales.view()[..., :4], scales)


def test_outliers_per_tail_are_the_ceiling_of_half_the_fraction():
    assert [per_tail(s, n) for n, s in [(128, 0.01), (2048, 0.01), (64, 0.1), (32, 0.1), (200, 0.01), (128, 0.0)]] \
        == [1, 11, 4, 2, 1, 0]


def test_error_feedback_never_increases_the_error():
    """‖X - (D + L + S)‖ <= ‖X - (D + S)‖ <= ‖X - D‖: the same backbone, then each term."""
    keys, values = kv(256, seed=5)
    errs = {}
    for name, options in {"D": dict(gear_rank=0, gear_sparse_fraction=0.0),
                          "D+S": dict(gear_rank=0), "D+L+S": dict(gear_rank=4),
                          "D+L+S energy": dict(gear_rank=None), "D+L+S r16": dict(gear_rank=16)}.items():
        cache = gear(**options)
        feed(cache, keys, values, 256)
        k_hat, v_hat = cache.dequantized(mx.float32)
        errs[name] = rel_err(k_hat, keys) + rel_err(v_hat, values)
    assert errs["D+L+S r16"] < errs["D+L+S"] < errs["D+S"] < errs["D"]
    assert errs["D+L+S energy"] < errs["D+S"]


def test_rank_zero_and_no_outliers_is_plain_group_quantization_bit_for_bit():
    keys, values = kv(200, seed=6)
    cache = gear(gear_rank=0, gear_sparse_fraction=0.0, gear_bits=4)
    feed(cache, keys, values, 200)
    s = cache.store
    codes, scales, biases = quantize_per_channel(keys[:, :, :192], 32, 4)
    assert mx.array_equal(s.keys.base.codes.view(), codes) and mx.array_equal(s.keys.base.scales.view(), scales)
    assert mx.array_equal(s.keys.base.biases.view(), biases)
    codes, scales, _ = quantize_per_token(values[:, :, :192], 32, 4)
    assert mx.array_equal(s.values.base.codes.view(), codes) and mx.array_equal(s.values.base.scales.view(), scales)
    assert s.keys.factors is None and s.keys.sparse is None  # nothing else is kept
    (part,) = s.decode_parts(mx.zeros((0,)))
    assert isinstance(part.keys, AffineLayout) and isinstance(part.values, AffineLayout) and part.affine


def _svd_error(x, r):
    sigma = np.linalg.svd(np.array(x, dtype=np.float64), compute_uv=False)
    return np.sqrt((sigma[..., r:] ** 2).sum(-1))


def test_svd_factors_reach_the_best_rank_r_error():
    for shape in [(2, 3, 96, 32), (1, 2, 16, 64)]:  # tall and wide
        x = mx.random.normal(shape, key=mx.random.key(7))
        a, b, sigma = svd_factors(x)
        assert np.allclose(np.array(sigma), np.linalg.svd(np.array(x), compute_uv=False), rtol=1e-4, atol=1e-4)
        for r in (1, 4, min(shape[-2:])):
            err = np.linalg.norm(np.array(x - a[..., :r] @ b[..., :r].swapaxes(-1, -2)), axis=(-2, -1))
            assert np.allclose(err, _svd_error(x, r), rtol=1e-3, atol=1e-4)


def test_a_fixed_rank_is_a_projection_deterministic_and_near_the_svd_optimum():
    """A = X V, B = V (``leading_basis``): A Bᵀ = X V Vᵀ, an orthogonal projection, so never
    worse than nothing and never better than the SVD; with a spectral gap, 3 products reach
    the optimum to the float32 Gram matrix's resolution (directions below sqrt(eps) = 3.5e-4
    of the largest singular value blur: 4e-4 of ‖x‖ on top, as the latent fits'); on white
    noise (a quantization residual) they come close."""
    u = mx.linalg.qr(mx.random.normal((2, 128, 32), key=mx.random.key(1)), stream=mx.cpu)[0]
    v = mx.linalg.qr(mx.random.normal((2, 32, 32), key=mx.random.key(2)), stream=mx.cpu)[0]
    x = (u * (0.3 ** mx.arange(32))) @ v.swapaxes(-1, -2)  # decaying: a gap after every rank
    for r in (1, 3, 8):
        codec = ErrorFeedback(GroupAffine(2, 32, "channel"), r, 0.9, 0.0)
        a, b = codec.kept_factors(x)
        assert a.shape == (2, 128, r) and b.shape == (2, 32, r)
        assert mx.allclose(b.swapaxes(-1, -2) @ b, mx.eye(r), atol=1e-5)  # B orthonormal
        err = np.linalg.norm(np.array(x - a @ b.swapaxes(-1, -2)), axis=(-2, -1))
        best = _svd_error(x, r)
        norm = np.linalg.norm(np.array(x), axis=(-2, -1))
        assert np.all(err >= best * (1 - 1e-4)) and np.all(err <= best * 1.01 + 4e-4 * norm), (err, best)
        a2, b2 = codec.kept_factors(x)
        assert mx.array_equal(a, a2) and mx.array_equal(b, b2)  # a fixed seed
    white = mx.random.normal((2, 128, 32), key=mx.random.key(3))
    norm = np.linalg.norm(np.array(white), axis=(-2, -1))
    for r in (1, 4, 16):
        a, b = ErrorFeedback(GroupAffine(2, 32, "channel"), r, 0.9, 0.0).kept_factors(white)
        err = np.linalg.norm(np.array(white - a @ b.swapaxes(-1, -2)), axis=(-2, -1))
        best = _svd_error(white, r)
        assert np.all(err < norm) and np.all(err >= best * (1 - 1e-4)) and np.all(err <= best * 1.1), (r, err, best)


def test_energy_rank_is_the_minimal_rank_meeting_the_threshold():
    x = mx.random.normal((3, 4, 64, 32), key=mx.random.key(8)) * (0.8 ** mx.arange(32))
    _, _, sigma = svd_factors(x)
    s2 = np.linalg.svd(np.array(x, np.float64), compute_uv=False) ** 2
    share = np.cumsum(s2, -1) / s2.sum(-1, keepdims=True)
    for tau in (0.3, 0.5, 0.9, 0.99, 1.0):
        expected = np.minimum((share < tau - 1e-9).sum(-1) + 1, 32)
        assert np.array_equal(np.array(energy_rank(sigma, tau)), expected), tau
    exact = mx.array([1.0, 1.0, 0.0, 0.0])  # thresholds met exactly: ">=" counts them
    assert [int(energy_rank(exact, tau)) for tau in (0.5, 0.75, 1.0)] == [1, 2, 2]


def test_the_energy_rule_caps_the_rank_of_a_white_residual_and_not_of_a_low_rank_one():
    codec = ErrorFeedback(GroupAffine(2, 32, "channel"), None, 0.9, 0.0)
    white = mx.random.normal((1, 2, 256, 128), key=mx.random.key(9))
    a, b = codec.factors(white)
    assert a.shape[-1] == rank_cap(256, 128, RANK_CAP_FRACTION) == math.ceil(0.05 * 128) == 7
    low = mx.random.normal((1, 2, 256, 2), key=mx.random.key(10)) @ mx.random.normal((1, 2, 2, 128))
    low = low + 1e-3 * white  # rank 2 and a little noise
    a, b = codec.factors(low)
    assert a.shape[-1] == 2 and rel_err(a @ b.swapaxes(-1, -2), low) < 1e-2
    cache = gear(gear_rank=None)  # in the cache: the widest chunk's rank is what is kept
    keys, values = kv(256, seed=11)
    feed(cache, keys, values, 256)
    assert cache.store.keys.factors.rank == rank_cap(256, 64, RANK_CAP_FRACTION) == 4


def test_chunks_of_narrower_rank_are_padded_and_a_wider_one_widens_the_store():
    keys, values = kv(96, seed=12)
    cache = gear(window=32, gear_rank=40)  # a chunk of 32 tokens has rank 32 at most
    feed(cache, keys[:, :, :32], values[:, :, :32], 32)
    assert cache.store.keys.factors.rank == 32
    feed(cache, keys[:, :, 32:], values[:, :, 32:], 64)  # a chunk of 64: rank 40
    f = cache.store.keys.factors
    assert f.rank == 40 and f.n_chunks == 2 and f.chunk.view().tolist() == [0] * 32 + [1] * 64
    assert float(mx.abs(f.a.view()[:, :, :32, 32:]).max()) == 0.0  # the first chunk, zero-padded
    k_hat, _ = cache.dequantized(mx.float32)
    assert mx.allclose(k_hat[:, :, :32], keys[:, :, :32], atol=1e-5)  # still exact at full rank


def test_a_prompt_chunks_history_reads_no_chunk_end_on_the_host_and_a_restore_reads_them_once():
    """The chunks' ends come from the host's record of the appends: a prompt chunk's history
    (``dense``, per layer and chunk) waited for the device once each before. A restored or
    trimmed store has no record and reads them from its arrays."""
    from decode_steps import recording_host_reads

    keys, values = kv(160, seed=3)
    cache = gear(window=32)
    with recording_host_reads() as reads:
        for start in range(0, 160, 40):  # four prompt chunks, three of them over a history
            feed(cache, keys[:, :, start:start + 40], values[:, :, start:start + 40], 40)
    assert not [r for r in reads if "chunked.py" in r.where], reads
    f = cache.store.keys.factors
    assert f.chunk_ends() == f.ends.view().tolist() == [32, 64, 96, 160]  # whole groups of 32 flushed
    restored = gear(window=32)
    restored.state = cache.state
    g = restored.store.keys.factors
    assert g.chunk_ends() == [32, 64, 96, 160]
    assert mx.array_equal(g.dense(), f.dense())
    g.ends.length -= 2  # a shortened record is read again
    assert g.chunk_ends() == [32, 64]


@pytest.mark.parametrize("t, chunk", [(20, 20), (31, 7), (64, 64), (200, 200), (201, 1), (300, 77)])
def test_streaming_compresses_whole_groups_of_a_prompt_and_block_sized_decode_chunks(t, chunk):
    keys, values = kv(t, seed=t)
    cache = gear(window=64)
    feed(cache, keys, values, chunk)
    chunks, held, n_prompt = [], 0, 0
    i = 0
    while i < t:  # the policy, by hand: a call of n > 1 tokens flushes whole groups
        n = min(chunk, t - i)
        held += n
        if n > 1 and held >= 32:
            chunks.append(held // 32 * 32)
            held %= 32
        elif n == 1 and held == 64:
            chunks.append(64)
            held = 0
        i += n
    s = cache.store
    assert (s.keys.count, s.k_buf.length, s.values.count) == (sum(chunks), held, sum(chunks))
    assert cache.stored_length == t == cache.offset
    if chunks:
        assert s.keys.factors.chunk.view().tolist() == sum(([c] * n for c, n in enumerate(chunks)), [])
    k_hat, v_hat = cache.dequantized(mx.float32)
    assert k_hat.shape == keys.shape and v_hat.shape == values.shape
    assert mx.array_equal(k_hat[:, :, t - held :], keys[:, :, t - held :])  # the buffer is exact
    assert mx.array_equal(v_hat[:, :, t - held :], values[:, :, t - held :])


@pytest.mark.parametrize("pure_path", ["qmm", "reference"])
@pytest.mark.parametrize("options", [
    dict(), dict(gear_rank=4), dict(gear_rank=4, gear_bits=3), dict(gear_bits=8, gear_sparse_fraction=0.1),
    dict(gear_rank=0), dict(gear_rank=0, gear_sparse_fraction=0.0), dict(gear_quantize_values=False),
    dict(gear_rank=0, gear_sparse_fraction=0.0, gear_quantize_values=False),
], ids=["default", "r4", "r4-3bit", "8bit-s10", "sparse-only", "plain", "keys-only", "plain-keys-only"])
def test_decode_attention_matches_attention_over_the_reconstructed_cache(options, pure_path, monkeypatch):
    """On the CPU's path and on the GPU's pure path (the dequantizing reference)."""
    monkeypatch.setattr(kd, "_pure_path", lambda: pure_path)
    model = tiny_model("llama")
    cache = make_prompt_cache(model, KVCacheConfig(method="gear", options=GEAROptions(**options), residual_window=64))
    run(model, cache, prompt(300), chunk=128, decode=3)
    c = cache[0]
    assert c.store.keys.count == 288 and c.store.k_buf.length == 15  # prompt chunks 128, 128, 32
    q = mx.random.normal((1, 4, 1, 32))
    out = stored_decode_attention(c, q, 32**-0.5)
    k_hat, v_hat = c.dequantized(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=32**-0.5)
    assert mx.allclose(out, ref, atol=1e-5), float(mx.abs(out - ref).max())


def test_a_decode_step_reads_the_packed_form_and_never_rebuilds_the_history(monkeypatch):
    """No dequantized history, no dense factors or outliers at a step; only a step that
    fills the buffer dequantizes, and only its own chunk (to take its residual)."""
    keys, values = kv(300, seed=13)
    cache = gear(gear_rank=4)  # decode chunks of 64
    feed(cache, keys[:, :, :250], values[:, :, :250], 250)  # 224 compressed, 26 buffered
    monkeypatch.setattr(kd, "_pure_path", lambda: "qmm")  # the CPU's path

    def forbidden(*args, **kwargs):
        raise AssertionError("a decode step rebuilt the history")

    with monkeypatch.context() as m:
        m.setattr(mx, "dequantize", forbidden)
        for cls, name in ((ErrorFeedbackTokens, "decode"), (ChunkedFactors, "dense"), (SparseTerm, "dense")):
            m.setattr(cls, name, forbidden)
        feed(cache, keys[:, :, 250:287], values[:, :, 250:287], 1)
        (part,) = cache.store.decode_parts(mx.zeros((0,)))
        assert isinstance(part.keys, ResidualScores) and isinstance(part.values, ResidualScores)
        assert {type(t) for t in part.keys.terms} == {LowRankTerm, SparseTerm}
    assert (cache.store.keys.count, cache.store.k_buf.length) == (224, 63)
    feed(cache, keys[:, :, 287:288], values[:, :, 287:288], 1)  # the 64th: a chunk
    assert (cache.store.keys.count, cache.store.k_buf.length) == (288, 0)


@pytest.mark.parametrize("options, kernel", [
    (dict(gear_rank=0, gear_sparse_fraction=0.0), True),
    (dict(gear_rank=0, gear_sparse_fraction=0.0, gear_quantize_values=False), True),
    (dict(gear_rank=0), False), (dict(gear_rank=4, gear_sparse_fraction=0.0), False), (dict(), False),
])
def test_which_parts_the_fused_kernel_could_serve(options, kernel):
    keys, values = kv(200, seed=14)
    cache = gear(**options)
    feed(cache, keys, values, 200)
    (part,) = cache.store.decode_parts(mx.zeros((0,)))
    assert part.affine == kernel
    assert isinstance(part.keys, AffineLayout if kernel else ResidualScores)


def test_values_kept_exact_when_they_are_not_quantized():
    keys, values = kv(300, seed=15)
    cache = gear(gear_quantize_values=False)
    feed(cache, keys[:, :, :200], values[:, :, :200], 200)
    feed(cache, keys[:, :, 200:], values[:, :, 200:], 1)
    k_hat, v_hat = cache.dequantized(mx.float32)
    assert mx.array_equal(v_hat, values) and not mx.allclose(k_hat, keys, atol=1e-2)
    assert cache.store.values.count == 0 and cache.store.v_buf.length == 300


def _card_bytes(b, d, g, s, idx, r, t_chunk):
    """The card's bytes per head per token for one of K or V."""
    return b * d / 8 + 4 * d / g + s * d * (2 + idx) + 2 * r + 2 * d * r / t_chunk


@pytest.mark.parametrize("rank", [4, None])
def test_memory_at_4k_matches_the_cards_formula(rank):
    """Codes, scales, factors A and B, outlier values and indices, chunk indices and the
    buffer, at fp16: against the exact count within the growth step, and the card's formula."""
    t, h, d, g, bits, s, block = 4096, 2, 128, 32, 2, 0.01, 128
    keys, values = kv(t + 200, d=d, h=h, seed=16, dtype=mx.float16)
    cache = gear(window=block, gear_rank=rank, gear_bits=bits, gear_sparse_fraction=s)
    for i in range(0, t, 2048):  # the prompt in mlx-lm's chunks of 2048, then 200 decode steps
        cache.store.commit(keys[:, :, i : i + 2048], values[:, :, i : i + 2048])
    for i in range(t, t + 200):
        cache.store.commit(keys[:, :, i : i + 1], values[:, :, i : i + 1])
    chunks, held = [2048, 2048, 128], 72
    st = cache.store
    r = st.keys.factors.rank
    assert r == (rank or math.ceil(0.05 * d)) == st.values.factors.rank
    n = sum(chunks)
    assert st.keys.count == n and st.k_buf.length == held
    backbone = n * (bits * d / 8 + 4 * d / g)
    factors = n * 2 * r + len(chunks) * d * r * 2
    key_sparse = sum(d * 2 * per_tail(s, c) for c in chunks) * (2 + 4)  # fp16 deltas, int32 positions
    value_sparse = n * 2 * per_tail(s, d) * (2 + 1)  # fp16 deltas, uint8 channels
    chunk_index = 2 * n * 4  # int32 per token, keys and values (per layer, not per head)
    exact = h * (2 * backbone + 2 * factors + key_sparse + value_sparse + 2 * held * d * 2) + chunk_index
    per_token = h * 2 * (bits * d / 8 + 4 * d / g + 2 * r + 2 * per_tail(s, d) * 6) + 8
    room = GROWTH_TOKENS * per_token + h * 2 * CHUNK_STEP * d * r * 2 + h * 2 * block * d * 2
    assert exact <= cache.nbytes <= exact + room, (cache.nbytes, exact)
    card = h * (n * _card_bytes(bits, d, g, s, 4, r, n / len(chunks)) + n * _card_bytes(bits, d, g, s, 1, r, n / len(chunks))
                + 2 * held * d * 2) + chunk_index
    assert abs(cache.nbytes - card) <= room, (cache.nbytes, card)
    # against fp16, the buffer's spare rows aside: it keeps a block's room across flushes
    assert st.k_buf.capacity == st.v_buf.capacity == block
    spare = h * 2 * (block - held) * d * 2
    assert cache.nbytes - spare < (2 * (t + 200) * h * d * 2) / (3.5 if rank == 4 else 3)


def test_bad_settings_name_the_field_and_what_is_allowed():
    with pytest.raises(ValueError, match=r"gear_bits=7.*2, 3, 4, 5, 6, 8"):
        KVCacheConfig(method="gear", options=GEAROptions(gear_bits=7))
    with pytest.raises(ValueError, match="residual_window"):
        KVCacheConfig(method="gear", options=GEAROptions(gear_group_size=64), residual_window=96)
    model = tiny_model("llama")  # head_dim 32
    with pytest.raises(ValueError, match="gear_group_size=64 must divide head_dim=32"):
        cache = make_prompt_cache(model, KVCacheConfig(method="gear", options=GEAROptions(gear_group_size=64)))
        model(prompt(8)[None], cache=cache)
