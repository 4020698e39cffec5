"""KVQuant: the codebook beats uniform levels on its own data, Lloyd never hurts, outliers
and sinks come back exactly, refits never change what stored indices mean, pre-RoPE keys,
decode over the packed form, memory at 4k against the card, bad fields name themselves."""

import math
from types import SimpleNamespace

import mlx.core as mx
import pytest

from test_kivi import feed
from test_methods_exactness import run
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import KVQuantOptions
from veloxquant_mlx.cache.rope import Rotary
from veloxquant_mlx.methods.kvquant import KVQuantCache
from veloxquant_mlx.quant import codebook as cb
from veloxquant_mlx.methods.kvquant import nonuniform
from veloxquant_mlx.methods.kvquant.nonuniform import NonUniform
from veloxquant_mlx.quant.outliers import per_tail
from veloxquant_mlx.quant.packed import GROWTH_TOKENS
from feeding import stored_decode_attention

ROPE_BASE = 10000.0


def kvquant(context=None, **options):
    return KVQuantCache(KVCacheConfig(method="kvquant", options=KVQuantOptions(**options)), context, 0)


def rotary_context(base=ROPE_BASE):
    """What a ``make_prompt_cache`` context tells a cache about the model's RoPE."""
    return SimpleNamespace(model_args=SimpleNamespace(rope_theta=base))


def kv(t, d=64, h=2, seed=0, dtype=mx.float32):
    k = mx.random.normal((1, h, t, d), key=mx.random.key(seed)) * (1 + mx.arange(d) % 5)  # uneven channels
    v = mx.random.normal((1, h, t, d), key=mx.random.key(seed + 1))
    return k.astype(dtype), v.astype(dtype)


def rel_err(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.linalg.norm((a - b).flatten()) / mx.linalg.norm(b.flatten()))


# -- the codebook ------------------------------------------------------------------------------
@pytest.mark.parametrize("bits, ratio", [(2, 0.75), (3, 0.9), (4, 0.97)])
def test_the_codebook_reconstructs_its_training_data_better_than_uniform_levels(bits, ratio):
    """On the normalised groups of its own data (heavy-tailed, as K/V are), the fitted
    codebook's error is below the uniform grid's at the same bits and normalisation (by less
as the levels get finer: measured 0.65 / 0.83 / 0.94 of it at 2 / 3 / 4 bits)."""
    x = mx.random.normal((1, 2, 256, 64), key=mx.random.key(3))
    x = x * mx.exp(mx.random.normal(x.shape, key=mx.random.key(4)) * 0.5)  # heavy tails
    z, weights, *_ = NonUniform(bits, 32, "token", 0.01, 8).prepare(x, mx.float32)
    book = cb.fit(z, bits, 8, weights)  # a batch of one row
    assert book.shape == (1, 1 << bits) and bool(mx.all(book[0, 1:] > book[0, :-1]))
    assert bool(mx.all(mx.abs(book) <= 1.0))
    z, weights = z.reshape(1, -1), weights.reshape(1, -1)
    nuq, uniform = float(cb.mse(z, book, weights)[0]), float(cb.mse(z, cb.uniform_grid(bits)[None], weights)[0])
    assert nuq < ratio * uniform, (nuq, uniform)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_the_cache_errs_less_with_its_codebook_than_with_uniform_levels(bits, monkeypatch):
    """The same cache (normalisation, outliers, groups) with the uniform grid in place of
    the fit: the fitted codebook reconstructs the cache's own tokens better."""
    keys, values = kv(512, seed=5)
    keys = keys * mx.exp(mx.random.normal(keys.shape, key=mx.random.key(6)) * 0.5)

    def errors():
        cache = kvquant(kvquant_bits=bits, kvquant_n_sink=0)
        feed(cache, keys, values, 512)
        k_hat, v_hat = cache.dequantized(mx.float32)
        return rel_err(k_hat, keys), rel_err(v_hat, values)

    fitted = errors()
    monkeypatch.setattr(cb, "fit", lambda z, bits, iters, weights, seed=0:
                        mx.broadcast_to(cb.uniform_grid(bits), (z.shape[0], 1 << bits)))
    uniform = errors()
    assert fitted[0] < uniform[0] and fitted[1] < uniform[1], (fitted, uniform)


