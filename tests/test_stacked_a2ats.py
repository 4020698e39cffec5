"""A2ATS stacked (cache/stacked.py): each row of a cache fed B rows keeps its own codebook,
query moment and metric factor, fitted from its own keys and queries, so the row is coded,
scored and attended exactly as alone; a state saved before the tables had a batch axis
still loads and goes on as one saved today."""

import functools

import mlx.core as mx
import pytest

from batching import assert_each_row_alone, run_rows, saved_state
from test_a2ats import BASE, a2ats, rope
from veloxquant_mlx.cache.base import CacheStateError
from veloxquant_mlx.methods.a2ats.cache import A2ATSCache
from veloxquant_mlx.quant.vq import kmeans, kmeans_rows

H, D, GQA = 2, 64, 2
TABLES = ("centroids", "factor", "h_sum")


def rows(b, n, seed):
    """(b, H, n, D) post-RoPE keys whose rows differ in scale and offset (so their codebooks
    and query moments differ), values and post-RoPE queries."""
    spread = 1 + mx.arange(b, dtype=mx.float32)[:, None, None, None]
    keys = spread * mx.random.normal((b, H, n, D), key=mx.random.key(seed)) + spread - 1
    queries = mx.random.normal((b, H * GQA, n, D), key=mx.random.key(seed + 1)) * spread
    values = mx.random.normal((b, H, n, D), key=mx.random.key(seed + 2))
    return rope(keys, 0), values, mx.concatenate([rope(queries[:, :, i : i + 1], i) for i in range(n)], axis=2)


CODEBOOK = mx.random.normal((32, 8), key=mx.random.key(12)).tolist()
_A = mx.random.normal((8, 8), key=mx.random.key(11))
QUERY_H = (_A @ _A.T + 0.1 * mx.eye(8)).tolist()
SETTINGS = {
    "fitted, query metric learned": {},
    "fitted, plain nearest": {"a2ats_use_query_aware": False},
    "given codebook and metric": {"a2ats_codebook": CODEBOOK, "a2ats_query_h": QUERY_H},
}


@pytest.mark.parametrize("options", list(SETTINGS.values()), ids=list(SETTINGS))
def test_a_two_row_cache_computes_each_row_as_that_row_alone(options):
    """Every output, code and table of each row of a 2-row cache is its own cache's, bit for
    bit, through prompt chunks, the first retrieving step (where the codebook is fitted) and
    coding blocks every window; fitted tables differ between the rows (one fitted over both
    rows would be theirs together), and the cache costs what its rows' caches cost."""
    keys, values, queries = rows(2, 230, seed=21)
    settings = dict(a2ats_retrieval_fraction=0.1, a2ats_window=16, a2ats_codebook_bits=5, a2ats_rope_base=BASE,
                    **options)
    both = a2ats(**settings)
    out_both = run_rows(both, keys, values, queries, 150)
    assert both.store.codes.length > 150  # coded past the prompt during decoding
    assert_each_row_alone(both, out_both, lambda: a2ats(**settings), keys, values, queries, 150)
    arrays = both.state["arrays"]
    for name in TABLES:
        table = arrays[name]
        if table is not None and name in ("centroids", "h_sum") and "a2ats_codebook" not in options:
            assert not mx.array_equal(table[0], table[1]), name


def test_the_fit_per_row_is_vq_kmeans_on_each_row_alone():
    """The fit a2ats makes inside a decode step (no host read: every iteration built, none
    skipped). One row: vq.kmeans's centroids bit for bit; several: each row's alone, rows
    that settle after different numbers of iterations included (a row that has settled
    keeps the centroids vq's returns there while the others go on)."""
    centers = 10 * mx.random.normal((16, 8), key=mx.random.key(7))
    clustered = centers[mx.random.randint(0, 16, (1, 900), key=mx.random.key(8))]
    noise = mx.random.normal((3, 900, 8), key=mx.random.key(5))
    # noise, and 16 clusters tight and loose: rows whose assignments settle at different iterations
    x = mx.concatenate([noise[:1], clustered + 0.01 * noise[1:2], clustered + 0.3 * noise[2:]])
    settled = []
    for r in range(3):
        calls = []
        ref = kmeans(x[r], 16, iters=10, key=mx.random.key(3), sample=512,
                     progress=lambda i, n: calls.append(i))
        settled.append(len(calls))
        fit = functools.partial(kmeans_rows, k=16, iters=10, key=mx.random.key(3), sample=512, read_host=False)
        assert mx.array_equal(fit(x[r : r + 1])[0], ref)
        assert mx.array_equal(fit(x)[r], ref), r
    assert len(set(settled)) > 1, settled
    few = x[:, :10]  # no more points than centroids: every point a centroid, as vq's
    assert mx.array_equal(kmeans_rows(few, 16, iters=10, key=mx.random.key(3), read_host=False)[1],
                          kmeans(few[1], 16, iters=10, key=mx.random.key(3)))


def test_a_state_saved_with_tables_of_no_batch_axis_loads_and_continues_identically():
    """The layout before the batch axis saved the codebook (K, s), the metric's factor and
    the query moment (s, s): they load as (1, ...), and the cache goes on (retrieving
    steps, coding blocks) exactly as one restored from today's state."""
    keys, values, queries = rows(1, 260, seed=31)
    settings = dict(a2ats_retrieval_fraction=0.1, a2ats_window=16, a2ats_codebook_bits=5, a2ats_rope_base=BASE)
    cache = a2ats(**settings)
    run_rows(cache, keys[:, :, :170], values[:, :, :170], queries[:, :, :170], 150)
    state = saved_state(cache)
    for name in TABLES:
        assert state["arrays"][name].shape[0] == 1, name
    old = saved_state(cache)
    old["arrays"].update({name: state["arrays"][name][0] for name in TABLES})
    restored_old, restored = A2ATSCache.from_state(old), A2ATSCache.from_state(state)
    for name in TABLES:
        table = getattr(restored_old.store, name)
        assert table.shape == state["arrays"][name].shape and mx.array_equal(table, getattr(restored.store, name))
    rest = [x[:, :, 170:] for x in (keys, values, queries)]
    coded = restored.store.codes.length
    out_old, out_new = run_rows(restored_old, *rest, 0), run_rows(restored, *rest, 0)
    assert restored.store.codes.length > coded  # coding blocks after the load
    assert all(mx.array_equal(x, y) for x, y in zip(out_old, out_new))
    after_old, after_new = saved_state(restored_old)["arrays"], saved_state(restored)["arrays"]
    assert all(mx.array_equal(after_old[n], after_new[n]) for n in after_new if after_new[n] is not None)


def test_a_state_whose_tables_have_other_rows_than_the_batch_is_refused():
    """One row's codebook in a 2-row state would be every row's (rows mixed)."""
    keys, values, queries = rows(2, 60, seed=41)
    cache = a2ats(a2ats_retrieval_fraction=0.1, a2ats_window=16, a2ats_codebook_bits=5, a2ats_rope_base=BASE)
    run_rows(cache, keys, values, queries, 59)
    state = saved_state(cache)
    state["arrays"]["centroids"] = state["arrays"]["centroids"][:1]
    problem = r"codebook \(rows, centroids, sub_dim\) is \(1, 32, 8\), expected \(2, 32, 8\)"
    with pytest.raises(CacheStateError, match=problem):
        A2ATSCache.from_state(state)
    assert A2ATSCache.from_state(saved_state(cache)).store.centroids.shape == (2, 32, 8)
