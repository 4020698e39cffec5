"""KVQuant's decode read (issue 30): over 40 decode steps (key flushes, value flushes and
refits among them) a step's attention, through the CPU's gather and through CUDA's tree of
selects (the entries taken by one split), is what attention over the reconstructed
history gives, to float32 reassociation; the history reconstructed the general way
(``_dense_graph``: the codes unpacked by a sum over the planes, then looked up), not
through the views and the bit tests a step reads (``_tile_graph``), which give it bit for
bit."""

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import KVQuantOptions
from veloxquant_mlx.methods.kvquant import KVQuantCache, nonuniform

from test_kvquant import kv, rotary_context
from test_kitty_decode_read import reassociation_bound


def reconstructed(cache, backend, monkeypatch):
    """The stored history in float32 through the CPU's gather (the reference's own read, not
    the path under test), then the path under test again."""
    with monkeypatch.context() as m:
        m.setattr(nonuniform, "gpu_backend", lambda: None)
        m.setattr(nonuniform, "_tile", lambda *args: None)  # the general reconstruction
        nonuniform._read_fn.cache_clear()
        k_hat, v_hat = cache.dequantized(mx.float32)
        mx.eval(k_hat, v_hat)
    nonuniform._read_fn.cache_clear()
    return k_hat, v_hat


@pytest.mark.parametrize("backend", [None, "cuda"])
@pytest.mark.parametrize("rope, refit, bits, group", [(False, 4, 3, 32), (True, 0, 2, 32), (True, 8, 4, 32),
                                                     (True, 4, 3, 64), (True, 4, 3, 16)])
def test_forty_decode_steps_match_attention_over_the_reconstructed_history(rope, refit, bits, group, backend,
                                                                           monkeypatch):
    monkeypatch.setattr(nonuniform, "gpu_backend", lambda: backend)
    nonuniform._read_fn.cache_clear()  # traced anew on this path
    t0, steps, d, scale = 170, 40, 64, 0.125
    keys, values = kv(t0 + steps, d=d, seed=41 + bits)
    options = KVQuantOptions(kvquant_bits=bits, kvquant_refit_interval=refit, kvquant_n_sink=3,
                             kvquant_group_size=group)
    cache = KVQuantCache(KVCacheConfig(method="kvquant", options=options), rotary_context() if rope else None, 0)
    cache.update_and_fetch(keys[:, :, :t0], values[:, :, :t0])
    q0 = mx.random.normal((1, 4, t0, d), key=mx.random.key(5))
    cache.attend(q0, keys[:, :, :t0], values[:, :, :t0], scale=scale, mask="causal")
    key_counts, books = set(), set()
    try:
        for i in range(t0, t0 + steps):
            k, v = keys[:, :, i : i + 1], values[:, :, i : i + 1]
            q = mx.random.normal((1, 4, 1, d), key=mx.random.key(200 + i))
            cache.update_and_fetch(k, v)
            out = cache.attend(q, k, v, scale=scale, mask=None)
            key_counts.add(cache.store.keys.count)
            books.add(cache.store.values.books.length)
            k_hat, v_hat = reconstructed(cache, backend, monkeypatch)
            assert k_hat.shape[2] == i + 1
            ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=scale)
            err, bound = float(mx.abs(out - ref).max()), reassociation_bound(q, k_hat, v_hat, scale)
            assert err <= bound, (i, err, bound)
    finally:
        nonuniform._read_fn.cache_clear()
    assert len(key_counts) > 1 and (len(books) > 1) == bool(refit)


def dense_both_ways(run, monkeypatch):
    """A run's reconstruction through the step's views and bit tests, and the general way."""
    nonuniform._read_fn.cache_clear()
    tiled = run.dense()
    with monkeypatch.context() as m:
        m.setattr(nonuniform, "_tile", lambda *args: None)
        nonuniform._read_fn.cache_clear()
        general = run.dense()
        mx.eval(tiled, general)
    nonuniform._read_fn.cache_clear()
    return tiled, general


@pytest.mark.parametrize("backend", [None, "cuda"])
@pytest.mark.parametrize("group, bits, fraction, rope", [
    (32, 3, 0.01, "halves"), (64, 2, 0.05, "pairs"), (16, 4, 0.01, "halves"), (32, 3, 0.0, None),
    (128, 3, 0.02, "pairs"), (8, 3, 0.05, None)])
