"""spectral with a calibration file: the paper's offline eigenbases and Lloyd-Max codebooks
instead of a fit on the prompt. A calibrated cache codes every token on the file's bases,
σ and codebooks from its first one (nothing held exactly, no eigenproblem, no codebook
training, no running moment, no refit); a file calibrated on the prompt's own tokens
rebuilds what the prompt fit rebuilds, bit for bit; rows of a batch are each coded as
alone, stacked or not; a saved cache continues as it would have; a file for another
method, setting, model, shape or key rotary is refused, naming the file, the field and
both values; `veloxquant calibrate --method spectral` writes a file generation uses."""

from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import batching
from conformance import profile
from feeding import feed
from rounding import SPECTRAL_ULPS, assert_same_logits
from test_calibrate import cli, fitted_and_read_on_the_prompt, write_file, reference, text_file  # noqa: F401 - module fixtures reused
from test_methods_exactness import run
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.calibration import (CalibrationError, calibration_header, collect_kv, read_calibration,
                                              write_calibration)
from veloxquant_mlx.cache.options import SpectralQuantOptions
from veloxquant_mlx.methods.spectral import SpectralQuantCache
from veloxquant_mlx.methods.spectral import eigen_store as es
from veloxquant_mlx.methods.spectral.cache import CALIBRATED
from veloxquant_mlx.quant.prerope import args_rotary
from veloxquant_mlx.reference import REFERENCE_MODEL

TOKENS = 400
PROMPT = (REFERENCE_MODEL / "heldout_kjv_acts.txt").read_text()[:300]  # not the calibration text


def config(path=None, bits=2, **options):
    return KVCacheConfig(method="spectral", kv_bits=bits, options=SpectralQuantOptions(**options),
                         calibration_file=path)


def calibrate(folder, name, *args):
    return write_file(folder, name, "--method", "spectral", *args)[0]


@pytest.fixture(scope="module")
def made(tmp_path_factory, text_file):  # noqa: F811
    return calibrate(tmp_path_factory.mktemp("spectral"), "spectral-ref", "--text", str(text_file),
                     "--tokens", str(TOKENS))


def no_fit(*args, **kwargs):
    raise AssertionError("a fit (eigh or codebook training) in a calibrated spectral cache")


def forbid_fits(monkeypatch):
    for owner, name in ((mx.linalg, "eigh"), (es, "fitted_arrays"), (es, "trained_table"), (es, "eigenbasis")):
        monkeypatch.setattr(owner, name, no_fit)


def file_arrays(path, layer, prefix):
    arrays, _ = read_calibration(path)
    return tuple(arrays[f"layer{layer}.{prefix}_{n}"] for n in es.CALIBRATED_ARRAYS)


def test_every_token_is_coded_on_the_files_arrays_from_the_first_and_nothing_is_fitted(
        made, reference, monkeypatch):
    model, tokenizer = reference
    tokens = mx.array(tokenizer.encode(PROMPT))[:64]  # fewer than head_dim: held exactly uncalibrated
    cache = make_prompt_cache(model, config(made))
    forbid_fits(monkeypatch)
    run(model, cache, tokens, chunk=16, decode=150)  # past two doublings of the prompt
    for i, c in enumerate(cache):
        store = c.store
        # the newest decode rows are held exactly until DECODE_FLUSH of them are there
        assert store.length == 64 + 150 and store.coded == store.length - store.k_pend.length
        assert store.k_pend.length < es.DECODE_FLUSH
        for prefix, run_ in (("k", store.keys), ("v", store.values)):
            basis, eigenvalues, tables = file_arrays(made, i, prefix)
            assert len(store.key_runs) == len(store.value_runs) == 1 and run_.moment is None
            assert mx.array_equal(run_.basis, basis) and mx.array_equal(run_.tables, tables)
            assert mx.array_equal(run_.sigma, run_.codec.sigmas(eigenvalues, 128))


