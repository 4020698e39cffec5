"""Driving a model through a cache the way mlx-lm's generate does."""

from __future__ import annotations

import mlx.core as mx

PREFILL_CHUNK = 2048  # mlx-lm's prefill_step_size


def prefill(model, cache, tokens: mx.array, chunk: int = PREFILL_CHUNK, tokenizer=None,
            after_chunk=None) -> mx.array:
    """Process a prompt in chunks, then its last token alone; return that token's logits:
    (V,) for a prompt (T,), (B, V) for a batch of equal-length prompts (B, T).

    A cache that scores by a reconstruction pass (kvzip) gets it, given the ``tokenizer``
    its probe is written with: all but the last token are the context it compresses (one
    prompt only). ``after_chunk(n)``, where given, runs after each evaluated chunk of ``n``
    tokens (not after the last token): a benchmark reads its time and peak memory there.
    """
    from ..integrations.mlx_lm import prefill_with_reconstruction, reconstruction_layers

    batched = tokens.ndim == 2
    if tokenizer is not None and not batched and tokens.shape[0] > 1 and reconstruction_layers(cache):
        prefill_with_reconstruction(model, tokenizer, tokens[:-1].tolist(), cache, chunk)
        tokens = tokens[-1:]
    rows = tokens if batched else tokens[None]
    while rows.shape[1] > 1:
        n = min(chunk, rows.shape[1] - 1)
        model(rows[:, :n], cache=cache)
        mx.eval([c.state for c in cache])
        if after_chunk is not None:
            after_chunk(n)
        rows = rows[:, n:]
    logits = model(rows, cache=cache)[:, -1]
    mx.eval(logits)
    return logits if batched else logits[0]


def step(model, cache, token: int | mx.array) -> mx.array:
    """One decode step: the logits (V,) after ``token``."""
    logits = model(mx.array([[token]]) if isinstance(token, int) else token.reshape(1, 1), cache=cache)
    return logits[0, -1]


def greedy(model, cache, first_logits: mx.array, n: int) -> list[int]:
    """``n`` greedy tokens, the first from ``first_logits``."""
    out = []
    logits = first_logits
    for i in range(n):
        token = mx.argmax(logits)
        mx.eval(token)
        out.append(int(token))
        if i + 1 < n:
            logits = step(model, cache, token)
    return out
