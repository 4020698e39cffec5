"""Saved caches edited, cut or made for another model, as a hostile user would try them."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache as mlx_lm_load
from mlx_lm.models.cache import save_prompt_cache as mlx_lm_save

from conformance import PROMPT, edit_saved_layer
from test_conformance import METHOD_KEYS, compressing, drive
from tiny_models import prompt, tiny_model
from veloxquant_mlx import load_prompt_cache, save_prompt_cache
from veloxquant_mlx.cache.base import CacheStateError

# A ring of sinks + window keeps no positions: nothing it holds bounds its offset.
RING = {"streaming_llm"}


def _saved(tmp_path, method, decode, model=None, save=mlx_lm_save):
    model = model or tiny_model("llama")
    cache = compressing(method, model)
    drive(model, cache, prompt(PROMPT + 4 + decode), decode=decode)
    path = tmp_path / "cache.safetensors"
    if save is mlx_lm_save:
        save(str(path), cache)
    else:
        save(str(path), cache, model)
    return path, model, cache


def _set_offset(path, layers, offset):
    for layer in range(layers):
        edit_saved_layer(path, layer, lambda meta, arrays: meta.update(offset=offset))


@pytest.mark.parametrize("method", sorted(set(METHOD_KEYS) - RING))
def test_an_offset_beyond_what_the_cache_holds_is_refused_after_decoding(method, tmp_path):
    """Before: offset 1,000,000 in every layer loaded for h2o, kvzip, snapkv (and 16 other
    methods) and went on with RoPE at the wrong positions."""
    path, _, cache = _saved(tmp_path, method, decode=4)
    _set_offset(path, len(cache), 1_000_000)
    named = r"layer 0 .*(offset is 1000000, expected \d+|expected (the offset )?(1000000|9999\d\d))"
    with pytest.raises(CacheStateError, match=named) as info:
        load_prompt_cache(path)
    assert str(path) in str(info.value)
    with pytest.raises(CacheStateError, match=named):
        mlx_lm_load(str(path))


@pytest.mark.parametrize("method", ["h2o", "snapkv", "kivi", "kvtc"])
def test_an_offset_edit_right_after_the_prompt_is_refused_by_both_loaders(method, tmp_path):
    """Methods that keep every token, or protect the newest ones, bound the offset by
    what they hold even before a decode step."""
    path, _, cache = _saved(tmp_path, method, decode=0)
    _set_offset(path, len(cache), 1_000_000)
    for load in (load_prompt_cache, mlx_lm_load):
        with pytest.raises(CacheStateError, match=r"(offset is 1000000, expected \d+|expected (the offset )?(1000000|9999\d\d))"):
            load(str(path))


@pytest.mark.parametrize("method", ["streaming_llm", "tova", "kvzip"])
def test_an_offset_edit_that_the_contents_cannot_bound_is_caught_by_the_checksum(method, tmp_path):
    """A ring, or an eviction at the prompt's end that may drop the newest token, leaves
    nothing that bounds the offset: the checksum written by our save catches the edit."""
    path, model, cache = _saved(tmp_path, method, decode=0, save=save_prompt_cache)
    assert len(load_prompt_cache(path, model)) == len(cache)  # unedited: loads
    _set_offset(path, len(cache), 1_000_000)
    with pytest.raises(CacheStateError, match=r"arrays checksum is [0-9a-f]{16}, expected the saved [0-9a-f]{16}"):
        load_prompt_cache(path, model)


def test_a_budget_edited_in_the_saved_config_is_refused(tmp_path):
    """Before: ``h2o_budget=64`` written into a saved h2o config (it kept 48) loaded."""
    path, _, cache = _saved(tmp_path, "h2o", decode=4)

    def edit(meta, arrays):
        config = json.loads(meta["config"])
        config["options"]["h2o_budget"] = 64
        meta["config"] = json.dumps(config, sort_keys=True)

    for layer in range(len(cache)):
        edit_saved_layer(path, layer, edit)
    with pytest.raises(CacheStateError, match=r"layer 0 .*stored tokens is 52, expected 68 for budget 64"):
        load_prompt_cache(path)


def test_a_cache_saved_from_another_model_of_the_same_shapes_is_refused(tmp_path):
    """Before: loaded into a model of the same shapes and other weights (both loaders),
    and continued with wrong text."""
    path, model, _ = _saved(tmp_path, "kivi", decode=2, save=save_prompt_cache)
    other = tiny_model("llama", seed=1)
    with pytest.raises(CacheStateError, match=r"model fingerprint is ([0-9a-f]{16}) \(llama, 2 layers, "
                       r"hidden 64\), expected this model's (?!\1)[0-9a-f]{16} \(llama, 2 layers, hidden 64\)"):
        load_prompt_cache(path, other)
    loaded, metadata = load_prompt_cache(path, model, return_metadata=True)
    assert len(loaded) == 2 and "veloxquant_arrays_sha256" not in metadata
    assert len(mlx_lm_load(str(path))) == 2  # mlx-lm's loader still reads our files


def test_corrupted_values_are_refused_by_the_checksum(tmp_path):
    """Before: 16 values changed in an array loaded silently."""
    path, model, _ = _saved(tmp_path, "snapkv", decode=2, save=save_prompt_cache)

    def corrupt(meta, arrays):
        keys = arrays["keys"]
        flat = keys.reshape(-1)
        flat[:16] = flat[:16] + 1
        arrays["keys"] = flat.reshape(keys.shape)

    edit_saved_layer(path, 1, corrupt)
    with pytest.raises(CacheStateError, match=r"arrays checksum .*changed or damaged after it was saved"):
        load_prompt_cache(path, model)


# -- damaged files: every problem names the file and the layer ------------------------------
@pytest.mark.parametrize("save,name", [(save_prompt_cache, "v_stream"), (save_prompt_cache, "v_anchor_scales"),
                                       (mlx_lm_save, "v_codes"), (mlx_lm_save, "v_anchor_codes")])
def test_a_missing_array_is_named_with_the_file_and_layer(tmp_path, save, name):
    """Before: cachegen without ``v_stream`` failed inside the cache with KeyError 'v_stream'.
    Our save writes the coded form (its checksum dropped here, as mlx-lm's save has none),
    mlx-lm's the resident one: both name what is missing."""
    path, _, _ = _saved(tmp_path, "cachegen", decode=2, save=save)
    arrays, metadata = mx.load(str(path), return_metadata=True)
    del arrays[f"1.arrays.{name}"]
    mx.save_safetensors(str(path), arrays, {k: v for k, v in metadata.items() if "sha256" not in k})
    with pytest.raises(CacheStateError, match=rf"cache.safetensors: .*layer 1 .*'{name}' is missing"):
        load_prompt_cache(path)


@pytest.mark.parametrize("method", ["snapkv", "h2o", "kvzip"])
def test_a_shortened_array_is_refused_naming_the_rows(method, tmp_path):
    path, _, _ = _saved(tmp_path, method, decode=2)
    edit_saved_layer(path, 1, lambda meta, arrays: arrays.update(values=arrays["values"][:, :, :-3]))
    with pytest.raises(CacheStateError, match=r"layer 1 .*rows of the kept arrays is .*'values': \d+"):
        load_prompt_cache(path)


def test_an_unknown_cache_class_and_a_cut_metadata_are_named_with_the_file(tmp_path):
    """Before: ``KeyError: 'NoSuchCache'`` and "not enough values to unpack" from mlx-lm."""
    path, _, _ = _saved(tmp_path, "kivi", decode=2)
    arrays, metadata = mx.load(str(path), return_metadata=True)
    mx.save_safetensors(str(path), arrays, {**metadata, "1.1": "NoSuchCache"})
    with pytest.raises(CacheStateError, match=r"cache.safetensors: layer 1 cache class is 'NoSuchCache'"):
        load_prompt_cache(path)
    mx.save_safetensors(str(path), arrays, {k: v for k, v in metadata.items() if not k.startswith("2.")})
    with pytest.raises(CacheStateError, match=r"cache.safetensors: metadata is not mlx-lm's prompt-cache layout"):
        load_prompt_cache(path)


def test_buffer_rooms_edited_are_refused_or_bounded(tmp_path):
    """The rooms a saved cache's buffers had: garbage is refused naming the field; a room
    no growth leaves (more than a step of spare rows) is not allocated."""
    path, _, cache = _saved(tmp_path, "kivi", decode=4)
    meta_rooms = {}

    def read(meta, arrays):
        meta_rooms.update(json.loads(meta["buffer_rooms"]))

    edit_saved_layer(path, 0, read)
    assert meta_rooms  # kivi's buffers hold spare rows after decoding
    edit_saved_layer(path, 0, lambda meta, arrays: meta.update(buffer_rooms="[not json"))
    with pytest.raises(CacheStateError, match=r"layer 0 .*buffer_rooms is '\[not json', expected a JSON object"):
        mlx_lm_load(str(path))
    huge = {name: 10**9 for name in meta_rooms}
    edit_saved_layer(path, 0, lambda meta, arrays: meta.update(buffer_rooms=json.dumps(huge)))
    loaded = mlx_lm_load(str(path))
    assert loaded[0].nbytes <= cache[0].nbytes
