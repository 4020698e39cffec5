"""a2ats with a calibration file: the paper's offline codebook and query metric instead of
a fit on the prompt. A cache reading the file installs each layer's codebook and metric
factor before its first token (no query moment kept, no k-means, no Cholesky factor); the
file holds what the per-sequence fit makes of the text as one prompt chunk followed by a
retrieving step, so a file calibrated on a prompt's own tokens (all but the last, which
mlx-lm feeds as the first step) fits as that prompt does, bit for bit; rows of a batch are
each as alone, and calibrated sequences stack; a saved cache continues as it would have; a
file for another method, setting, model, head_dim or key rotary is refused, naming the
file, the field and both values, and so is a file given with the tables as options;
`veloxquant calibrate --method a2ats` writes a file that generation uses."""

from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import batching
from conformance import profile
from test_calibrate import cli, write_file, reference, text_file  # noqa: F401 - module fixtures reused
from test_methods_exactness import run
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.calibration import (CalibrationError, calibration_header, read_calibration,
                                              write_calibration)
from veloxquant_mlx.cache.options import A2ATSOptions
from veloxquant_mlx.methods.a2ats import retrieval
from veloxquant_mlx.methods.a2ats.cache import A2ATSCache
from veloxquant_mlx.reference import REFERENCE_MODEL

TOKENS = 400
PROMPT = (REFERENCE_MODEL / "heldout_kjv_acts.txt").read_text()[:300]  # not the calibration text
THETA = 500000.0  # the reference model's rope_theta: a cache with no model context de-rotates with it
TABLES = ("codebook", "query_h", "factor")


def config(path=None, **options):
    return KVCacheConfig(method="a2ats", options=A2ATSOptions(**options), calibration_file=path)


def calibrate(folder, name, *args):
    return write_file(folder, name, "--method", "a2ats", *args)


@pytest.fixture(scope="module")
def made(tmp_path_factory, text_file):  # noqa: F811
    return calibrate(tmp_path_factory.mktemp("a2ats"), "a2ats-ref", "--text", str(text_file),
                     "--tokens", str(TOKENS))


def no_fit(*args, **kwargs):
    raise AssertionError("a calibrated a2ats cache fitted a table")


def test_calibrate_writes_each_layers_codebook_metric_and_factor_under_the_models_rotary(made):
    path, stderr = made
    arrays, meta = read_calibration(path)
    assert meta["method"] == "a2ats" and meta["layers"] == [0, 1, 2, 3] and meta["tokens"] == TOKENS
    assert {f: meta[f] for f in A2ATSCache.calibration_fields} == {
        "a2ats_codebook_bits": 8, "a2ats_sub_dim": 8, "a2ats_window": 128, "a2ats_b": 2048,
        "a2ats_use_query_aware": True, "a2ats_beta": 0.5}
    assert meta["key_rotary"] == f'[{THETA}, false, ""]'
    for i in range(4):
        assert arrays[f"layer{i}.codebook"].shape == (256, 8)
        h, factor = arrays[f"layer{i}.query_h"], arrays[f"layer{i}.factor"]
        assert h.shape == factor.shape == (8, 8) and h.dtype == factor.dtype == mx.float32
        assert mx.array_equal(factor, retrieval.metric_factor(h))  # L L^T = H + eps I
        assert abs(float(mx.trace(h)) - 8) < 1e-3  # the blend of a unit-mean-eigenvalue moment and I
    assert "layer 3 codebook and metric" in stderr and "queries, keys and values of 400 tokens" in stderr


