"""SpectralQuant: Lloyd-Max codebooks of a Gaussian, an orthonormal eigenbasis, the bit
split and memory of the card, decode over the packed rows equal to attention over the
reconstruction without QJL and to the explicit QJL formula with it (pre-RoPE keys
included), and the QJL estimator's bias and variance against the math."""

import math
import os
import re
import tempfile
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from test_kivi import feed
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import SpectralQuantOptions
from veloxquant_mlx.cache.rope import Rotary, derotate
from veloxquant_mlx.methods.spectral.cache import SKETCH_SEED, SpectralQuantCache
from veloxquant_mlx.quant import codebook as cb
from veloxquant_mlx.methods.spectral.bitfields import pack_fields, row_words, unpack_fields
from veloxquant_mlx.methods.spectral import eigen_store as es
from veloxquant_mlx.methods.spectral.eigen_store import EigenCodec, EigenTokens, gaussian_codebook
from veloxquant_mlx.quant.packed import GROWTH_TOKENS
from veloxquant_mlx.quant.prerope import from_pre_rope_channels
from feeding import peak_above_held, stored_decode_attention

ROPE = Rotary(10000.0)


def spectral(context=None, bits=2, layer=0, **options):
    config = KVCacheConfig(method="spectral", kv_bits=bits, options=SpectralQuantOptions(**options))
    return SpectralQuantCache(config, context, layer)


def rotary_context():
    return SimpleNamespace(model_args=SimpleNamespace(rope_theta=ROPE.base))


def structured(t, d=64, h=2, seed=0, energy=(8.0, 4.0, 3.0, 2.0), tail=0.3):
    """Rows with a few strong directions (a random orthonormal frame per head) over a weak
    isotropic tail: the spectral structure SpectralQuant expects of keys."""
    scales = mx.concatenate([mx.array(energy), mx.full((d - len(energy),), tail)])
    g = mx.random.normal((1, h, t, d), key=mx.random.key(seed)) * scales
    frame, _ = mx.linalg.qr(mx.random.normal((h, d, d), key=mx.random.key(seed + 100)), stream=mx.cpu)
    return g @ frame.swapaxes(-1, -2)


def attention(q, k, v, scale):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=None)


# -- codebooks, bit fields, basis ---------------------------------------------------------------
def test_gaussian_codebooks_are_the_lloyd_max_quantizers():
    """Max (1960): 1 bit +-0.7979, 2 bits +-0.4528 / +-1.5104, 3 bits outermost +-2.152."""
    assert mx.allclose(gaussian_codebook(1), mx.array([-0.7979, 0.7979]), atol=2e-3)
    assert mx.allclose(gaussian_codebook(2), mx.array([-1.5104, -0.4528, 0.4528, 1.5104]), atol=2e-3)
    three = gaussian_codebook(3)
    assert abs(float(three[-1]) - 2.152) < 3e-3 and abs(float(three[4]) - 0.2451) < 2e-3
    x = mx.random.normal((400_000,), key=mx.random.key(0))
    for bits in (6, 8):  # at high rates the error is Panter-Dite's 2.72 / 4^b
        book = gaussian_codebook(bits)
        mse = float(mx.square(x - book[cb.nearest(x, book)]).mean())
        assert abs(mse / (2.72 * 4.0 ** -bits) - 1) < 0.05, (bits, mse)


def test_bit_fields_round_trip_at_mixed_widths():
    key = mx.random.key(1)
    fields = [(mx.random.randint(0, 1 << b, (3, 5, n), key=mx.random.key(b * 7 + n)), b)
              for n, b in ((4, 3), (60, 2), (4, 1))]
    words = pack_fields(fields)
    assert words.shape == (3, 5, row_words(((4, 3), (60, 2), (4, 1)))) == (3, 5, 5)
    for (codes, _), back in zip(fields, unpack_fields(words, ((4, 3), (60, 2), (4, 1)))):
        assert mx.array_equal(codes.astype(mx.float32), back)
    del key


def _run(x, *, rotary=None, seed=SKETCH_SEED, qjl=True, key=True):
    run = EigenTokens(EigenCodec(2, 4, key=key, qjl=qjl), rotary=rotary, seed=seed)
    run.append(x)
    return run


