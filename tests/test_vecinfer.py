"""VecInfer: the dual transform is lossless, codes index the nearest centroid, decode scores
keys through q-centroid lookup tables (equal to scoring the dequantized keys, without
rebuilding them), the window is exact, and nbytes against the card's memory formula."""

import mlx.core as mx
import pytest

from feeding import feed_chunks
from tiny_models import prompt, tiny_model
from test_methods_exactness import run
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import VecInferOptions
from veloxquant_mlx.methods.vecinfer import VecInferCache
from veloxquant_mlx.quant import vq
from veloxquant_mlx.quant.packed import GROWTH_TOKENS
from veloxquant_mlx.quant.store import VALUE_ROOM, PackedStore
from veloxquant_mlx.quant.vq import (CodebookKeys, ProductVQ, index_words, kmeans, pack_indices, relative_error,
                                     unpack_indices)
from veloxquant_mlx.quant.vq_store import CodebookFit, CodebookStore, smoothing_factors

SMALL = dict(key_codebook_bits=6, value_codebook_bits=4)  # fits from a short prompt are lossy


def vecinfer(**options):
    return VecInferCache(KVCacheConfig(method="vecinfer", options=VecInferOptions(**options)), None, 0)


def kv(t, d=128, h=2, seed=0, dtype=mx.float32):
    # a few large key channels: the outliers the smoothing is for
    k = mx.random.normal((1, h, t, d), key=mx.random.key(seed)) * mx.where(mx.arange(d) % 37 == 0, 12.0, 1.0)
    v = mx.random.normal((1, h, t, d), key=mx.random.key(seed + 1))
    return k.astype(dtype), v.astype(dtype)


def sq_dist(x, centroids):
    """(..., s) x (K, s) -> (..., K) squared distances, formed directly."""
    return mx.square(x[..., None, :].astype(mx.float32) - centroids.astype(mx.float32)).sum(-1)


def assert_nearest(x, idx, centroids):
    """Each index points at a centroid no farther than the nearest (float32 rounding)."""
    d = sq_dist(x, centroids)
    chosen = mx.take_along_axis(d, idx.astype(mx.int32)[..., None], axis=-1)[..., 0]
    best = d.min(axis=-1)
    slack = 1e-5 * (mx.square(x).sum(-1) + 1)
    assert bool(mx.all(chosen <= best + slack)), float((chosen - best).max())
    assert float((idx == d.argmin(axis=-1)).mean()) > 0.999  # exact ties aside, the same index


def test_indices_pack_into_one_little_endian_bit_stream_and_unpack_at_every_width():
    for bits in range(1, 17):
        for n in (1, 7, 32, 45):
            idx = mx.random.randint(0, 1 << bits, (2, 3, n), key=mx.random.key(bits * 100 + n)).astype(mx.uint32)
            words = pack_indices(idx, bits)
            assert words.shape == (2, 3, index_words(n, bits)) and words.dtype == mx.uint32
            assert mx.array_equal(unpack_indices(words, bits, n), idx), (bits, n)
    words = pack_indices(mx.array([0xABC, 0x123, 0xFFF]), 12)  # the layout itself
    assert words.tolist() == [0xABC | 0x123 << 12 | 0xFF << 24, 0xF]


def test_the_dual_transform_is_lossless_and_keeps_query_key_products():
    keys, _ = kv(64)
    codec = ProductVQ(mx.zeros((16, 4)), 4, smoothing_factors(keys), rotated=True)
    y = codec.to_code_space(keys)
    assert float(mx.abs(codec.from_code_space(y) - keys).max()) < 1e-5 * float(mx.abs(keys).max())
    q = mx.random.normal((1, 2, 3, 128), key=mx.random.key(9))
    exact = q @ keys.swapaxes(-1, -2)
    moved = codec.query_to_code_space(q) @ y.swapaxes(-1, -2)
    assert mx.allclose(moved, exact, atol=1e-4, rtol=1e-5)
    # lambda_c = sqrt(max_t |K[t, c]|) per KV head, floored
    lam = mx.sqrt(mx.abs(keys).max(axis=2, keepdims=True))
    assert mx.allclose(codec.scale, mx.maximum(lam, 1e-4))


