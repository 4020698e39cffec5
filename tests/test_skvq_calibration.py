"""skvq with a calibration file: the paper's offline channel orders and clip ratios instead
of a fit on the prompt. A calibrated cache takes the file's orders and ratios before its
first token (the sinks reordered too) and sorts no channel and searches no ratio; a file
calibrated on the prompt's own tokens gives what the prompt fit gives, bit for bit; rows
of a batch are each as alone, stacked sequences too; a saved cache continues token for
token; a file for another method, setting, model, shape or rotary pairing is refused,
naming the file, the field and both values; `veloxquant calibrate --method skvq` writes
the store's own fit on a text's rows past the sinks."""

import dataclasses
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import batching
from conformance import profile
from feeding import feed
from test_calibrate import cli, fitted_and_read_on_the_prompt, write_file, reference, text_file  # noqa: F401 - module fixtures reused
from test_methods_exactness import run
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.calibration import CalibrationError, collect_kv, read_calibration, write_calibration
from veloxquant_mlx.cache.options import SKVQOptions
from veloxquant_mlx.methods.skvq import SKVQCache
from veloxquant_mlx.methods.skvq import sliding_store
from veloxquant_mlx.methods.skvq.clip import quantize_clipped, search_clip
from veloxquant_mlx.methods.skvq.reorder import RangeOrder, inverse, permute
from veloxquant_mlx.reference import REFERENCE_MODEL

TOKENS = 400
N_SINK = 5
PROMPT = (REFERENCE_MODEL / "heldout_kjv_acts.txt").read_text()[:300]  # not the calibration text
FITTED = ("perm_k", "perm_v", "inv_v", "alpha_k", "alpha_v")  # what the store's fit gives


def config(path=None, **options):
    return KVCacheConfig(method="skvq", options=SKVQOptions(**options), calibration_file=path)


def calibrate(folder, name, *args):
    return write_file(folder, name, "--method", "skvq", *args)[0]


@pytest.fixture(scope="module")
def made(tmp_path_factory, text_file):  # noqa: F811
    return calibrate(tmp_path_factory.mktemp("skvq"), "skvq-ref", "--text", str(text_file), "--tokens", str(TOKENS))


def no_fit(*args, **kwargs):
    raise AssertionError("a calibrated skvq cache fitted an order or a clip ratio")


def store_arrays(cache):
    s = cache.store
    return [getattr(s, name) for name in FITTED]


def test_the_file_is_the_stores_fit_on_the_texts_rows_past_the_sinks(made, reference, text_file):  # noqa: F811
    model, tokenizer = reference
    arrays, meta = read_calibration(made)
    assert meta["method"] == "skvq" and meta["layers"] == [0, 1, 2, 3] and meta["tokens"] == TOKENS
    assert [meta[f] for f in SKVQCache.calibration_fields] == [N_SINK, True, True, 32, 2, 2]
    assert meta["key_pairs"] == "half"
    kv = collect_kv(model, mx.array(tokenizer.encode(text_file.read_text())[:TOKENS]))
    for i, (keys, values) in kv.items():
        rows_k, rows_v = keys[:, :, N_SINK:], values[:, :, N_SINK:]
        perm_k, perm_v = RangeOrder("half").fit(rows_k), RangeOrder().fit(rows_v)
        want = {"perm_k": perm_k, "perm_v": perm_v, "alpha_k": search_clip(permute(rows_k, perm_k), 32, 2),
                "alpha_v": search_clip(permute(rows_v, perm_v), 32, 2)}
        assert sorted(n for n in arrays if n.startswith(f"layer{i}.")) == sorted(f"layer{i}.{n}" for n in want)
        for name, x in want.items():
            assert arrays[f"layer{i}.{name}"].dtype == x.dtype and mx.array_equal(arrays[f"layer{i}.{name}"], x)