def test_the_files_tables_are_in_place_before_the_first_token_and_nothing_is_fitted(made, reference, monkeypatch):
    model, tokenizer = reference
    arrays, _ = read_calibration(made[0])
    tokens = mx.array(tokenizer.encode(PROMPT))
    cache = make_prompt_cache(model, config(made[0]))
    for name in ("kmeans_rows", "blended_metric", "metric_factor"):
        monkeypatch.setattr(retrieval, name, no_fit)
    monkeypatch.setattr(mx.linalg, "cholesky", no_fit)
    first = cache[0]
    first.update_and_fetch(mx.zeros((1, 2, 4, 128)), mx.zeros((1, 2, 4, 128)))  # the first keys
    assert mx.array_equal(first.store.centroids[0], arrays["layer0.codebook"])
    assert mx.array_equal(first.store.factor[0], arrays["layer0.factor"]) and first.store.h_sum is None
    cache = make_prompt_cache(model, config(made[0]))
    run(model, cache, tokens, chunk=128, decode=140)  # codes at the prompt's end, then a block a window
    for i, c in enumerate(cache):
        store = c.store
        assert store.h_sum is None and store.codes.length > tokens.shape[0] - 128  # a block past the first
        assert mx.array_equal(store.centroids[0], arrays[f"layer{i}.codebook"])
        assert mx.array_equal(store.factor[0], arrays[f"layer{i}.factor"])


def test_a_file_calibrated_on_the_prompt_fits_as_the_prompt_does(reference, tmp_path):
    """Bit for bit: mlx-lm feeds a prompt of n tokens as a chunk of n - 1 and a first step
    that retrieves; the file of those n - 1 tokens is the fit that step makes (the same
    keys and queries, the same code, seed 0). The fitted cache also keeps the query
    moment, which the calibrated one does not."""
    model, tokenizer = reference
    text = tmp_path / "prompt.txt"
    text.write_text(PROMPT)
    tokens = mx.array(tokenizer.encode(PROMPT))
    n = tokens.shape[0]
    path, _ = calibrate(tmp_path, "prompt", "--text", str(text), "--tokens", str(n - 1))
    arrays, _ = read_calibration(path)
    fitted, read = make_prompt_cache(model, config()), make_prompt_cache(model, config(path))
    a = run(model, fitted, tokens, chunk=n, decode=8)
    b = run(model, read, tokens, chunk=n, decode=8)
    assert mx.array_equal(a, b)
    for i, (f, r) in enumerate(zip(fitted, read)):
        assert f.store.codes.length == r.store.codes.length == n - 128  # the keys the fit saw
        assert mx.array_equal(f.store.codes.view(), r.store.codes.view())
        for name in ("centroids", "factor"):
            assert mx.array_equal(getattr(f.store, name), getattr(r.store, name)), (i, name)
        assert mx.array_equal(retrieval.blended_metric(f.store.h_sum, 0.5)[0], arrays[f"layer{i}.query_h"])
        assert f.nbytes - r.nbytes == f.store.h_sum.nbytes > 0


def test_without_a_learned_metric_the_file_holds_the_codebook_alone(tmp_path):
    """Plain nearest centroid (no query awareness, or beta 1): a codebook fitted on the
    pre-RoPE keys, no queries needed; a cache reading it assigns without a factor."""
    args = SimpleNamespace(rope_theta=THETA, num_key_value_heads=2, head_dim=128)
    keys = mx.random.normal((1, 2, 200, 128), key=mx.random.key(3))
    for options in ({"a2ats_use_query_aware": False}, {"a2ats_beta": 1.0}):
        cfg = config(a2ats_codebook_bits=4, a2ats_window=16, **options)
        arrays = A2ATSCache.calibrate(keys, keys, cfg, iters=1, seed=0, model_args=args)
        assert list(arrays) == ["codebook"] and arrays["codebook"].shape == (16, 8)
    path = str(tmp_path / "plain.safetensors")
    write_calibration(path, {0: arrays}, calibration_header(A2ATSCache, cfg, args, "synthetic"))
    cache = A2ATSCache(config(path, a2ats_codebook_bits=4, a2ats_window=16, a2ats_beta=1.0, a2ats_rope_base=THETA,
                              a2ats_retrieval_fraction=0.1), None, 0)
    q = mx.random.normal((1, 4, 200, 128), key=mx.random.key(4))
    batching.run_rows(cache, keys, keys, q, 150)
    assert cache.store.factor is None and cache.store.h_sum is None and cache.store.codes.length > 0
    assert mx.array_equal(cache.store.centroids[0], arrays["codebook"])
    with pytest.raises(ValueError, match=r"the query metric needs the text's queries \(1, n_heads, 200, 128\); "
                                         r"given None"):
        A2ATSCache.calibrate(keys, keys, config(a2ats_window=16), iters=1, seed=0, model_args=args)