def test_a_file_calibrated_on_the_prompt_rebuilds_what_the_prompt_fit_rebuilds(reference, tmp_path):
    """Exactly, or within ``SPECTRAL_ULPS`` where this CPU rounds the two caches' prompt
    attention apart: the file's arrays are the prompt fit's (the same rows, de-rotated at the
    same positions, the same arithmetic) and σ is derived from its eigenvalues as the fit
    derives it. The prompt is one chunk of fewer than collect_kv's 512 tokens, so the file is
    fitted on the very keys the cache receives. The fitted cache also keeps its running
    moments (two (H, D, D) float32 a layer), the calibrated one none."""
    fitted, read, n = fitted_and_read_on_the_prompt(reference, tmp_path, "spectral", PROMPT, config)
    for f, r in zip(fitted, read):
        assert f.store.length == r.store.length == n - 1 + 9
        for x, y in zip(f.store.history(mx.float32), r.store.history(mx.float32)):
            assert_same_logits(x, y, ulps=SPECTRAL_ULPS)  # layer 1 on: what layer 0's attention gave
        assert f.nbytes - r.nbytes == 2 * 2 * 128 * 128 * 4


def _layer_rows(model, tokenizer, layer=1):
    """Two rows of a layer's keys and values (2, H, n, D) from two texts, and queries."""
    kv = collect_kv(model, mx.array(tokenizer.encode(PROMPT + PROMPT[::-1])))
    keys, values = kv[layer]
    n = keys.shape[2] // 2
    k = mx.concatenate([keys[:, :, :n], keys[:, :, n : 2 * n]], axis=0)
    v = mx.concatenate([values[:, :, :n], values[:, :, n : 2 * n]], axis=0)
    q = mx.random.normal((2, 8, n, 128), key=mx.random.key(1))
    return k, v, q, n