def test_every_layer_takes_the_files_arrays_before_its_first_token_and_fits_nothing(made, reference, monkeypatch):
    model, tokenizer = reference
    arrays, _ = read_calibration(made)
    kv = collect_kv(model, mx.array(tokenizer.encode(PROMPT)))
    caches = make_prompt_cache(model, config(made))
    short = make_prompt_cache(model, config(made, skvq_window=16))  # a prompt within sinks + window
    monkeypatch.setattr(RangeOrder, "fit", no_fit)
    monkeypatch.setattr(sliding_store, "search_clip", no_fit)
    for i, (keys, values) in kv.items():
        q = mx.random.normal((1, 8, keys.shape[2], 128), key=mx.random.key(i))
        t = keys.shape[2] - 40
        feed(caches[i], keys, values, q, 0, t)
        for s in range(t, keys.shape[2]):  # decode steps past a flush
            feed(caches[i], keys, values, q, s, s + 1)
        c = short[i]
        feed(c, keys, values, q, 0, 12)
        assert c.store.fitted and c.n_quantized == 0  # in place before anything is quantized
        for s in range(12, 70):
            feed(c, keys, values, q, s, s + 1)
        assert c.n_quantized == 32 and not list(c.store.problems(c.offset))  # flushed as a fitted store
        file = {n: arrays[f"layer{i}.{n}"] for n in ("perm_k", "perm_v", "alpha_k", "alpha_v")}
        for c in (caches[i], short[i]):
            s = c.store
            assert all(mx.array_equal(getattr(s, n), x) for n, x in file.items())
            assert mx.array_equal(s.inv_v, inverse(file["perm_v"]))
            # the sinks are kept in the order, and the packed rows are the file's clipped codes
            assert mx.array_equal(s.sink_k.view(), permute(keys[:, :, :N_SINK], file["perm_k"]))
            assert mx.array_equal(s.sink_v.view(), permute(values[:, :, :N_SINK], file["perm_v"]))
            rows = slice(N_SINK, N_SINK + c.n_quantized)
            for packed, x, suffix in ((s.keys, keys, "k"), (s.values, values, "v")):
                want = quantize_clipped(permute(x[:, :, rows], file[f"perm_{suffix}"]), file[f"alpha_{suffix}"], 32, 2)
                for got, w in zip((packed.codes.view(), packed.scales.view(), packed.biases.view()), want):
                    assert mx.array_equal(got, w)
        k_hat, v_hat = caches[i].dequantized(mx.float32)
        assert mx.array_equal(k_hat[:, :, :N_SINK], keys[:, :, :N_SINK])  # given back in the model's order
        assert mx.array_equal(v_hat[:, :, -100:], values[:, :, -100:])


@pytest.mark.parametrize("settings", [{}, {"skvq_reorder": False},
                                      {"skvq_clip_search": False, "skvq_clip_alpha": 0.95}],
                         ids=["defaults", "ratios-only", "orders-only"])
def test_a_file_calibrated_on_the_prompt_gives_what_the_prompt_fit_gives(settings, reference, tmp_path):
    """Exactly: a one-chunk prompt is fitted on its rows past the sinks, the very rows the
    command fits (the same keys: mlx-lm's cache and this one attend the first chunk alike),
    by the same function; the file keeps the uint32 orders and float32 ratios as they are."""
    fitted, read, _ = fitted_and_read_on_the_prompt(reference, tmp_path, "skvq", PROMPT, config,
                                                    *(f"--set={k}={v}" for k, v in settings.items()),
                                                    decode=40, **settings)
    for f, r in zip(fitted, read):
        assert f.n_quantized == r.n_quantized > 0 and f.nbytes == r.nbytes
        for name, x, y in zip(FITTED, store_arrays(f), store_arrays(r)):
            assert (x is None) == (y is None) == (not settings.get("skvq_reorder", True) and name[0] != "a")
            assert x is None or mx.array_equal(x, y)
        for x, y in zip(f.dequantized(mx.float32), r.dequantized(mx.float32)):
            assert mx.array_equal(x, y)


