"""The model-mode harness: memory, quality and speed of one method on one workload.

Every figure of a method is measured the same way as the full cache's, in the same run,
so the report can give ratios: memory from the caches' ``nbytes`` and
``mx.get_peak_memory``, quality from greedy answers to retrieval tasks and from the
next-token distributions over held-out text, speed from wall-clock prefill and decode
timed in rounds that alternate the full cache and the method (:func:`interleaved_speed`).
"""

from __future__ import annotations

import gc
import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx

from ..cache.config import KVCacheConfig
from ..integrations.mlx_lm import make_prompt_cache
from . import metrics
from .runner import greedy, prefill, step
from .tasks import Example, score


@dataclass
class Workload:
    """What every method is run on (identical inputs for every method)."""

    retrieval: list[Example]
    prefix: list[int]  # held-out text given as the prompt (memory, prefill speed)...
    continuation: list[int]  # ...and the tokens that follow it (quality, decode speed)


@dataclass
class MethodRun:
    label: str
    config: KVCacheConfig
    make_cache: Callable[[Any], list] | None = None  # default: make_prompt_cache(model, config)
    settings: dict = field(default_factory=dict)  # what differs from the method's defaults

    def cache(self, model):
        return self.make_cache(model) if self.make_cache else make_prompt_cache(model, self.config)

    @property
    def method(self) -> str:
        """The method key, with its storage as ``--methods`` spells it (snapkv+kivi4)."""
        c = self.config
        return c.method if c.storage is None else f"{c.method}+kivi{c.kv_bits}"


def _kv_bytes(cache) -> int:
    return sum(c.nbytes for c in cache)


def held_out_text(model, run: MethodRun, work: Workload, tokenizer=None) -> tuple[dict, mx.array]:
    """Prefill the held-out prefix, then decode its continuation teacher-forced.

    One pass gives the memory figures (``nbytes`` after prefill and after decoding, peak
    memory over both), the speeds (prefill tokens/s, median decode step) and the
    next-token log-probabilities the quality metrics compare. The prefill time includes
    a method's reconstruction pass (kvzip), run when ``tokenizer`` is given.
    """
    gc.collect()  # the previous run's caches, so that they are not freed during this one
    mx.clear_cache()
    mx.reset_peak_memory()
    active = mx.get_active_memory()
    cache = run.cache(model)
    start = time.perf_counter()
    first = prefill(model, cache, mx.array(work.prefix), tokenizer=tokenizer)
    prefill_s = time.perf_counter() - start
    bytes_prefill = _kv_bytes(cache)
    rows, steps = [first], []
    for token in work.continuation[:-1]:
        start = time.perf_counter()
        rows.append(step(model, cache, token))
        mx.eval(rows[-1])
        steps.append(time.perf_counter() - start)
    logits = mx.stack(rows).astype(mx.float32)
    n, total = len(work.prefix), len(work.prefix) + len(work.continuation) - 1
    figures = {
        "tokens_prefill": n,
        "tokens_decode": total,
        "kv_bytes_prefill": bytes_prefill,
        "kv_bytes_decode": _kv_bytes(cache),
        "bytes_per_token_prefill": bytes_prefill / n,
        "bytes_per_token_decode": _kv_bytes(cache) / total,
        # above what was in use before the run; memory freed during the run (arrays of
        # earlier runs) could otherwise make it negative
        "peak_bytes": max(0, mx.get_peak_memory() - active),
        "prefill_tokens_per_s": n / prefill_s,
        "decode_tokens_per_s": 1.0 / statistics.median(steps),
    }
    return figures, logits - mx.logsumexp(logits, axis=-1, keepdims=True)


SPEED_ROUNDS = 3
SPEED_DECODE_STEPS = 32


