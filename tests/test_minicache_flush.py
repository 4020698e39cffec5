"""minicache's decode rows merged FLUSH at a time: the merged state after each flush (and
after a prompt chunk that finds rows held) is, bit for bit, the state merging each decode
token at its own step leaves (``FLUSH = 1``); rows held are attended exact, saved with their
room, and a restored state holds up to FLUSH - 1 of them."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache as mlx_lm_load
from mlx_lm.models.cache import save_prompt_cache

from conformance import config
from cross_layer_util import kv, layered, reference_attention
from test_conformance import drive
from tiny_models import prompt, tiny_model
from veloxquant_mlx import make_prompt_cache
from veloxquant_mlx.cache.base import CacheStateError
from veloxquant_mlx.cache.buffers import GrowingArray
from veloxquant_mlx.methods.minicache import cache as minicache

T = 100
FLUSH = minicache.FLUSH


def _noisy(x0, i):
    size = mx.sqrt((x0 * x0).mean(axis=-2, keepdims=True))
    return x0 + 1.2 * mx.random.normal(x0.shape, key=mx.random.key(7)) * size


def _apart_after_the_prompt(x0, i):
    """Nothing retained over the prompt, every pair over the decode tokens: reservations
    run out and pairs are dropped."""
    return mx.where(mx.arange(x0.shape[2])[None, None, :, None] < T, x0, -x0)


def _state(caches):
    """What the pair stores for its merged tokens (held rows aside), as host lists."""
    first, second = caches
    out = {name: second.shared[name].view() for name in ("e_k", "e_v")}
    for x in ("k", "v"):
        out[f"m1_{x}"], out[f"m2_{x}"] = getattr(first, f"m_{x}").view(), getattr(second, f"m_{x}").view()
        for name in ("where", "delta", "used", "dropped"):
            kept = getattr(second, f"ret_{x}_{name}")
            out[f"{name}_{x}"] = kept.view() if isinstance(kept, GrowingArray) else kept
    return {k: None if v is None else v.tolist() for k, v in out.items()}


def _step(caches, ks, vs, i, n):
    for layer, c in enumerate(caches):
        k, v = ks[layer][:, :, i:i + n], vs[layer][:, :, i:i + n]
        c.update_and_fetch(k, v)
        q = mx.random.normal((1, 4, n, 32), key=mx.random.key(i + 100 * layer))
        out = c.attend(q, k, v, scale=32 ** -0.5, mask="causal" if n > 1 else None)
    return out


# decode steps, then a prompt chunk of 20 while rows are held (70 = 2 flushes + 6), then more
SCHEDULE = [1] * 70 + [20] + [1] * 40


@pytest.mark.parametrize("related, threshold", [(_noisy, 0.5), (_noisy, 0.0), (_apart_after_the_prompt, 0.5)])
def test_each_flush_leaves_the_state_of_merging_token_by_token_bit_for_bit(monkeypatch, related, threshold):
    ks, vs = kv(T + sum(SCHEDULE), 2, related=related)
    runs = {}
    for flush in (FLUSH, 1):
        monkeypatch.setattr(minicache, "FLUSH", flush)
        runs[flush] = layered("minicache", 2, minicache_start_frac=0.0, minicache_retention_threshold=threshold)
        _step(runs[flush], ks, vs, 0, T)
    batched, per_token = runs[FLUSH], runs[1]
    compared, i = 0, T
    for n in SCHEDULE:
        for flush, caches in runs.items():
            monkeypatch.setattr(minicache, "FLUSH", flush)
            _step(caches, ks, vs, i, n)
        i += n
        if batched[1].held_k.length == 0:  # just flushed (or a prompt chunk merged the rows held)
            assert _state(batched) == _state(per_token), i
            compared += 1
    assert compared == 4  # two flushes, the prompt chunk, one flush after it
    assert batched[1].held_k.length == batched[0].held_k.length == 40 - FLUSH
    assert batched[1].n_merged == per_token[1].n_merged == i
    if related is _apart_after_the_prompt:
        assert batched[1].ret_k_dropped.item() > 0


def test_rows_held_are_attended_exact():
    """With every pair retained the merged history is exact too: a decode step's output is
    exact attention over every token, held rows included."""
    ks, vs = kv(T + 40, 2, related=_noisy)
    caches = layered("minicache", 2, minicache_start_frac=0.0, minicache_retention_threshold=2.0)
    _step(caches, ks, vs, 0, T)
    for i in range(T, T + 40):
        out = _step(caches, ks, vs, i, 1)
        q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(i + 100))
        assert mx.allclose(out, reference_attention(q, ks[1][:, :, :i + 1], vs[1][:, :, :i + 1], 32 ** -0.5),
                           atol=1e-5)
    assert caches[1].held_k.length == 40 - minicache.FLUSH and caches[1].merged_rows == T + minicache.FLUSH


def test_held_rows_are_counted_saved_with_their_room_and_at_most_flush_minus_one(tmp_path):
    model = tiny_model("llama")
    cache = make_prompt_cache(model, config("minicache", {"minicache_start_frac": 0.0,
                                                          "minicache_retention_threshold": 0.0}))
    drive(model, cache, prompt(100 + minicache.FLUSH), decode=minicache.FLUSH - 2)  # FLUSH - 1 decode steps
    assert [c.held_k.length for c in cache] == [minicache.FLUSH - 1] * 2
    assert [c.held_k.capacity for c in cache] == [minicache.FLUSH] * 2
    own = sum(c.held_k.nbytes + c.held_v.nbytes for c in cache)
    assert own == 2 * 2 * minicache.FLUSH * cache[0].kv_shape[1] * cache[0].kv_shape[2] * 4
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache)
    loaded = mlx_lm_load(path)
    assert [c.nbytes for c in loaded] == [c.nbytes for c in cache]
    assert [c.held_k.length for c in loaded] == [minicache.FLUSH - 1] * 2
    arrays, meta = dict(loaded[1].state["arrays"]), dict(loaded[1].state["meta"])
    for name in ("held_k", "held_v"):  # one row more than a flush leaves
        arrays[name] = mx.concatenate([arrays[name], arrays[name][:, :, :1]], axis=2)
    meta["offset"] = str(int(meta["offset"]) + 1)
    with pytest.raises(CacheStateError, match=rf"held exact rows \(keys, values\) is \({minicache.FLUSH}, "
                                              rf"{minicache.FLUSH}\), expected equal, fewer than {minicache.FLUSH}"):
        type(loaded[1]).from_state({"arrays": arrays, "meta": meta})
