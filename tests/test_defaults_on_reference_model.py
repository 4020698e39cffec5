"""Every method at its defaults on the reference model (issue 37): after a prompt, decode
steps fed the full cache's greedy tokens (so every method is scored on the same text),

1. every token decoded stays in the cache for at least ``WINDOW`` steps (an eviction
   method's ``kept_positions`` still hold it; any other cache holds every token), and
2. the method agrees with the full cache at least as well as the median method of its
   family: a mean KL of the next-token distributions no larger than the median's, or a
   greedy-token agreement within two binomial standard errors of the median's (either
   suffices); or its status note states its figure (``DOCUMENTED``, checked).

The whole registry at 1,024 prompt tokens and 64 steps is ``slow`` (about 5 minutes on 2
CPU cores); ``python tests/test_defaults_on_reference_model.py`` prints its table
(benchmarks/results/defaults_reference_model.md). The default suite runs a few methods on
a 600-token prompt.
"""

from __future__ import annotations

import functools
import math
import statistics
import sys
import time

import veloxquant_mlx  # noqa: F401  (before mlx: the CPU back-end's BLAS)
import mlx.core as mx
import pytest

from veloxquant_mlx import REFERENCE_MODEL, KVCacheConfig, make_prompt_cache
from veloxquant_mlx.registry import METHODS, implemented_methods

PROMPT_TOKENS, STEPS, WINDOW = 1024, 64, 32
# Past the eviction budgets' default (512 tokens), so the cheap run evicts: the recent-window
# defaults of issue 37 (keyformer, qfilters, knorm: *_recent=0) and snapkv as a fourth
# member of their family's median.
QUICK_PROMPT, QUICK_STEPS, QUICK_WINDOW = 600, 20, 16
QUICK_METHODS = ("snapkv", "keyformer", "qfilters", "knorm")

# Methods that agree with the full cache worse than their family's median at the defaults,
# whose status note gives the figure ("KL <figure>": the slow run's mean KL, within a
# factor 1.5 of it) and the reason.
DOCUMENTED: dict[str, float] = {"turboquant": 0.0725, "knorm": 0.09, "curdkv": 0.042, "svdq": 0.20, "spectral": 0.19}

# Methods whose own protected window of the newest tokens (a contract field, at its
# default) is shorter than WINDOW: they keep each decoded token for that many steps.
OWN_WINDOW = {"h2o": "h2o_grace", "morphkv": "morphkv_window"}

# Methods that evict decoded tokens before any window (strict: a fix removes its entry).
EVICTS_DECODED: dict[str, str] = {}


# Caches that evict without a kept_positions: the newest tokens they keep by construction.
RECENT_BY_CONSTRUCTION = {
    "streaming_llm": lambda c: c.window,  # sinks + the newest stream_window_size tokens
}


@functools.lru_cache(maxsize=1)
def reference():
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(REFERENCE_MODEL))
    model.set_dtype(mx.float32)  # MLX's fast CPU path
    text = (REFERENCE_MODEL / "heldout_kjv_acts.txt").read_text()
    return model, mx.array(tokenizer.encode(text))


def _log_softmax(logits):
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@functools.lru_cache(maxsize=None)
def full_run(n_prompt: int, steps: int):
    """The full cache's greedy tokens (the inputs of every step) and log-probabilities."""
    tokens, logprobs = decode("full", n_prompt, steps, None)[:2]
    return tokens, logprobs


