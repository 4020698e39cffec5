"""KVQuant stacked (cache/stacked.py): each row of a cache fed B rows fits, refits and reads
its own codebooks (keys and values), so the row is coded and attended exactly as alone;
``codebook``'s fit, histogram and refit give each row what it gets as a batch of one; a
state saved before the codebooks had a batch axis still loads and goes on as one saved
today."""

import mlx.core as mx
import pytest

from batching import assert_each_row_alone, run_rows, saved_state
from test_kvquant import kvquant, rotary_context
from veloxquant_mlx.cache.base import CacheStateError
from veloxquant_mlx.methods.kvquant import KVQuantCache
from veloxquant_mlx.methods.kvquant.nonuniform import NonUniform
from veloxquant_mlx.quant import codebook as cb

H, D, GQA = 2, 64, 2
# The layout before the batch axis: the codebooks (codebooks, 2^bits), their ids (units,),
# the refit histogram (2, bins), each from today's one-row array.
OLD_LAYOUT = {"books": lambda x: x[0, 0, 0], "book_ids": lambda x: x.reshape(-1), "hist": lambda x: x[0]}


def rows(b, n, seed, dtype=mx.float32):
    """(b, H, n, D) keys, values and (b, H * GQA, n, D) queries whose rows differ in shape
    (a heavier tail row after row), so that their codebooks differ."""
    tail = 0.3 * mx.arange(b, dtype=mx.float32)[:, None, None, None]
    keys = mx.random.normal((b, H, n, D), key=mx.random.key(seed)) * (1 + mx.arange(D) % 5)
    keys = keys * mx.exp(tail * mx.random.normal(keys.shape, key=mx.random.key(seed + 1)))
    values = mx.random.normal((b, H, n, D), key=mx.random.key(seed + 2))
    values = mx.tanh((1 + tail) * values) if b > 1 else values
    queries = mx.random.normal((b, H * GQA, n, D), key=mx.random.key(seed + 3))
    return keys.astype(dtype), values.astype(dtype), queries.astype(dtype)


SETTINGS = {
    "pre-RoPE keys, refits": dict(rope=True, kvquant_refit_interval=4),
    "small groups (codebooks end to end), refits, 5 bits": dict(kvquant_refit_interval=2, kvquant_bits=5,
                                                                 kvquant_group_size=8),
    "frozen codebooks, 2 bits, float16": dict(kvquant_bits=2, dtype=mx.float16),
    "no outliers, refits": dict(kvquant_outlier_fraction=0.0, kvquant_refit_interval=8),
}


@pytest.mark.parametrize("settings", list(SETTINGS.values()), ids=list(SETTINGS))
def test_a_three_row_cache_computes_each_row_as_that_row_alone(settings):
    """Every output and kept array of each row of a 3-row cache is its own cache's, bit for
    bit, through prompt chunks (fitted on the first), decode steps (refitted every R), key
    blocks and value flushes; the rows' codebooks differ (one fitted over every row would
    be theirs together), and the cache costs what its rows' caches cost."""
    settings = dict(settings)
    rope, dtype = settings.pop("rope", False), settings.pop("dtype", mx.float32)
    settings.setdefault("kvquant_n_sink", 3)

    def make():
        return kvquant(rotary_context() if rope else None, **settings)

    keys, values, queries = rows(3, 260, seed=21, dtype=dtype)
    both = make()
    out_both = run_rows(both, keys, values, queries, 170)
    refits = settings.get("kvquant_refit_interval", 0)
    assert (both.store.values.books.length > 1) == bool(refits)  # refitted while decoding, or frozen
    assert_each_row_alone(both, out_both, make, keys, values, queries, 170)
    arrays = both.state["arrays"]
    for name in ("k_books", "v_books"):
        assert not mx.array_equal(arrays[name][0], arrays[name][1]), name


def _heavy_rows(shape, seed):
    """Values whose rows have tails of different weights, so that their codebooks differ."""
    x = mx.random.normal(shape, key=mx.random.key(seed))
    tails = mx.linspace(0.2, 0.8, shape[0]).reshape(-1, *[1] * (len(shape) - 1))
    return x * mx.exp(mx.random.normal(x.shape, key=mx.random.key(seed + 1)) * tails)


def test_each_rows_codebook_fit_histogram_and_refit_are_that_rows_alone():
    """``codebook``'s fit / histogram / refit over several rows: each row exactly (bit for
    bit on the CPU) what it gets as a batch of one, at sizes past the fit's sample (a
    seeded subset of each row, the same picks as alone); the rows' codebooks differ."""
    x = _heavy_rows((3, 4, 640, 64), seed=3)
    for codec in (NonUniform(3, 32, "token", 0.01, 8), NonUniform(4, 32, "channel", 0.01, 8)):
        z, w, *_ = codec.prepare(x, mx.float16)
        assert z[0].size > cb.FIT_SAMPLES
        books, hists = cb.fit(z, codec.bits, 8, w), cb.accumulate(None, z, w)
        refits = cb.compiled_refit(cb.accumulate(hists, z, w), books, 8)
        assert books.shape == (3, 1 << codec.bits) and hists.shape == refits.shape[:1] + (2, cb.HIST_BINS)
        for r in range(3):
            zr, wr = z[r : r + 1], w[r : r + 1]
            book, hist = cb.fit(zr, codec.bits, 8, wr), cb.histogram(zr, wr)
            assert mx.array_equal(books[r], book[0]), r
            assert mx.array_equal(hists[r], hist[0]), r
            assert mx.array_equal(refits[r], cb.compiled_refit(cb.accumulate(hist, zr, wr), book, 8)[0]), r
        assert not mx.array_equal(books[0], books[2])


