"""kvquant with a calibration file: the paper's offline datatype (per layer, per tensor
codebooks fixed before inference) instead of a fit on the prompt. A calibrated cache starts
every row on the file's key and value codebooks before its first tokens and runs no fit
(no quantile grid, no Lloyd); a file calibrated on the prompt's own tokens is the prompt
fit, bit for bit; an explicit refit interval refits warm-started from the file's codebook;
rows of a batch and stacked sequences are each coded as alone; a saved cache continues as
it would have; a file for another method, setting, model, head_dim or key rotary is
refused, naming the file, the field and both values; `veloxquant calibrate --method
kvquant` writes a file that generation uses."""

import re

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import batching
from conformance import profile
from test_calibrate import cli, fitted_and_read_on_the_prompt, write_file, reference, text_file  # noqa: F401 - module fixtures reused
from test_methods_exactness import run
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.calibration import CalibrationError, read_calibration, write_calibration
from veloxquant_mlx.cache.options import KVQuantOptions
from veloxquant_mlx.methods.kvquant import KVQuantCache
from veloxquant_mlx.methods.kvquant.nonuniform import NonUniform
from veloxquant_mlx.quant import codebook as cb
from veloxquant_mlx.reference import REFERENCE_MODEL

TOKENS = 400
PROMPT = (REFERENCE_MODEL / "heldout_kjv_acts.txt").read_text()[:200]  # not the calibration text
KEY = '[500000.0, false, ""]'  # the reference model's key rotary, as a file records it


def config(path=None, **options):
    return KVCacheConfig(method="kvquant", options=KVQuantOptions(**options), calibration_file=path)


def calibrate(folder, name, *args):
    return write_file(folder, name, "--method", "kvquant", *args)[0]


@pytest.fixture(scope="module")
def made(tmp_path_factory, text_file):  # noqa: F811
    return calibrate(tmp_path_factory.mktemp("kvquant"), "kvquant-ref", "--text", str(text_file),
                     "--tokens", str(TOKENS))


def books(run):
    """A run's codebooks (B, codebooks, 2^bits)."""
    return run.books.view()[:, 0, 0]


def no_fit(*args, **kwargs):
    raise AssertionError("a codebook fit on the path of a calibrated cache")


def test_every_row_starts_on_the_files_codebooks_and_nothing_is_fitted(made, reference, monkeypatch):
    """Prompt chunks, then decode steps that flush key blocks and values: every token is
    coded with the file's codebooks, and no fit runs (its functions raise here)."""
    model, tokenizer = reference
    arrays, _ = read_calibration(made)
    for name in ("fit", "quantile_init", "lloyd", "lloyd_step", "compiled_refit"):
        monkeypatch.setattr(cb, name, no_fit)
    cache = make_prompt_cache(model, config(made))
    received = {}
    for i, c in enumerate(cache):
        def spy(keys, values, c=c, i=i, update=c.update_and_fetch):
            received.setdefault(i, []).append(values)
            return update(keys, values)
        c.update_and_fetch = spy
    tokens = mx.array(tokenizer.encode(PROMPT))[:150]
    run(model, cache, tokens, chunk=48, decode=40)
    codec = NonUniform(3, 32, "token", 0.01, 8)
    for i, c in enumerate(cache):
        keys, values = c.store.keys, c.store.values
        # past the sink: 96 keys and 148 values in the prompt, then 32 more of each by steps
        assert (keys.count, values.count) == (160, 180)
        for run_, prefix in ((keys, "k"), (values, "v")):
            assert run_.books.length == 1
            assert mx.array_equal(books(run_)[0, 0], arrays[f"layer{i}.{prefix}_centroids"])
        x = mx.concatenate(received[i], axis=2)[:, :, 1:181]
        want = codec.encode(x, arrays[f"layer{i}.v_centroids"][None, None, None, None], x.dtype)[0]
        assert mx.array_equal(values.codes.view(), want)


def test_a_file_calibrated_on_the_prompt_is_the_prompt_fit(reference, tmp_path):
    """Bit for bit: the calibration fits the same tokens (values past the sink, keys past
    it in whole blocks, rotated back at the same positions) with the same arithmetic and
    sample, and the file keeps the float32 centroids as they are."""
    fitted, read, _ = fitted_and_read_on_the_prompt(reference, tmp_path, "kvquant", PROMPT, config)
    for f, r in zip(fitted, read):
        assert f.store.keys.count > 0
        for x, y in ((f.store.keys, r.store.keys), (f.store.values, r.store.values)):
            assert mx.array_equal(books(x), books(y))
        for x, y in zip(f.dequantized(mx.float32), r.dequantized(mx.float32)):
            assert mx.array_equal(x, y)
        assert f.nbytes == r.nbytes


