"""ZipCache: probe saliency against brute force, the hi set is each head's top fraction,
decode blocks re-compressed by the current query, the card's invariants, memory at 4k."""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, save_prompt_cache

from conformance import edit_saved_layer
from test_conformance import drive
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.base import CacheStateError
from veloxquant_mlx.cache.options import ZipCacheOptions
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.zipcache import ZipCacheKVCache
from veloxquant_mlx.methods.zipcache.channel_scaled import channel_scale
from veloxquant_mlx.quant.packed import GROWTH_TOKENS
from veloxquant_mlx.quant.saliency import (
    ProbeSaliency, n_salient, normalized_by_visibility, probe_attention_sums, probe_positions)
from veloxquant_mlx.methods.zipcache.token_mixed import TokenMixedStore
from veloxquant_mlx.quant.token_rows import TokenGroups, TokenRows
from feeding import stored_decode_attention


def zipcache(f=0.2, hi=4, lo=2, group=32, gap=128, quantize_values=True):
    options = ZipCacheOptions(zipcache_hi_fraction=f, zipcache_hi_bits=hi, zipcache_lo_bits=lo,
                              zipcache_group_size=group, zipcache_quantize_values=quantize_values)
    return ZipCacheKVCache(KVCacheConfig(method="zipcache", options=options, residual_window=gap), None, 0)


def call(cache, q, k, v, scale=None):
    """One update + attention call with given queries (B, Hq, n, D)."""
    cache.update_and_fetch(k, v)
    n = k.shape[2]
    return cache.attend(q, k, v, scale=scale or k.shape[3] ** -0.5, mask="causal" if n > 1 else None)


def feed(cache, keys, values, chunk, gqa=2, seed=0):
    t, i = keys.shape[2], 0
    while i < t:
        n = min(chunk, t - i)
        q = mx.random.normal((keys.shape[0], keys.shape[1] * gqa, n, keys.shape[3]), key=mx.random.key(seed + i))
        call(cache, q.astype(keys.dtype), keys[:, :, i : i + n], values[:, :, i : i + n])
        i += n


