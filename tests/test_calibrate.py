"""`veloxquant calibrate`: on the embedded reference model and a small text it writes a
safetensors file of per-layer codebooks (progress shown) fitted on the model's own keys and
values; a config pointing at it loads and uses it; a file for another model, shape,
setting or method is refused with an error naming the field and both values."""

import contextlib
import io
import json

import mlx.core as mx
import mlx_lm
import pytest

from rounding import SPECTRAL_ULPS, assert_same_logits
from test_methods_exactness import run
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.bench.cli import method_runs
from veloxquant_mlx.cache.options import VecInferOptions
from veloxquant_mlx.cli import main
from veloxquant_mlx.reference import REFERENCE_MODEL
from veloxquant_mlx.methods.vecinfer import VecInferCache
from veloxquant_mlx.cache.calibration import CalibrationError, collect_kv, read_calibration
from veloxquant_mlx.quant.vq_store import smoothing_factors

SETTINGS = {"key_codebook_bits": 8, "value_codebook_bits": 4}  # small codebooks: a fast fit
TOKENS = 400


def cli(*argv):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def write_file(folder, name, *args) -> tuple[str, str]:
    """``veloxquant calibrate --model <reference> --out FOLDER/NAME.safetensors ARGS``, which
    must succeed: the file's path and what the command wrote to stderr (its progress)."""
    out = folder / f"{name}.safetensors"
    code, _, stderr = cli("calibrate", "--model", str(REFERENCE_MODEL), "--out", str(out), *args)
    assert code == 0, stderr
    return str(out), stderr


def fitted_and_read_on_the_prompt(reference, folder, method, prompt, config, *args, decode=8, **settings):
    """A method's caches fitted on ``prompt`` (``config(**settings)``) and read from a file that
    ``veloxquant calibrate --method METHOD ARGS`` wrote on the prompt's own tokens (all but its
    last, which comes as the first decode step; ``config(file, **settings)``), each run over
    the prompt in one chunk then ``decode`` steps: their logits must be equal. Returns
    (fitted caches, read caches, the prompt's tokens)."""
    model, tokenizer = reference
    text = folder / "prompt.txt"
    text.write_text(prompt)
    tokens = mx.array(tokenizer.encode(prompt))
    n = tokens.shape[0]
    path = write_file(folder, "on-the-prompt", "--method", method, "--text", str(text), "--tokens", str(n - 1),
                      *args)[0]
    fitted, read = make_prompt_cache(model, config(**settings)), make_prompt_cache(model, config(path, **settings))
    a = run(model, fitted, tokens, chunk=n, decode=decode)
    b = run(model, read, tokens, chunk=n, decode=decode)
    assert_same_logits(a, b, ulps=SPECTRAL_ULPS if method == "spectral" else 0)
    return fitted, read, n



@pytest.fixture(scope="module")
def reference():
    model, tokenizer = mlx_lm.load(str(REFERENCE_MODEL))
    model.set_dtype(mx.float32)  # what calibrate's --dtype auto computes in on the CPU
    return model, tokenizer


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "acts.txt"
    path.write_text((REFERENCE_MODEL / "heldout_kjv_acts.txt").read_text()[60000:61000])
    return path


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, text_file):
    out = tmp_path_factory.mktemp("cal") / "vecinfer-ref.safetensors"
    code, stdout, stderr = cli("calibrate", "--model", str(REFERENCE_MODEL), "--method", "vecinfer",
                               "--text", str(text_file), "--out", str(out), "--tokens", str(TOKENS),
                               "--iters", "3", *[f"--set={k}={v}" for k, v in SETTINGS.items()])
    assert code == 0, stderr
    return out, stdout, stderr


def config(**extra):
    return KVCacheConfig(method="vecinfer", options=VecInferOptions(residual_length=32, **SETTINGS), **extra)