def test_rows_of_a_batch_are_each_as_alone(made, reference):
    model, tokenizer = reference
    kv = collect_kv(model, mx.array(tokenizer.encode(PROMPT + PROMPT[::-1])))
    keys, values = kv[1]
    n = keys.shape[2] // 2
    k = mx.concatenate([keys[:, :, :n], keys[:, :, n : 2 * n]], axis=0)
    v = mx.concatenate([values[:, :, :n], values[:, :, n : 2 * n]], axis=0)
    q = mx.random.normal((2, 8, n, 128), key=mx.random.key(1))
    t = n - 40

    def steps(cache, k, v, q):
        return [feed(cache, k, v, q, 0, t)] + [feed(cache, k, v, q, s, s + 1) for s in range(t, n)]

    batch = SKVQCache(config(made), None, 1)
    out = steps(batch, k, v, q)
    assert batch.store.perm_k.shape[0] == batch.store.alpha_v.shape[0] == 2
    for b in range(2):
        alone = SKVQCache(config(made), None, 1)
        single = steps(alone, k[b : b + 1], v[b : b + 1], q[b : b + 1])
        for x, y in zip(out, single):
            assert mx.array_equal(x[b : b + 1], y)
        for x, y in zip(batch.dequantized(mx.float32), alone.dequantized(mx.float32)):
            assert mx.array_equal(x[b : b + 1], y)