def brute_saliency(q, k, scale, q_pos, first, normalize=True):
    """Σ_g Σ_p softmax over visible keys, per KV head, divided by T - i: numpy loops."""
    q, k = np.array(q, dtype=np.float64), np.array(k, dtype=np.float64)
    b, hq, _, d = q.shape
    h, t = k.shape[1], k.shape[2]
    out = np.zeros((b, h, t))
    for bi in range(b):
        for j in range(hq):
            for p, pos in enumerate(q_pos):
                logits = k[bi, j // (hq // h), : pos + 1] @ q[bi, j, p] * scale
                w = np.exp(logits - logits.max())
                out[bi, j // (hq // h), : pos + 1] += w / w.sum()
    if normalize:
        out = out / (t - np.arange(t))
    return out[..., first:]


def top_sets(scores, k):
    """Per (batch, head), the set of the k largest positions."""
    s = np.array(scores)
    return [[set(np.argsort(-s[b, h], kind="stable")[:k].tolist()) for h in range(s.shape[1])] for b in range(s.shape[0])]


def hi_sets(flags):
    f = np.array(flags)
    return [[set(np.nonzero(f[b, h])[0].tolist()) for h in range(f.shape[1])] for b in range(f.shape[0])]


# -- saliency (card §3 steps 1-4) ---------------------------------------------------------------
def test_probes_are_the_newest_five_percent_and_five_percent_drawn_earlier():
    p = probe_positions(200, start=37, recent=0.05, random=0.05).tolist()
    assert p[-10:] == list(range(190, 200)) and len(p) == 20 == len(set(p))
    assert all(0 <= x < 190 for x in p[:10]) and p == sorted(p)
    assert probe_positions(200, 37, 0.05, 0.05).tolist() == p  # the same chunk, the same probes
    assert probe_positions(200, 38, 0.05, 0.05).tolist() != p
    assert probe_positions(7, 0, 0.05, 0.05).tolist() == [6]  # int(6.65) = 6: one newest probe


@pytest.mark.parametrize("n_old, n", [(0, 200), (150, 64)])
def test_prefill_saliency_is_the_normalized_probe_attention_by_brute_force(n_old, n):
    """GQA 2:1, a chunk after ``n_old`` stored tokens: probes at their real positions,
    softmax over every key they see, summed over the group and the probes, / (T - i)."""
    b, h, d, t = 1, 2, 16, n_old + n
    keys = mx.random.normal((b, h, t, d), key=mx.random.key(1)) * 2
    queries = mx.random.normal((b, 2 * h, n, d), key=mx.random.key(2)) * 2
    got = ProbeSaliency(0.05, 0.05).prefill(queries, keys, 0.3, first=n_old)
    probes = probe_positions(n, n_old, 0.05, 0.05)
    want = brute_saliency(queries[:, :, probes], keys, 0.3, (probes + n_old).tolist(), n_old)
    assert got.shape == (b, h, n) and np.allclose(np.array(got), want, rtol=1e-4, atol=1e-7)


def test_gqa_saliency_is_the_sum_of_the_query_heads_of_the_group():
    keys = mx.random.normal((1, 2, 120, 16), key=mx.random.key(3))
    queries = mx.random.normal((1, 8, 120, 16), key=mx.random.key(4))
    s = ProbeSaliency(0.05, 0.05)
    grouped = s.prefill(queries, keys, 0.25, 0)
    for kv in range(2):
        heads = [s.prefill(queries[:, j : j + 1], keys[:, kv : kv + 1], 0.25, 0) for j in range(4 * kv, 4 * kv + 4)]
        assert mx.allclose(grouped[:, kv], sum(heads)[:, 0], rtol=1e-5)


def test_normalization_takes_out_the_head_start_of_early_tokens():
    """Uniform causal attention (row q uniform over 0..q): the raw column sums S_i fall
    with i by a factor T·H_T from first to last token; S_i / (T - i) (the mean over the
    queries that see i) by H_T only, the count of queries taken out. Tokens that every
    query attends to more are then found wherever they sit; by raw sums late ones are not."""
    t = 200
    all_positions = mx.arange(t)
    flat = probe_attention_sums(mx.ones((1, 1, t, 8)), mx.zeros((1, 1, t, 8)), 1.0, all_positions)
    raw, norm = np.array(flat[0, 0]), np.array(normalized_by_visibility(flat, 0)[0, 0])
    harmonic = sum(1 / (q + 1) for q in range(t))
    assert np.all(np.diff(raw) < 0) and raw[0] / raw[-1] == pytest.approx(t * harmonic, rel=1e-4)
    assert norm[0] / norm[-1] == pytest.approx(harmonic, rel=1e-4)
    planted = [3, 60, 120, 185, 192, 196]  # each gets e^3 the weight of an ordinary token
    keys = mx.zeros((1, 1, t, 8)).at[:, :, mx.array(planted), 0].add(3.0)
    q = mx.zeros((1, 1, t, 8)).at[..., 0].add(1.0)
    sums = probe_attention_sums(q, keys, 1.0, all_positions)
    assert top_sets(normalized_by_visibility(sums, 0), 6)[0][0] == set(planted)
    assert top_sets(sums, 6)[0][0] != set(planted)  # accumulated attention misses the late ones


@pytest.mark.parametrize("f, n", [(0.2, 200), (0.37, 201), (0.3, 75)])
def test_the_hi_set_of_each_head_is_its_top_fraction(f, n):
    """One chunk through the cache: per head exactly round(f n) tokens are flagged hi,
    the ones of largest normalized probe attention, stored at hi bits."""
    keys = mx.random.normal((2, 2, n, 32), key=mx.random.key(5))
    values = mx.random.normal((2, 2, n, 32), key=mx.random.key(6))
    queries = mx.random.normal((2, 4, n, 32), key=mx.random.key(7))
    cache = zipcache(f=f, hi=8, lo=3)
    call(cache, queries, keys, values)
    k = n_salient(f, n)
    assert k == math.floor(f * n + 0.5) and cache.class_counts == (k, n - k)
    flags = cache.store.flags.view()
    assert mx.all(flags.astype(mx.int32).sum(axis=-1) == k)
    expected = top_sets(ProbeSaliency(0.05, 0.05).prefill(queries, keys, 32**-0.5, 0), k)
    assert hi_sets(flags) == expected
    assert cache.store.hi.keys.codec.bits == 8 and cache.store.lo.values.codec.bits == 3


# -- quantization invariants (card §7) ------------------------------------------------------------
def direct(x, bits, group):
    """Channel-separable token-wise quantization of every token: c from all, then /c, codes, *c."""
    c = channel_scale(x)
    codec = TokenGroups(bits, group)
    scaled = (x.astype(mx.float32) / c[:, :, None]).astype(x.dtype)
    return (codec.decode(*codec.encode(scaled), mx.float32) * c[:, :, None]).astype(x.dtype)


@pytest.mark.parametrize("hi, lo, group", [(4, 2, 32), (7, 3, 16), (8, 1, 64)])
def test_fraction_one_is_uniform_hi_bit_and_zero_uniform_lo_bit(hi, lo, group):
    keys = mx.random.normal((1, 2, 100, 64), key=mx.random.key(8)).astype(mx.float16)
    values = mx.random.normal((1, 2, 100, 64), key=mx.random.key(9)).astype(mx.float16)
    out = {}
    for f in (1.0, 0.0, 0.5):
        cache = zipcache(f=f, hi=hi, lo=lo, group=group)
        feed(cache, keys, values, 100)
        out[f] = cache.dequantized(mx.float16)
    for f, bits in ((1.0, hi), (0.0, lo)):
        assert mx.array_equal(out[f][0], direct(keys, bits, group))
        assert mx.array_equal(out[f][1], direct(values, bits, group))
    assert not mx.array_equal(out[0.5][0], out[1.0][0]) and not mx.array_equal(out[0.5][0], out[0.0][0])


def test_hi_tokens_err_less_than_lo_tokens():
    keys = mx.random.normal((1, 4, 300, 64), key=mx.random.key(10))
    keys = keys * (1 + 6 * (mx.arange(64) % 13 == 0))  # outlier channels
    cache = zipcache(f=0.3)
    feed(cache, keys, keys, 300)
    k_hat, v_hat = cache.dequantized(mx.float32)
    hi = np.array(cache.store.flags.view()) == 1
    for x_hat in (k_hat, v_hat):
        err = np.array(mx.abs(x_hat - keys).mean(axis=-1))
        assert err[hi].mean() * 3 < err[~hi].mean()


def test_the_channel_scales_beat_plain_token_wise_groups_on_outlier_channels():
    x = mx.random.normal((1, 2, 256, 128), key=mx.random.key(11)) * (1 + 9 * (mx.arange(128) % 32 == 5))
    codec = TokenGroups(2, 32)
    plain = codec.decode(*codec.encode(x), mx.float32)
    err = lambda y: float(mx.abs(y - x).mean())  # noqa: E731
    assert err(direct(x, 2, 32)) < 0.8 * err(plain)


def test_buffer_tokens_are_exact_and_every_token_stays_at_its_position():
    """Stored tokens come back at their own position, within half a step of their class's
    grid (times the channel scale); the newest decode tokens are the model's own."""
    t, gap = 150, 32
    keys = mx.random.normal((1, 2, t, 32), key=mx.random.key(12)).astype(mx.float16)
    values = mx.random.normal((1, 2, t, 32), key=mx.random.key(13)).astype(mx.float16)
    cache = zipcache(f=0.4, hi=4, lo=2, gap=gap)
    feed(cache, keys[:, :, :100], values[:, :, :100], 100)
    feed(cache, keys[:, :, 100:], values[:, :, 100:], 1)  # 50 steps: one block of 32, 18 waiting
    store = cache.store
    assert store.compressed == 132 and store.k_buf.length == 18
    assert cache.class_counts == (40 + 13, 60 + 19)
    k_hat, v_hat = cache.dequantized(mx.float16)
    assert mx.array_equal(k_hat[:, :, 132:], keys[:, :, 132:]) and mx.array_equal(v_hat[:, :, 132:], values[:, :, 132:])
    flags = np.array(store.flags.view())
    for x, x_hat, channel, name in ((keys, k_hat, store.k_channel, "keys"), (values, v_hat, store.v_channel, "values")):
        err = np.abs(np.array(x_hat[:, :, :132], dtype=np.float32) - np.array(x[:, :, :132], dtype=np.float32))
        for cls, flag in ((store.hi, 1), (store.lo, 0)):
            scales = np.array(getattr(cls, name).scales.view(), dtype=np.float32)  # (1, 2, count, 1)
            bound = np.repeat(scales, 32, axis=-1) * np.array(channel)[:, :, None] / 2
            for h in range(2):
                at = np.nonzero(flags[0, h] == flag)[0]
                assert np.all(err[0, h, at] <= bound[0, h] * 1.01 + 6e-3), (name, flag, h)


def test_decode_blocks_are_scored_by_the_current_query_and_keep_counts_and_bits():
    """gap - 1 steps wait; the step that fills the buffer attends with it exact, then
    its query's softmax over the whole cache (restricted to the block, summed over the
    group, not normalised) flags round(f gap) hi tokens per head."""
    gap, f, t = 16, 0.25, 96
    keys = mx.random.normal((1, 2, t + gap, 32), key=mx.random.key(14)) * 1.5
    values = mx.random.normal((1, 2, t + gap, 32), key=mx.random.key(15))
    cache = zipcache(f=f, hi=4, lo=2, gap=gap)
    feed(cache, keys[:, :, :t], values[:, :, :t], t)
    feed(cache, keys[:, :, t : t + gap - 1], values[:, :, t : t + gap - 1], 1, seed=100)
    counts = cache.class_counts
    assert counts == (24, 72) and cache.store.k_buf.length == gap - 1
    q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(16)) * 2
    k_all = mx.concatenate([cache.dequantized(mx.float32)[0], keys[:, :, t + gap - 1 : t + gap]], axis=2)
    v_all = mx.concatenate([cache.dequantized(mx.float32)[1], values[:, :, t + gap - 1 : t + gap]], axis=2)
    want_out = mx.fast.scaled_dot_product_attention(q, k_all, v_all, scale=32**-0.5)
    scores = brute_saliency(q, k_all, 32**-0.5, [t + gap - 1], t, normalize=False)
    out = call(cache, q, keys[:, :, t + gap - 1 :], values[:, :, t + gap - 1 :])
    assert mx.allclose(out, want_out, atol=1e-5)  # the block attended exact, then compressed
    n_hi = n_salient(f, gap)
    assert cache.class_counts == (counts[0] + n_hi, counts[1] + gap - n_hi) and cache.store.k_buf.length == 0
    block_flags = cache.store.flags.view()[:, :, t:]
    assert hi_sets(block_flags) == top_sets(scores, n_hi)
    assert cache.store.hi.keys.codes.view().shape[-1] == 32 * 4 // 32  # hi tokens at 4 bits
    assert cache.store.lo.keys.codes.view().shape[-1] == 32 * 2 // 32


def test_a_prompt_chunk_compresses_the_tokens_waiting_in_the_buffer_too():
    keys = mx.random.normal((1, 2, 140, 32), key=mx.random.key(17))
    cache = zipcache(f=0.2, gap=64)
    feed(cache, keys[:, :, :100], keys[:, :, :100], 100)
    feed(cache, keys[:, :, 100:110], keys[:, :, 100:110], 1)
    assert cache.store.k_buf.length == 10
    feed(cache, keys[:, :, 110:], keys[:, :, 110:], 30)
    assert cache.store.k_buf.length == 0 and cache.class_counts == (20 + 8, 80 + 32)  # round(0.2 * 40) = 8


def test_values_stay_exact_when_not_quantized():
    keys = mx.random.normal((1, 2, 90, 32), key=mx.random.key(18)).astype(mx.float16)
    values = mx.random.normal((1, 2, 90, 32), key=mx.random.key(19)).astype(mx.float16)
    cache = zipcache(quantize_values=False, gap=16)
    feed(cache, keys[:, :, :60], values[:, :, :60], 60)
    feed(cache, keys[:, :, 60:], values[:, :, 60:], 1)
    k_hat, v_hat = cache.dequantized(mx.float16)
    assert mx.array_equal(v_hat, values) and not mx.array_equal(k_hat, keys)
    assert cache.store.v_channel is None and cache.store.hi.values is None


# -- attention --------------------------------------------------------------------------------
@pytest.mark.parametrize("hi, lo, group, quantize_values", [(4, 2, 32, True), (7, 3, 16, True), (8, 1, 32, False)])
@pytest.mark.parametrize("pure_path", ["qmm", "reference"])
def test_decode_attention_matches_the_dequantized_reference(hi, lo, group, quantize_values, pure_path, monkeypatch):
    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", pure_path)
    keys = mx.random.normal((1, 2, 150, 64), key=mx.random.key(20))
    cache = zipcache(f=0.3, hi=hi, lo=lo, group=group, gap=32, quantize_values=quantize_values)
    feed(cache, keys[:, :, :120], keys[:, :, :120] * 0.5, 120)
    feed(cache, keys[:, :, 120:], keys[:, :, 120:] * 0.5, 1)  # 30 steps: 30 wait in the buffer
    parts = cache.store.decode_parts(None)
    assert [p.length for p in parts] == [36 + 30, 84] and not any(p.affine for p in parts)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(21))
    k_hat, v_hat = cache.dequantized(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=0.125)
    assert mx.allclose(stored_decode_attention(cache, q, 0.125), ref, atol=2e-5, rtol=1e-4)


