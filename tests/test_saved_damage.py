"""Damaged saved caches (issue 38): an edited xkv layer index or bit width, and a cut
cachegen stream, are refused when loading, naming the file, the layer and the field
(they used to load and fail at generation with MLX shape errors, or name no field)."""

import json

import mlx.core as mx
import mlx_lm
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.base import CacheStateError
from veloxquant_mlx.integrations.mlx_lm import make_prompt_cache
from veloxquant_mlx.integrations.saved import CHECKSUM_KEY, load_prompt_cache, save_prompt_cache
from veloxquant_mlx.reference import REFERENCE_MODEL


@pytest.fixture(scope="module")
def model():
    return mlx_lm.load(str(REFERENCE_MODEL))


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    """method -> (arrays, metadata) of a file saved after a 300-token prompt and 3 tokens."""
    m, tokenizer = model
    text = (REFERENCE_MODEL / "heldout_kjv_acts.txt").read_text()[:300]
    out = {}
    for method in ("xkv", "cachegen"):
        cache = make_prompt_cache(m, KVCacheConfig(method=method))
        for _ in mlx_lm.stream_generate(m, tokenizer, text, max_tokens=3, prompt_cache=cache):
            pass
        path = tmp_path_factory.mktemp(method) / "cache.safetensors"
        save_prompt_cache(str(path), cache, m)
        out[method] = mx.load(str(path), return_metadata=True)
    return out


def _damaged(saved, method, tmp_path, edit):
    """The saved file with ``edit(arrays)`` applied and its checksum dropped (as a file saved
    by mlx-lm's own save_prompt_cache has none), written to a new file."""
    arrays, metadata = saved[method]
    arrays = dict(arrays)
    edit(arrays)
    metadata = {k: v for k, v in metadata.items() if not k.endswith(CHECKSUM_KEY)}
    path = tmp_path / f"damaged-{method}.safetensors"
    mx.save_safetensors(str(path), arrays, metadata)
    return str(path)


def _edit_config(arrays, layer, field, value):
    key = f"{layer}.meta.config"
    config = json.loads("".join(chr(i) for i in arrays[key].tolist()))
    config["options"][field] = value
    arrays[key] = mx.array([ord(c) for c in json.dumps(config, sort_keys=True)])


def test_the_undamaged_file_loads(saved, model, tmp_path):
    for method in saved:
        assert len(load_prompt_cache(_damaged(saved, method, tmp_path, lambda a: None), model[0])) == 4


@pytest.mark.parametrize("layer,claimed", [(0, 3), (1, 2), (3, 7)])
def test_edited_xkv_layer_index_is_refused(saved, model, tmp_path, layer, claimed):
    def edit(arrays):
        arrays[f"{layer}.meta.layer"] = mx.array(claimed)

    path = _damaged(saved, "xkv", tmp_path, edit)
    with pytest.raises(CacheStateError) as err:
        load_prompt_cache(path, model[0])
    message = str(err.value)
    assert path in message and f"layer {layer} " in message and f"meta.layer is {claimed}" in message, message


@pytest.mark.parametrize("bits", [2, 8, 16])
def test_edited_xkv_bit_width_is_refused(saved, model, tmp_path, bits):
    path = _damaged(saved, "xkv", tmp_path, lambda a: _edit_config(a, 0, "xkv_latent_bits", bits))
    with pytest.raises(CacheStateError) as err:
        load_prompt_cache(path, model[0])
    message = str(err.value)
    assert path in message and "layer 0 " in message and "latent codes" in message, message
    assert f"xkv_latent_bits={bits}" in message and "[dequantize]" not in message, message


@pytest.mark.parametrize("name,cut", [("0.arrays.k_stream", 100), ("1.arrays.v_stream", 1),
                                      ("0.arrays.k_anchor_stream", 50), ("2.arrays.v_table", 10)])
def test_cut_cachegen_stream_is_refused(saved, model, tmp_path, name, cut):
    def edit(arrays):
        arrays[name] = arrays[name][: arrays[name].shape[0] - cut]

    path = _damaged(saved, "cachegen", tmp_path, edit)
    with pytest.raises(CacheStateError) as err:
        load_prompt_cache(path, model[0])
    layer, _, field = name.split(".")
    message = str(err.value)
    assert path in message and f"layer {layer} " in message and field in message, message