@pytest.mark.parametrize("traditional", [False, True])
def test_the_qjl_correction_of_pre_rope_keys_equals_turning_each_tokens_directions(traditional):
    """The reader folds the correction into the keys' first e coordinates (``Sᵀ sign``); it
    must equal turning every token's own copy of the directions ``V[:, :e] Sᵀ`` to its
    position (the explicit (e, D, n) form), in both rotary layouts, with the norms on the
    scores (a decode step's rows) and on the coordinates (a prompt chunk's), to float32
    rounding of sums of ~D terms."""
    rot, start, n, d, e = Rotary(10000.0, traditional), 100, 37, 64, 4
    run = _run(structured(start + n, h=3), rotary=rot)
    run.start = start  # its rows taken as positions start.. (the rotation is all that reads it)
    words, norms = run.words.buffer[:, :, :n], run.norms.buffer[:, :, :n]
    codes = unpack_fields(words, run.codec.layout(d))
    signs, rho = 2 * codes[2] - 1, norms[..., 1:2].astype(mx.float32)
    directions = run.basis[..., :e] @ run.sketch.T  # (B, H, D, e)
    turned = from_pre_rope_channels(mx.broadcast_to(directions.swapaxes(-1, -2)[..., None], (1, 3, e, d, n)),
                                    start, rot)
    for r in (4, 2 * d):
        q = mx.random.normal((1, 3, r, d), key=mx.random.key(r))
        explicit = ((q[:, :, None] @ turned) * signs.transpose(0, 1, 3, 2)[:, :, :, None]).sum(axis=2)
        explicit = explicit * (es.QJL_SCALE / e) * rho.swapaxes(-1, -2)
        reader = es.EigenScores(run, run.count, (0, n))
        got = reader.scores(q) - reader.scores(q, qjl=False)
        assert got.shape == explicit.shape == (1, 3, r, n)
        scale = mx.abs(reader.scores(q)).max().item()
        assert mx.abs(got - explicit).max().item() <= 1e-6 * d * scale, r


def test_the_qjl_correction_of_a_prompt_chunk_holds_no_query_by_direction_by_token_table():
    """A prompt chunk's R queries against n pre-RoPE keys: the correction rides in the keys'
    rebuild, so the transients are a few (n, D) copies of the keys and the (R, n) result; an
    (R, e, n) table (64 MiB here) made spectral's 4-layer prefill grow by gigabytes a chunk
    on the H200 (benchmarks/notes/prefill.md, session 50)."""
    b, h, r, d, e, n = 1, 1, 512, 128, 32, 1024
    run = EigenTokens(EigenCodec(2, e, key=True, qjl=True), rotary=Rotary(10000.0, False), seed=SKETCH_SEED)
    run.append(structured(n, d, h))
    q = mx.random.normal((b, h, r, d), key=mx.random.key(1))
    mx.eval(q, run.words.buffer, run.norms.buffer)
    out, peak = peak_above_held(lambda: es.EigenScores(run, n, (0, n)).scores(q))
    assert out.shape == (b, h, r, n)
    assert peak <= 2 * out.nbytes + 8 * d * n * 4 < r * e * n * 4 // 4


def test_the_basis_is_orthonormal_and_eight_bits_reconstruct_within_one_percent():
    """A spectrum whose semantic directions are within a factor 2 of each other (steeper
    ones: test_eight_bits_are_near_lossless_whatever_the_spectrum_and_d_eff). An 8-bit
    Lloyd-Max code of a Gaussian alone leaves 0.65% (SNR 43.8 dB), one codebook for the
    whole block a little more: the card's "< 1e-2" with that margin."""
    k = structured(200, energy=(2.0, 1.8, 1.6, 1.4), tail=0.5)
    v = structured(200, seed=5, energy=(1.2, 1.1, 1.0, 1.0), tail=0.8)
    cache = spectral(bits=8)
    feed(cache, k, v, 200)
    basis = cache.store.keys.basis
    assert mx.allclose(basis.swapaxes(-1, -2) @ basis, mx.eye(64), atol=1e-5)
    k_hat, v_hat = cache.dequantized(mx.float32)
    for x, x_hat in ((k, k_hat), (v, v_hat)):
        assert float(mx.linalg.norm((x - x_hat).flatten()) / mx.linalg.norm(x.flatten())) < 1.5e-2
        ratio = mx.linalg.norm(x_hat, axis=-1) / mx.linalg.norm(x, axis=-1)  # norms kept
        assert float(mx.abs(ratio - 1).mean()) < 5e-3  # (a clipped outlier coordinate costs more)


def _keylike(t, seed):
    """Rows like a model's keys: a common direction (a nonzero mean, 3x the rest's scale)
    over a steep spectrum, so that the unit rows' first eigen-coordinate holds most of their
    mass and the others spread over decades (the reference models' keys: λ_1 = 0.3-0.8)."""
    x = structured(t, seed=seed, energy=(6.0, 3.0, 1.5, 0.8), tail=0.05)
    offset = mx.random.normal((1, 2, 1, 64), key=mx.random.key(seed + 50))
    return x + 12.0 * offset / mx.linalg.norm(offset, axis=-1, keepdims=True)