def decode(method: str, n_prompt: int, steps: int, inputs, window: int = 0):
    """Prefill all but the prompt's last token, then ``steps`` single-token steps as
    mlx-lm's generate_step runs them: the last prompt token, then ``inputs`` (the full
    cache's greedy tokens; None: the method's own). Returns (inputs fed after the prompt,
    log-probabilities (steps, vocab), window violations, seconds)."""
    model, ids = reference()
    cache = make_prompt_cache(model, KVCacheConfig(method=method))
    start = time.perf_counter()
    model(ids[None, : n_prompt - 1], cache=cache)
    token, fed, out, violations = ids[n_prompt - 1 : n_prompt], [], [], []
    for i in range(steps):
        logprobs = _log_softmax(model(token[None], cache=cache)[0, -1])
        out.append(logprobs)
        nxt = mx.argmax(logprobs).reshape(1) if inputs is None else inputs[i : i + 1]
        if window:
            violations += unkept(cache, n_prompt, n_prompt - 1 + i, window)
        token = nxt
        fed.append(nxt)
    out = mx.stack(out)
    mx.eval(out)
    return mx.concatenate(fed), out, violations, time.perf_counter() - start


def unkept(cache, n_prompt: int, newest: int, window: int) -> list[str]:
    """The decoded tokens of the last ``window`` steps (positions from n_prompt to the
    newest) that some layer and head no longer holds."""
    want = mx.arange(max(n_prompt, newest - window + 1), newest + 1)
    if want.size == 0:
        return []
    missing = []
    for layer, c in enumerate(cache):
        kept = getattr(c, "kept_positions", None)
        if kept is None:
            if c.stored_length < c.offset:  # evicted, with no positions to show: by construction
                recent = RECENT_BY_CONSTRUCTION.get(c.config.method)
                if recent is None or recent(c) < window:
                    missing.append(f"layer {layer}: {c.stored_length} of {c.offset} tokens stored, "
                                   f"no kept positions to check")
            continue
        held = (kept[..., None] == want).any(axis=-2).all(axis=(0, 1))  # (window,)
        if not bool(held.all()):
            gone = [p for p, ok in zip(want.tolist(), held.tolist()) if not ok]
            missing.append(f"step at position {newest}, layer {layer}: positions {gone} evicted")
    return missing


@functools.lru_cache(maxsize=None)
def measure(method: str, n_prompt: int, steps: int, window: int) -> dict:
    tokens, full = full_run(n_prompt, steps)
    _, got, violations, seconds = decode(method, n_prompt, steps, tokens, window)
    p = mx.exp(full)
    kl = (p * (full - got)).sum(axis=-1)
    agree = (mx.argmax(got, axis=-1) == mx.argmax(full, axis=-1)).astype(mx.float32)
    return {"kl": float(kl.mean()), "agreement": float(agree.mean()), "violations": violations,
            "seconds": seconds, "window": window}


def family_medians(results: dict[str, dict]) -> dict[str, tuple[float, float]]:
    """(median KL, median agreement) per family: of an even count the worse middle one
    (median_high of KL, median_low of agreement), the median method's figure."""
    by_family: dict[str, list[str]] = {}
    for m in results:
        by_family.setdefault(METHODS[m].family, []).append(m)
    return {f: (statistics.median_high([results[m]["kl"] for m in ms]),
                statistics.median_low([results[m]["agreement"] for m in ms])) for f, ms in by_family.items()}


def as_good_as_the_median(result: dict, median: tuple[float, float], steps: int) -> bool:
    """KL no more than the median's, or agreement within two standard errors of it: a
    binomial proportion over the steps (variance floored at one disagreement in n, so a
    median of 1.0 still allows one), since two methods a token or two apart over the
    steps are not told apart by them."""
    p = median[1]
    slack = 2 * math.sqrt(max(p * (1 - p), 1 / steps) / steps)
    return result["kl"] <= median[0] or result["agreement"] >= p - slack


def compressing_methods(names) -> list[str]:
    return [m for m in names if m != "full"]


def window_for(method: str, window: int) -> int:
    field = OWN_WINDOW.get(method)
    if field is None:
        return window
    return min(window, getattr(KVCacheConfig(method=method).options, field))


@functools.lru_cache(maxsize=None)
def measure_all(names: tuple[str, ...], n_prompt: int, steps: int, window: int) -> dict[str, dict]:
    return {m: measure(m, n_prompt, steps, window_for(m, window)) for m in names}


