"""The codebook store's window flushes VALUE_ROOM tokens at a time: decode steps leave their
tokens exact until the window holds ``window + VALUE_ROOM``, then the oldest VALUE_ROOM are
coded in one pass each for keys and values. The codes are those of the tokens coded one a
step, bit for bit; the window holds ``window`` to ``window + 31`` tokens, saved and restored
as such."""

import mlx.core as mx
import pytest

from batching import run_rows
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import VecInferOptions
from veloxquant_mlx.methods.vecinfer import VecInferCache
from veloxquant_mlx.quant import vq, vq_store
from veloxquant_mlx.quant.store import VALUE_ROOM
from veloxquant_mlx.quant.vq_store import CodebookFit

WINDOW = 24


def vecinfer():
    options = VecInferOptions(residual_length=WINDOW, key_codebook_bits=6, value_codebook_bits=4)
    return VecInferCache(KVCacheConfig(method="vecinfer", options=options), None, 0)


def kvq(t, rows=1, h=2, d=128):
    k = mx.random.normal((rows, h, t, d), key=mx.random.key(0)) * mx.where(mx.arange(d) % 37 == 0, 12.0, 1.0)
    v = mx.random.normal((rows, h, t, d), key=mx.random.key(1))
    q = mx.random.normal((rows, 2 * h, t, d), key=mx.random.key(2))
    return k.astype(mx.float16), v.astype(mx.float16), q.astype(mx.float16)


def codes_at_each_flush(k, v, q, prompt, codecs=None):
    """Run a cache over the prompt (chunks of 64), then a token a step; after each step that
    is a multiple of VALUE_ROOM, the (count, key codes, value codes, window rows held)."""
    cache = vecinfer()
    if codecs:
        cache.store.install(*codecs, "calibration")
    run_rows(cache, k[:, :, :prompt], v[:, :, :prompt], q[:, :, :prompt], prompt)
    seen = []
    for i in range(prompt, k.shape[2]):
        run_rows(cache, k[:, :, i : i + 1], v[:, :, i : i + 1], q[:, :, i : i + 1], 0)
        s = cache.store
        assert min(i + 1, WINDOW) <= s.k_win.held < WINDOW + VALUE_ROOM
        if (i + 1 - prompt) % VALUE_ROOM == 0:
            seen.append((s.count, s.k_codes.view(), s.v_codes.view(), s.k_win.held))
    return cache, seen


@pytest.mark.parametrize("prompt, calibrated, blocks", [(200, False, False), (10, False, False),
                                                       (100, True, False), (200, False, True)],
                         ids=["fit-at-prefill", "fit-while-decoding", "calibrated", "in-blocks"])
def test_codes_flushed_32_at_a_time_are_those_coded_one_a_step(monkeypatch, prompt, calibrated, blocks):
    steps = 4 * VALUE_ROOM
    k, v, q = kvq(prompt + steps, rows=2)
    codecs = CodebookFit(4, 6, 8, 4, iters=4, sample=8, seed=0).fit(k, v) if calibrated else None
    passes, encode = [], vq_store._encode_step_fn
    with monkeypatch.context() as m:
        m.setattr(vq_store, "_encode_step_fn",
                  lambda *a: (lambda x, *rest: passes.append(x.shape[2]) or encode(*a)(x, *rest)))
        if blocks:  # the keys' distances of 5 tokens a pass (2 rows x 2 heads x 32 sub-spaces x 64)
            m.setattr(vq, "NEAREST_CHUNK", 5 * 2 * 2 * 32 * 64)
        cache, flushed = codes_at_each_flush(k, v, q, prompt, codecs)
    assert set(passes[:8]) == ({5, 2, 32} if blocks else {32}), passes[:8]
    with monkeypatch.context() as m:
        m.setattr(vq_store, "VALUE_ROOM", 1)  # the window holds `window` tokens: one coded a step
        _, one_a_step = codes_at_each_flush(k, v, q, prompt, codecs)
    for (count, k_codes, v_codes, held), (count_1, k_1, v_1, held_1) in zip(flushed, one_a_step):
        assert held_1 == WINDOW and count_1 == count + held - WINDOW
        assert held < WINDOW + VALUE_ROOM
        assert mx.array_equal(k_codes, k_1[:, :, :count]) and mx.array_equal(v_codes, v_1[:, :, :count])
    # and the codes are each token's own: ProductVQ.encode of the token alone
    s = cache.store
    for t in (0, s.count // 2, s.count - 1):
        one = s.key_codec.encode(k[:, :, t : t + 1]), s.value_codec.encode(v[:, :, t : t + 1])
        assert mx.array_equal(s.k_codes.view()[:, :, t : t + 1], one[0])
        assert mx.array_equal(s.v_codes.view()[:, :, t : t + 1], one[1])


def test_steps_between_flushes_write_their_row_only_and_a_flush_codes_32_in_one_pass(monkeypatch):
    k, v, q = kvq(200 + 2 * VALUE_ROOM)
    cache = vecinfer()
    run_rows(cache, k[:, :, :200], v[:, :, :200], q[:, :, :200], 200)
    passes, encode = [], vq_store._encode_step_fn
    monkeypatch.setattr(vq_store, "_encode_step_fn",
                        lambda *a: (lambda x, *rest: passes.append(x.shape[2]) or encode(*a)(x, *rest)))
    counts = []
    for i in range(200, 200 + 2 * VALUE_ROOM - 1):
        run_rows(cache, k[:, :, i : i + 1], v[:, :, i : i + 1], q[:, :, i : i + 1], 0)
        counts.append(cache.store.count)
    assert counts == [176] * (VALUE_ROOM - 1) + [176 + VALUE_ROOM] * VALUE_ROOM
    assert passes == [VALUE_ROOM, VALUE_ROOM]  # keys, then values: one pass each, once
    assert cache.store.k_win.held == WINDOW + VALUE_ROOM - 1 and cache.store.k_win.start == 0


def test_a_window_saved_between_flushes_reloads_and_goes_on_bit_for_bit():
    k, v, q = kvq(200 + 60)
    cache = vecinfer()
    run_rows(cache, k[:, :, :210], v[:, :, :210], q[:, :, :210], 200)
    assert cache.store.k_win.held == WINDOW + 10
    restored = VecInferCache.from_state(cache.state)
    assert not list(restored.store.problems(restored.offset))
    assert restored.nbytes == cache.nbytes
    outs = [mx.concatenate(run_rows(c, k[:, :, 210:], v[:, :, 210:], q[:, :, 210:], 0), axis=2)
            for c in (cache, restored)]
    assert mx.array_equal(outs[0], outs[1])
    a, b = cache.state["arrays"], restored.state["arrays"]
    assert all(mx.array_equal(a[n], b[n]) for n in a if a[n] is not None)


def test_a_restored_window_outside_window_to_window_plus_31_is_a_problem():
    k, v, q = kvq(240)
    cache = vecinfer()
    run_rows(cache, k[:, :, :230], v[:, :, :230], q[:, :, :230], 200)
    s = cache.store
    assert not list(s.problems(230))
    s.k_win.truncate(WINDOW - 1), s.v_win.truncate(WINDOW - 1)  # fewer than the window
    assert [p[0] for p in s.problems(s.count + WINDOW - 1)] == ["full-precision tokens"]
    s.k_win.reset(k[:, :, :WINDOW + VALUE_ROOM]), s.v_win.reset(v[:, :, :WINDOW + VALUE_ROOM])  # a flush due
    assert [p[0] for p in s.problems(s.count + WINDOW + VALUE_ROOM)] == ["full-precision tokens"]
