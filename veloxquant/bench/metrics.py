"""Quality metrics against the full cache, and the Pareto frontier of a sweep."""

from __future__ import annotations

import math

import mlx.core as mx


def kl_divergence(reference_logprobs: mx.array, logprobs: mx.array) -> mx.array:
    """KL(reference || method) per position, in nats: (N,) from two (N, V) log-prob arrays."""
    p = mx.exp(reference_logprobs)
    return (p * (reference_logprobs - logprobs)).sum(axis=-1)


def top1_agreement(reference_logprobs: mx.array, logprobs: mx.array) -> float:
    same = mx.argmax(reference_logprobs, axis=-1) == mx.argmax(logprobs, axis=-1)
    return float(same.astype(mx.float32).mean())


def perplexity(logprobs: mx.array, targets: list[int]) -> float:
    nll = -mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)
    return math.exp(float(nll.mean()))


def unigram_perplexity(train_tokens: list[int], eval_tokens: list[int], vocab: int) -> float:
    """Perplexity of an add-one unigram model: the floor any LM must beat."""
    counts = mx.zeros((vocab,)).at[mx.array(train_tokens)].add(1.0) + 1.0
    logp = mx.log(counts / counts.sum())
    return math.exp(-float(logp[mx.array(eval_tokens)].mean()))


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points no other point beats: fewer bytes (x) and better quality (y)."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (x2 <= x and y2 >= y) and (x2 < x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])
