"""Issue 38's last item: xkv given its prompt one token at a time says that it compresses
nothing; a field given both flat and in ``options`` at different values is reported."""

import warnings

import mlx_lm
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.config import ConflictingFieldWarning
from veloxquant_mlx.cache.options import H2OOptions
from veloxquant_mlx.integrations.mlx_lm import make_prompt_cache
from veloxquant_mlx.reference import REFERENCE_MODEL


@pytest.fixture(scope="module")
def model():
    return mlx_lm.load(str(REFERENCE_MODEL))


def _generate(model, step):
    m, tokenizer = model
    cache = make_prompt_cache(m, KVCacheConfig(method="xkv"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in mlx_lm.stream_generate(m, tokenizer, "In the beginning was the Word, " * 2,
                                        max_tokens=2, prompt_cache=cache, prefill_step_size=step):
            pass
    return cache, [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]


def test_xkv_prefilled_one_token_at_a_time_says_it_saves_nothing(model):
    cache, said = _generate(model, 1)
    assert all(c.n_latent == 0 for c in cache)  # what the warning is about: nothing compressed
    assert len(said) == 2 and all("prefill_step_size=1" in s and "saves no memory" in s for s in said), said
    cache, said = _generate(model, 16)
    assert all(c.n_latent > 0 for c in cache) and not said, said


def test_a_field_given_flat_and_in_options_at_different_values_warns():
    with pytest.warns(ConflictingFieldWarning, match=r"h2o_budget is given twice, h2o_budget=100 .*h2o_budget=64"):
        config = KVCacheConfig(method="h2o", h2o_budget=100, options=H2OOptions(h2o_budget=64))
    assert config.h2o_budget == 100
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConflictingFieldWarning)
        # the same value twice, or a field options leave at its default: nothing to report
        KVCacheConfig(method="h2o", h2o_budget=100, options=H2OOptions(h2o_budget=100))
        KVCacheConfig(method="h2o", h2o_budget=100, options=H2OOptions(h2o_n_sink=8))
        KVCacheConfig(method="h2o", options=H2OOptions(h2o_budget=64))


def test_a_flat_field_named_at_its_default_against_options_warns_that_options_hold():
    default = H2OOptions().h2o_budget
    with pytest.warns(ConflictingFieldWarning, match=rf"h2o_budget={default} and .*h2o_budget=64.*the options' 64 is used"):
        config = KVCacheConfig(method="h2o", h2o_budget=default, options=H2OOptions(h2o_budget=64))
    assert config.h2o_budget == 64
