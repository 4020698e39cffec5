"""AMC's tiers on a model: short prompts (the fit waits for enough tokens) and the tier
mix of generated tokens, which must follow the card's fractions as the prompt's do."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.methods.amc.cache import FIT_TOKENS


def amc_cache(model, **options):
    return make_prompt_cache(model, KVCacheConfig.from_dict({"method": "amc", "options": options}))


def tier_fractions(flags: mx.array) -> list[float]:
    return [float((flags == t).astype(mx.float32).mean()) for t in range(3)]


def test_decode_tokens_take_the_cards_tier_mix_with_frozen_thresholds():
    # Trained models' keys carry large channel means; RoPE turns a pair's mean further
    # with every position, so statistics of the prompt's post-RoPE keys call generated
    # keys atypical (99% of them went to High). A key bias stands in for those means;
    # saliency over pre-RoPE keys ranks generated keys like the prompt's.
    model = tiny_model("llama", attention_bias=True)
    for layer in model.layers:
        layer.self_attn.k_proj.bias = mx.full(layer.self_attn.k_proj.bias.shape, 2.0)
    n_prompt, n_decode = 128, 256
    tokens = prompt(n_prompt + n_decode, seed=3)
    cache = amc_cache(model)  # defaults: 0.2 High, 0.3 Mid, frozen thresholds
    model(tokens[:n_prompt][None], cache=cache)
    for t in tokens[n_prompt:]:
        model(t.reshape(1, 1), cache=cache)
    for layer in cache:
        flags = layer.store.flags.view()
        assert tier_fractions(flags[..., :n_prompt]) == pytest.approx([0.2, 0.3, 0.5], abs=1 / n_prompt)
        assert tier_fractions(flags[..., n_prompt:])[0] < 0.4
    # Layer 0's keys are a function of the token alone (stationary before RoPE), so its
    # generated tokens follow the card's mix: 512 samples (2 heads), a binomial standard
    # deviation of about 0.02, thresholds that are quantiles of 128 prompt tokens (about
    # 0.04 each way). Deeper layers' keys also drift with the context's length.
    flags = cache[0].store.flags.view()
    assert tier_fractions(flags[..., n_prompt:]) == pytest.approx([0.2, 0.3, 0.5], abs=0.08)


@pytest.mark.parametrize("n_prompt", [1, 2, FIT_TOKENS - 2])
def test_tokens_before_the_fit_are_high_and_the_fit_comes_when_enough_exist(n_prompt):
    model = tiny_model("llama")
    tokens = prompt(FIT_TOKENS + 64, seed=4)
    cache = amc_cache(model)
    model(tokens[:n_prompt][None], cache=cache)
    assert all(layer.mu is None for layer in cache)
    for t in tokens[n_prompt:]:
        model(t.reshape(1, 1), cache=cache)
    for layer in cache:
        flags = layer.store.flags.view()
        assert mx.array_equal(flags[..., : FIT_TOKENS - 1], mx.zeros_like(flags[..., : FIT_TOKENS - 1]))
        assert layer.mu is not None and layer.theta is not None
        # after the fit the decode tokens spread over the three tiers
        assert all(f > 0 for f in tier_fractions(flags[..., FIT_TOKENS:]))
