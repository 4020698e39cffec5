"""Issue 36: an eviction method's kept tokens held by a quantizer (``storage=KIVIOptions``).

The composed cache must equal the unquantized method's kept tokens, quantized: the same
positions (scores run over the model's own keys at the prompt's end), the same codes as
``quantize_rows`` gives for those keys and values, the same per-token state; its memory is
the kept tokens times the quantized bytes per token, plus the position and the state each
token keeps without storage too.
"""

from __future__ import annotations

import gc
import re
import warnings

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from mlx_lm.sample_utils import make_sampler

import test_conformance
from conformance import COMPOSED, arrays_held, config, split_composed
from feeding import feed, run_prompt, synthetic_kvq
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import H2OOptions, KIVIOptions, SnapKVOptions, StreamingLLMOptions
from veloxquant_mlx.diagnostics import UnreadFieldWarning
from veloxquant_mlx.quant.token_rows import dequantize_rows, quantize_rows
from veloxquant_mlx.registry import METHODS

BUDGET, PROMPT, HEAD_DIM = 40, 150, 64
FLOAT32_EPS = 2.0**-23


def _caches(method: str, group: int = 32):
    """(the eviction method alone, composed with storage) at BUDGET, direct (no model)."""
    base, composed = split_composed(method)
    cls = METHODS[base].load_implementation()
    settings = {cls.roles.budget: BUDGET}
    plain = cls(config(base, settings))
    stored = cls(config(method, {**settings, "storage": {"method": "kivi",
                                                         "options": {"kivi_group_size": group}}}))
    return plain, stored, composed["kv_bits"], group


def _packed(store, p):
    return [store.view(f"{p}_{n}") for n in ("codes", "scales", "biases")]


def _reference(keys, values, group, bits):
    """The kept keys and values as the storage must hold them: each row quantized alone."""
    return {"k": quantize_rows(keys, group, bits), "v": quantize_rows(values, group, bits)}


def _held(cache, k, v, group, bits):
    """What a decode step must attend over: every slot's dequantized row, but the newest
    ``ring_fill`` tokens (the method's recent window) as the model gave them."""
    store = cache.store
    keys, values = (dequantize_rows(*_packed(store, p), group, bits, mx.float32) for p in "kv")
    positions = store.view("positions")
    in_ring = (positions >= cache.offset - store.ring_fill)[..., None]
    index = mx.maximum(positions, 0)[..., None]
    exact_k, exact_v = (mx.take_along_axis(x, index, axis=2) for x in (k, v))
    return mx.where(in_ring, exact_k, keys), mx.where(in_ring, exact_v, values)


def _ring_holds_the_newest_tokens(cache, k, v):
    """Ring row j holds position offset - fill + (j - next) mod fill, as the model gave it."""
    store, n = cache.store, cache.store.ring_fill
    assert n == min(cache.recent, cache.stored_length)
    for j in range(n):
        pos = cache.offset - n + (j - store.ring_next) % n
        assert mx.array_equal(store.k_ring[:, :, j], k[:, :, pos])
        assert mx.array_equal(store.v_ring[:, :, j], v[:, :, pos])