def test_the_steps_read_reconstructs_what_the_general_read_does_bit_for_bit(group, bits, fraction, rope, backend,
                                                                              monkeypatch):
    """Every layout ``_tile`` takes (groups of whole words, words of whole groups), with and
    without outliers, pre-RoPE keys rotated back both ways, one codebook and several (the
    ids of two rows), through the CPU's gather and through CUDA's selects."""
    monkeypatch.setattr(nonuniform, "gpu_backend", lambda: backend)
    t0, d = 150, 128
    keys, values = kv(t0 + 120, d=d, seed=group + bits)
    keys, values = (mx.concatenate([x, x[:, :, ::-1] * 0.5], axis=0) for x in (keys, values))  # two rows
    context = None
    if rope:
        context = rotary_context()
        context.model_args.rope_traditional = rope == "pairs"
    options = KVQuantOptions(kvquant_bits=bits, kvquant_group_size=group, kvquant_outlier_fraction=fraction,
                             kvquant_refit_interval=8, kvquant_n_sink=2)
    cache = KVQuantCache(KVCacheConfig(method="kvquant", options=options), context, 0)
    cache.update_and_fetch(keys[:, :, :t0], values[:, :, :t0])
    cache.attend(mx.zeros((2, 2, t0, d)), keys[:, :, :t0], values[:, :, :t0], scale=0.1, mask="causal")
    checked = set()
    for i in range(t0, t0 + 120):
        k, v = keys[:, :, i : i + 1], values[:, :, i : i + 1]
        cache.update_and_fetch(k, v)
        cache.attend(mx.zeros((2, 2, 1, d)), k, v, scale=0.1, mask=None)
        store = cache.store
        if i in (t0, t0 + 119) or store.keys.count not in checked:
            checked.add(store.keys.count)
            for run in (store.keys, store.values):
                assert nonuniform._tile(group, *((run.capacity, run.capacity // 32) if run is store.keys else
                                                  (d, run.codes.buffer.shape[-1]))) is not None
                tiled, general = dense_both_ways(run, monkeypatch)
                assert tiled.shape == general.shape
                assert bool(mx.array_equal(tiled, general)), (i, float(mx.abs(tiled - general).max()))
    assert min(store.keys.books.length, store.values.books.length) > 1 and (rope is None or store.keys.rotary is not None)
    assert (store.keys.out_pos.buffer is not None) == bool(fraction)


@pytest.mark.parametrize("backend", [None, "cuda"])
@pytest.mark.parametrize("rope, refit", [(False, 0), (True, 8)])
def test_the_kept_read_passes_give_the_joint_read_bit_for_bit(rope, refit, backend, monkeypatch):
    """``StreamingStore.attend_parts`` (each run's compiled pass and inputs kept between its
    writes, ``NonUniformTokens.read_pass``) against ``_JointRead``'s scores and mix with every
    run read through a pass built anew (``_read`` and ``_read_fn``), over 40 steps with key
    flushes, value flushes and refits among them: equal bit for bit."""
    from veloxquant_mlx.kernels.decode import scaled_queries
    from veloxquant_mlx.methods.kvquant import streaming_store

    monkeypatch.setattr(nonuniform, "gpu_backend", lambda: backend)
    nonuniform._read_fn.cache_clear()

    def fresh(self):  # the read before the kept passes: built at every call
        how, args = self._read()
        return nonuniform._read_fn(how, True), args, self.capacity

    t0, steps, d, scale = 170, 40, 64, 0.125
    keys, values = kv(t0 + steps, d=d, seed=43)
    options = KVQuantOptions(kvquant_bits=3, kvquant_refit_interval=refit, kvquant_n_sink=3, kvquant_group_size=32)
    cache = KVQuantCache(KVCacheConfig(method="kvquant", options=options), rotary_context() if rope else None, 0)
    cache.update_and_fetch(keys[:, :, :t0], values[:, :, :t0])
    cache.attend(mx.random.normal((1, 4, t0, d), key=mx.random.key(5)), keys[:, :, :t0], values[:, :, :t0],
                 scale=scale, mask="causal")
    counts = set()
    try:
        for i in range(t0, t0 + steps):
            k, v = keys[:, :, i : i + 1], values[:, :, i : i + 1]
            q = mx.random.normal((1, 4, 1, d), key=mx.random.key(200 + i))
            cache.update_and_fetch(k, v)
            out = cache.attend(q, k, v, scale=scale, mask=None)
            store = cache.store
            with monkeypatch.context() as m:
                m.setattr(nonuniform.NonUniformTokens, "read_pass", fresh)
                read = streaming_store._JointRead(store, k.shape[1])
                p = mx.softmax(read.scores(scaled_queries(q, k.shape[1], scale)), axis=-1)
                ref = read.mix(p).reshape(q.shape).astype(q.dtype)
            assert mx.array_equal(out, ref).item(), i
            counts.add((store.keys.count, store.values.count, store.keys.books.length))
    finally:
        nonuniform._read_fn.cache_clear()
    assert len({c[0] for c in counts}) > 1 and len({c[1] for c in counts}) > 1
    if refit:
        assert len({c[2] for c in counts}) > 1
