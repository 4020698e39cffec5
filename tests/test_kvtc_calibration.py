"""kvtc with a calibration file (issue 31): the paper's offline basis instead of a fit at
prefill. A cache reading the file codes exactly what the file's codec gives and solves no
eigenproblem; a file calibrated on the prompt's own tokens rebuilds what the prompt fit
rebuilds; a file for another method, setting, model or key rotary is refused, naming the
file, the field and both values; `veloxquant calibrate --method kvtc` writes a file that
mlx-lm-style generation uses."""

import mlx.core as mx
import pytest

from feeding import feed
from test_calibrate import write_file, reference, text_file  # noqa: F401 - module fixtures reused
from test_methods_exactness import run
from tiny_models import tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.calibration import CalibrationError, collect_kv, read_calibration
from veloxquant_mlx.cache.options import KVTCOptions
from veloxquant_mlx.methods.kvtc import KVTCCache
from veloxquant_mlx.methods.kvtc.cache import CODEC, N_SINK
from veloxquant_mlx.methods.kvtc.transform import TransformCodec, _rotate
from veloxquant_mlx.quant.prerope import args_rotary
from veloxquant_mlx.reference import REFERENCE_MODEL

TOKENS = 256
WINDOW = 32
PROMPT = (REFERENCE_MODEL / "heldout_kjv_acts.txt").read_text()[:200]  # not the calibration text


def calibrate(tmp_path, name, *args):
    return write_file(tmp_path, name, *args)[0]


@pytest.fixture(scope="module")
def made(tmp_path_factory, text_file):  # noqa: F811
    return calibrate(tmp_path_factory.mktemp("kvtc"), "kvtc-ref", "--method", "kvtc", "--text",
                     str(text_file), "--tokens", str(TOKENS), "--set", f"residual_window={WINDOW}")


def config(path=None, **options):
    return KVCacheConfig(method="kvtc", options=KVTCOptions(**options), residual_window=WINDOW,
                         calibration_file=path)


def file_codec(path, layer, prefix) -> TransformCodec:
    arrays, _ = read_calibration(path)
    return TransformCodec(*(arrays[f"layer{layer}.{prefix}_{name}"] for name in CODEC))


def encoded(codec, x, rotary, start=N_SINK):
    """The codes of tokens x (B, H, n, d) at positions start.. (pre-RoPE keys when rotary)."""
    b, h, n, d = x.shape
    return codec.encode(_rotate(x, start, rotary, inverse=True).transpose(0, 2, 1, 3).reshape(b, n, h * d))


def prefill(cache, keys, values):
    """The whole prompt as one chunk, as mlx-lm hands it to the layer's cache."""
    q = mx.random.normal(keys.shape, key=mx.random.key(0))
    feed(cache, keys, values, q, 0, keys.shape[2])
    mx.eval(cache.state)


def test_prefill_codes_with_the_files_codec_and_solves_no_eigenproblem(made, reference, monkeypatch):
    model, tokenizer = reference
    kv = collect_kv(model, mx.array(tokenizer.encode(PROMPT)))
    caches = make_prompt_cache(model, config(made))

    def no_eigh(*args, **kwargs):
        raise AssertionError("mx.linalg.eigh on the prefill path of a calibrated cache")

    monkeypatch.setattr(mx.linalg, "eigh", no_eigh)
    rotary = args_rotary(model.args)
    for i, (keys, values) in kv.items():
        cache = caches[i]
        prefill(cache, keys, values)
        n = cache.store.keys.count
        assert n == keys.shape[2] - N_SINK - WINDOW
        for prefix, run, x, rot in (("k", cache.store.keys, keys, rotary), ("v", cache.store.values, values, None)):
            codec = file_codec(made, i, prefix)
            assert mx.array_equal(run.codec.basis, codec.basis)
            assert mx.array_equal(run.unpacked(), encoded(codec, x[:, :, N_SINK : N_SINK + n], rot))