@pytest.mark.parametrize("method", COMPOSED)
@pytest.mark.parametrize("group", [32, 64])
def test_kept_tokens_are_the_unquantized_methods_kept_tokens_quantized(method, group):
    plain, stored, bits, group = _caches(method, group)
    k, v, q = synthetic_kvq(PROMPT + 6, 2, 2, HEAD_DIM)
    out_plain, out_stored = run_prompt(plain, k, v, q, PROMPT), run_prompt(stored, k, v, q, PROMPT)
    # the prompt's end attends in full precision and scores over the model's keys
    assert mx.array_equal(out_plain, out_stored)
    assert mx.array_equal(plain.store.view("positions"), stored.store.view("positions"))
    for name in plain.token_state:
        assert mx.array_equal(plain.store.view(name), stored.store.view(name))
    assert stored.store.quantized and "keys" not in stored.store.arrays
    want = _reference(plain.store.view("keys"), plain.store.view("values"), group, bits)
    for p in "kv":
        for got, expected in zip(_packed(stored.store, p), want[p]):
            assert mx.array_equal(got, expected)
    _ring_holds_the_newest_tokens(stored, k, v)
    if plain.schedule.decode_every:
        return  # later evictions score dequantized keys: the positions may part from here
    # an appending method's decode tokens are quantized one by one, with the same codes
    for t in range(PROMPT, PROMPT + 6):
        feed(plain, k, v, q, t, t + 1)
        feed(stored, k, v, q, t, t + 1)
    want = _reference(plain.store.view("keys"), plain.store.view("values"), group, bits)
    for p in "kv":
        for got, expected in zip(_packed(stored.store, p), want[p]):
            assert mx.array_equal(got, expected)
    _ring_holds_the_newest_tokens(stored, k, v)


@pytest.mark.parametrize("method", COMPOSED)
def test_a_decode_step_attends_over_the_packed_rows_as_over_their_dequantized_values(method):
    _, stored, bits, group = _caches(method)
    k, v, q = synthetic_kvq(PROMPT + 8, 2, 2, HEAD_DIM)
    run_prompt(stored, k, v, q, PROMPT)
    scale = HEAD_DIM**-0.5
    for t in range(PROMPT, PROMPT + 8):
        out = feed(stored, k, v, q, t, t + 1)
        _ring_holds_the_newest_tokens(stored, k, v)
        keys, values = _held(stored, k, v, group, bits)
        want = mx.fast.scaled_dot_product_attention(q[:, :, t : t + 1], keys, values, scale=scale)
        # float32 sums of head_dim products, then of ``rows`` weighted values: each term
        # rounds by at most eps, so the error is below (rows + head_dim) eps max|v|
        rows = keys.shape[2]
        bound = (rows + HEAD_DIM) * FLOAT32_EPS * float(mx.abs(values).max())
        assert float(mx.abs(out - want).max()) <= bound
        assert stored.stored_length <= BUDGET + (t - PROMPT + 1)