@pytest.mark.parametrize("context", [None, rotary_context()], ids=["post-rope", "pre-rope"])
@pytest.mark.parametrize("d_eff", [1, 4, 63])
def test_eight_bits_are_near_lossless_whatever_the_spectrum_and_d_eff(context, d_eff):
    """The codebooks are trained on the coordinates the basis is fitted on (the paper's
    Lloyd-Max codebooks), so they span each block's range however unequal its coordinates'
    variances. Bound, per block (row range R <= 1 for unit rows): Lloyd started no worse
    than 2^b uniform levels over [-R, R] never gets worse, so the mean squared error of a
    coordinate is at most (R / (2^b - 1))^2 plus the histogram bins' (R / TABLE_BINS)^2;
    over the D coordinates of a unit row, the RMS relative error is at most sqrt(D) times
    that (0.031 at D = 64, 8 bits), plus float16 norms (2^-11). The N(0, mean λ) codebook
    of one σ per block clipped the strongest coordinate: 0.13-0.63 here. Decode then matches
    exact attention within what those errors allow: scores off by at most
    δ = max_t |q.(k_t - k_hat_t)| move the softmax by at most e^(2δ) - 1 in L1."""
    d, t, bits = 64, 300, 8
    k, v = _keylike(t, 0), _keylike(t, 7)
    cache = spectral(context, bits=bits, spectral_key_d_eff=d_eff, spectral_val_d_eff=d_eff,
                     spectral_apply_qjl=False)
    feed(cache, k[:, :, : t - 1], v[:, :, : t - 1], t - 1)  # the basis and codebooks from these rows
    bound = math.sqrt(d) * math.sqrt((2**bits - 1) ** -2 + es.TABLE_BINS**-2) + 2**-11
    k_hat, v_hat = cache.dequantized(mx.float32)
    for x, x_hat in ((k[:, :, : t - 1], k_hat), (v[:, :, : t - 1], v_hat)):
        per_row = mx.linalg.norm(x - x_hat, axis=-1) / mx.linalg.norm(x, axis=-1)
        assert float(mx.sqrt(mx.square(per_row).mean())) <= bound, (float(per_row.max()), bound)
    q = mx.random.normal((1, 4, 1, d), key=mx.random.key(3)) * 0.1
    keys, values = cache.update_and_fetch(k[:, :, t - 1 :], v[:, :, t - 1 :])  # a decode step
    got = cache.attend(q, keys, values, scale=0.125, mask=None)
    k_hat, v_hat = cache.dequantized(mx.float32)
    want = attention(q, k, v, 0.125)
    qk = (q.reshape(1, 2, 2, d) * 0.125) @ (k - k_hat).swapaxes(-1, -2)
    delta = float(mx.abs(qk).max())
    v_norm = float(mx.linalg.norm(v, axis=-1).max())
    allowed = (math.exp(2 * delta) - 1) * v_norm + float(mx.linalg.norm(v - v_hat, axis=-1).max())
    assert float(mx.linalg.norm(got - want, axis=-1).max()) <= allowed
    assert float(mx.linalg.norm(got - want) / mx.linalg.norm(want)) < 0.05


@pytest.mark.parametrize("bits, d, d_eff, key, qjl, expected", [
    (3, 128, 4, True, True, 420), (3, 128, 50, False, False, 450),  # the card's example
    (3, 128, 4, True, False, 4 * 3 + 124 * 3 + 16), (2, 128, 4, True, True, 4 * 3 + 124 * 2 + 32),
    (2, 32, 50, False, False, 31 * 2 + 1 * 1 + 16),  # e clamped to 31: b_low = round(2 - 31/32) = 1
])
def test_bit_split_and_bits_per_row_follow_the_card(bits, d, d_eff, key, qjl, expected):
    codec = EigenCodec(bits, d_eff, key=key, qjl=qjl)
    e, head, tail = codec.widths(d)
    low = max(1, math.floor(bits - min(d_eff, d - 1) / d + 0.5))
    assert (e, tail) == (min(d_eff, d - 1), low) and head == (low if key else low + 1)
    code_bits = sum(n * b for n, b in codec.layout(d))
    assert code_bits + 16 * codec.n_norms == expected


