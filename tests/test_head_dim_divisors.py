"""Issue 37: a field that must divide head_dim (``divides: [head_dim]`` in the spec) is
refused when the model is known, at cache construction, in one line naming the field,
the value and what is allowed; not at the first use."""

from pathlib import Path

import pytest

from codegen.parse import SpecError, load_spec

from tiny_models import tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache, patch_model_kv_cache
from veloxquant_mlx.cache.options import CacheGenOptions
from veloxquant_mlx.cli import main
from veloxquant_mlx.registry import METHODS

CACHEGEN_48 = KVCacheConfig(method="cachegen", options=CacheGenOptions(cachegen_group_size=48))


def test_every_field_documented_to_divide_head_dim_is_checked():
    spec = load_spec(Path(__file__).parents[1] / "spec" / "methods.yaml")
    for m in spec.methods:
        documented = {f.name for f in m.fields if "divide head_dim" in f.doc or "divisor of head_dim" in f.doc}
        assert documented == set(METHODS[m.key].head_dim_divisors), m.key
    assert "cachegen_group_size" in METHODS["cachegen"].head_dim_divisors
    assert set(METHODS["vecinfer"].head_dim_divisors) == {"key_sub_dim", "value_sub_dim"}


def test_the_spec_refuses_divides_naming_an_unknown_dimension(tmp_path):
    text = (Path(__file__).parents[1] / "spec" / "methods.yaml").read_text()
    bad = text.replace("    divides: [head_dim]", "    divides: [hidden_size]", 1)
    (tmp_path / "methods.yaml").write_text(bad)
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path / "methods.yaml")
    assert "divides: expected a non-empty list of head_dim, got ['hidden_size']" in str(info.value)


@pytest.mark.parametrize("build", [make_prompt_cache, patch_model_kv_cache])
def test_a_group_size_that_does_not_divide_head_dim_is_refused_at_construction(build):
    model = tiny_model("llama")  # head_dim 32
    with pytest.raises(ValueError) as info:
        build(model, CACHEGEN_48)
    assert str(info.value) == ("method 'cachegen': cachegen_group_size=48 must divide head_dim=32; "
                               "allowed here: 1, 2, 4, 8, 16, 32")
    make_prompt_cache(model, KVCacheConfig(method="cachegen", options=CacheGenOptions(cachegen_group_size=16)))


def test_generate_refuses_it_in_one_line(capsys):
    code = main(["generate", "--method", "cachegen", "--set", "cachegen_group_size=48", "--prompt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == ("veloxquant generate: error: --set cachegen_group_size=48 must divide "
                      "head_dim=128; allowed here: 1, 2, 4, 8, 16, 32, 64, 128")