def timed_pass(model, run: MethodRun, work: Workload, tokenizer=None,
               decode_steps: int = SPEED_DECODE_STEPS) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s from the median step) of one pass over the
    held-out text: the prefix, then up to ``decode_steps`` tokens of its continuation."""
    cache = run.cache(model)
    start = time.perf_counter()
    prefill(model, cache, mx.array(work.prefix), tokenizer=tokenizer)
    prefill_s = time.perf_counter() - start
    steps = []
    for token in work.continuation[: max(1, decode_steps)]:
        start = time.perf_counter()
        mx.eval(step(model, cache, token))
        steps.append(time.perf_counter() - start)
    return len(work.prefix) / prefill_s, 1.0 / statistics.median(steps)


def interleaved_speed(model, run: MethodRun, baseline: MethodRun, work: Workload,
                      tokenizer=None, rounds: int = SPEED_ROUNDS) -> dict:
    """Prefill and decode speed of ``run`` as ratios to ``baseline``'s, timed in ``rounds``
    rounds of (baseline pass, method pass): a load that comes and goes on a shared machine
    weighs on both passes of a round alike, and the spread of the rounds' ratios shows
    what it left. The median ratio and the (lowest, highest) of the rounds."""
    prefill_ratios, decode_ratios = [], []
    for _ in range(rounds):
        base_prefill, base_decode = timed_pass(model, baseline, work, tokenizer)
        own_prefill, own_decode = timed_pass(model, run, work, tokenizer)
        prefill_ratios.append(own_prefill / base_prefill)
        decode_ratios.append(own_decode / base_decode)
    return {
        "rounds": rounds,
        "decode_steps": min(SPEED_DECODE_STEPS, len(work.continuation)),
        "prefill_speed": statistics.median(prefill_ratios),
        "prefill_speed_range": [min(prefill_ratios), max(prefill_ratios)],
        "decode_speed": statistics.median(decode_ratios),
        "decode_speed_range": [min(decode_ratios), max(decode_ratios)],
    }


def answer(model, tokenizer, run: MethodRun, example: Example) -> str:
    cache = run.cache(model)
    logits = prefill(model, cache, mx.array(tokenizer.encode(example.prompt)), tokenizer=tokenizer)
    return tokenizer.decode(greedy(model, cache, logits, example.max_new_tokens))


def answer_question_after(model, tokenizer, run: MethodRun, example) -> str:
    """kvpress's protocol: the context (the prompt before its closing question) prefilled
    and compressed alone, every cache then told to stop evicting (``stop_evicting``, where
    it has one: a method without it stores the question as it stores any token), the
    question read and the answer written."""
    ids = tokenizer.encode(example.prompt)
    context = tokenizer.encode(example.prompt[: len(example.prompt) - len(example.question)])
    n = next((i for i, (a, b) in enumerate(zip(ids, context)) if a != b), min(len(ids), len(context)))
    if not 1 < n < len(ids):
        raise ValueError(f"{example.task} example {example.index}: no context before its question "
                         f"({n} shared tokens of {len(ids)})")
    cache = run.cache(model)
    prefill(model, cache, mx.array(ids[:n]), tokenizer=tokenizer)
    for layer in cache:
        stop = getattr(layer, "stop_evicting", None)
        if stop is not None:
            stop()
    logits = prefill(model, cache, mx.array(ids[n:]))
    return tokenizer.decode(greedy(model, cache, logits, example.max_new_tokens))


def retrieval(model, tokenizer, run: MethodRun, examples: list[Example], tick) -> dict:
    rows = []
    for ex in examples:
        output = answer(model, tokenizer, run, ex)
        rows.append({"task": ex.task, "context": ex.context_tokens, "depth": ex.depth,
                     "index": ex.index, "correct": score(ex, output), "output": output})
        tick()

    def accuracy(key):
        groups: dict[Any, list[bool]] = {}
        for r in rows:
            groups.setdefault(r[key], []).append(r["correct"])
        return {str(k): sum(v) / len(v) for k, v in sorted(groups.items())}

    return {
        "accuracy": sum(r["correct"] for r in rows) / max(1, len(rows)),
        "by_task": accuracy("task"),
        "by_context": accuracy("context"),
        "by_depth": accuracy("depth"),
        "examples": rows,
    }


def evaluate(model, tokenizer, run: MethodRun, work: Workload, reference_logprobs=None,
             tick: Callable[[], None] = lambda: None) -> tuple[dict, mx.array | None]:
    """All figures of one method; a failure is recorded, never raised."""
    result: dict[str, Any] = {"label": run.label, "method": run.method,
                              "settings": run.settings, "config": run.config.to_dict()}
    logprobs = None
    try:
        result["memory_speed"], logprobs = held_out_text(model, run, work, tokenizer)
        quality = {"perplexity": metrics.perplexity(logprobs, work.continuation)}
        if reference_logprobs is not None:
            quality["kl_mean"] = float(metrics.kl_divergence(reference_logprobs, logprobs).mean())
            quality["top1_agreement"] = metrics.top1_agreement(reference_logprobs, logprobs)
        result["continuation"] = quality
        tick()
        result["retrieval"] = retrieval(model, tokenizer, run, work.retrieval, tick)
        result["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - one method's failure must not abort the run
        result["status"] = "failed"
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc(limit=6)
    return result, logprobs
