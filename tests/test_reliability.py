"""What broke for users: saved caches in a fresh process, the server's copies of caches."""

import json
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache as mlx_lm_load
from mlx_lm.models.cache import save_prompt_cache

from conformance import edit_saved_layer
from test_methods_exactness import run
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache

KIVI = KVCacheConfig(method="kivi", kv_bits=4, residual_window=64)


def _fresh_process(code: str) -> dict:
    """Run ``code`` in a new interpreter (nothing of ours imported); it prints one JSON line."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=300, cwd=__file__.rsplit("/", 1)[0],
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_saved_cache_loads_after_importing_the_package_and_decodes_right_unpatched(tmp_path):
    """Before: KeyError 'KIVICache' in load_prompt_cache; with the module imported and the
    model unpatched, a first decode step silently off by ~15 in the logits."""
    model = tiny_model("llama")
    tokens = prompt(150)
    cache = make_prompt_cache(model, KIVI)
    run(model, cache, tokens, decode=0)
    path = tmp_path / "kivi.safetensors"
    save_prompt_cache(str(path), cache)
    nxt = mx.array([[7]])
    expected = model(nxt, cache=cache)[0, -1]
    out = _fresh_process(f"""
        import json, mlx.core as mx, veloxquant_mlx
        from mlx_lm.models.cache import load_prompt_cache
        from tiny_models import tiny_model
        model = tiny_model("llama")
        cache = load_prompt_cache({str(path)!r})
        logits = model(mx.array([[7]]), cache=cache)[0, -1]
        print(json.dumps({{"cls": type(cache[0]).__name__, "logits": logits.tolist()}}))
    """)
    assert out["cls"] == "KIVICache"
    assert mx.allclose(mx.array(out["logits"]), expected, atol=1e-4)


# -- saved files that do not match their config or the model ------------------------------
def _save(tmp_path, config, n=150, model=None):
    model = model or tiny_model("llama")
    cache = make_prompt_cache(model, config)
    run(model, cache, prompt(n), decode=2)
    path = tmp_path / "cache.safetensors"
    save_prompt_cache(str(path), cache)
    return path, model


def _config_edit(**changes):
    def edit(meta, arrays):
        config = json.loads(meta["config"])
        for key, value in changes.items():
            if key == "method":
                config["method"] = value
            elif key in config:
                config[key] = value
            else:
                config["options"][key] = value
        meta["config"] = json.dumps(config, sort_keys=True)

    return edit


def _as_snapkv(meta, arrays):
    meta["config"] = json.dumps(KVCacheConfig(method="snapkv").to_dict(), sort_keys=True)


@pytest.mark.parametrize("edit, message", [
    (_as_snapkv, r"config method is 'snapkv', expected 'kivi'"),
    (_config_edit(method="snapkv"), r"config does not parse: 'kivi_group_size' is not a field of SnapKVOptions"),
    (_config_edit(residual_window=32), r"full-precision values is 6\d, expected (from )?min\(offset 152, window 32\)"),
    (_config_edit(kv_bits=2), r"key codes and scales is .*expected .*2-bit codes"),
    (_config_edit(kivi_group_size=64), r"groups of 64"),
    (lambda meta, arrays: meta.update(offset=5000), r"offset 5000"),
    (lambda meta, arrays: meta.update(offset=10), r"offset is 10, expected >= the 152 tokens stored"),
    (lambda meta, arrays: meta.update(offset=-1), r"offset is -1, expected a token count >= 0"),
])
def test_a_saved_kivi_cache_that_contradicts_its_config_is_refused(tmp_path, edit, message):
    from veloxquant_mlx import load_prompt_cache
    from veloxquant_mlx.cache.base import CacheStateError

    path, _ = _save(tmp_path, KIVI)
    edit_saved_layer(path, 1, edit)
    with pytest.raises(CacheStateError, match=message) as info:
        load_prompt_cache(path)
    assert str(path) in str(info.value) and "layer 1" in str(info.value)
    with pytest.raises(CacheStateError, match=message):  # mlx-lm's own loader refuses too
        mlx_lm_load(str(path))


@pytest.mark.parametrize("method", ["full", "streaming_llm", "snapkv", "h2o"])
def test_a_saved_cache_with_an_impossible_offset_is_refused(tmp_path, method):
    from veloxquant_mlx import load_prompt_cache
    from veloxquant_mlx.cache.base import CacheStateError
    from conformance import config, profile

    path, _ = _save(tmp_path, config(method, profile(method).compressing))
    edit_saved_layer(path, 0, lambda meta, arrays: meta.update(offset=3))
    with pytest.raises(CacheStateError, match=r"layer 0 .*offset"):
        load_prompt_cache(path)


def test_a_cache_saved_for_another_model_is_refused(tmp_path):
    from veloxquant_mlx import load_prompt_cache
    from veloxquant_mlx.cache.base import CacheStateError

    path, model = _save(tmp_path, KIVI)
    other_heads = tiny_model("llama", num_key_value_heads=1)
    with pytest.raises(CacheStateError, match=r"kv heads x head_dim is 2 x 32, expected the model's 1 x 32"):
        load_prompt_cache(path, model=other_heads)
    with pytest.raises(CacheStateError, match=r"layers is 2, expected the model's 3"):
        load_prompt_cache(path, model=tiny_model("llama", num_hidden_layers=3))
    cache = mlx_lm_load(str(path))  # mlx-lm's loader cannot know the model: the first step refuses
    with pytest.raises(CacheStateError, match=r"holds batch x kv heads x key/value head_dim \(1, 2, 32, 32\), but the model gives \(1, 1, 32, 32\)"):
        other_heads(mx.array([[3]]), cache=cache)
    loaded = load_prompt_cache(path, model=model)  # the right model: loads, one shared context
    assert all(c.context is loaded[0].context for c in loaded)