def test_rows_of_a_batch_are_coded_as_each_alone(made, reference):
    """Each row's run starts on the file's arrays (broadcast over the batch): a row's prompt
    attention (the second chunk's with the QJL-corrected scores), decode attention and
    history are its own, bit for bit."""
    model, tokenizer = reference
    k, v, q, n = _layer_rows(model, tokenizer)
    context = SimpleNamespace(model_args=model.args)

    def fed(cache, k, v, q):
        return [feed(cache, k, v, q, 0, n // 2), feed(cache, k, v, q, n // 2, n - 1), feed(cache, k, v, q, n - 1, n)]

    batch = SpectralQuantCache(config(made), context, 1)
    out = fed(batch, k, v, q)
    for b in range(2):
        alone = SpectralQuantCache(config(made), context, 1)
        single = fed(alone, k[b : b + 1], v[b : b + 1], q[b : b + 1])
        for x, y in zip(out, single):
            assert mx.array_equal(x[b : b + 1], y)
        for x, y in zip(batch.dequantized(mx.float32), alone.dequantized(mx.float32)):
            assert mx.array_equal(x[b : b + 1], y)
    assert batch.store.keys.basis.shape[0] == 2 and batch.store.keys.moment is None


def test_a_saved_calibrated_cache_continues_token_for_token(made, reference, tmp_path):
    model, tokenizer = reference
    tokens = mx.array(tokenizer.encode(PROMPT))
    head, tail = tokens[:200], tokens[200:240]
    cache = make_prompt_cache(model, config(made))
    run(model, cache, head, chunk=64, decode=0)
    path = str(tmp_path / "saved.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    for t in tail:
        a = model(t.reshape(1, 1), cache=cache)[:, -1]
        b = model(t.reshape(1, 1), cache=loaded)[:, -1]
        assert mx.array_equal(a, b)
    assert all(len(c.store.key_runs) == 1 and c.store.keys.moment is None for c in loaded)


@pytest.fixture(scope="module")
def rowwise_file(tmp_path_factory):
    """A file for the row-wise batching model (2 KV heads of 32, its rotary), fitted on a
    token sequence of its own."""
    settings = profile("spectral").compressing
    path = batching.rowwise_calibration(tmp_path_factory.mktemp("rowwise"), "spectral", settings)
    return {**settings, "calibration_file": path}


def test_calibrated_sequences_stack_and_each_gets_what_it_gets_alone(rowwise_file):
    """Through mlx-lm's BatchGenerator: two prompts of one length share one cache (the
    file's arrays stacked per row), a third joins; tokens and caches as each alone."""
    model, make = batching.rowwise_setup("spectral", rowwise_file)
    prompts = [prompt(n, seed=i + 3).tolist() for i, n in enumerate((150, 150, 90))]
    steps = (40, 30, 30)
    alone = [batching.run_alone(model, make, t, m) for t, m in zip(prompts, steps)]
    sizes = set()

    def check(gen):
        sizes.update(tuple(c.packed.group_sizes) for c in batching.batch_caches(gen) if c.packed is not None)

    got = batching.run_batched(model, prompts, steps, join_at=10, check=check)
    assert (2,) in sizes, sizes
    batching.assert_batch_equals_alone(got, alone)
    assert all(c[0].store.keys.moment is None for _, _, c in alone)


def test_a_file_for_another_method_setting_model_shape_or_rotary_is_refused_naming_both_values(
        made, reference, tmp_path):
    model, _ = reference
    arrays, _ = read_calibration(made)
    layer0 = {name: arrays[f"layer0.{name}"] for name in CALIBRATED}
    svdq = str(tmp_path / "svdq.safetensors")
    write_calibration(svdq, {0: layer0}, calibration_header(SpectralQuantCache, config(), model.args, "ref")
                      | {"method": "svdq"})
    keys = mx.random.normal((1, 2, 200, 128), key=mx.random.key(3))  # post-RoPE: no model known
    post_rope = str(tmp_path / "post-rope.safetensors")
    write_calibration(post_rope, {0: SpectralQuantCache.calibrate(keys, keys, config(), iters=0, seed=0)},
                      calibration_header(SpectralQuantCache, config(), None, "no model"))
    tiny = tiny_model("llama")  # 2 layers, 2 KV heads of 32
    narrow, wide = mx.zeros((1, 2, 8, 64)), mx.zeros((1, 2, 8, 128))
    rotary = SimpleNamespace(model_args=model.args)
    refusals = [
        (lambda: SpectralQuantCache(config(svdq), rotary, 0), svdq,
         "method is 'svdq' in the file .*, but 'spectral' in the config"),
        (lambda: SpectralQuantCache(config(made, bits=4), rotary, 0), made,
         "kv_bits is 2 in the file .*, but 4 in the config"),
        (lambda: SpectralQuantCache(config(made, spectral_key_d_eff=8), rotary, 0), made,
         "spectral_key_d_eff is 4 in the file .*, but 8 in the config"),
        (lambda: SpectralQuantCache(config(made, spectral_val_d_eff=40), None, 0).update_and_fetch(wide, wide), made,
         "spectral_val_d_eff is 50 in the file .*, but 40 in the config"),
        (lambda: make_prompt_cache(tiny, config(made)), made,
         r"num_hidden_layers is 4 in the file \(made for .*\), but 2 in the model"),
        (lambda: SpectralQuantCache(config(made), None, 0).update_and_fetch(narrow, narrow), made,
         "head_dim is 128 in the file .*, but 64 in the keys of layer 0"),
        # the right shape, but no model known: the cache would code its keys post-RoPE
        (lambda: SpectralQuantCache(config(made), None, 0).update_and_fetch(wide, wide), made,
         r"""key_rotary is '\[500000.0, false, ""\]' in the file .*, but 'none' in the cache of layer 0"""),
        (lambda: SpectralQuantCache(config(post_rope), rotary, 0), post_rope,
         r"""key_rotary is 'none' in the file .*, but '\[500000.0, false, ""\]' in the cache of layer 0"""),
    ]
    for build, path, message in refusals:
        with pytest.raises(CalibrationError, match=message) as refused:
            build()
        assert f"calibration_file={path!r}" in str(refused.value)
    # QJL and the model name change none of the file's arrays: a file serves every value
    c = SpectralQuantCache(config(made, spectral_apply_qjl=False, spectral_model_name="other"), rotary, 0)
    feed(c, wide, wide, mx.zeros((1, 8, 8, 128)), 0, 8)
    assert c.store.coded == 8 and c.store.keys.sketch is None


def test_the_cli_file_serves_generation_with_the_codes_of_its_arrays(made, reference):
    model, tokenizer = reference
    arrays, meta = read_calibration(made)
    assert meta["method"] == "spectral" and meta["layers"] == [0, 1, 2, 3] and meta["tokens"] == TOKENS
    assert [meta[f] for f in SpectralQuantCache.calibration_fields] == [2, 4, 50]
    assert meta["key_rotary"] == '[500000.0, false, ""]'
    # (basis, eigenvalues, codebooks) of each tensor: b_low 2, keys 2 + 2 bits, values 3 + 2
    shapes = {"k": [(1, 2, 128, 128), (1, 2, 128), (1, 2, 4 + 4)], "v": [(1, 2, 128, 128), (1, 2, 128), (1, 2, 8 + 4)]}
    for i in range(4):
        for prefix, want in shapes.items():
            assert [tuple(a.shape) for a in file_arrays(made, i, prefix)] == want
    tokens = mx.array(tokenizer.encode(PROMPT))[:120]
    greedy, received = [], {}
    for attempt in range(2):
        cache = make_prompt_cache(model, config(made))
        if attempt == 0:  # what each layer's cache is given, and how many rows it had coded before
            for i, c in enumerate(cache):
                def spy(keys, values, c=c, i=i, update=c.update_and_fetch):
                    received.setdefault(i, []).append((keys, values, c.store.coded))
                    return update(keys, values)
                c.update_and_fetch = spy
        greedy.append(mx.argmax(run(model, cache, tokens, chunk=64, decode=4), axis=-1))
        if attempt == 0:
            rotary = args_rotary(model.args)
            for i, c in enumerate(cache):
                for prefix, run_, frame in (("k", c.store.keys, rotary), ("v", c.store.values, None)):
                    basis, eigenvalues, tables = file_arrays(made, i, prefix)
                    sigma = run_.codec.sigmas(eigenvalues, 128)
                    want = [es._encode_fn(run_.codec)(es.coded_rows(k if prefix == "k" else v, start, frame),
                                                      basis, sigma, run_.sketch, tables)[0]
                            for k, v, start in received[i] if k.shape[2] > 1]  # chunk by chunk, as coded
                    assert mx.array_equal(run_.words.view(), mx.concatenate(want, axis=2))
                # the decode steps' rows are held exactly (fewer than DECODE_FLUSH of them)
                decoded = [(k, v) for k, v, _ in received[i] if k.shape[2] == 1]
                assert 0 < len(decoded) == c.store.k_pend.length < es.DECODE_FLUSH
                assert mx.array_equal(c.store.k_pend.view(), mx.concatenate([k for k, _ in decoded], axis=2))
                assert mx.array_equal(c.store.v_pend.view(), mx.concatenate([v for _, v in decoded], axis=2))
    assert mx.array_equal(greedy[0], greedy[1])


def test_calibrate_refuses_fewer_tokens_than_head_dim(tmp_path, text_file):  # noqa: F811
    out = tmp_path / "short.safetensors"
    code, _, stderr = cli("calibrate", "--model", str(REFERENCE_MODEL), "--method", "spectral", "--out", str(out),
                          "--text", str(text_file), "--tokens", "100")
    assert code != 0 and not out.exists()
    assert "--method spectral: 100 calibration tokens: an eigenbasis of head_dim 128 needs at least 128" in stderr