def test_a_decode_step_reads_the_packed_codes_and_decodes_nothing(monkeypatch):
    keys = mx.random.normal((1, 2, 100, 64), key=mx.random.key(22))
    cache = zipcache(gap=64)
    feed(cache, keys[:, :, :90], keys[:, :, :90], 90)

    def refuse(*a, **k):
        raise AssertionError("a decode step dequantized the history")

    monkeypatch.setattr(TokenRows, "rows", refuse)
    monkeypatch.setattr(TokenMixedStore, "history", refuse)
    feed(cache, keys[:, :, 90:], keys[:, :, 90:], 1)
    assert cache.store.k_buf.length == 10 and cache.store.k_buf.capacity == 32  # grown 32 rows at a time


@pytest.mark.parametrize("heads, masks", [((4, 2), False), ((8, 2), False), ((4, 2), True)])
def test_one_channel_per_group_is_lossless_through_the_model(heads, masks, monkeypatch):
    """Groups of 1 channel keep every value (scale floor, codes 0): the model's logits,
    prompt in chunks, decode blocks re-compressed, GQA and array masks, are mlx-lm's
    KVCache's to float rounding."""
    if masks:
        import mlx_lm.models.llama as llama

        original = llama.create_attention_mask
        monkeypatch.setattr(llama, "create_attention_mask", lambda h, cache=None, **kw: original(h, cache, return_array=True))
    model = tiny_model("llama", num_attention_heads=heads[0], num_key_value_heads=heads[1])
    tokens = prompt(130)
    ref = drive(model, [KVCache() for _ in model.layers], tokens, chunk=50, decode=12)
    config = KVCacheConfig(method="zipcache", options=ZipCacheOptions(zipcache_group_size=1), residual_window=5)
    cache = make_prompt_cache(model, config)
    out = drive(model, cache, tokens, chunk=50, decode=12)
    assert cache[0].class_counts[0] > 0 and cache[0].store.k_buf.length == 3  # 13 steps: two blocks
    assert mx.allclose(out, ref, atol=1e-4, rtol=1e-4), float(mx.abs(out - ref).max())