def test_calibrate_writes_a_safetensors_file_for_the_model_and_settings_showing_progress(calibrated):
    path, stdout, stderr = calibrated
    arrays, meta = read_calibration(str(path))
    assert meta["method"] == "vecinfer" and meta["layers"] == [0, 1, 2, 3]
    assert {k: meta[k] for k in ("key_codebook_bits", "value_codebook_bits", "key_sub_dim", "value_sub_dim")} \
        == {**SETTINGS, "key_sub_dim": 4, "value_sub_dim": 8}
    assert (meta["num_hidden_layers"], meta["num_key_value_heads"], meta["head_dim"]) == (4, 2, 128)
    assert meta["tokens"] == TOKENS and meta["text"] == "acts.txt"
    for i in range(4):
        assert arrays[f"layer{i}.key_centroids"].shape == (256, 4)
        assert arrays[f"layer{i}.value_centroids"].shape == (16, 8)
        assert arrays[f"layer{i}.key_scale"].shape == (1, 2, 1, 128)
    assert "keys and values of 400 tokens" in stderr and "layer 3" in stderr  # the progress bars
    assert f"calibration_file={path}" in stdout


def test_the_file_holds_the_smoothing_of_the_models_own_post_rope_keys(calibrated, reference, text_file):
    model, tokenizer = reference
    tokens = mx.array(tokenizer.encode(text_file.read_text())[:TOKENS])
    kv = collect_kv(model, tokens)
    arrays, _ = read_calibration(str(calibrated[0]))
    for i, (keys, _) in kv.items():
        assert mx.allclose(arrays[f"layer{i}.key_scale"], smoothing_factors(keys), rtol=1e-5)


def test_a_config_pointing_at_the_file_loads_and_uses_it(calibrated, reference):
    model, tokenizer = reference
    path = str(calibrated[0])
    arrays, _ = read_calibration(path)
    tokens = mx.array(tokenizer.encode((REFERENCE_MODEL / "heldout_kjv_acts.txt").read_text()[:300]))
    cache = make_prompt_cache(model, config(calibration_file=path))
    out = run(model, cache, tokens, chunk=150, decode=4)
    for i, c in enumerate(cache):
        assert c.store.fitted_from == "calibration" and c.store.count > 0
        assert mx.array_equal(c.store.key_codec.centroids, arrays[f"layer{i}.key_centroids"])
        assert mx.array_equal(c.store.value_codec.centroids, arrays[f"layer{i}.value_centroids"])
        assert mx.array_equal(c.store.key_codec.scale, arrays[f"layer{i}.key_scale"])
    fitted = make_prompt_cache(model, config())
    from_prompt = run(model, fitted, tokens, chunk=150, decode=4)
    assert fitted[0].store.fitted_from == "prompt"
    assert not mx.allclose(out, from_prompt, atol=1e-3)


def test_a_file_for_another_model_shape_setting_or_method_is_refused(calibrated, tmp_path):
    path = str(calibrated[0])
    tiny = tiny_model("llama")  # 2 layers, 2 KV heads of 32
    with pytest.raises(CalibrationError, match=r"num_hidden_layers is 4 in the file \(made for .*\), but 2 in the model"):
        make_prompt_cache(tiny, config(calibration_file=path))
    other = VecInferCache(config(calibration_file=path), None, 0)  # no model known: the keys' shape
    keys = mx.zeros((1, 2, 8, 64))
    with pytest.raises(CalibrationError, match="head_dim is 128 in the file .*, but 64 in the keys of layer 0"):
        other.update_and_fetch(keys, keys)
    with pytest.raises(CalibrationError, match="key_codebook_bits is 8 in the file .*, but 6 in the config"):
        options = VecInferOptions(key_codebook_bits=6, value_codebook_bits=4)
        keys = mx.zeros((1, 2, 8, 128))
        VecInferCache(KVCacheConfig(method="vecinfer", options=options, calibration_file=path), None, 0).update_and_fetch(keys, keys)
    arrays, meta = mx.load(path, return_metadata=True)
    foreign = tmp_path / "other.safetensors"
    mx.save_safetensors(str(foreign), arrays, {**meta, "method": json.dumps("kvquant")})
    with pytest.raises(CalibrationError, match="method is 'kvquant' in the file"):
        make_prompt_cache(tiny, config(calibration_file=str(foreign)))
    with pytest.raises(CalibrationError, match="no such file"):
        make_prompt_cache(tiny, config(calibration_file=str(tmp_path / "missing.safetensors")))