def test_codes_index_the_nearest_centroid_of_keys_in_the_smoothed_rotated_frame_and_of_raw_values():
    keys, values = kv(300)
    cache = vecinfer(residual_length=32, **SMALL)
    feed_chunks(cache, keys[:, :, :200], values[:, :, :200], 200)
    feed_chunks(cache, keys[:, :, 200:], values[:, :, 200:], 1)
    s = cache.store
    n = s.count
    assert n == 300 - 32 - 100 % VALUE_ROOM and s.fitted_from == "prompt"  # flushed 32 at a time
    kc, vc = s.key_codec, s.value_codec
    k_idx = unpack_indices(s.k_codes.view(), kc.bits, 128 // 4)
    v_idx = unpack_indices(s.v_codes.view(), vc.bits, 128 // 8)
    k_sub = kc.to_code_space(keys[:, :, :n]).reshape(1, 2, n, 32, 4)
    assert_nearest(k_sub, k_idx, kc.centroids)
    assert_nearest(values[:, :, :n].reshape(1, 2, n, 16, 8), v_idx, vc.centroids)


def test_lookup_table_scores_equal_the_scores_of_the_dequantized_keys():
    keys, values = kv(300)
    cache = vecinfer(residual_length=16, key_codebook_bits=12, value_codebook_bits=8)
    cache.store.install(*CodebookFit(4, 12, 8, 8, iters=1, sample=2, seed=0).fit(keys, values), "calibration")
    feed_chunks(cache, keys, values, 300)
    s = cache.store
    k_hat = s.key_codec.decode(s.k_codes.view(), 128, mx.float32)
    q = mx.random.normal((1, 2, 4, 128), key=mx.random.key(3))  # 4 query heads a KV head
    lut = CodebookKeys(s.k_codes.buffer, s.count, s.key_codec, 128).scores(q)
    ref = q @ k_hat.swapaxes(-1, -2)
    assert lut.shape == (1, 2, 4, 284)
    assert mx.allclose(lut, ref, atol=1e-4, rtol=1e-4), float(mx.abs(lut - ref).max())
    # and the scores are of the right keys: against the exact keys the codes are lossy
    assert float(mx.abs(lut - q @ keys[:, :, :284].swapaxes(-1, -2)).max()) > 1e-2


def test_a_decode_step_scores_keys_through_lookup_tables_never_rebuilding_the_history(monkeypatch):
    # The steady-state step (CodebookStore.decode_attention) is held bit for bit to the general
    # path (commit, then the joint softmax over decode_parts), whose keys are scored by one
    # lookup_scores call (q~ . C tables gathered by index); neither decodes the coded history.
    keys, values = kv(200)
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(4))
    k, v = keys[:, :, 199:], values[:, :, 199:]

    def refuse(*a, **kw):
        raise AssertionError("a decode step decoded the coded history")

    monkeypatch.setattr(ProductVQ, "decode", refuse)
    outs, states = [], []
    for general in (True, False):
        cache = vecinfer(residual_length=16, **SMALL)
        feed_chunks(cache, keys[:, :, :199], values[:, :, :199], 199)
        calls = []
        real = vq.lookup_scores
        with monkeypatch.context() as m:
            m.setattr(vq, "lookup_scores", lambda *a: calls.append(a[1].shape) or real(*a))
            if general:
                m.setattr(CodebookStore, "decode_attention", PackedStore.decode_attention)
            else:  # the step reads no index through the general readers
                for name in ("unpack_indices", "gather_centroids"):
                    m.setattr(vq, name, refuse)
            cache.update_and_fetch(k, v)
            outs.append(cache.attend(q, k, v, scale=128**-0.5, mask=None))
            mx.eval(outs[-1])
        # general: one table lookup over the 183 coded tokens' 32 sub-spaces (the step's token
        # joins the window); steady: the same lookup, gathered from the whole code buffer
        # without lookup_scores
        assert calls == ([(1, 2, 183, 32)] if general else [])
        states.append(cache.state["arrays"])
    assert mx.array_equal(outs[0], outs[1])
    assert states[0].keys() == states[1].keys()
    assert all(mx.array_equal(states[0][n], states[1][n]) for n in states[0] if states[0][n] is not None)
    monkeypatch.undo()
    all_k, all_v = cache.dequantized(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q, all_k, all_v, scale=128**-0.5)
    out = outs[1]
    assert mx.allclose(out, ref, atol=1e-5, rtol=1e-4), float(mx.abs(out - ref).max())


def test_window_tokens_are_exact_and_decode_steps_code_them_32_at_a_time_past_the_window():
    keys, values = kv(150, dtype=mx.float16)
    cache = vecinfer(residual_length=40, **SMALL)
    feed_chunks(cache, keys[:, :, :100], values[:, :, :100], 50)
    assert cache.store.count == 60  # a prompt chunk codes every token past the window
    feed_chunks(cache, keys[:, :, 100:], values[:, :, 100:], 1)
    # 50 steps: the window reached 40 + 32 at the 32nd and its oldest 32 were coded
    assert cache.store.count == 60 + VALUE_ROOM == 92 and cache.store.k_win.held == 40 + 50 - VALUE_ROOM
    k_hat, v_hat = cache.dequantized(mx.float16)
    assert mx.array_equal(k_hat[:, :, 92:], keys[:, :, 92:]) and mx.array_equal(v_hat[:, :, 92:], values[:, :, 92:])
    assert relative_error(keys[:, :, :92], k_hat[:, :, :92]) > 1e-3  # the rest is coded


def test_with_codebooks_given_the_codes_do_not_depend_on_how_the_prompt_came():
    keys, values = kv(160)
    fit = CodebookFit(4, 6, 8, 4, iters=4, sample=8, seed=0)
    codecs = fit.fit(keys, values)
    states = []
    for chunk, decode_from in ((160, 160), (37, 160), (64, 100)):
        cache = vecinfer(residual_length=24, **SMALL)
        cache.store.install(*codecs, "calibration")
        feed_chunks(cache, keys[:, :, :decode_from], values[:, :, :decode_from], chunk)
        feed_chunks(cache, keys[:, :, decode_from:], values[:, :, decode_from:], 1)
        s = cache.store  # decode steps leave up to 31 more tokens in the window
        assert mx.array_equal(s.k_win.view(), keys[:, :, s.count:])
        assert mx.array_equal(s.v_win.view(), values[:, :, s.count:])
        states.append((s.k_codes.view(), s.v_codes.view()))
    n = min(codes.shape[2] for codes, _ in states)
    assert n < max(codes.shape[2] for codes, _ in states)
    for other in states[1:]:
        assert all(mx.array_equal(a[:, :, :n], b[:, :, :n]) for a, b in zip(states[0], other))


def test_kmeans_codebooks_on_gaussian_data_reach_the_cards_error_and_more_bits_do_not_hurt():
    x = mx.random.normal((40000, 8), key=mx.random.key(0))
    test = mx.random.normal((10000, 8), key=mx.random.key(1))
    errors = []
    for bits in (4, 6, 8):
        c = kmeans(x, 1 << bits, iters=12, key=mx.random.key(2))
        errors.append(relative_error(test, c[vq.nearest(test, c)]))
    assert errors[2] < 0.40  # card: ~0.33 for 8-dim, 256 centroids
    assert errors[0] > errors[1] > errors[2]


def test_nbytes_after_a_long_prompt_matches_the_cards_memory_formula():
    h, d, t, window = 2, 128, 1500, 128
    keys, values = kv(t, h=h, dtype=mx.float16)
    cache = vecinfer(residual_length=window, key_codebook_bits=10)  # 10-bit keys / 4, 8-bit values / 8
    feed_chunks(cache, keys[:, :, :1400], values[:, :, :1400], 1400)
    feed_chunks(cache, keys[:, :, 1400:], values[:, :, 1400:], 1)
    per_token = h * ((d // 4) * 10 // 8 + (d // 8) * 8 // 8)  # 56 B a head: 40 key + 16 value
    codebooks = (1 << 10) * 4 * 2 + (1 << 8) * 8 * 2  # float16 centroids
    smoothing = h * d * 4  # float32 here (the card counts float16)
    fp_window = window * h * 4 * d  # K + V rows, float16
    formula = (t - window) * per_token + fp_window + codebooks + smoothing
    slack = GROWTH_TOKENS * per_token + VALUE_ROOM * h * 4 * d  # code rows grown ahead, the window's room
    assert formula <= cache.nbytes <= formula + slack, (cache.nbytes, formula)


def test_fields_that_do_not_fit_the_head_are_refused_naming_them():
    keys, values = kv(8, d=96)
    with pytest.raises(ValueError, match="key_sub_dim=5 must divide head_dim=96"):
        vecinfer(key_sub_dim=5).update_and_fetch(keys, values)
    with pytest.raises(ValueError, match="head_dim=80"):
        vecinfer(key_sub_dim=4).update_and_fetch(*kv(8, d=80))


def test_the_model_decodes_equal_to_the_full_cache_when_the_window_covers_the_context():
    model = tiny_model("llama")
    tokens = prompt(120)
    ref = run(model, make_prompt_cache(model, KVCacheConfig(method="full")), tokens, chunk=50, decode=8)
    config = KVCacheConfig(method="vecinfer", options=VecInferOptions(residual_length=200, **SMALL))
    out = run(model, make_prompt_cache(model, config), tokens, chunk=50, decode=8)
    assert mx.allclose(out, ref, atol=1e-4, rtol=1e-4)
    lossy = KVCacheConfig(method="vecinfer", options=VecInferOptions(residual_length=16, **SMALL))
    out = run(model, make_prompt_cache(model, lossy), tokens, chunk=50, decode=8)
    assert not mx.allclose(out, ref, atol=1e-3, rtol=1e-3)


def test_nearest_on_a_gpu_takes_large_blocks_paced_one_behind_and_a_decode_step_waits_for_nothing(monkeypatch):
    """On a GPU the nearest-centroid search forms NEAREST_CHUNK_GPU distances a block (the
    CPU's 128 rows a block at 4,096 centroids made vecinfer's 4k prompt 8,192 blocks of
    launches a layer: 291 ms against 27 on the H200); blocks past one are scheduled and the
    host waits for the block before (left lazy, every block's distances existed at once:
    14 GB for one layer's keys). A decode step's rows are one block: no wait. The indices
    are the CPU path's."""
    x = mx.random.normal((3000, 4), key=mx.random.key(0))
    c = mx.random.normal((256, 4), key=mx.random.key(1))
    expected = vq.nearest(x, c)
    calls = []
    real_eval, real_async = mx.eval, mx.async_eval
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(mx, "eval", lambda *a: (calls.append("wait"), real_eval(*a))[1])
    monkeypatch.setattr(mx, "async_eval", lambda *a: (calls.append("schedule"), real_async(*a))[1])
    monkeypatch.setattr(vq, "NEAREST_CHUNK_GPU", 256 * 1000)  # 1,000 rows a block: 3 blocks
    got = vq.nearest(x, c)
    assert calls == ["schedule", "schedule", "wait", "schedule", "wait"]
    assert mx.array_equal(got, expected)
    calls.clear()
    assert mx.array_equal(vq.nearest(x[:256], c), expected[:256]) and calls == []  # one block


def test_a_steady_decode_step_holds_about_the_lookups_it_gathers_not_a_word_per_index():
    """The steady step reads each key and value index from the two words it spans at most.
    The form it replaced summed every word's share for every index over the whole code
    buffer, an intermediate W times the indices (12 words a token at the defaults): 370 MB
    for a 4k-token layer of 8 heads against 2.6 MB kept. The step's peak above what is held
    before it is its lookup tables (R query rows x n sub-spaces x K centroids), the token's
    distances to the K key centroids, and a few arrays of the R query rows' flat indices'
    size (the indices, the lookups they gather, the values' centroids: 4 bytes each); 31 MB
    here before, 11 after."""
    b, h, r, d, t = 1, 2, 4, 128, 1024
    cache = vecinfer(residual_length=32)
    k, v = kv(t, d=d, h=h)
    q = mx.random.normal((b, h * r, 1, d), key=mx.random.key(9))
    feed_chunks(cache, k, v, 256)
    for _ in range(3):  # past the window's first flush: the steady step
        out = cache.attend(q, *cache.update_and_fetch(k[:, :, -1:], v[:, :, -1:]), scale=d ** -0.5, mask=None)
        mx.eval(out)
    assert cache.store.k_codes.buffer.shape[-1] == 12  # words a token: 32 indices of 12 bits
    rows, n, centroids = cache.store.k_codes.buffer.shape[2], d // 4, 1 << 12
    lookups = b * h * r * rows * n * 4
    tables, distances = b * h * r * n * centroids * 4, b * h * n * centroids * 4
    mx.eval(cache.state["arrays"])
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = cache.attend(q, *cache.update_and_fetch(k[:, :, -1:], v[:, :, -1:]), scale=d ** -0.5, mask=None)
    mx.eval(out)
    assert mx.get_peak_memory() - before < tables + distances + 6 * lookups, (mx.get_peak_memory() - before, lookups)


def test_a_prompt_fit_on_a_gpu_reads_nothing_on_the_host_and_gives_the_cpus_codebooks(monkeypatch):
    """A fit from the prompt (``CodebookFit.fit_rows``) on the CPU reads each Lloyd
    iteration's settling on the host and stops there; on a GPU each read waits for the
    device (vecinfer's 4k prefill on an H100: 16.5x KVCache's, benchmarks/results/h200_s67),
    so the iterations are built lazily, settled rows keeping their centroids: the same
    codebooks, and no wait while the distances fit one block of ``nearest``."""
    keys, values = kv(300, d=64)
    fit = CodebookFit(key_sub_dim=4, key_bits=6, value_sub_dim=8, value_bits=4, iters=8, sample=8)
    cpu = fit.fit_rows(keys, values)
    waits = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(mx, "eval", lambda *a: (waits.append(1), real_eval(*a))[1])
    gpu = fit.fit_rows(keys, values)
    assert waits == []
    for a, b in zip(cpu, gpu):
        assert mx.array_equal(a.centroids, b.centroids)
        assert (a.scale is None and b.scale is None) or mx.array_equal(a.scale, b.scale)