@pytest.mark.parametrize("method", COMPOSED)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["float32", "float16"])
def test_memory_is_kept_tokens_times_quantized_bytes_per_token(method, dtype):
    plain, stored, bits, group = _caches(method)
    k, v, q = (x.astype(dtype) for x in synthetic_kvq(PROMPT, 2, 2, HEAD_DIM))
    run_prompt(plain, k, v, q, PROMPT)
    run_prompt(stored, k, v, q, PROMPT)
    kept, heads = stored.stored_length, 2
    assert kept == plain.stored_length == BUDGET
    # a token, per KV head: codes and a scale and minimum per group, for keys and values;
    # its position (int32) and the method's float32 state, as without storage; per KV
    # head, the ring of the method's recent window in full precision
    quantized = 2 * (HEAD_DIM * bits // 8 + 2 * (HEAD_DIM // group) * dtype.size)
    overhead = 4 + 4 * len(stored.token_state)
    ring = stored.recent * 2 * HEAD_DIM * dtype.size
    assert stored.nbytes == kept * heads * (quantized + overhead) + heads * ring
    assert arrays_held(stored) == stored.nbytes  # nothing kept beside what nbytes counts


def _freed_on_delete(method: str, budget: int, n_prompt: int, decode: int) -> tuple[int, int, int]:
    """(bytes freed when the caches are deleted, their nbytes, their layers) after a prompt
    and ``decode`` steps, the state evaluated as mlx-lm evaluates it; with MLX's allocator
    pool off, so that each buffer is counted at its own size (tests/test_conformance.py's
    memory check says why)."""
    model = tiny_model("llama")
    base = split_composed(method)[0]

    def active() -> int:
        gc.collect()
        mx.synchronize()
        mx.clear_cache()
        return mx.get_active_memory()

    active()
    pool = mx.set_cache_limit(0)
    try:
        cache = make_prompt_cache(model, config(method, {METHODS[base].load_implementation().roles.budget: budget}))
        mx.eval(test_conformance.drive(model, cache, prompt(n_prompt + decode), chunk=256, decode=decode))
        mx.eval([c.state for c in cache])
        nbytes, layers = sum(c.nbytes for c in cache), len(cache)
        with_cache = active()
        del cache
        return with_cache - active(), nbytes, layers
    finally:
        mx.set_cache_limit(pool)


@pytest.mark.parametrize("method", COMPOSED)
def test_the_memory_a_composed_cache_holds_is_its_nbytes(method):
    # Once the prompt is packed (nothing pins the prompt's full-precision slots, 4.5x the
    # packed ones here), and after decode steps have grown the slot arrays: exactly what
    # nbytes counts, but for a float32 scalar a layer a method may keep in the model context.
    for decode in (0, 8):
        freed, nbytes, layers = _freed_on_delete(method, 1024, 1100, decode=decode)
        assert abs(freed - nbytes) <= 4 * layers, (decode, freed, nbytes)


@pytest.mark.parametrize("method", COMPOSED)
def test_save_load_continue_gives_the_same_logits(method, tmp_path):
    test_conformance.test_save_load_continue_gives_the_same_logits(method, tmp_path)


def test_a_cache_saved_before_the_prompt_ended_loads_full_precision_and_packs_later(tmp_path):
    model = tiny_model("llama")
    cache = make_prompt_cache(model, config("snapkv+kivi4", {"snap_budget": BUDGET}))
    tokens = prompt(PROMPT + 4)
    model(tokens[: PROMPT - 1][None], cache=cache)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert not loaded[0].store.quantized and loaded[0].config.storage == KIVIOptions()
    for c in (cache, loaded):
        model(tokens[PROMPT - 1 : PROMPT][None], cache=c)
    for c, l in zip(cache, loaded):
        assert l.store.quantized
        for name in ("k_codes", "k_scales", "v_codes", "positions"):
            assert mx.array_equal(c.store.view(name), l.store.view(name))
        assert mx.array_equal(c.store.k_ring, l.store.k_ring)
        assert (c.store.ring_next, c.store.ring_fill) == (l.store.ring_next, l.store.ring_fill)


@pytest.mark.parametrize("method", COMPOSED)
def test_mlx_lm_generate_equals_driving_the_model_step_by_step(method):
    """generate's overlapped loop (async_eval, lazy cache writes) gives the tokens a plain
    greedy loop over the same composed cache gives."""
    from veloxquant_mlx.cli_common import load_model

    model, tokenizer, _ = load_model("reference")
    text = "In the beginning God created the heaven and the earth. " * 6
    ids = tokenizer.encode(text)
    settings = {"snap_budget": 48, "h2o_budget": 48, "tova_budget": 48}
    base = split_composed(method)[0]
    own = {k: v for k, v in settings.items() if k in METHODS[base].fields}
    cache = make_prompt_cache(model, config(method, own))
    out = mlx_lm.generate(model, tokenizer, ids, max_tokens=12, sampler=make_sampler(0.0),
                          prompt_cache=cache)
    assert all(c.store.quantized and c.stored_length <= 48 + 12 for c in cache)
    manual = make_prompt_cache(model, config(method, own))
    ids = mx.array(ids)
    model(ids[None, :-1], cache=manual)  # generate sends the prompt's last token alone
    logits = model(ids[None, -1:], cache=manual)[:, -1]
    generated = []
    for _ in range(12):
        token = mx.argmax(logits, axis=-1)
        generated.append(int(token.item()))
        logits = model(token[None], cache=manual)[:, -1]
    assert out == tokenizer.decode(generated)


# -- the config -------------------------------------------------------------------------------
def test_config_round_trips_and_kv_bits_is_read_with_a_storage():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnreadFieldWarning)
        c = KVCacheConfig(method="snapkv", options=SnapKVOptions(snap_budget=64),
                          storage=KIVIOptions(kivi_group_size=64), kv_bits=4)
    d = c.to_dict()
    assert d["storage"] == {"method": "kivi", "options": {"kivi_group_size": 64}}
    assert KVCacheConfig.from_dict(d) == c
    assert "storage" not in KVCacheConfig(method="snapkv").to_dict()  # as before issue 36
    with pytest.warns(UnreadFieldWarning, match="kv_bits=4"):
        KVCacheConfig(method="snapkv", kv_bits=4)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(method="kivi", storage=KIVIOptions()), ValueError,
     ("method='kivi'", "quantization method", "allowed methods: snapkv")),
    (dict(method="snapkv", storage=H2OOptions()), TypeError,
     ("storage=H2OOptions(", "allowed are None or KIVIOptions")),
    (dict(method="h2o", storage="kivi"), TypeError, ("storage='kivi'", "KIVIOptions")),
    (dict(method="snapkv", storage=KIVIOptions(), residual_window=64), ValueError,
     ("residual_window=64", "protects as recent", "left at 128")),
])
def test_combinations_that_cannot_work_are_refused_naming_field_value_and_allowed(kwargs, error, words):
    with pytest.raises(error) as info:
        KVCacheConfig(**kwargs)
    for w in words:
        assert w in str(info.value)