def test_a_file_for_another_method_setting_model_shape_or_rotary_is_refused_naming_both_values(made, tmp_path):
    path = made[0]
    arrays, meta = read_calibration(path)
    other = str(tmp_path / "other-method.safetensors")
    write_calibration(other, {i: {n: arrays[f"layer{i}.{n}"] for n in TABLES} for i in meta["layers"]},
                      {k: v for k, v in meta.items() if k not in ("format", "version", "layers")} | {"method": "kvtc"})
    wide, narrow = mx.zeros((1, 2, 8, 128)), mx.zeros((1, 2, 8, 64))
    alone = {"a2ats_rope_base": THETA}  # no model context: the model's rotary given by field

    def fed(file, keys=wide, **options):
        return lambda: A2ATSCache(config(file, **{**alone, **options}), None, 0).update_and_fetch(keys, keys)

    refusals = [
        (fed(other), other, "method is 'kvtc' in the file .*, but 'a2ats' in the config"),
        (fed(path, a2ats_codebook_bits=6), path, "a2ats_codebook_bits is 8 in the file .*, but 6 in the config"),
        (fed(path, a2ats_sub_dim=4), path, "a2ats_sub_dim is 8 in the file .*, but 4 in the config"),
        (fed(path, a2ats_window=64), path, "a2ats_window is 128 in the file .*, but 64 in the config"),
        (fed(path, a2ats_b=1024), path, "a2ats_b is 2048 in the file .*, but 1024 in the config"),
        (fed(path, a2ats_use_query_aware=False), path,
         "a2ats_use_query_aware is True in the file .*, but False in the config"),
        (fed(path, a2ats_beta=0.25), path, "a2ats_beta is 0.5 in the file .*, but 0.25 in the config"),
        (lambda: make_prompt_cache(tiny_model("llama"), config(path)), path,
         r"num_hidden_layers is 4 in the file \(made for .*\), but 2 in the model"),
        (fed(path, narrow), path, "head_dim is 128 in the file .*, but 64 in the keys of layer 0"),
        (fed(path, a2ats_rope_base=10000.0), path,
         r"key_rotary is '\[500000.0, false, \"\"\]' in the file .*, but '\[10000.0, false, \"\"\]' in the cache"),
    ]
    for build, file, message in refusals:
        with pytest.raises(CalibrationError, match=message) as refused:
            build()
        assert f"calibration_file={file!r}" in str(refused.value)
    # the retrieval fraction reads the tables, it does not make them: a file serves every fraction
    c = A2ATSCache(config(path, a2ats_retrieval_fraction=0.03, **alone), None, 0)
    c.update_and_fetch(wide, wide)
    assert mx.array_equal(c.store.centroids[0], arrays["layer0.codebook"])


def test_tables_given_as_options_and_a_file_are_refused_together(made):
    path, table = made[0], [[0.0] * 8] * 256
    for field, value in (("a2ats_codebook", table), ("a2ats_query_h", [[1.0] * 8] * 8)):
        with pytest.raises(ValueError, match=f"calibration_file={path!r} and {field} are both given"):
            A2ATSCache(config(path, **{field: value}), None, 0)
        with pytest.raises(ValueError, match=f"{field} is given: calibrate fits the codebook and metric"):
            A2ATSCache.calibrate(mx.zeros((1, 2, 300, 128)), None, config(**{field: value}), iters=1, seed=0)


def test_calibrate_refuses_too_few_tokens_past_the_window(tmp_path, text_file):  # noqa: F811
    out = tmp_path / "short.safetensors"
    code, _, stderr = cli("calibrate", "--model", str(REFERENCE_MODEL), "--method", "a2ats", "--out", str(out),
                          "--text", str(text_file), "--tokens", "100")
    assert code != 0 and not out.exists()
    assert "--method a2ats: 100 calibration tokens leave no keys to fit" in stderr


