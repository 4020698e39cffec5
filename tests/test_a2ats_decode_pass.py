"""A2ATS's retrieving decode step is one compiled pass over the buffers' room (static shapes,
rows past those kept masked): it attends as the selection ``RetrievalStore.selected`` makes
(top-k per query head, ties at the k-th score to the latest; their union) gathered row by
row, step after step, through buffer growths, coding blocks and k's changes, with scores
tied to the bit (keys drawn from three vectors, two-bit codes)."""

import mlx.core as mx

from test_a2ats import BASE, a2ats, feed, rope


def _by_selection(store, q, scale, position):
    """The attention over sinks, ``selected``'s union (repeats masked) and the window."""
    idx, repeat = store.selected(q, position)
    t, first, stop = store.length, store.n_sink, store.codes.length
    k_all, v_all = store.rows(t)
    pick = lambda x: mx.take_along_axis(x, idx[..., None], axis=2)  # noqa: E731
    keys = mx.concatenate([k_all[:, :, :first], pick(k_all), k_all[:, :, stop:]], axis=2)
    values = mx.concatenate([v_all[:, :, :first], pick(v_all), v_all[:, :, stop:]], axis=2)
    b, h, _ = repeat.shape
    keep = mx.concatenate([mx.ones((b, h, first), mx.bool_), ~repeat, mx.ones((b, h, t - stop), mx.bool_)], axis=-1)
    mask = mx.repeat(keep, q.shape[1] // h, axis=1)[:, :, None, :]
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


def test_the_compiled_step_attends_as_the_selection_gathered_row_by_row():
    h, d, prompt, steps = 2, 64, 60, 90
    base = mx.random.normal((3, d), key=mx.random.key(11))
    which = mx.random.randint(0, 3, (1, h, prompt + steps), key=mx.random.key(12))
    keys = rope(base[which], 0)  # three pre-RoPE keys: their codes, and scores, tie
    values = mx.random.normal((1, h, prompt + steps, d), key=mx.random.key(13))
    cache = a2ats(a2ats_retrieval_fraction=0.1, a2ats_window=8, a2ats_codebook_bits=2, a2ats_rope_base=BASE)
    feed(cache, keys[:, :, :prompt], values[:, :, :prompt], prompt)
    rooms = set()
    for i in range(prompt, prompt + steps):
        k, v = keys[:, :, i : i + 1], values[:, :, i : i + 1]
        q = rope(mx.random.normal((1, 2 * h, 1, d), key=mx.random.key(100 + i)), i)
        cache.update_and_fetch(k, v)
        out = cache.attend(q, k, v, scale=d**-0.5, mask=None)
        ref = _by_selection(cache.store, q, d**-0.5, i)
        assert mx.allclose(out, ref, atol=1e-5, rtol=1e-5), (i, float(mx.abs(out - ref).max()))
        rooms.add(cache.store.keys.capacity)
    assert len(rooms) > 1  # the buffers grew on the way