def test_assignment_after_construction_is_checked_and_a_refusal_changes_nothing():
    c = KVCacheConfig(method="h2o", storage=KIVIOptions(), kv_bits=4)
    with pytest.raises(ValueError, match="residual_window=64"):
        c.residual_window = 64
    with pytest.raises(ValueError, match="method='kivi'"):
        c.method = "kivi"
    assert (c.method, c.residual_window, c.storage) == ("h2o", 128, KIVIOptions())
    with pytest.warns(UnreadFieldWarning, match="kv_bits=4 has no effect: h2o does not read"):
        c.storage = None  # kv_bits was the storage's
    assert c.to_dict() == {**KVCacheConfig(method="h2o").to_dict(), "kv_bits": 4}


def test_an_eviction_method_with_buffers_of_its_own_refuses_a_storage_at_construction():
    model = tiny_model("llama")
    c = KVCacheConfig(method="streaming_llm", options=StreamingLLMOptions(), storage=KIVIOptions())
    with pytest.raises(ValueError, match="storage=KIVIOptions.*streaming_llm.*scorer base"):
        make_prompt_cache(model, c)


def test_a_group_that_does_not_divide_head_dim_is_refused_naming_the_divisors():
    from veloxquant_mlx.cache.config import head_dim_problem

    c = KVCacheConfig(method="snapkv", storage=KIVIOptions(kivi_group_size=64), kv_bits=4)
    assert head_dim_problem(c, 32) == "storage kivi_group_size=64 must divide head_dim=32"
    cache = METHODS["snapkv"].load_implementation()(c)
    k, v, q = synthetic_kvq(8, 2, 2, 32)
    with pytest.raises(ValueError, match=r"kivi_group_size=64 must divide head_dim=32.*allowed here: \[1, 2, 4, 8, 16, 32\]"):
        run_prompt(cache, k, v, q, 8)


def test_a_composed_cache_does_not_batch():
    model = tiny_model("llama")
    cache = make_prompt_cache(model, config("snapkv+kivi4", {"snap_budget": BUDGET}))
    assert not hasattr(cache[0], "merge")
    with pytest.raises(AttributeError, match="with a storage does not batch"):
        cache[0].merge
    message = test_conformance._refusal_checked(model, [cache, make_prompt_cache(model, cache[0].config)],
                                                "method 'snapkv'")
    assert "it is a composed cache (storage=KIVIOptions(...) under an eviction method)" in message
    assert "not opted in" not in message