# -- memory (card §5) -----------------------------------------------------------------------------
def test_memory_at_4k_is_the_cards_formula_within_the_growth_step():
    """Per token and KV head, K and V each: f b_hi d/8 + (1 - f) b_lo d/8 + 4 d/G (float16
    scales and minima), plus a 1-byte class flag, the float32 channel scales, the buffer."""
    h, d, g, f, gap = 4, 128, 32, 0.2, 128
    keys = mx.random.normal((1, h, 4096 + 40, d), key=mx.random.key(23)).astype(mx.float16)
    cache = zipcache(f=f, hi=4, lo=2, group=g, gap=gap)
    feed(cache, keys[:, :, :4096], keys[:, :, :4096], 4096)
    feed(cache, keys[:, :, 4096:], keys[:, :, 4096:], 1)
    n_hi, n_lo = cache.class_counts
    assert (n_hi, n_lo) == (819, 4096 - 819)
    per_hi, per_lo = 4 * d / 8 + 4 * d / g, 2 * d / 8 + 4 * d / g
    formula = 2 * h * (n_hi * per_hi + n_lo * per_lo)  # K and V
    room = 2 * h * GROWTH_TOKENS * (per_hi + per_lo)
    side = 4096 * h + 2 * h * d * 4  # flags; channel scales of K and V
    buffer = 2 * cache.store.k_buf.capacity * h * d * 2
    assert cache.store.k_buf.capacity == 64  # grown with the 40 waiting rows, 32 at a time
    assert cache.store.flags.nbytes == 4096 * h  # one byte per token and head
    assert cache.store.k_channel.nbytes + cache.store.v_channel.nbytes == 2 * h * d * 4
    packed = cache.nbytes - side - buffer
    assert formula <= packed <= formula + room
    spare = 2 * h * ((cache.store.hi.keys.codes.capacity - n_hi) * per_hi + (cache.store.lo.keys.codes.capacity - n_lo) * per_lo)
    assert packed == formula + spare  # the rest is growth room, nothing else
    per_head_token = formula / (2 * h * 4096)
    assert per_head_token == pytest.approx(12.8 + 25.6 + 16, abs=0.01)  # the card's 54.4 B