def test_a_saved_calibrated_cache_continues_token_for_token(made, reference, tmp_path):
    model, tokenizer = reference
    tokens = mx.array(tokenizer.encode(PROMPT))
    head, tail = tokens[:172], tokens[172:]  # retrieving from the prompt's end; a block coded at 300
    cache = make_prompt_cache(model, config(made[0]))
    run(model, cache, head, chunk=64, decode=4)
    coded = cache[0].store.codes.length
    assert coded > 0
    path = str(tmp_path / "saved.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    for t in tail:
        a = model(t.reshape(1, 1), cache=cache)[:, -1]
        b = model(t.reshape(1, 1), cache=loaded)[:, -1]
        assert mx.array_equal(a, b)
    assert loaded[0].store.codes.length > coded
    for c, d in zip(cache, loaded):
        assert d.store.h_sum is None and mx.array_equal(c.store.centroids, d.store.centroids)
        assert mx.array_equal(c.store.factor, d.store.factor)


def test_rows_of_a_batch_are_each_as_alone(made):
    """Each row gets the file's tables (a copy a row): its outputs, codes and tables are
    its own cache's, bit for bit, through prompt chunks, the first retrieving step and
    coding blocks."""
    b, n = 2, 330
    keys = mx.random.normal((b, 2, n, 128), key=mx.random.key(5)) * (1 + mx.arange(b)[:, None, None, None])
    values = mx.random.normal((b, 2, n, 128), key=mx.random.key(6))
    queries = mx.random.normal((b, 8, n, 128), key=mx.random.key(7))

    def make():
        return A2ATSCache(config(made[0], a2ats_rope_base=THETA), None, 0)

    both = make()
    outs = batching.run_rows(both, keys, values, queries, 200)
    assert both.store.codes.length > 200 - 128
    batching.assert_each_row_alone(both, outs, make, keys, values, queries, 200)


@pytest.fixture(scope="module")
def rowwise_calibration(tmp_path_factory):
    """A file for the row-wise model at a2ats' compressing settings, fitted on a text of its own."""
    settings = profile("a2ats").compressing
    path = batching.rowwise_calibration(tmp_path_factory.mktemp("a2ats-rowwise"), "a2ats", settings, iters=1)
    return {**settings, "calibration_file": path}


def test_calibrated_sequences_share_one_stacked_cache_and_each_gets_what_it_gets_alone(rowwise_calibration):
    settings = dict(rowwise_calibration)
    path = settings.pop("calibration_file")
    cfg = config(path, **settings)
    model = batching.RowwiseModel()

    def make():
        from veloxquant_mlx.cache.context import ModelContext
        context = ModelContext(cfg, 2, (0, 1), model_args=batching._RowwiseArgs())
        context.layers = [A2ATSCache(cfg, context, i) for i in range(2)]
        return list(context.layers)

    model.make_cache = make
    prompts = [prompt(120, seed=i + 3).tolist() for i in range(2)]
    alone = [batching.run_alone(model, make, t, 40) for t in prompts]
    sizes = []

    def check(gen):
        sizes.append({tuple(c.packed.group_sizes) for c in batching.batch_caches(gen) if c.packed is not None})

    got = batching.run_batched(model, prompts, (40, 40), join_at=200, check=check)
    assert {(2,)} in sizes, sizes
    batching.assert_batch_equals_alone(got, alone)
    assert all(c.store.h_sum is None for *_, cache in got for c in cache)


def test_generation_with_the_file_retrieves_through_its_tables(made, reference):
    """mlx-lm's generation with a cache reading the file `veloxquant calibrate` wrote: the
    prompt's last token and every step after it retrieve (8 sinks, the window, the top 20%)."""
    import mlx_lm

    model, tokenizer = reference
    cache = make_prompt_cache(model, config(made[0]))
    text = mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=8, prompt_cache=cache)
    arrays, _ = read_calibration(made[0])
    assert text and cache[0].offset >= len(tokenizer.encode(PROMPT)) + 7
    assert cache[0].store.codes.length > 0 and mx.array_equal(cache[0].store.centroids[0], arrays["layer0.codebook"])


def test_veloxquant_generate_takes_the_file(made):
    code, out, err = cli("generate", "--model", "reference", "--method", "a2ats", "--prompt", PROMPT,
                         "--max-tokens", "8", "--set", f"calibration_file={made[0]}")
    assert code == 0, err
    assert out.strip()