def _check_window(method, results):
    assert not results[method]["violations"], f"{method}: " + "; ".join(results[method]["violations"][:5])


def _check_agreement(method, results, steps, figures=True):
    """``figures``: the run is the slow one, whose KL the documented figures give."""
    r = results[method]
    median = family_medians(results)[METHODS[method].family]
    if method in DOCUMENTED:
        figure = DOCUMENTED[method]
        note = METHODS[method].status_note or ""
        assert f"KL {figure}" in note, f"{method}: its status note must state 'KL {figure}'"
        if figures:
            assert figure / 1.5 <= r["kl"] <= 1.5 * figure, (method, r["kl"], figure)
        return
    assert as_good_as_the_median(r, median, steps), (
        f"{method}: KL {r['kl']:.4f}, agreement {r['agreement']:.3f} against its family's median "
        f"{median[0]:.4f} / {median[1]:.3f}: worse on both, and its status note states no figure")


ALL = tuple(compressing_methods(implemented_methods()))


@pytest.mark.slow
@pytest.mark.parametrize("method", [
    pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=EVICTS_DECODED[m])) if m in EVICTS_DECODED else m
    for m in ALL])
def test_every_decoded_token_is_kept_for_a_window_of_steps(method):
    # the method's own run alone (shared with measure_all's through measure's cache), so that
    # `-k "window and tova"` measures one method, not the registry
    _check_window(method, {method: measure(method, PROMPT_TOKENS, STEPS, window_for(method, WINDOW))})


@pytest.mark.slow
@pytest.mark.parametrize("method", ALL)
def test_agreement_is_the_family_median_or_documented(method):
    _check_agreement(method, measure_all(ALL, PROMPT_TOKENS, STEPS, WINDOW), STEPS)


@pytest.mark.parametrize("method", QUICK_METHODS)
def test_quick_every_decoded_token_is_kept_for_a_window_of_steps(method):
    _check_window(method, measure_all(QUICK_METHODS, QUICK_PROMPT, QUICK_STEPS, QUICK_WINDOW))


@pytest.mark.parametrize("method", QUICK_METHODS)
def test_quick_agreement_is_the_median_of_these_or_documented(method):
    _check_agreement(method, measure_all(QUICK_METHODS, QUICK_PROMPT, QUICK_STEPS, QUICK_WINDOW), QUICK_STEPS,
                     figures=False)


def table(results: dict[str, dict], steps: int) -> str:
    medians = family_medians(results)
    lines = ["| method | family | mean KL | greedy agreement | family median KL / agreement | kept window (steps) | as good as the median |",
             "|---|---|---|---|---|---|---|"]
    for m in sorted(results, key=lambda m: (METHODS[m].family, results[m]["kl"])):
        r, med = results[m], medians[METHODS[m].family]
        ok = "yes" if as_good_as_the_median(r, med, steps) else ("documented" if m in DOCUMENTED else "NO")
        lines.append(f"| {m} | {METHODS[m].family} | {r['kl']:.4f} | {r['agreement']:.3f} | "
                     f"{med[0]:.4f} / {med[1]:.3f} | {r['window']}: {'kept' if not r['violations'] else 'EVICTED'} | {ok} |")
    return "\n".join(lines)


if __name__ == "__main__":
    names = tuple(sys.argv[1].split(",")) if len(sys.argv) > 1 else ALL
    shape = (QUICK_PROMPT, QUICK_STEPS, QUICK_WINDOW) if "--quick" in sys.argv else (PROMPT_TOKENS, STEPS, WINDOW)
    results = {}
    for m in names:
        results[m] = measure(m, shape[0], shape[1], window_for(m, shape[2]))
        r = results[m]
        print(f"# {m}: KL {r['kl']:.4f} agreement {r['agreement']:.3f} violations {len(r['violations'])} "
              f"({r['seconds']:.1f} s) {r['violations'][:2]}", file=sys.stderr, flush=True)
    print(table(results, shape[1]))