def test_a_file_calibrated_on_the_prompt_rebuilds_what_the_prompt_fit_rebuilds(reference, tmp_path):
    """Exactly: the calibration fits the same rows (past the sinks, keys rotated back at
    the same positions) with the same arithmetic, and the file keeps the codec's float16
    mean and basis and float32 steps as they are; so no rounding separates the two."""
    model, tokenizer = reference
    text = tmp_path / "prompt.txt"
    text.write_text(PROMPT)
    n = len(tokenizer.encode(PROMPT))
    path = calibrate(tmp_path, "on-the-prompt", "--method", "kvtc", "--text", str(text), "--tokens", str(n),
                     "--set", f"residual_window={WINDOW}")
    kv = collect_kv(model, mx.array(tokenizer.encode(PROMPT)))
    fitted, read = make_prompt_cache(model, config()), make_prompt_cache(model, config(path))
    for i, (keys, values) in kv.items():
        prefill(fitted[i], keys, values)
        prefill(read[i], keys, values)
        assert fitted[i].store.keys.count > 0
        for a, b in zip(fitted[i].dequantized(mx.float32), read[i].dequantized(mx.float32)):
            assert mx.array_equal(a, b)
        assert read[i].nbytes == fitted[i].nbytes  # the file's codec is held and counted alike


def test_a_file_for_another_method_setting_model_or_rotary_is_refused_naming_both_values(
        made, tmp_path, text_file):  # noqa: F811
    vecinfer = calibrate(tmp_path, "vecinfer", "--method", "vecinfer", "--text", str(text_file), "--tokens",
                         "64", "--iters", "1", "--set", "key_codebook_bits=4", "--set", "value_codebook_bits=4")
    tiny = tiny_model("llama")  # 2 layers, 2 KV heads of 32
    narrow, wide = mx.zeros((1, 2, 8, 64)), mx.zeros((1, 2, 8, 128))
    refusals = [
        (lambda: make_prompt_cache(tiny, config(vecinfer)), vecinfer,
         "method is 'vecinfer' in the file .*, but 'kvtc' in the config"),
        (lambda: make_prompt_cache(tiny, config(made, kvtc_bit_budget=256)), made,
         "kvtc_bit_budget is 512 in the file .*, but 256 in the config"),
        (lambda: make_prompt_cache(tiny, config(made)), made,
         r"num_hidden_layers is 4 in the file \(made for .*\), but 2 in the model"),
        (lambda: KVTCCache(config(made), None, 0).update_and_fetch(narrow, narrow), made,
         "head_dim is 128 in the file .*, but 64 in the keys of layer 0"),
        # the right shape, but no model known: the cache would code its keys post-RoPE
        (lambda: KVTCCache(config(made), None, 0).update_and_fetch(wide, wide), made,
         r"""key_rotary is '\[500000.0, false, ""\]' in the file .*, but 'none' in the cache of layer 0"""),
    ]
    for build, path, message in refusals:
        with pytest.raises(CalibrationError, match=message) as refused:
            build()
        assert f"calibration_file={path!r}" in str(refused.value)


def test_the_cli_file_serves_generation_with_the_codes_of_its_codec(made, reference):
    model, tokenizer = reference
    arrays, meta = read_calibration(made)
    assert meta["method"] == "kvtc" and meta["layers"] == [0, 1, 2, 3] and meta["tokens"] == TOKENS
    assert [meta[f] for f in KVTCCache.calibration_fields] == [512, [0, 1, 2, 3, 4, 6, 8], 3.5, WINDOW]
    assert arrays["layer0.k_basis"].shape[0] == 2 * 128
    assert int(arrays["layer0.k_bits"].astype(mx.int32).sum()) == 512
    tokens = mx.array(tokenizer.encode(PROMPT))
    greedy, received = [], {}
    for attempt in range(2):
        cache = make_prompt_cache(model, config(made))
        if attempt == 0:  # what each layer's cache is given, and how many rows it had coded before
            for i, c in enumerate(cache):
                def spy(keys, values, c=c, i=i, update=c.update_and_fetch):
                    received.setdefault(i, []).append((keys, c.store.keys.count))
                    return update(keys, values)
                c.update_and_fetch = spy
        greedy.append(mx.argmax(run(model, cache, tokens, chunk=64, decode=4), axis=-1))
        if attempt == 0:
            rotary = args_rotary(model.args)
            for i, c in enumerate(cache):
                n = c.store.keys.count
                assert n == tokens.size - 1 - N_SINK - WINDOW  # the last prompt token and the steps wait
                keys = mx.concatenate([k for k, _ in received[i]], axis=2)
                # encoded chunk by chunk, as the cache codes the rows each chunk pushes out of
                # the window: a projection of other row counts rounds a few codes otherwise
                ends = sorted({coded for _, coded in received[i]} | {n})
                want = [encoded(file_codec(made, i, "k"), keys[:, :, N_SINK + a : N_SINK + b], rotary, N_SINK + a)
                        for a, b in zip(ends, ends[1:])]
                assert mx.array_equal(c.store.keys.unpacked(), mx.concatenate(want, axis=1))
    assert mx.array_equal(greedy[0], greedy[1])
