"""The queries a model's layers attend with over a text, with the keys and values they
attend to, for calibrations that fit on queries (``veloxquant calibrate`` with a class
whose ``calibration_queries`` is true): one pass over the text gives all three."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from ..cache.config import KVCacheConfig
from .mlx_lm import make_prompt_cache


def collect_queries(model, tokens: mx.array, chunk: int = 512,
                    progress: Callable[[int, int], None] | None = None
                    ) -> tuple[dict[int, mx.array], dict[int, tuple[mx.array, mx.array]]]:
    """Run ``model`` over ``tokens`` (T,) through our uncompressed caches, recording what
    each layer attends with: its queries (1, n_heads, T, D), post-RoPE, as a cache's
    ``attend`` receives them (for methods whose paper calibrates on queries), and the
    keys and values (1, H, T, D) its cache holds after the text: those ``collect_kv``
    gives (the same computation, tested bit for bit). Returns (queries, keys and values)
    by layer."""
    cache = make_prompt_cache(model, KVCacheConfig())
    seen: dict[int, list[mx.array]] = {i: [] for i in range(len(cache))}

    def recording(i, attend):
        def attend_and_keep(queries, keys, values, **kwargs):
            seen[i].append(queries)
            return attend(queries, keys, values, **kwargs)
        return attend_and_keep

    for i, c in enumerate(cache):
        c.attend = recording(i, c.attend)
    n = tokens.shape[0]
    for start in range(0, n, chunk):
        model(tokens[start : start + chunk][None], cache=cache)
        mx.eval([c.state for c in cache], [q[-1] for q in seen.values() if q])
        if progress:
            progress(min(start + chunk, n), n)
    queries = {i: mx.concatenate(q, axis=2) for i, q in seen.items() if q}
    return queries, {i: (cache[i].keys.view(), cache[i].values.view()) for i in queries}
