"""KVQuant's decode read (issue 30): over 40 decode steps (key flushes, value flushes and
refits among them) a step's attention, through the CPU's gather and through CUDA's chain of
selects (its table's entries taken by one split), is what attention over the reconstructed
history gives, to float32 reassociation."""

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
    monkeypatch.setattr(nonuniform, "gpu_backend", lambda: None)
    nonuniform._read_fn.cache_clear()
    k_hat, v_hat = cache.dequantized(mx.float32)
    mx.eval(k_hat, v_hat)
    monkeypatch.setattr(nonuniform, "gpu_backend", lambda: backend)
    nonuniform._read_fn.cache_clear()
    return k_hat, v_hat


@pytest.mark.parametrize("backend", [None, "cuda"])
@pytest.mark.parametrize("rope, refit, bits", [(False, 4, 3), (True, 0, 2), (True, 8, 4)])
def test_forty_decode_steps_match_attention_over_the_reconstructed_history(rope, refit, bits, backend,
                                                                           monkeypatch):
    monkeypatch.setattr(nonuniform, "gpu_backend", lambda: backend)
    nonuniform._read_fn.cache_clear()  # traced anew on this path
    t0, steps, d, scale = 170, 40, 64, 0.125
    keys, values = kv(t0 + steps, d=d, seed=41 + bits)
    options = KVQuantOptions(kvquant_bits=bits, kvquant_refit_interval=refit, kvquant_n_sink=3)
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