@pytest.mark.parametrize("n_prompt", [30, 200])  # 30: nothing quantized yet when saved
def test_a_saved_calibrated_cache_continues_token_for_token(n_prompt, made, reference, tmp_path):
    model, tokenizer = reference
    tokens = mx.array(tokenizer.encode(PROMPT))
    head, tail = tokens[:n_prompt], tokens[n_prompt : n_prompt + 70]
    cache = make_prompt_cache(model, config(made, skvq_window=32))
    model(head[None], cache=cache)
    assert (cache[0].n_quantized > 0) == (n_prompt > 37) and cache[0].store.fitted
    path = str(tmp_path / "saved.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    for t in tail:
        a = model(t.reshape(1, 1), cache=cache)[:, -1]
        b = model(t.reshape(1, 1), cache=loaded)[:, -1]
        assert mx.array_equal(a, b)
    assert all(c.n_quantized > 0 for c in loaded)
    assert all(mx.array_equal(x, y) for c, d in zip(cache, loaded) for x, y in zip(store_arrays(c), store_arrays(d)))


def test_a_file_for_another_method_setting_model_shape_or_rotary_is_refused_naming_both_values(
        made, reference, tmp_path):
    model, _ = reference
    arrays, meta = read_calibration(made)
    layers = {i: {n: arrays[f"layer{i}.{n}"] for n in ("perm_k", "perm_v", "alpha_k", "alpha_v")} for i in range(4)}
    kvtc = str(tmp_path / "kvtc.safetensors")
    write_calibration(kvtc, layers, {**{k: v for k, v in meta.items() if k not in ("format", "version", "layers")},
                                     "method": "kvtc"})
    tiny = tiny_model("llama")  # 2 layers, 2 KV heads of 32
    narrow = mx.zeros((1, 2, 8, 64))
    traditional = SimpleNamespace(model_args=dataclasses.replace(model.args, rope_traditional=True))
    refusals = [
        (lambda: make_prompt_cache(model, config(kvtc)), kvtc,
         "method is 'kvtc' in the file .*, but 'skvq' in the config"),
        (lambda: make_prompt_cache(tiny, config(made)), made,
         r"num_hidden_layers is 4 in the file \(made for .*\), but 2 in the model"),
        (lambda: SKVQCache(config(made), None, 0).update_and_fetch(narrow, narrow), made,
         "head_dim is 128 in the file .*, but 64 in the keys of layer 0"),
        (lambda: SKVQCache(config(made), traditional, 0), made,
         "key_pairs is 'half' in the file .*, but 'adjacent' in the cache of layer 0"),
    ]
    for field, value in (("skvq_n_sink", 4), ("skvq_reorder", False), ("skvq_clip_search", False),
                         ("skvq_group_size", 64), ("skvq_bits_key", 4), ("skvq_bits_value", 3)):
        was = meta[field]
        refusals.append((lambda f=field, v=value: make_prompt_cache(model, config(made, **{f: v})), made,
                         f"{field} is {was} in the file .*, but {value} in the config"))
    for build, path, message in refusals:
        with pytest.raises(CalibrationError, match=message) as refused:
            build()
        assert f"calibration_file={path!r}" in str(refused.value)
    # the window is no calibration field: the fit reads every row past the sinks
    make_prompt_cache(model, config(made, skvq_window=7, skvq_max_ctx=4096))


def test_a_file_without_the_search_holds_the_orders_alone_and_serves_any_width(
        reference, tmp_path, text_file):  # noqa: F811
    model, tokenizer = reference
    path = calibrate(tmp_path, "orders", "--text", str(text_file), "--tokens", "200",
                     "--set", "skvq_clip_search=False")
    arrays, _ = read_calibration(path)
    assert sorted(arrays) == sorted(f"layer{i}.{n}" for i in range(4) for n in ("perm_k", "perm_v"))
    cache = make_prompt_cache(model, config(path, skvq_clip_search=False, skvq_clip_alpha=0.9, skvq_bits_key=4,
                                            skvq_group_size=64))
    model(mx.array(tokenizer.encode(PROMPT))[None], cache=cache)
    assert mx.array_equal(cache[2].store.perm_k, arrays["layer2.perm_k"])
    assert mx.all(cache[2].store.alpha_k == 0.9) and cache[2].store.alpha_k.shape == (1, 2)
    with pytest.raises(CalibrationError, match="skvq_clip_search is False in the file .*, but True in the config"):
        make_prompt_cache(model, config(path))
    out = tmp_path / "nothing.safetensors"
    code, _, stderr = cli("calibrate", "--model", str(REFERENCE_MODEL), "--method", "skvq", "--out", str(out),
                          "--text", str(text_file), "--tokens", "64", "--set", "skvq_clip_search=False",
                          "--set", "skvq_reorder=False")
    assert code != 0 and not out.exists() and "nothing is fitted, so nothing to calibrate" in stderr


def test_the_cli_file_serves_generation(made, reference):
    """``veloxquant calibrate --method skvq``'s file through mlx-lm-style generation: every
    layer quantizes with the file's arrays, and a run is repeatable."""
    model, tokenizer = reference
    arrays, _ = read_calibration(made)
    tokens = mx.array(tokenizer.encode(PROMPT))
    outs = []
    for _ in range(2):
        cache = make_prompt_cache(model, config(made))
        outs.append(run(model, cache, tokens, chunk=64, decode=8))
        for i, c in enumerate(cache):
            assert c.n_quantized > 0 and not list(c.store.problems(c.offset))
            assert mx.array_equal(c.store.alpha_k, arrays[f"layer{i}.alpha_k"])
    assert mx.array_equal(outs[0], outs[1])
    greedy = mx.argmax(outs[0], axis=-1)
    plain = mx.argmax(run(model, make_prompt_cache(model, config()), tokens, chunk=64, decode=8), axis=-1)
    assert (greedy == plain).mean().item() > 0.5  # another text's orders: close to the prompt's own


@pytest.fixture(scope="module")
def rowwise_calibration(tmp_path_factory):
    """A file for the row-wise model at the conformance profile's settings, on a text of its own."""
    settings = profile("skvq").compressing
    path = batching.rowwise_calibration(tmp_path_factory.mktemp("skvq"), "skvq", settings)
    return {**settings, "calibration_file": path}


def test_calibrated_sequences_stack_and_each_gets_what_it_gets_alone(rowwise_calibration, monkeypatch):
    """Through mlx-lm's BatchGenerator: sequences share the file's arrays, two of one length
    decode as one group, each equal to itself alone; nothing is fitted on the way."""
    monkeypatch.setattr(RangeOrder, "fit", no_fit)
    monkeypatch.setattr(sliding_store, "search_clip", no_fit)
    model, make = batching.rowwise_setup("skvq", rowwise_calibration)
    prompts = [prompt(n, seed=i + 3).tolist() for i, n in enumerate((200, 200, 130))]
    max_tokens = (60, 40, 50)
    alone = [batching.run_alone(model, make, t, m) for t, m in zip(prompts, max_tokens)]
    sizes = set()

    def check(gen):
        sizes.update(tuple(c.packed.group_sizes) for c in batching.batch_caches(gen) if c.packed is not None)

    got = batching.run_batched(model, prompts, max_tokens, check=check)
    assert (2,) in sizes, sizes
    batching.assert_batch_equals_alone(got, alone)