def test_an_explicit_refit_interval_refits_warm_started_from_the_files_codebook(made, reference):
    """R = 1: the first decode step refits each tensor from the file's codebook on all it
    encoded (the prompt included: the file is the last fit); the tokens after it use the
    new codebook, the prompt's keep the file's."""
    model, _ = reference
    cache = make_prompt_cache(model, config(made, kvquant_refit_interval=1))[2]
    arrays, _ = read_calibration(made)
    k = mx.random.normal((1, 2, 101, 128), key=mx.random.key(5))
    v = mx.random.normal((1, 2, 101, 128), key=mx.random.key(6))
    q = mx.random.normal((1, 8, 101, 128), key=mx.random.key(7))
    for start, stop in ((0, 100), (100, 101)):  # the step's value waits: the refit sees the prompt's
        out = cache.update_and_fetch(k[:, :, start:stop], v[:, :, start:stop])
        cache.attend(q[:, :, start:stop], *out, scale=128**-0.5, mask="causal" if stop - start > 1 else None)
    values = cache.store.values
    file_book = arrays["layer2.v_centroids"]
    assert values.books.length == 2 and mx.array_equal(books(values)[0, 0], file_book)
    z, weights, *_ = NonUniform(3, 32, "token", 0.01, 8).prepare(v[:, :, 1:100], mx.float32)
    want = cb.refit(cb.histogram(z, weights), file_book[None], 8, cb.row_index(1, cb.HIST_BINS))
    assert mx.allclose(books(values)[:, 1], want, atol=1e-6)  # compiled there: float rounding
    assert not mx.allclose(books(values)[:, 1], file_book[None], atol=1e-3)


@pytest.mark.parametrize("refit", [0, 4])
def test_rows_of_a_batch_are_coded_as_each_alone(made, reference, refit):
    """Each row starts on the file's codebooks (broadcast over the batch) and, with refits,
    refits on its own histogram: every output and kept array of a row is its own cache's."""
    model, _ = reference

    def make():
        return make_prompt_cache(model, config(made, kvquant_refit_interval=refit))[1]

    keys, values = (mx.random.normal((3, 2, 140, 128), key=mx.random.key(s)) * (1 + s) for s in (1, 2))
    queries = mx.random.normal((3, 8, 140, 128), key=mx.random.key(3))
    both = make()
    outs = batching.run_rows(both, keys, values, queries, 100, chunk=48)
    batching.assert_each_row_alone(both, outs, make, keys, values, queries, 100, chunk=48)
    assert (both.store.keys.books.length > 1) == bool(refit)