# -- errors and saved states ------------------------------------------------------------------
def test_bad_widths_and_groups_name_the_field():
    with pytest.raises(ValueError, match="zipcache_group_size=5 must divide head_dim=32"):
        call(zipcache(group=5), *(mx.zeros((1, 4, 2, 32)), mx.zeros((1, 2, 2, 32)), mx.zeros((1, 2, 2, 32))))
    with pytest.raises(ValueError, match=r"zipcache_hi_bits=7: .* head_dim=16 .* allowed here: \[2, 4, 8\]"):
        call(zipcache(hi=7, group=16), mx.zeros((1, 4, 2, 16)), mx.zeros((1, 2, 2, 16)), mx.zeros((1, 2, 2, 16)))
    with pytest.raises(ValueError, match="zipcache_lo_bits must be smaller than zipcache_hi_bits"):
        ZipCacheOptions(zipcache_hi_bits=3, zipcache_lo_bits=3)


def test_a_saved_state_whose_flags_contradict_the_classes_is_refused(tmp_path):
    from veloxquant_mlx import load_prompt_cache

    model = tiny_model("llama")
    cache = make_prompt_cache(model, KVCacheConfig(method="zipcache", residual_window=8))
    drive(model, cache, prompt(100), decode=3)
    path = tmp_path / "cache.safetensors"
    save_prompt_cache(str(path), cache)
    loaded = load_prompt_cache(path)
    assert mx.array_equal(loaded[1].store.flags.view(), cache[1].store.flags.view())
    edit_saved_layer(path, 1, lambda meta, arrays: arrays.update(flags=1 - arrays["flags"]))
    with pytest.raises(CacheStateError, match="layer 1.*hi flags per head"):
        load_prompt_cache(path)
