"""palu and svdq with a calibration file (issue 31): the papers' offline bases instead of
a fit on the prompt. A calibrated cache codes every token on the file's bases from its
first one (nothing held exactly, no eigenproblem, no running moments, no refit); a file
calibrated on the prompt's own tokens rebuilds what the prompt fit rebuilds, bit for bit;
rows of a batch are each coded as alone; a saved cache continues as it would have; a
file for another method, setting, model or shape is refused, naming the file, the field
and both values; too few calibration tokens for a basis are refused by the command."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from feeding import feed
from test_calibrate import cli, write_file, reference, text_file  # noqa: F401 - module fixtures reused
from test_methods_exactness import run
from tiny_models import tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.calibration import CalibrationError, collect_kv, read_calibration
from veloxquant_mlx.cache.options import PALUOptions, SVDqOptions
from veloxquant_mlx.methods.palu import PALUCache
from veloxquant_mlx.methods.svdq import SVDqCache
from veloxquant_mlx.reference import REFERENCE_MODEL

TOKENS = 400
PROMPT = (REFERENCE_MODEL / "heldout_kjv_acts.txt").read_text()[:300]  # not the calibration text
# palu with the reference model's two KV heads in one group (a basis of 256 rows), svdq a head each
SETTINGS = {"palu": ("--set", "palu_n_head_groups=1"), "svdq": ()}


def options(method, **extra):
    if method == "palu":
        return PALUOptions(**{"palu_n_head_groups": 1, **extra})
    return SVDqOptions(**extra)


def config(method, path=None, **extra):
    return KVCacheConfig(method=method, options=options(method, **extra), calibration_file=path)


def calibrate(folder, method, *args):
    return write_file(folder, method, "--method", method, *SETTINGS[method], *args)[0]


@pytest.fixture(scope="module")
def made(tmp_path_factory, text_file):  # noqa: F811
    folder = tmp_path_factory.mktemp("latent")
    return {m: calibrate(folder, m, "--text", str(text_file), "--tokens", str(TOKENS)) for m in SETTINGS}


def no_eigh(*args, **kwargs):
    raise AssertionError("mx.linalg.eigh called by a calibrated cache")


@pytest.mark.parametrize("method", list(SETTINGS))
def test_every_token_is_coded_on_the_files_bases_from_the_first_and_nothing_is_fitted(
        method, made, reference, monkeypatch):
    model, tokenizer = reference
    arrays, _ = read_calibration(made[method])
    tokens = mx.array(tokenizer.encode(PROMPT))[:64]  # fewer than a basis has rows: held exactly uncalibrated
    cache = make_prompt_cache(model, config(method, made[method]))
    monkeypatch.setattr(mx.linalg, "eigh", no_eigh)
    run(model, cache, tokens, chunk=16, decode=150)  # past two doublings of the prompt
    for i, c in enumerate(cache):
        store = c.store
        assert store.fitted and store.k_pend.length == 0 and store.length == 64 + 150
        for prefix, latent in (("k", store.keys), ("v", store.values)):
            if latent is None:
                continue
            assert len(latent.runs) == 1 and latent.gram is None and latent.total is None
            assert mx.array_equal(latent.basis, arrays[f"layer{i}.{prefix}_basis"])
            assert mx.array_equal(latent.mean, arrays[f"layer{i}.{prefix}_mean"])
    assert (cache[0].store.values is None) == (method == "svdq")


@pytest.mark.parametrize("method", list(SETTINGS))
def test_a_file_calibrated_on_the_prompt_rebuilds_what_the_prompt_fit_rebuilds(method, reference, tmp_path):
    """Exactly: a one-chunk prompt is fitted on all its tokens with the same arithmetic as
    the file, and both cast the float32 bases to the keys' dtype. The prompt fit's cache
    also keeps its running moments, which the calibrated one does not."""
    model, tokenizer = reference
    text = tmp_path / "prompt.txt"
    text.write_text(PROMPT)
    tokens = mx.array(tokenizer.encode(PROMPT))
    n = tokens.shape[0]
    path = calibrate(tmp_path, method, "--text", str(text), "--tokens", str(n - 1))
    fitted, read = make_prompt_cache(model, config(method)), make_prompt_cache(model, config(method, path))
    a = run(model, fitted, tokens, chunk=n, decode=8)
    b = run(model, read, tokens, chunk=n, decode=8)
    assert mx.array_equal(a, b)
    for f, r in zip(fitted, read):
        assert f.store.length == r.store.length == n - 1 + 9
        for x, y in zip(f.store.history(mx.float32), r.store.history(mx.float32)):
            assert mx.array_equal(x, y)
        moments = sum(m.nbytes for latent in (f.store.keys, f.store.values) if latent is not None
                      for m in (latent.shift, latent.total, latent.gram))
        assert f.nbytes - r.nbytes == moments > 0


def test_rows_of_a_batch_are_coded_as_each_alone(made, reference):
    """Each row's runs start on the file's bases (broadcast over the batch): a row's prompt
    attention, decode attention and history are its own, bit for bit."""
    model, tokenizer = reference
    kv = collect_kv(model, mx.array(tokenizer.encode(PROMPT + PROMPT[::-1])))
    keys, values = kv[1]
    n = keys.shape[2] // 2
    k = mx.concatenate([keys[:, :, :n], keys[:, :, n : 2 * n]], axis=0)
    v = mx.concatenate([values[:, :, :n], values[:, :, n : 2 * n]], axis=0)
    q = mx.random.normal((2, 8, n, 128), key=mx.random.key(1))
    batch = PALUCache(config("palu", made["palu"]), None, 1)
    out = [feed(batch, k, v, q, 0, n - 1), feed(batch, k, v, q, n - 1, n)]
    for b in range(2):
        alone = PALUCache(config("palu", made["palu"]), None, 1)
        kb, vb, qb = k[b : b + 1], v[b : b + 1], q[b : b + 1]
        single = [feed(alone, kb, vb, qb, 0, n - 1), feed(alone, kb, vb, qb, n - 1, n)]
        for x, y in zip(out, single):
            assert mx.array_equal(x[b : b + 1], y)
        for x, y in zip(batch.dequantized(mx.float32), alone.dequantized(mx.float32)):
            assert mx.array_equal(x[b : b + 1], y)
    assert batch.store.keys.basis.shape[0] == 2


@pytest.mark.parametrize("method", list(SETTINGS))
def test_a_saved_calibrated_cache_continues_token_for_token(method, made, reference, tmp_path):
    model, tokenizer = reference
    tokens = mx.array(tokenizer.encode(PROMPT))
    head, tail = tokens[:200], tokens[200:260]
    cache = make_prompt_cache(model, config(method, made[method]))
    run(model, cache, head, chunk=64, decode=0)
    path = str(tmp_path / "saved.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    for t in tail:
        a = model(t.reshape(1, 1), cache=cache)[:, -1]
        b = model(t.reshape(1, 1), cache=loaded)[:, -1]
        assert mx.array_equal(a, b)
    assert all(len(c.store.keys.runs) == 1 and c.store.keys.gram is None for c in loaded)


def test_a_file_for_another_method_setting_model_or_shape_is_refused_naming_both_values(made):
    palu, svdq = made["palu"], made["svdq"]
    tiny = tiny_model("llama")  # 2 layers, 2 KV heads of 32
    wide = mx.zeros((1, 2, 8, 128))
    narrow = mx.zeros((1, 2, 8, 64))
    refusals = [
        (lambda: SVDqCache(KVCacheConfig(method="svdq", calibration_file=palu), None, 0)
         .update_and_fetch(wide, wide), palu, "method is 'palu' in the file .*, but 'svdq' in the config"),
        (lambda: PALUCache(config("palu", palu, palu_n_head_groups=2), None, 0).update_and_fetch(wide, wide),
         palu, "palu_n_head_groups is 1 in the file .*, but 2 in the config"),
        (lambda: PALUCache(config("palu", palu, palu_energy_threshold=0.8), None, 0).update_and_fetch(wide, wide),
         palu, "palu_energy_threshold is 0.9 in the file .*, but 0.8 in the config"),
        (lambda: make_prompt_cache(tiny, config("svdq", svdq, svdq_rank=8)), svdq,
         "svdq_rank is None in the file .*, but 8 in the config"),
        (lambda: make_prompt_cache(tiny, config("svdq", svdq)), svdq,
         r"num_hidden_layers is 4 in the file \(made for .*\), but 2 in the model"),
        (lambda: PALUCache(config("palu", palu), None, 0).update_and_fetch(narrow, narrow), palu,
         "head_dim is 128 in the file .*, but 64 in the keys of layer 0"),
    ]
    for build, path, message in refusals:
        with pytest.raises(CalibrationError, match=message) as refused:
            build()
        assert f"calibration_file={path!r}" in str(refused.value)
    # the widths code the latents, not the bases: a file serves every width
    c = PALUCache(config("palu", palu, palu_hi_bit=8, palu_lo_bit=4), None, 0)
    feed(c, wide, wide, mx.zeros((1, 8, 8, 128)), 0, 8)
    assert c.store.fitted and c.store.length == 8


def test_calibrate_refuses_too_few_tokens_for_a_basis(tmp_path, text_file):  # noqa: F811
    out = tmp_path / "short.safetensors"
    code, _, stderr = cli("calibrate", "--model", str(REFERENCE_MODEL), "--method", "palu", "--out", str(out),
                          "--set", "palu_n_head_groups=1", "--text", str(text_file), "--tokens", "200")
    assert code != 0 and not out.exists()
    assert "--method palu: 200 calibration tokens: a basis of 2 head(s) x head_dim 128 needs at least 256" in stderr