def test_lloyd_never_increases_the_fitting_error():
    z = mx.clip(mx.random.normal((1, 20000), key=mx.random.key(7)) * 0.4, -1, 1)
    weights = (mx.random.uniform(shape=z.shape, key=mx.random.key(8)) > 0.05).astype(mx.float32)
    c = cb.quantile_init(z, weights, 3)
    errors = [float(cb.mse(z, c, weights)[0])]
    for _ in range(10):
        c = cb.lloyd_step(z, weights, c, cb.row_index(*z.shape))
        errors.append(float(cb.mse(z, c, weights)[0]))
    assert all(b <= a + 1e-7 for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < errors[0]


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_the_fused_lookup_is_a_gather_from_the_codebook_at_every_width(bits):
    """One codebook, and one per row (refitted codebooks): in passes of at most
    FUSED_STEPS centroid steps from 4 bits on, the values of indexing the table (to the
    rounding of a sum of centroid steps)."""
    n = 1 << bits
    codes = mx.random.randint(0, n, (1, 2, 6, 40), key=mx.random.key(23)).astype(mx.float32)
    table = mx.sort(mx.random.uniform(-1, 1, (n,), key=mx.random.key(24)))
    assert mx.allclose(cb.lookup(codes, table), table[codes.astype(mx.uint32)], atol=1e-6, rtol=0)
    rows = mx.sort(mx.random.uniform(-1, 1, (6, n), key=mx.random.key(25)), axis=-1)
    want = mx.take_along_axis(mx.broadcast_to(rows[:, None], (1, 2, 6, 40, n)),
                              codes.astype(mx.uint32)[..., None], axis=-1)[..., 0]
    assert mx.allclose(cb.lookup(codes, rows.reshape(1, 1, 6, 1, n)), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("bits, expected", [(2, 0.31), (3, 0.16), (4, 0.085)])
def test_normal_data_errs_as_the_cards_numpy_check(bits, expected):
    """The card's check (N(0,1), per token, f=0.01, 8 Lloyd steps; statistics over whole
    vectors): groups of 32 channels can only do better, by less than a third."""
    x = mx.random.normal((1, 4, 256, 128), key=mx.random.key(9))
    cache = kvquant(kvquant_bits=bits, kvquant_n_sink=0, kvquant_group_size=128)
    feed(cache, x, x, 256)
    err = rel_err(cache.dequantized(mx.float32)[1], x)
    assert 0.75 * expected < err < 1.05 * expected, err


# -- outliers and sinks ------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.1])
def test_outliers_are_kept_exactly_and_out_of_the_range(fraction):
    d, g, t = 64, 32, 256
    keys, values = kv(t, d=d, seed=10, dtype=mx.float16)
    # Every 8th token: one entry at +60 and one at -60, as many as the smallest tail keeps.
    up = (mx.arange(t)[:, None] % 8 == 0) & (mx.arange(d) == (mx.arange(t)[:, None] * 7) % d)
    down = (mx.arange(t)[:, None] % 8 == 0) & (mx.arange(d) == (mx.arange(t)[:, None] * 7 + 3) % d)
    spikes = up | down
    values = mx.where(up, mx.array(60.0, mx.float16), mx.where(down, mx.array(-60.0, mx.float16), values))
    cache = kvquant(kvquant_outlier_fraction=fraction, kvquant_n_sink=0, kvquant_group_size=g)
    feed(cache, keys, values, t)
    k_hat, v_hat = cache.dequantized(mx.float16)
    st, k = cache.store, per_tail(fraction, d)

    # Values: per token the k smallest and k largest entries, positions uint16, back bit for bit.
    pos, val = st.values.out_pos.view(), st.values.out_val.view()
    assert pos.dtype == mx.uint16 and pos.shape == (1, 2, t, 2 * k) and val.dtype == mx.float16
    order = mx.argsort(values.astype(mx.float32), axis=-1)
    tails = mx.sort(mx.concatenate([order[..., :k], order[..., d - k :]], axis=-1), axis=-1)
    assert mx.array_equal(mx.sort(pos.astype(mx.int32), axis=-1), tails.astype(mx.int32))
    at = pos.astype(mx.int32)
    assert mx.array_equal(mx.take_along_axis(v_hat, at, axis=-1), mx.take_along_axis(values, at, axis=-1))
    # A spiked token's range is taken without its spikes: its other entries err as unspiked
    # ones do (with the spikes in the range a step would be 120 / 7 wide).
    spiked = spikes.any(axis=-1)
    err = mx.abs(v_hat.astype(mx.float32) - values.astype(mx.float32)).max(axis=-1)
    assert float(mx.where(spiked, err, 0.0).max()) < 1.5 * float(mx.where(spiked, 0.0, err).max()) < 1.5

    # Keys: per group of G tokens, G times as many per tail, kept exactly at channel * G + token.
    kpos, kval = st.keys.out_pos.view(), st.keys.out_val.view()
    assert kpos.shape == (1, 2, t // g, 2 * g * k)
    chan, tok = kpos.astype(mx.int32) // g, kpos.astype(mx.int32) % g
    tok = tok + (mx.arange(t // g, dtype=mx.int32) * g)[:, None]
    flat = tok * d + chan
    rows = lambda x: x.reshape(1, 2, t * d)  # noqa: E731
    got = mx.take_along_axis(rows(k_hat), flat.reshape(1, 2, -1), axis=-1)
    want = mx.take_along_axis(rows(keys), flat.reshape(1, 2, -1), axis=-1)
    assert mx.array_equal(got, want) and mx.array_equal(got, kval.reshape(1, 2, -1))


def test_without_outliers_no_table_is_kept():
    keys, values = kv(128, seed=12)
    cache = kvquant(kvquant_outlier_fraction=0.0)
    feed(cache, keys, values, 128)
    assert cache.store.keys.out_pos.buffer is None and cache.store.values.out_val.buffer is None


@pytest.mark.parametrize("n_sink, t, chunk", [(1, 200, 200), (4, 200, 3), (64, 300, 50), (300, 200, 64)])
def test_sinks_are_exact_and_a_prompt_within_them_is_returned_whole(n_sink, t, chunk):
    keys, values = kv(t, seed=13, dtype=mx.float16)
    cache = kvquant(kvquant_n_sink=n_sink)
    feed(cache, keys[:, :, : t - 20], values[:, :, : t - 20], chunk)
    feed(cache, keys[:, :, t - 20 :], values[:, :, t - 20 :], 1)
    k_hat, v_hat = cache.dequantized(mx.float16)
    s = min(n_sink, t)
    assert k_hat.shape == keys.shape and cache.stored_length == t
    assert mx.array_equal(k_hat[:, :, :s], keys[:, :, :s]) and mx.array_equal(v_hat[:, :, :s], values[:, :, :s])
    if n_sink >= t:
        assert cache.store.keys.count == cache.store.values.count == 0
    else:  # past the sinks: keys in whole blocks (the newest n mod 32 exact), values encoded
        rest = t - n_sink  # as they come in a prompt and 32 at a time by decode steps
        assert cache.store.keys.count == rest // 32 * 32 and cache.store.values.count == rest - 20
        assert mx.array_equal(v_hat[:, :, t - 20 :], values[:, :, t - 20 :])
        assert mx.array_equal(k_hat[:, :, n_sink + rest // 32 * 32 :], keys[:, :, n_sink + rest // 32 * 32 :])
        assert not mx.array_equal(v_hat[:, :, s:], values[:, :, s:])


# -- the codebook over time ------------------------------------------------------------------------
def test_without_refits_the_codebook_is_fitted_once_and_never_changes():
    keys, values = kv(400, seed=14)
    cache = kvquant(kvquant_refit_interval=0)
    feed(cache, keys[:, :, :200], values[:, :, :200], 64)  # a chunked prompt: fitted on its first chunk
    books = [mx.array(cache.store.keys.centroids), mx.array(cache.store.values.centroids)]
    feed(cache, keys[:, :, 200:], values[:, :, 200:], 1)
    for run, before in zip((cache.store.keys, cache.store.values), books):
        assert run.books.length == 1 and run.book_ids is None and mx.array_equal(run.centroids, before)


@pytest.mark.parametrize("interval", [1, 8])
def test_refits_every_interval_and_stored_indices_keep_their_meaning(interval):
    keys, values = kv(200 + 40, seed=15)
    later = 3.0 * mx.tanh(values[:, :, 200:])  # decode data of another shape: a refit moves centroids
    cache = kvquant(kvquant_refit_interval=interval)
    feed(cache, keys[:, :, :200], values[:, :, :200], 200)
    st = cache.store
    snapshots = []
    for i in range(40):
        feed(cache, keys[:, :, 200 + i : 201 + i], later[:, :, i : i + 1], 1)
        snapshots.append(cache.dequantized(mx.float32))
    # A refit every ``interval`` steps, which makes a codebook only when tokens were encoded
    # since the last fit (nothing seen: no new codebook): keys in blocks of 32, values 32 at
    # a time too, both flushed at step 31 of the 40.
    assert st.values.books.length == 2 and st.keys.books.length == 2
    assert not mx.array_equal(st.values.books.buffer[..., 0, :], st.values.books.buffer[..., 1, :])
    ids = st.values.book_ids.view()
    # step 31 encodes its 32 values with the codebook of before, then refits
    assert ids.shape == (1, 1, 231, 1, 1) and mx.array_equal(ids, mx.zeros((1, 1, 231, 1, 1), mx.int32))
    # What was stored never changes meaning: each token reads back the same at every later step.
    for i, (k_hat, v_hat) in enumerate(snapshots[:-1]):
        n = 200 + i + 1
        last_k, last_v = snapshots[-1]
        encoded = 200 + (n - 200) // 32 * 32  # values quantized by then (the rest exact)
        assert mx.array_equal(v_hat[:, :, :encoded], last_v[:, :, :encoded])
        stable = cache.store.n_sink + (n - cache.store.n_sink) // 32 * 32  # keys quantized by then
        assert mx.array_equal(k_hat[:, :, :stable], last_k[:, :, :stable])


def test_no_lloyd_steps_means_no_refit():
    keys, values = kv(240, seed=16)
    cache = kvquant(kvquant_refit_interval=2, kvquant_lloyd_iters=0)
    feed(cache, keys[:, :, :200], values[:, :, :200], 200)
    feed(cache, keys[:, :, 200:], values[:, :, 200:], 1)
    assert cache.store.values.books.length == 1
    # The start kept as it is: the quantile grid of the first encode's values, or the uniform
    # grid where that fits them better (at 3 bits here, the uniform one).
    z, weights = _z_weights(cache, values[:, :, 1:200])
    starts = cb.quantile_init(z, weights, 3), cb.uniform_grid(3)[None]
    best = min(starts, key=lambda c: float(cb.mse(z, c, weights)[0]))
    assert mx.array_equal(cache.store.values.centroids, best)


def _z_weights(cache, values):
    """A codec's z and weights of ``values`` (one row), each (1, N)."""
    z, weights, *_ = cache.store.values.codec.prepare(values, values.dtype)
    return z.reshape(1, -1), weights.reshape(1, -1)


# -- pre-RoPE keys ----------------------------------------------------------------------------------
def test_pre_rope_keys_quantize_better_and_come_back_rotated():
    """Keys with strong per-channel offsets before RoPE (as real keys have): post-RoPE the
    offsets turn with the position and widen every channel's range over a block; de-rotated
    first they do not. The cache hands back post-RoPE keys either way."""
    t, d = 256, 64
    base = mx.random.normal((1, 2, t, d), key=mx.random.key(17)) * 0.3
    pre = base + mx.where(mx.arange(d) % 8 == 0, 6.0, 0.0)
    keys = mx.fast.rope(pre, d, traditional=False, base=ROPE_BASE, scale=1.0, offset=0)
    values = mx.random.normal(keys.shape, key=mx.random.key(18))
    errs = {}
    for name, context in (("pre", rotary_context()), ("post", None)):
        cache = kvquant(context, kvquant_n_sink=1)
        assert (cache.store.keys.rotary is not None) == (name == "pre")
        feed(cache, keys, values, 100)
        k_hat = cache.dequantized(mx.float32)[0]
        assert mx.array_equal(k_hat[:, :, :1], keys[:, :, :1])
        errs[name] = rel_err(k_hat[:, :, 1:225], keys[:, :, 1:225])
    assert errs["pre"] < 0.5 * errs["post"], errs


def test_a_model_cache_knows_the_models_rotary():
    model = tiny_model("llama")
    cache = make_prompt_cache(model, KVCacheConfig(method="kvquant"))
    assert cache[0].store.keys.rotary == Rotary.from_model_args(model.args)
    assert cache[0].store.values.rotary is None


# -- decode over the packed form ----------------------------------------------------------------------
@pytest.mark.parametrize("rope, refit, bits", [(False, 0, 3), (True, 4, 2), (False, 2, 5)])
def test_decode_attention_matches_attention_over_the_reconstructed_cache(rope, refit, bits):
    keys, values = kv(300, seed=19)
    cache = kvquant(rotary_context() if rope else None, kvquant_refit_interval=refit, kvquant_bits=bits,
                    kvquant_n_sink=3)
    feed(cache, keys[:, :, :250], values[:, :, :250], 128)
    feed(cache, keys[:, :, 250:], values[:, :, 250:], 1)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(20))
    k_hat, v_hat = cache.dequantized(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=0.125)
    out = stored_decode_attention(cache, q, 0.125)
    assert mx.allclose(out, ref, atol=2e-5, rtol=1e-4), float(mx.abs(out - ref).max())


@pytest.mark.parametrize("rope, bits", [(False, 3), (True, 4)])
def test_the_cuda_table_read_gives_the_gathers_values_bit_for_bit(rope, bits, monkeypatch):
    """On CUDA each code's centroid is chosen by a chain of selects instead of the axis
    gather (notes/decode_kernels.md): the same decode step, both ways, must agree exactly."""
    keys, values = kv(300, seed=23)
    cache = kvquant(rotary_context() if rope else None, kvquant_bits=bits, kvquant_n_sink=3)
    feed(cache, keys[:, :, :299], values[:, :, :299], 128)
    feed(cache, keys[:, :, 299:], values[:, :, 299:], 1)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(24))
    nonuniform._read_fn.cache_clear()
    gathered = stored_decode_attention(cache, q, 0.125)
    monkeypatch.setattr(nonuniform, "gpu_backend", lambda: "cuda")
    nonuniform._read_fn.cache_clear()  # the compiled reads are traced anew, the selects in them
    selected = stored_decode_attention(cache, q, 0.125)
    nonuniform._read_fn.cache_clear()
    assert mx.array_equal(gathered, selected)


def test_a_decode_step_never_decodes_the_history(monkeypatch):
    keys, values = kv(300, seed=21)
    cache = kvquant()
    feed(cache, keys[:, :, :290], values[:, :, :290], 290)
    calls = []
    monkeypatch.setattr(type(cache.store), "history", lambda self, dtype: calls.append(1))
    feed(cache, keys[:, :, 290:], values[:, :, 290:], 1)
    assert not calls


def test_logits_through_the_model_with_sinks_past_the_prompt_equal_the_full_cache():
    model = tiny_model("llama")
    tokens = prompt(120)

    def logits(config):
        return run(model, make_prompt_cache(model, config), tokens, chunk=50, decode=40)

    full = logits(KVCacheConfig(method="full"))
    kept = logits(KVCacheConfig(method="kvquant", options=KVQuantOptions(kvquant_n_sink=4096)))
    assert mx.allclose(kept, full, atol=1e-5, rtol=1e-5), float(mx.abs(kept - full).max())
    lossy = logits(KVCacheConfig(method="kvquant", options=KVQuantOptions(kvquant_bits=2)))
    assert not mx.allclose(lossy, full, atol=1e-3, rtol=1e-3)


# -- memory ---------------------------------------------------------------------------------------------------
def test_memory_at_4k_matches_the_cards_formula():
    """Per head and token, K and V each: ``b d/8 + 4 d/G + n_out (2 + 2)`` bytes, n_out =
    2 ceil(f d / 2); plus the codebooks, the sinks and the keys' exact tail (the card)."""
    t, steps, h, d, g, bits, f, n_sink = 4096, 100, 2, 128, 32, 3, 0.01, 1
    keys, values = kv(t + steps, d=d, h=h, seed=22, dtype=mx.float16)
    cache = kvquant(kvquant_bits=bits, kvquant_group_size=g, kvquant_outlier_fraction=f, kvquant_n_sink=n_sink)
    for i in range(0, t, 2048):  # mlx-lm's prompt chunks, then decode steps
        cache.store.commit(keys[:, :, i : i + 2048], values[:, :, i : i + 2048])
    for i in range(t, t + steps):
        cache.store.commit(keys[:, :, i : i + 1], values[:, :, i : i + 1])
    rest = t + steps - n_sink
    n_k, n_v, tail = rest // 32 * 32, rest - steps % 32, rest % 32  # values leave 32 at a time
    assert (cache.store.keys.count, cache.store.values.count) == (n_k, n_v)
    per_token = bits * d / 8 + 4 * d / g + 2 * math.ceil(f * d / 2) * (2 + 2)
    assert per_token == 72  # the card's example: 48 + 16 + 8 bytes against 256 in fp16
    books = 2 * (1 << bits) * 4  # per layer, keys and values; float32 centroids here
    formula = h * ((n_k + n_v) * per_token + 2 * n_sink * d * 2 + (tail + steps % 32) * d * 2) + books
    # packed growth, the key tail's and the value window's room
    room = h * 2 * GROWTH_TOKENS * per_token + h * 2 * 32 * d * 2
    assert formula <= cache.nbytes <= formula + room, (cache.nbytes, formula)
    assert cache.nbytes < 2 * (t + steps) * h * d * 2 / 3.3  # about 3.6x against fp16


# -- bad settings ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, allowed", [
    ("kvquant_bits", 6, r"\[2, 5\]"), ("kvquant_bits", 1, r"\[2, 5\]"),
    ("kvquant_outlier_fraction", 0.2, r"\[0, 0.1\]"), ("kvquant_group_size", 0, r"\[1, inf\)"),
    ("kvquant_lloyd_iters", -1, r"\[0, inf\)"), ("kvquant_refit_interval", -1, r"\[0, inf\)"),
    ("kvquant_n_sink", -1, r"\[0, inf\)"),
])
def test_bad_fields_name_themselves_and_what_is_allowed(field, value, allowed):
    with pytest.raises(ValueError, match=rf"{field}={value}.*allowed.*{allowed}"):
        KVCacheConfig(method="kvquant", options=KVQuantOptions(**{field: value}))


def test_a_group_that_does_not_divide_head_dim_is_refused_with_the_divisors():
    cache = kvquant(kvquant_group_size=48)
    with pytest.raises(ValueError, match=r"kvquant_group_size=48 must divide head_dim=64.*\[1, 2, 4, 8, 16, 32, 64\]"):
        cache.update_and_fetch(*kv(8))
    for g in (1, 8, 16):  # any divisor works: keys wait for lcm(G, 32) tokens
        cache = kvquant(kvquant_group_size=g, kvquant_n_sink=0)
        keys, values = kv(64, seed=g)
        feed(cache, keys, values, 64)
        assert cache.store.keys.count == 64 and rel_err(cache.dequantized(mx.float32)[1], values) < 0.2


def test_outlier_sorts_over_many_rows_equal_one_sort():
    """MLX's CUDA sort cannot launch 65,536 rows at once; the outlier split sorts in slices
    of MAX_SORT_ROWS rows, which must give exactly what one sort gives."""
    from veloxquant_mlx.quant import outliers

    x = mx.random.normal((3, outliers.MAX_SORT_ROWS // 2 + 7, 32), key=mx.random.key(5))
    assert mx.array_equal(outliers.sort_rows(x), mx.sort(x, axis=-1))
    assert mx.array_equal(outliers.sort_rows(x, arg=True), mx.argsort(x, axis=-1))