def test_a_saved_calibrated_cache_continues_token_for_token(made, reference, tmp_path):
    model, tokenizer = reference
    tokens = mx.array(tokenizer.encode(PROMPT))
    head, tail = tokens[:120], tokens[120:180]
    cache = make_prompt_cache(model, config(made, kvquant_refit_interval=8))
    run(model, cache, head, chunk=48, decode=0)
    path = str(tmp_path / "saved.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    for t in tail:
        a = model(t.reshape(1, 1), cache=cache)[:, -1]
        b = model(t.reshape(1, 1), cache=loaded)[:, -1]
        assert mx.array_equal(a, b)
    arrays, _ = read_calibration(made)
    for i, c in enumerate(loaded):
        assert c.store.keys.books.length > 1  # refitted after the load
        assert mx.array_equal(books(c.store.keys)[0, 0], arrays[f"layer{i}.k_centroids"])


def test_a_file_for_another_method_setting_model_head_dim_or_rotary_is_refused_naming_both_values(
        made, tmp_path):
    arrays, meta = read_calibration(made)
    other = str(tmp_path / "other.safetensors")
    write_calibration(other, {i: {n: arrays[f"layer{i}.{n}"] for n in ("k_centroids", "v_centroids")}
                              for i in meta["layers"]}, {**meta, "method": "vecinfer"})
    tiny = tiny_model("llama")  # 2 layers, 2 KV heads of 32
    narrow, wide = mx.zeros((1, 2, 8, 64)), mx.zeros((1, 2, 8, 128))

    def bare(path=made, **options):  # no model context: checked at the first update
        return lambda: KVQuantCache(config(path, **options), None, 0).update_and_fetch(wide, wide)

    refusals = [
        (bare(other), other, "method is 'vecinfer' in the file .*, but 'kvquant' in the config"),
        (bare(kvquant_bits=4), made, "kvquant_bits is 3 in the file .*, but 4 in the config"),
        (bare(kvquant_group_size=64), made, "kvquant_group_size is 32 in the file .*, but 64 in the config"),
        (bare(kvquant_outlier_fraction=0.02), made,
         "kvquant_outlier_fraction is 0.01 in the file .*, but 0.02 in the config"),
        (bare(kvquant_lloyd_iters=4), made, "kvquant_lloyd_iters is 8 in the file .*, but 4 in the config"),
        (bare(kvquant_n_sink=4), made, "kvquant_n_sink is 1 in the file .*, but 4 in the config"),
        (lambda: make_prompt_cache(tiny, config(made)), made,
         r"num_hidden_layers is 4 in the file \(made for .*\), but 2 in the model"),
        (lambda: KVQuantCache(config(made), None, 0).update_and_fetch(narrow, narrow), made,
         "head_dim is 128 in the file .*, but 64 in the keys of layer 0"),
        # the right shape, but no model known: the cache would code its keys post-RoPE
        (bare(), made, f"key_rotary is '{re.escape(KEY)}' in the file .*, but 'none' in the cache of layer 0"),
    ]
    for build, path, message in refusals:
        with pytest.raises(CalibrationError, match=message) as refused:
            build()
        assert f"calibration_file={path!r}" in str(refused.value)


def test_the_refit_interval_is_not_a_calibration_field(made, reference):
    model, _ = reference
    cache = make_prompt_cache(model, config(made, kvquant_refit_interval=4))  # checked at once: accepted
    k = mx.random.normal((1, 2, 40, 128), key=mx.random.key(0))
    cache[0].update_and_fetch(k, k)
    assert cache[0].store.keys.books.length == 1 and cache[0].store.values.books.length == 1


def test_the_cli_file_serves_generation(made, reference):
    model, tokenizer = reference
    arrays, meta = read_calibration(made)
    assert meta["method"] == "kvquant" and meta["layers"] == [0, 1, 2, 3] and meta["tokens"] == TOKENS
    assert [meta[f] for f in KVQuantCache.calibration_fields] == [3, 32, 0.01, 8, 1]
    assert meta["key_rotary"] == KEY
    for i in range(4):
        for prefix in "kv":
            c = arrays[f"layer{i}.{prefix}_centroids"]
            assert c.shape == (8,) and c.dtype == mx.float32
            assert bool(mx.all(c[1:] > c[:-1])) and bool(mx.all(mx.abs(c) <= 1))
    tokens = mx.array(tokenizer.encode(PROMPT))
    logits = run(model, make_prompt_cache(model, config(made)), tokens, chunk=64, decode=8)
    full = run(model, make_prompt_cache(model, KVCacheConfig()), tokens, chunk=64, decode=8)
    assert bool(mx.all(mx.isfinite(logits)))
    assert mx.array_equal(mx.argmax(logits[:, 0], -1), mx.argmax(full[:, 0], -1))  # the prompt's next token
    cache = make_prompt_cache(model, config(made))
    text = mlx_lm.generate(model, tokenizer, PROMPT[:60], max_tokens=8, prompt_cache=cache)
    assert len(text) == 8  # a byte-level model: a character a token
    for i, c in enumerate(cache):
        assert c.offset >= len(tokenizer.encode(PROMPT[:60])) + 7  # the prompt and the steps
        assert mx.array_equal(books(c.store.values)[0, 0], arrays[f"layer{i}.v_centroids"])


def test_calibrate_refuses_too_few_tokens_for_a_key_block(tmp_path, text_file):  # noqa: F811
    out = tmp_path / "short.safetensors"
    code, _, stderr = cli("calibrate", "--model", str(REFERENCE_MODEL), "--method", "kvquant", "--out", str(out),
                          "--text", str(text_file), "--tokens", "20")
    assert code != 0 and not out.exists()
    assert "--method kvquant: 20 calibration tokens: kvquant fits its key codebook on whole blocks of 32" in stderr


@pytest.fixture(scope="module")
def rowwise_calibration(tmp_path_factory):
    """A kvquant file for the row-wise model of tests/batching.py, fitted on a text of its own."""
    settings = profile("kvquant").compressing
    path = batching.rowwise_calibration(tmp_path_factory.mktemp("kvquant"), "kvquant", settings, tokens=300)
    return {**settings, "calibration_file": path}


def test_calibrated_sequences_stack_and_each_decodes_as_alone(rowwise_calibration):
    """Through mlx-lm's BatchGenerator: calibrated sequences join one stacked cache (their
    codebooks the file's, then refitted every 4 steps on each row's own histogram) and each
    gets its tokens, log-probabilities and cache alone."""
    model, make = batching.rowwise_setup("kvquant", rowwise_calibration)
    prompts = [prompt(n, seed=i + 3).tolist() for i, n in enumerate((120, 120, 90))]
    most = (30, 24, 20)
    alone = [batching.run_alone(model, make, t, m) for t, m in zip(prompts, most)]
    sizes = set()

    def check(gen):
        batching.memory_check(gen)
        sizes.update(tuple(c.packed.group_sizes) for c in batching.batch_caches(gen) if c.packed is not None)

    got = batching.run_batched(model, prompts, most, join_at=6, check=check)
    assert (2,) in sizes, sizes
    batching.assert_batch_equals_alone(got, alone)
    arrays, _ = read_calibration(rowwise_calibration["calibration_file"])
    for _, _, cache in got:
        assert mx.array_equal(books(cache[0].store.keys)[0, 0], arrays["layer0.k_centroids"])