def test_nbytes_after_a_long_prompt_is_the_card_formula_plus_word_padding_and_the_bases():
    t, d, h = 600, 64, 2
    cache = spectral(bits=2)
    feed(cache, structured(t), structured(t, seed=3), 256)
    rows = -(-t // GROWTH_TOKENS) * GROWTH_TOKENS
    k_codec, v_codec = EigenCodec(2, 4, True, True), EigenCodec(2, 50, False, False)
    per_row = 4 * row_words(k_codec.layout(d)) + 2 * 2 + 4 * row_words(v_codec.layout(d)) + 2
    side = h * (2 * d * d * 4 + 2 * 2 * 4) + 4 * 4 * 4  # bases, sigmas (float32), the 4 x 4 sketch
    side += h * 2 * d * d * 4  # the keys' and values' second moments (float32), for refits
    side += h * 4 * (sum(k_codec.table_sizes(d)) + sum(v_codec.table_sizes(d)))  # trained codebooks (float32)
    assert cache.nbytes == rows * h * per_row + side
    card_bits = (4 * 3 + 60 * 2 + 32) + (50 * 3 + 14 * 2 + 16)  # b = 2: b_low 2, b_high 3
    assert rows * h * per_row - t * h * card_bits / 8 < (GROWTH_TOKENS + t * 2 * 4 / 8) * h * per_row


# -- attention ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("context", [None, rotary_context()], ids=["post-rope", "pre-rope"])
def test_without_qjl_decode_equals_attention_over_the_reconstruction(context):
    k, v = structured(150), structured(150, seed=9)
    cache = spectral(context, spectral_apply_qjl=False)
    feed(cache, k[:, :, :140], v[:, :, :140], 64)
    feed(cache, k[:, :, 140:], v[:, :, 140:], 1)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(2))
    k_hat, v_hat = cache.dequantized(mx.float32)
    assert k_hat.shape[2] == 150
    want = attention(q, k_hat, v_hat, 0.125)
    assert mx.allclose(stored_decode_attention(cache, q, 0.125), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("context", [None, rotary_context()], ids=["post-rope", "pre-rope"])
def test_with_qjl_decode_is_the_softmax_of_the_corrected_scores(context):
    """The cache's scores equal ``q k_hat + sqrt(pi/2)/e ||r|| (S q_sem) . sign(S r)``,
    computed here from the original keys (de-rotated for pre-RoPE), not from the codes."""
    t, d = 96, 64
    k, v = structured(t), structured(t, seed=9)
    cache = spectral(context, layer=3)
    feed(cache, k, v, 64)
    keys = cache.store.keys
    k_hat, v_hat = cache.dequantized(mx.float32)
    pre = derotate(k, mx.arange(t), ROPE) if context else k
    pre_hat = derotate(k_hat, mx.arange(t), ROPE) if context else k_hat
    basis, e = keys.basis, 4
    r_sem = ((pre - pre_hat) @ basis)[..., :e]
    signs = mx.where(r_sem @ keys.sketch.T >= 0, 1.0, -1.0)
    q = mx.random.normal((1, 2, 1, d), key=mx.random.key(4)) * 0.125
    q_frames = derotate(mx.broadcast_to(q, (1, 2, t, d)), mx.arange(t), ROPE) if context else q
    q_sem = (q_frames @ basis)[..., :e] @ keys.sketch.T  # (1, 2, t or 1, e)
    corr = math.sqrt(math.pi / 2) / e * mx.linalg.norm(r_sem, axis=-1) * (q_sem * signs).sum(-1)
    scores = (q @ k_hat.swapaxes(-1, -2))[:, :, 0] + corr
    want = mx.softmax(scores, axis=-1)[:, :, None] @ v_hat
    got = stored_decode_attention(cache, q / 0.125, 0.125)
    assert mx.allclose(got, want, atol=2e-4), float(mx.abs(got - want).max())
    assert not mx.allclose(got, attention(q / 0.125, k_hat, v_hat, 0.125), atol=1e-3)  # QJL did something


@pytest.mark.parametrize("block", [None, 16], ids=["one-block", "blocks-of-16"])
@pytest.mark.parametrize("context", [None, rotary_context()], ids=["post-rope", "pre-rope"])
def test_with_qjl_a_later_prompt_chunk_attends_with_the_corrected_scores_over_the_history(context, block, monkeypatch):
    """A chunk after the first: the history through the decode reader's corrected scores,
    the chunk itself exact and causal, one softmax (not SDPA over the reconstruction);
    scored in blocks of the history (the last one short, pre-RoPE keys turned from each
    block's first position), the online softmax equals it to float32 rounding."""
    if block:  # 2 KV heads x 16 query rows score ``block`` tokens at a time
        monkeypatch.setattr(es, "HISTORY_BLOCK_SCORES", 32 * block)
        monkeypatch.setattr(es, "MIN_HISTORY_BLOCK", 1)
    k, v = structured(80), structured(80, seed=9)
    cache = spectral(context)
    feed(cache, k[:, :, :72], v[:, :, :72], 40)
    q = mx.random.normal((1, 4, 8, 64), key=mx.random.key(5))
    history = cache.store.keys.reader().scores(q.reshape(1, 2, 16, 64) * 0.125)  # (1, 2, 16, 72)
    _, v_hat = cache.dequantized(mx.float32)
    own = (q.reshape(1, 2, 16, 64) * 0.125) @ k[:, :, 72:].swapaxes(-1, -2)
    causal = mx.tile(mx.tril(mx.ones((8, 8), mx.bool_)), (2, 1))
    p = mx.softmax(mx.concatenate([history, mx.where(causal, own, -mx.inf)], axis=-1), axis=-1)
    want = (p @ mx.concatenate([v_hat, v[:, :, 72:]], axis=2)).reshape(1, 4, 8, 64)
    cache.update_and_fetch(k[:, :, 72:], v[:, :, 72:])
    got = cache.attend(q, k[:, :, 72:], v[:, :, 72:], scale=0.125, mask="causal")
    assert mx.allclose(got, want, atol=1e-5)
    k_hat, _ = cache.dequantized(mx.float32)
    sdpa = mx.fast.scaled_dot_product_attention(q, mx.concatenate([k_hat[:, :, :72], k[:, :, 72:]], axis=2),
                                                mx.concatenate([v_hat, v[:, :, 72:]], axis=2), scale=0.125, mask="causal")
    assert not mx.allclose(got, sdpa, atol=1e-3)


def test_a_prompt_chunk_scores_the_history_a_block_at_a_time(monkeypatch):
    """A chunk of R query rows over n coded tokens holds one block's (R, block) scores at a
    time, not (R, n): on the H200 the whole table was 8.6 GB a layer at 32k, and spectral
    failed on CUDA (benchmarks/notes/prefill.md, session 50). Here the whole table is 16 MiB;
    one softmax over it peaked at 80 MiB, the blocks (evaluated one at a time) at 7."""
    h, d, n, r = 2, 64, 4096, 256
    monkeypatch.setattr(es, "HISTORY_BLOCK_SCORES", h * 2 * r * 256)  # blocks of 256 tokens
    cache = spectral()
    feed(cache, structured(n, d, h), structured(n, d, h, seed=9), 1024)
    k, v = structured(r, d, h, seed=3), structured(r, d, h, seed=4)
    q = mx.random.normal((1, 2 * h, r, d), key=mx.random.key(5))
    mx.eval(cache.store.keys.words.buffer, cache.store.values.words.buffer, q, k, v)
    whole_table = 1 * h * (2 * r) * n * 4  # float32 scores of every query row against the history
    assert es.history_block(h * 2 * r) == 256

    def chunk():
        cache.update_and_fetch(k, v)
        return cache.attend(q, k, v, scale=0.125, mask="causal")

    out, peak = peak_above_held(chunk)
    assert out.shape == q.shape
    assert peak < whole_table // 2, (peak, whole_table)


def test_a_prompt_chunk_reduces_its_own_scores_before_it_scores_the_history():
    """A chunk of R query rows over as many coded tokens (one history block): the chunk's own
    (R, n) scores and the history's are never held together. One part's softmax holds about
    two such tables (scores and their exponentials); both parts at once held 4.7 (the CPU's
    schedule computes every part's scores before it reduces any: 1.43x mlx-lm's KVCache's
    prefill peak on the small preset at 4k, 0.90x now)."""
    h, d, n = 2, 64, 1024
    cache = spectral()
    feed(cache, structured(n, d, h), structured(n, d, h, seed=9), 1024)
    k, v = structured(n, d, h, seed=3), structured(n, d, h, seed=4)
    q = mx.random.normal((1, 2 * h, n, d), key=mx.random.key(5))
    mx.eval(cache.store.keys.words.buffer, cache.store.values.words.buffer, q, k, v)
    table = 1 * h * (2 * n) * n * 4  # float32 scores of every query row against n tokens

    def chunk():
        cache.update_and_fetch(k, v)
        return cache.attend(q, k, v, scale=0.125, mask="causal")

    _, peak = peak_above_held(chunk)
    assert peak < 3.5 * table, (peak / table)


def _decode_read(keys, values, q):
    """A decode step's read of one key and value run: scores, softmax, mix (the pure path's)."""
    p = mx.softmax(keys.reader().scores(q), axis=-1)
    return values.reader().mix(p)


@pytest.mark.parametrize("rot", [None, Rotary(10000.0, False), Rotary(10000.0, True)],
                         ids=["post-rope", "pre-rope", "pre-rope-traditional"])
def test_a_decode_step_read_in_blocks_equals_the_whole_history_read(rot, monkeypatch):
    """Blocks of 256 tokens (the last one short, spare rows in it) against one block: the
    scores and the mix equal to float32 rounding, with the QJL correction."""
    n, d = 700, 64
    keys, values = _run(structured(n), rotary=rot), _run(structured(n, seed=9), key=False, qjl=False)
    q = mx.random.normal((1, 2, 4, d), key=mx.random.key(3)) * 0.125
    whole = (keys.reader().scores(q), _decode_read(keys, values, q))
    monkeypatch.setattr(es, "READ_BLOCK_BYTES", 2 * d * 4 * 256)  # 256 tokens of 2 heads
    assert keys.reader()._spans()[0] == ((0, 256), (256, 512), (512, 768))
    blocks = (keys.reader().scores(q), _decode_read(keys, values, q))
    for a, b in zip(whole, blocks):
        assert a.shape == b.shape
        assert mx.abs(a - b).max().item() <= 1e-6 * mx.abs(a).max().item()


def test_a_stacked_decode_steps_transients_fit_the_cpus_buffer_cache():
    """8 sequences of 4,096 tokens stacked (tiny preset's head of 128): the read holds a block
    of the history at a time, within the 32 MiB of freed buffers MLX's CPU allocator keeps
    for reuse. The whole history's float32 transients (16 MiB each here, 240 MB at the peak)
    overflowed it, so a stacked step took ~250 MB of fresh pages from the system every step
    (60,000 page faults) and ran slower than the 8 sequences one by one (216 against 139 ms
    a step, benchmarks/results/stacked_steps_cpu_s55.md)."""
    b, n, d = 8, 4096, 128
    rot = Rotary(500000.0, False)
    keys = _run(structured(n, d, h=1, seed=1), rotary=rot)
    values = _run(structured(n, d, h=1, seed=2), key=False, qjl=False)
    for run in (keys, values):  # the rows of 8 sequences
        for field in ("words", "norms"):
            getattr(run, field).reset(mx.concatenate([getattr(run, field).view()] * b))
        run.basis, run.sigma, run.tables = (mx.concatenate([a] * b) for a in (run.basis, run.sigma, run.tables))
    q = mx.random.normal((b, 1, 2, d), key=mx.random.key(4)) * 0.1
    mx.eval(q, [a for r in (keys, values) for a in (r.words.buffer, r.norms.buffer, r.basis, r.sigma, r.tables)])
    _, peak = peak_above_held(lambda: _decode_read(keys, values, q))
    assert peak <= 32 << 20, peak


# -- the QJL estimator ------------------------------------------------------------------------
def _estimates(keys, q, seeds):
    """Per sketch seed: the QJL correction of each token's score, and the true q_sem . r_sem."""
    out = []
    for seed in seeds:
        run = EigenTokens(EigenCodec(2, 4, key=True, qjl=True), seed=seed)
        run.append(keys)
        reader = run.reader()
        out.append(reader.scores(q) - reader.scores(q, qjl=False))
    k_hat = run.decode(mx.float32)
    truth = (((keys - k_hat) @ run.basis)[..., :4] * (q @ run.basis)[..., :4]).sum(-1)
    return mx.stack(out)[:, :, :, 0], truth[:, :, None] if truth.ndim == 3 else truth, run


def test_qjl_is_unbiased_over_sketches_and_its_variance_is_the_formula():
    """Over S, E[correction] = q_sem . r_sem (the bias of q . k_hat gone, within 4 standard
    errors), and E[(correction - truth)^2] = (pi/2 ||q_sem||^2 ||r_sem||^2 - (q_sem . r_sem)^2) / e
    (the variance of e sign projections): measured within 15%."""
    keys = structured(40, h=1, seed=11)
    q = mx.random.normal((1, 1, 1, 64), key=mx.random.key(12)) * 0.5
    est, _, run = _estimates(keys, q, range(300))
    k_hat = run.decode(mx.float32)
    r_sem = ((keys - k_hat) @ run.basis)[..., :4]
    q_sem = (q @ run.basis)[..., :4]
    truth = (r_sem * q_sem).sum(-1)[:, :, None, :][:, :, 0]  # (1, 1, 40)
    mean, sd = est.mean(axis=0), mx.sqrt(est.var(axis=0))
    assert float(mx.abs(mean - truth).max() / (sd.max() / math.sqrt(300))) < 4.5
    assert float(mx.abs(truth).mean()) > 10 * float(mx.abs(mean - truth).mean())  # bias removed
    variance = (math.pi / 2 * (q_sem ** 2).sum(-1) * (r_sem ** 2).sum(-1) - truth ** 2) / 4
    measured = ((est - truth) ** 2).mean(axis=0)
    assert abs(float(measured.mean() / variance.mean()) - 1) < 0.15


def test_qjl_lowers_the_score_error_where_the_query_follows_the_residual_and_not_elsewhere():
    """One sketch of e = 4 signs beats leaving the residual out when cos^2(q_sem, r_sem) >
    pi / (2 (e + 1)) = 0.31 (from the variance above), the card's regime; for queries
    independent of the residual (cos^2 about 1/e) it costs about pi/2 - 1/e times more."""
    keys = structured(200, h=1, seed=21)
    run = EigenTokens(EigenCodec(2, 4, key=True, qjl=True), seed=SKETCH_SEED)
    run.append(keys)
    k_hat = run.decode(mx.float32)
    r = keys - k_hat
    r_sem_dir = (r @ run.basis[..., :4]) @ run.basis[..., :4].swapaxes(-1, -2)  # residual in the subspace
    aligned = r_sem_dir / mx.linalg.norm(r_sem_dir, axis=-1, keepdims=True)  # one query per token
    reader = run.reader()
    with_qjl = mx.diagonal(reader.scores(aligned), axis1=-2, axis2=-1)
    without = mx.diagonal(reader.scores(aligned, qjl=False), axis1=-2, axis2=-1)
    truth = (aligned * keys).sum(-1)
    assert float(((with_qjl - truth) ** 2).mean()) < 0.6 * float(((without - truth) ** 2).mean())
    q = mx.random.normal((1, 1, 64, 64), key=mx.random.key(22))
    q = (q @ run.basis[..., :4]) @ run.basis[..., :4].swapaxes(-1, -2)  # independent, in the subspace
    truth = q @ keys.swapaxes(-1, -2)
    ratio = float(((reader.scores(q) - truth) ** 2).mean() / ((reader.scores(q, qjl=False) - truth) ** 2).mean())
    assert 1.0 < ratio < 2.0, ratio  # about pi/2 - 1/4 = 1.32


def test_encoding_is_deterministic_given_the_layer_and_differs_across_layers():
    k, v = structured(64), structured(64, seed=2)  # head_dim tokens: the basis is fitted
    a, b, c = spectral(layer=1), spectral(layer=1), spectral(layer=2)
    for cache in (a, b, c):
        feed(cache, k, v, 64)
    assert mx.array_equal(a.store.keys.words.view(), b.store.keys.words.view())
    assert not mx.array_equal(a.store.keys.sketch, c.store.keys.sketch)


def test_value_d_eff_is_clamped_below_head_dim():
    cache = spectral()
    feed(cache, structured(40, d=32), structured(40, d=32, seed=1), 40)
    assert cache.store.values.codec.widths(32)[0] == 31


@pytest.mark.parametrize("context", [None, rotary_context()], ids=["post-rope", "pre-rope"])
def test_decode_rows_are_held_exactly_then_coded_together_as_one_at_a_time_would_code_them(context, monkeypatch):
    """A decode step writes its row only; once DECODE_FLUSH rows are held they are coded in
    one batch, to the very words and norms the token-by-token coding gives."""
    flush_at = es.DECODE_FLUSH
    t, steps = 140, 2 * flush_at + 6
    k, v = structured(t + steps), structured(t + steps, seed=9)
    caches = []
    for flush in (flush_at, 1):
        monkeypatch.setattr(es, "DECODE_FLUSH", flush)
        cache = spectral(context)
        feed(cache, k[:, :, :t], v[:, :, :t], 64)
        feed(cache, k[:, :, t:], v[:, :, t:], 1)
        caches.append(cache.store)
    batched, one_at_a_time = caches
    held = steps % flush_at
    assert batched.k_pend.length == held and batched.coded == t + steps - held
    assert one_at_a_time.k_pend.length == 0 and one_at_a_time.coded == t + steps
    assert mx.array_equal(batched.k_pend.view(), k[:, :, t + steps - held:])
    assert mx.array_equal(batched.v_pend.view(), v[:, :, t + steps - held:])
    n = batched.coded
    for mine, theirs in ((batched.keys, one_at_a_time.keys), (batched.values, one_at_a_time.values)):
        assert mx.array_equal(mine.words.view(), theirs.words.view()[:, :, :n])
        assert mx.array_equal(mine.norms.view(), theirs.norms.view()[:, :, :n])


def test_a_cache_saved_with_its_window_just_coded_reloads_with_its_room_and_continues_bit_for_bit(tmp_path):
    from mlx_lm.models.cache import save_prompt_cache

    from veloxquant_mlx import load_prompt_cache

    k, v = structured(300), structured(300, seed=9)
    cache = spectral(rotary_context())
    feed(cache, k[:, :, :140], v[:, :, :140], 64)
    feed(cache, k[:, :, 140 : 140 + 2 * es.DECODE_FLUSH], v[:, :, 140 : 140 + 2 * es.DECODE_FLUSH], 1)
    assert cache.store.k_pend.length == 0 and cache.store.k_pend.capacity == es.DECODE_FLUSH
    save_prompt_cache(str(tmp_path / "c.safetensors"), [cache])
    (back,) = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert back.nbytes == cache.nbytes
    for c in (cache, back):
        feed(c, k[:, :, 204:], v[:, :, 204:], 1)
    assert back.nbytes == cache.nbytes
    for mine, theirs in zip(cache.dequantized(mx.float32), back.dequantized(mx.float32)):
        assert mx.array_equal(mine, theirs)


# -- the CUDA read: selects instead of axis gathers ---------------------------------------------


def _step_output(cache, q, *, cuda: bool, monkeypatch):
    """A decode step's attention over the cache, read as on the CPU or with the package's
    dispatcher answering CUDA (the compiled reads traced anew either way), and its graph's
    operations."""
    from decode_steps import _clear_package_caches

    from veloxquant_mlx.kernels import kivi_decode as kd

    monkeypatch.setattr(kd, "gpu_backend", (lambda: "cuda") if cuda else (lambda: None))
    _clear_package_caches()
    out = stored_decode_attention(cache, q, 0.125)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "step.dot")
        mx.export_to_dot(path, out)
        labels = re.findall(r'label ="?([A-Za-z_]+)"?, shape=rectangle', open(path).read())
    mx.eval(out)
    _clear_package_caches()
    return out, labels