def test_bench_takes_the_file_as_a_config_field(calibrated):
    runs = method_runs(["vecinfer"], [f"calibration_file={calibrated[0]}"], sweep=False)
    assert [r.config.method for r in runs] == ["full", "vecinfer"]
    assert runs[1].config.calibration_file == str(calibrated[0])
    assert runs[1].settings["calibration_file"] == str(calibrated[0])


def test_calibrate_refuses_bad_requests_naming_what_is_wrong(tmp_path, text_file):
    code, _, err = cli("calibrate", "--method", "nsnquant", "--text", str(text_file))
    assert code == 2 and "has no calibration step; methods that have one: vecinfer" in err
    code, _, err = cli("calibrate", "--method", "vecinfer", "--out", str(tmp_path / "x.npz"))
    assert code == 2 and "must end in .safetensors" in err
    code, _, err = cli("calibrate", "--method", "vecinfer", "--text", str(tmp_path / "none.txt"))
    assert code == 2 and "no such file" in err
    code, _, err = cli("calibrate", "--method", "vecinfer", "--set", "calibration_file=a.safetensors")
    assert code == 2 and "calibrate writes the file that --out names" in err


def test_collect_queries_gives_each_layers_post_rope_queries_and_collect_kvs_keys_and_values(reference):
    """What a layer's cache attends with over a text fed in chunks: layer 0's queries are
    its projection of the normed embeddings, rotated at their positions (chunking rounds
    the rotation's angles by float32 ulps only); the keys and values of the same pass are
    mlx-lm's caches' (``collect_kv``), bit for bit, so one pass serves a query calibration."""
    from veloxquant_mlx.cache.calibration import collect_kv
    from veloxquant_mlx.integrations.query_capture import collect_queries

    model, tokenizer = reference
    tokens = mx.array(tokenizer.encode((REFERENCE_MODEL / "heldout_kjv_acts.txt").read_text()[:700]))
    queries, kv = collect_queries(model, tokens, chunk=256)
    stock = collect_kv(model, tokens, chunk=256)
    assert sorted(kv) == sorted(stock) == [0, 1, 2, 3]
    for i in kv:
        assert all(mx.array_equal(a, b) for a, b in zip(kv[i], stock[i]))
    attn = model.model.layers[0].self_attn
    assert sorted(queries) == [0, 1, 2, 3]
    assert queries[0].shape == (1, attn.n_heads, tokens.shape[0], 128)
    h = model.model.layers[0].input_layernorm(model.model.embed_tokens(tokens[None]))
    expected = attn.rope(attn.q_proj(h).reshape(1, tokens.shape[0], attn.n_heads, -1).transpose(0, 2, 1, 3))
    assert mx.allclose(queries[0], expected, atol=1e-4, rtol=1e-4)
    assert not mx.allclose(queries[1], queries[0], atol=1e-2)  # each layer its own


def test_the_methods_that_calibrate_are_those_the_spec_says_read_calibration_file():
    """A class with ``calibrate`` whose spec entry does not list ``calibration_file`` would
    be refused the file by the command line (and warned at by the config), and the reverse
    would accept a file nothing reads."""
    from veloxquant_mlx._generated.deprecations import CONFIG_FIELD_USERS
    from veloxquant_mlx.registry import METHODS, implemented_methods

    calibrating = {m for m in implemented_methods() if hasattr(METHODS[m].load_implementation(), "calibrate")}
    assert calibrating == set(CONFIG_FIELD_USERS["calibration_file"])
    assert len(calibrating) == 9
