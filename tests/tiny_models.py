"""Tiny random mlx-lm models built from ModelArgs (no hub), for CPU tests."""

from __future__ import annotations

import importlib

import mlx.core as mx

ARCH_ARGS = {
    "llama": dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
        vocab_size=260, rope_theta=10000.0, tie_word_embeddings=False,
    ),
    # mlx-lm pipelines (model.model.pipeline) and tensor-shards (model.shard) this one
    "qwen2": dict(
        model_type="qwen2", hidden_size=128, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=260,
        rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "qwen3": dict(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        vocab_size=260, rope_theta=10000.0, max_position_embeddings=65536,
        tie_word_embeddings=True,
    ),
    "gemma2": dict(
        model_type="gemma2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        vocab_size=260, rope_theta=10000.0, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, query_pre_attn_scalar=32.0,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        vocab_size=260, query_pre_attn_scalar=32.0, sliding_window=32, sliding_window_pattern=2,
    ),
}


def tiny_model(arch: str = "llama", seed: int = 0, dtype=mx.float32, **overrides):
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    args = module.ModelArgs.from_dict({**ARCH_ARGS[arch], **overrides})
    mx.random.seed(seed)
    model = module.Model(args)
    if dtype != mx.float32:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def prompt(n: int, seed: int = 1, vocab: int = 256) -> mx.array:
    return mx.random.randint(0, vocab, (n,), key=mx.random.key(seed))


def char_tokenizer():
    """A character-level tokenizer (ids 0..255, ``<eos>`` = 256) wrapped for mlx-lm."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = range(32, 127)
    vocab = {chr(i): i for i in printable}
    vocab.update({chr(0x100 + i): i for i in range(256) if i not in printable})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<eos>"])
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>"))