@pytest.mark.parametrize("bits", [2, 3, 5])
def test_one_rows_codebook_is_sorted_in_range_and_errs_no_more_than_either_start(bits):
    """A row's fit: sorted centroids in [-1, 1], of weighted error at most its quantile
    start's and the uniform grid's (the better start, then Lloyd steps, which never
    increase it); no steps leave the better start as it is. Its histogram holds its
    weights and weighted values bin by bin, and a refit on it errs no more on the bins."""
    z, w, *_ = NonUniform(bits, 32, "token", 0.02, 8).prepare(_heavy_rows((1, 2, 300, 64), seed=7), mx.float32)
    flat_z, flat_w = z.reshape(1, -1), w.reshape(1, -1)
    assert 0 < float(flat_w.sum()) < flat_w.size  # outliers left out

    def err(c):
        return float(cb.mse(flat_z, c, flat_w)[0])

    book = cb.fit(z, bits, 8, w)
    assert book.shape == (1, 1 << bits) and bool(mx.all(book[0, 1:] > book[0, :-1]))
    assert bool(mx.all(mx.abs(book) <= 1.0))
    starts = cb.quantile_init(flat_z, flat_w, bits), cb.uniform_grid(bits)[None]
    assert err(book) <= min(err(c) for c in starts) + 1e-7
    assert err(book) < max(err(c) for c in starts)
    assert mx.array_equal(cb.fit(z, bits, 0, w), min(starts, key=err))

    hist = cb.histogram(z, w)
    at = mx.clip(mx.floor((flat_z + 1) * (cb.HIST_BINS / 2)), 0, cb.HIST_BINS - 1).astype(mx.int32)[0]
    onehot = (at[:, None] == mx.arange(cb.HIST_BINS)).astype(mx.float32)  # (N, bins)
    assert mx.array_equal(hist[0, 0], (flat_w[0][:, None] * onehot).sum(axis=0))
    assert mx.allclose(hist[0, 1], ((flat_w * flat_z)[0][:, None] * onehot).sum(axis=0), atol=1e-4)
    mass = hist[:, 0]
    points = mx.where(mass > 0, hist[:, 1] / mx.where(mass > 0, mass, 1.0), 0.0)
    refit = cb.compiled_refit(hist, book, 8)
    assert bool(mx.all(refit[0, 1:] >= refit[0, :-1])) and bool(mx.all(mx.abs(refit) <= 1.0))
    assert float(cb.mse(points, refit, mass)[0]) <= float(cb.mse(points, book, mass)[0]) + 1e-7


def test_a_state_saved_with_codebooks_of_no_batch_axis_loads_and_continues_identically():
    """The layout before the batch axis saved the codebooks (codebooks, 2^bits), their ids
    (units,) and the refit histogram (2, bins): they load as (1, ...), and the cache goes on
    (decode steps, key blocks, refits) exactly as one restored from today's state."""
    keys, values, queries = rows(1, 300, seed=31)
    settings = dict(kvquant_refit_interval=4, kvquant_n_sink=3)
    cache = kvquant(rotary_context(), **settings)
    run_rows(cache, keys[:, :, :230], values[:, :, :230], queries[:, :, :230], 170)
    state = saved_state(cache)
    assert cache.store.keys.books.length > 1 and cache.store.values.books.length > 1  # refitted before the save
    old = saved_state(cache)
    for prefix in "kv":
        for name, old_layout in OLD_LAYOUT.items():
            array = state["arrays"][f"{prefix}_{name}"]
            assert array.shape[0] == 1 and array.ndim == 3 + 2 * (name != "hist"), name
            old["arrays"][f"{prefix}_{name}"] = old_layout(array)
    restored_old, restored = KVQuantCache.from_state(old), KVQuantCache.from_state(state)
    for run_old, run_new in ((restored_old.store.keys, restored.store.keys),
                             (restored_old.store.values, restored.store.values)):
        for name in ("books", "book_ids", "hist"):
            a, b = getattr(run_old, name).view(), getattr(run_new, name).view()
            assert a.shape == b.shape and mx.array_equal(a, b), name
    rest = [x[:, :, 230:] for x in (keys, values, queries)]
    n_books = restored.store.values.books.length
    out_old, out_new = run_rows(restored_old, *rest, 0), run_rows(restored, *rest, 0)
    assert restored.store.values.books.length > n_books  # refitted after the load
    assert all(mx.array_equal(x, y) for x, y in zip(out_old, out_new))
    after_old, after_new = saved_state(restored_old)["arrays"], saved_state(restored)["arrays"]
    assert all(mx.array_equal(after_old[n], after_new[n]) for n in after_new if after_new[n] is not None)


def test_a_state_whose_codebooks_have_other_rows_than_the_batch_is_refused():
    """One row's codebooks in a 2-row state would be every row's (rows mixed)."""
    keys, values, queries = rows(2, 120, seed=41)
    cache = kvquant(kvquant_refit_interval=4, kvquant_n_sink=3)
    run_rows(cache, keys, values, queries, 100)
    state = saved_state(cache)
    state["arrays"]["v_books"] = state["arrays"]["v_books"][:1]
    with pytest.raises(CacheStateError, match=r"value codebooks is \(1, 1, 1, 2, 8\), expected .*\(2, 1, 1, at least 1, 8\)"):
        KVQuantCache.from_state(state)
    assert KVQuantCache.from_state(saved_state(cache)).store.values.books.view().shape == (2, 1, 1, 2, 8)