@pytest.mark.parametrize("context, bits", [(None, 2), (rotary_context(), 2), (rotary_context(), 8)],
                         ids=["post-rope-2bit", "pre-rope-2bit", "pre-rope-8bit"])
def test_on_cuda_a_decode_step_reads_words_and_codebooks_by_selects_to_the_same_bits(context, bits, monkeypatch):
    """On CUDA MLX's axis gather read a row's words at 85 us a layer and gather (results/h200_s77):
    there the words and the codebooks are read by trees of selects (``quant/packed.py``), up to
    32 entries. The step must give the gathers' output bit for bit, and launch no axis gather
    where every axis read is that short (head_dim 64 at 2 bits: rows of 5 and 6 words,
    codebooks of 8 and 12 levels; at 8 bits the rows of 17 and 16 words are selects, the
    codebooks of 512 and 384 levels stay gathers)."""
    from decode_steps import cache_arrays

    k, v = structured(300), structured(300, seed=9)
    cache = spectral(context, bits=bits)
    feed(cache, k[:, :, :256], v[:, :, :256], 128)
    feed(cache, k[:, :, 256:], v[:, :, 256:], 1)
    mx.eval(cache_arrays([cache]))
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(31))
    gathered, on_cpu = _step_output(cache, q, cuda=False, monkeypatch=monkeypatch)
    selected, on_cuda = _step_output(cache, q, cuda=True, monkeypatch=monkeypatch)
    assert on_cpu.count("GatherAxis") >= 6  # words (low, high) and codebooks, keys and values
    assert mx.array_equal(gathered, selected)
    assert on_cuda.count("GatherAxis") == (0 if bits == 2 else 2), on_cuda.count("GatherAxis")


