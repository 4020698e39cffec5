"""SnapKV: the last prompt queries vote, once, on which prompt tokens each KV head keeps.

Prefill runs on the full cache (chunk by chunk, as mlx-lm sends it) while the last
``snap_obs_window`` queries are buffered. On the first single-token call (mlx-lm sends the
last prompt token alone) attention still sees everything, then each layer scores the
prefix with the window queries (softmax over all keys, causal inside the window, summed
over the window, mean over the query heads of a KV head, max-pooled with kernel 7),
forces the sinks, keeps the top ``snap_budget - snap_obs_window`` prefix tokens plus the
window, in order. Decode only appends. Adapted: sinks are an addition to the paper.
"""

from __future__ import annotations

import mlx.core as mx

from ..cache.base import CompressedKVCache
from ..cache.buffers import GrowingArray
from ..evict.select import gather_tokens, max_pool_same, top_k_sorted

POOL_KERNEL = 7  # the official LongBench configs: max-pool, kernel 7, window 32
_SCORE_DTYPES = {"auto": mx.float32, "float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def window_attention_mass(queries, keys, scale, dtype=mx.float32) -> mx.array:
    """Attention the window queries pay each key, summed over the window and a KV group.

    queries (B, Hq, w, D) at the last w positions; keys (B, Hkv, n, D). Returns (B, Hkv, n).
    """
    b, hq, w, d = queries.shape
    hkv, n = keys.shape[1], keys.shape[2]
    q = queries.reshape(b, hkv, hq // hkv, w, d).astype(dtype)
    logits = (q * scale) @ keys[:, :, None].astype(dtype).swapaxes(-1, -2)
    visible = mx.arange(n - w, n)[:, None] >= mx.arange(n)[None]
    logits = mx.where(visible, logits, -float("inf"))
    weights = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
    return weights.sum(axis=3).mean(axis=2)


class SnapKVCache(CompressedKVCache):
    requires_attention_hook = True

    def _init_storage(self) -> None:
        c = self.config
        self.budget, self.window, self.n_sink = c.snap_budget, c.snap_obs_window, c.snap_n_sink
        if c.snap_dtype not in _SCORE_DTYPES:
            raise ValueError(
                f"snap_dtype={c.snap_dtype!r} is not supported; allowed: {', '.join(_SCORE_DTYPES)}"
            )
        self.score_dtype = _SCORE_DTYPES[c.snap_dtype]
        self.batched = c.snap_batched_scoring
        self.keys = GrowingArray()
        self.values = GrowingArray()
        self.window_queries = None  # last `window` prompt queries, until the decision
        self.kept_positions = None  # (B, Hkv, budget) once tokens were evicted
        self.decided = False

    @property
    def stored_length(self) -> int:
        return self.keys.length

    def _arrays(self):
        return {
            "keys": self.keys,
            "values": self.values,
            "window_queries": self.window_queries,
            "kept_positions": self.kept_positions,
        }

    def _meta(self):
        return {"decided": self.decided}

    def _restore_meta(self, meta):
        self.decided = bool(meta["decided"])

    def update_and_fetch(self, keys, values):
        self._expect_attend()
        self.keys.append(keys)
        self.values.append(values)
        self.offset += keys.shape[2]
        return self.keys.view(), self.values.view()

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        if not self.decided:
            q = queries if self.window_queries is None else mx.concatenate(
                [self.window_queries, queries], axis=2
            )
            self.window_queries = q[:, :, -self.window :]
        out = super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if not self.decided and queries.shape[2] == 1:
            self.decided = True  # prefill is over: mlx-lm sends the last prompt token alone
            if self.keys.length > self.budget:
                self._evict(scale)
            self.window_queries = None
        return out

    def scores(self, scale) -> mx.array:
        """Pooled importance of every prefix token, sinks forced: (B, Hkv, n - window)."""
        keys = self.keys.view()
        n = keys.shape[2]
        if self.batched:
            mass = window_attention_mass(self.window_queries, keys, scale, self.score_dtype)
        else:  # one KV head at a time: lower peak memory, the same numbers
            hkv, hq = keys.shape[1], self.window_queries.shape[1]
            g = hq // hkv
            mass = mx.concatenate(
                [
                    window_attention_mass(
                        self.window_queries[:, h * g : (h + 1) * g], keys[:, h : h + 1],
                        scale, self.score_dtype,
                    )
                    for h in range(hkv)
                ],
                axis=1,
            )
        prefix = max_pool_same(mass[..., : n - self.window], POOL_KERNEL)
        if self.n_sink:
            forced = mx.arange(n - self.window) < self.n_sink
            prefix = mx.where(forced, float("inf"), prefix)
        return prefix

    def _evict(self, scale) -> None:
        keys, values = self.keys.view(), self.values.view()
        b, hkv, n, _ = keys.shape
        chosen = top_k_sorted(self.scores(scale), self.budget - self.window)
        recent = mx.broadcast_to(mx.arange(n - self.window, n), (b, hkv, self.window))
        positions = mx.concatenate([chosen, recent.astype(chosen.dtype)], axis=-1)
        self.keys.reset(gather_tokens(keys, positions))
        self.values.reset(gather_tokens(values, positions))
        self.kept_positions = positions.astype(mx.int32)

    def is_trimmable(self) -> bool:
        return self.kept_positions is None

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        n = min(n, self.keys.length)
        self.keys.truncate(self.keys.length - n)
        self.values.truncate(self.values.length - n)
        self.offset -= n
        return n