# -- the bench ----------------------------------------------------------------------------------
def test_bench_methods_select_composed_rows_with_the_storage_in_their_config():
    from veloxquant_mlx.bench.cli import method_runs, report_config, select_methods

    chosen = select_methods("snapkv+kivi4,H2O+kivi2,tova")
    assert chosen == ["snapkv+kivi4", "h2o+kivi2", "tova"]
    runs = method_runs(chosen, ["snap_budget=256"], sweep=False)
    assert [(r.label, r.method) for r in runs] == [
        ("full", "full"), ("snapkv+kivi4 snap_budget=256", "snapkv+kivi4"),
        ("h2o+kivi2", "h2o+kivi2"), ("tova", "tova")]
    snap = runs[1].config
    assert (snap.method, snap.snap_budget, snap.kv_bits, snap.storage) == ("snapkv", 256, 4, KIVIOptions())
    assert report_config(snap)["storage"] == {"method": "kivi", "options": {"kivi_group_size": 32}}
    assert runs[1].settings["kv_bits"] == 4 and "kv_bits" not in runs[3].settings
    assert runs[3].config.storage is None


@pytest.mark.parametrize("spec, words", [
    ("kivi+kivi4", "kivi is a quantization method"),
    ("snapkv+kivi3", "allowed bits: 2, 4, 8"),
    ("snapkv+gear4", "the storage after '+' is kivi<bits>"),
])
def test_bench_refuses_a_composition_that_cannot_work(spec, words):
    from veloxquant_mlx.bench.cli import BenchError, select_methods

    with pytest.raises(BenchError, match=re.escape(words)):
        select_methods(spec)


def test_a_saved_composed_cache_of_another_bit_width_is_refused_naming_the_array(tmp_path):
    from conformance import edit_saved_layer
    from veloxquant_mlx.cache.base import CacheStateError

    model = tiny_model("llama")
    cache = make_prompt_cache(model, config("snapkv+kivi4", {"snap_budget": BUDGET}))
    test_conformance.drive(model, cache, prompt(PROMPT + 4), decode=4)
    path = tmp_path / "cache.safetensors"
    save_prompt_cache(str(path), cache)
    # 2-bit codes (half the words) under a config that says 4 bits
    edit_saved_layer(path, 1, lambda meta, arrays: arrays.update(k_codes=arrays["k_codes"][..., :2]))
    with pytest.raises(CacheStateError, match=r"layer 1 .*k_codes width is \(2,\), expected \(4,\) for head_dim 32 at kv_bits=4"):
        load_prompt_cache(str(path))


@pytest.mark.parametrize("method", COMPOSED)
def test_trim_is_exact_or_refused(method):
    test_conformance.test_trim_is_exact_or_refused(method)


@pytest.mark.parametrize("method", COMPOSED)
def test_deep_copy_is_independent(method):
    test_conformance.test_deep_copy_is_independent(method)


@pytest.mark.parametrize("method", COMPOSED)
@pytest.mark.parametrize("setting", ["compressing", "lossless"])
def test_what_the_server_does_copy_trim_and_reuse_as_a_prefix(method, setting):
    test_conformance.test_what_the_server_does_copy_trim_and_reuse_as_a_prefix(method, setting)


def test_trim_is_refused_once_a_token_is_held_only_quantized():
    """A reused prefix must equal a fresh cache's, which holds its prompt exactly: trim works
    while every token is also in the full-precision ring (snapkv's recent window, 32)."""
    k, v, q = synthetic_kvq(60, 2, 2, HEAD_DIM)
    for n, trimmable in ((20, True), (33, False)):
        _, stored, _, _ = _caches("snapkv+kivi4")
        run_prompt(stored, k, v, q, n)  # below the budget: nothing evicted
        assert stored.store.quantized and stored.store.ring_fill == min(n, 32)
        assert stored.is_trimmable() is trimmable
        assert stored.trim(3) == (3 if trimmable else 0)