def test_the_qjl_sketch_of_a_few_columns_is_summed_within_float32_rounding_of_the_product():
    signs = mx.where(mx.random.normal((2, 3, 50, 4), key=mx.random.key(5)) > 0, 1.0, -1.0)
    for e in (1, 4, es.QJL_SUMMED_COLUMNS, es.QJL_SUMMED_COLUMNS + 1):
        s = signs[..., :e] if e <= 4 else mx.tile(signs, (1, 1, 1, 3))[..., :e]
        sketch = mx.random.normal((e, e), key=mx.random.key(e))
        exact = np.asarray(s, dtype=np.float64) @ np.asarray(sketch, dtype=np.float64)
        # e - 1 float32 additions of terms no larger than max |sketch|
        bound = (e - 1) * 2**-24 * float(mx.abs(sketch).sum(axis=0).max())
        assert np.abs(np.asarray(es._sketched(s, sketch)) - exact).max() <= bound + 1e-30
        if e > es.QJL_SUMMED_COLUMNS:
            assert mx.array_equal(es._sketched(s, sketch), s @ sketch)


@pytest.mark.parametrize("context", [None, rotary_context()], ids=["post-rope", "pre-rope"])
def test_a_decode_steps_qjl_correction_adds_no_matrix_product_at_the_default_d_eff(context, monkeypatch):
    """The correction is ``signs @ sketch``, n rows by spectral_key_d_eff (4) columns: as a
    product it was a launch of its own a layer and step (a cuBLAS kernel for four
    multiply-adds a row); summed, it fuses into the compiled read."""
    from decode_steps import cache_arrays

    k, v = structured(300), structured(300, seed=9)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(31))
    products = {}
    for qjl in (False, True):
        cache = spectral(context, spectral_apply_qjl=qjl)
        feed(cache, k[:, :, :256], v[:, :, :256], 128)
        feed(cache, k[:, :, 256:], v[:, :, 256:], 1)
        mx.eval(cache_arrays([cache]))
        _, labels = _step_output(cache, q, cuda=True, monkeypatch=monkeypatch)
        products[qjl] = labels.count("Matmul") + labels.count("AddMM")
    assert products[True] == products[False] > 0, products


def test_encoding_the_qjl_signs_adds_no_matrix_product_at_the_default_d_eff(tmp_path):
    """The encoder projects each key's residual on the sketch, n rows by 4 columns: the same
    shape as the read's correction (above), summed in the same way."""
    d, n = 64, 2048
    x = structured(n)
    basis = mx.broadcast_to(mx.eye(d), (1, 2, d, d))
    sigma = mx.ones((1, 2, 2))
    sketch = mx.random.normal((4, 4), key=mx.random.key(3))
    mx.eval(x, basis, sigma, sketch)
    products = {}
    for qjl in (False, True):
        codec = EigenCodec(2, 4, key=True, qjl=qjl)
        words, norms = codec.encode(x, basis, sigma, sketch if qjl else None)
        path = tmp_path / f"encode_{qjl}.dot"
        mx.export_to_dot(str(path), words, norms)
        products[qjl] = re.findall(r'label ="?([A-Za-z_]+)"?, shape=rectangle', path.read_text()).count("Matmul")
    assert products[True] == products[False] == 1, products
