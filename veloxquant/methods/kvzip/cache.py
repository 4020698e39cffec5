"""KVzip: keep the KV pairs the model relies on to reconstruct its context, once, for any question.

Stored: the kept context tokens' keys and values at the model's dtype and their
positions; tokens that come later (a question, generated text) are appended and never
evicted. Scored once, after the context is prefilled, by the reconstruction pass that
``veloxquant_mlx.integrations.mlx_lm.prefill_with_reconstruction`` drives (the cache
cannot run the model itself):

1. the context (T tokens) is prefilled; it is cut into chunks of 2,000 tokens;
2. per chunk the model reads, teacher-forced and after the context (positions T, T+1,
   ...), ``"\\n\\nRepeat the previous context exactly."`` (later chunks: ``"...the part
   of the previous context exactly, starting with "`` + the previous chunk's last 8
   tokens), the chat template's assistant suffix (``"\\n"`` without a template) and the
   chunk; in every layer the repeat queries attend over [sinks before the chunk, the
   chunk, the repeat block (causal)] only, softmax in float32, and a chunk token's
   reliance is the max over the repeat positions and the query heads of its KV head;
   the repeat block's KV is dropped again (``offset`` back to T);
3. the first ``kvzip_n_sink`` positions rank above everything; of all layers x KV heads x
   tokens the best sum_l H_kv min(budget_l, T) are kept (the paper's global 'pair'
   threshold, with ``kvzip_budget`` = B as the per-head average, i.e. ratio B/T): heads
   keep different counts, each layer padded to its largest head (padding in ``nbytes``).

Without the pass (mlx-lm's server, a plain generate call, the synthetic bench) a prompt
that ends over the budget is compressed by a documented fall-back that is *not* KVzip: a
RuntimeWarning says so, and each KV head keeps its sinks and the top B - sinks tokens by
the max attention of the prompt's last 32 queries (per head, like 'pair-uniform').

A cache is compressed once (by the pass, or by the fall-back at the first prompt end over
the budget); later prompt ends append, until a trim takes scored tokens away. Per-layer
budgets from the model context replace B in the total. ``kvzip_probe``: 'context' is the
only probe (the validator refuses any other value).

Adapted: exactly ratio x total tokens kept (the official threshold keeps the scores
strictly above the k-th, fewer on ties); the softmax in float32 (the official code uses
the model dtype); sinks are the first positions of the prompt (the official code keeps
a system prompt; kvpress ``n_sink``); batch size 1 for the pass, as in the official code.
"""

from __future__ import annotations

import warnings

import mlx.core as mx

from ...evict.attention import attention_weights, reduce_query_blocks
from ...evict.base import Roles, Schedule, ScoreInputs, ScoredEvictionCache
from .global_budget import global_top_k

CHUNK = 2000  # context tokens per repeat probe (the official self_task)
OVERLAP = 8  # tokens of the previous chunk quoted by a later probe
FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with "
FALLBACK_WINDOW = 32  # prompt queries the fall-back scores with


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def assistant_suffix(tokenizer) -> str:
    """What the chat template puts between a user turn and the assistant's reply."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n"
    marker = "\n" + "#" * 16
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "context" + marker}], add_generation_prompt=True, tokenize=False
    )
    return text.split(marker, 1)[1]


def probe_chunks(tokenizer, ids: list[int]) -> list[tuple[int, int, list[int]]]:
    """(start, end, probe ids) for each chunk [start, end) of the context ``ids``."""
    suffix = _encode(tokenizer, assistant_suffix(tokenizer))
    out = []
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        head = _encode(tokenizer, FIRST) if start == 0 else _encode(tokenizer, LATER) + ids[start - OVERLAP : start]
        out.append((start, start + len(chunk), head + suffix + chunk))
    return out


class KVzipCache(ScoredEvictionCache):
    batchable = "stacked"  # its rows never mix: sequences in the same state share one cache (cache/stacked.py)
    roles = Roles(budget="kvzip_budget", n_sink="kvzip_n_sink")
    schedule = Schedule(prefill_end=True)
    scores_by_reconstruction = True  # the integration's drivers look for this

    def _init_storage(self) -> None:
        super()._init_storage()
        self.settled = False  # the context was compressed (or the pass ran): later tokens append
        self.pass_pending = False  # between begin_reconstruction and the global selection
        self.probe = None  # (start, end): the context chunk the current repeat block scores
        self.context_length = 0
        self.reliance = None  # (B, Hkv, T) float32 while the pass runs
        self.chosen = None  # (B, Hkv, T) bool, during the global selection only

    @property
    def window(self) -> int:  # only the fall-back needs the prompt's last queries
        return 0 if self.pass_pending or self.settled else FALLBACK_WINDOW

    # -- the reconstruction pass (driven by integrations/mlx_lm.py) -------------------------
    def begin_reconstruction(self) -> None:
        if self.offset or self.settled:
            raise ValueError(
                f"kvzip layer {self.layer}: the reconstruction pass compresses the context it "
                f"prefills, so it needs a fresh cache; this one already holds {self.offset} tokens"
            )
        self.pass_pending = True

    def begin_probe(self, start: int, end: int) -> None:
        if self.reliance is None:
            b, h = self.kv_shape[:2]
            self.context_length = self.offset
            self.reliance = mx.zeros((b, h, self.offset), mx.float32)
        self.probe = (start, end)

    def end_probe(self) -> None:
        """Drop the repeat block's KV: the cache holds the context as before the probe."""
        if self.probe is not None:
            self.store.truncate(self.context_length)
            self.offset = self.context_length
            self.probe = None

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        out = super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if self.probe is not None:
            self.reliance[..., self.probe[0] : self.probe[1]] = self._probe_reliance(queries, keys, scale)
            out = mx.depends(out, [self.reliance])  # scored with its layer: no layer's probe kept alive
        return out

    def _probe_reliance(self, queries, keys, scale) -> mx.array:
        """Max softmax weight over [sinks, chunk, repeat block] each chunk token receives."""
        (start, end), t, n = self.probe, self.context_length, queries.shape[2]
        s = min(self.n_sink, start)
        k_pos = mx.concatenate([mx.arange(s), mx.arange(start, end), mx.arange(t, t + n)])
        subset = mx.concatenate([keys[:, :, :s], keys[:, :, start:end], keys[:, :, t : t + n]], axis=2)
        k_pos = mx.broadcast_to(k_pos, (*subset.shape[:2], k_pos.shape[0]))

        def block(q, q0, q1):  # a max over queries: blocks change nothing
            w = attention_weights(q, subset, scale, mx.arange(t + q0, t + q1), k_pos)
            return w[..., s : s + end - start].max(axis=(2, 3))

        return reduce_query_blocks(queries, subset.shape[2], block, mx.maximum)

    def ranking_scores(self) -> mx.array:
        """Reliance with the sinks above every other token (what the global threshold ranks)."""
        sink = mx.arange(self.reliance.shape[-1]) < self.n_sink
        return mx.where(sink, float("inf"), self.reliance)

    probe_chunks_for = staticmethod(probe_chunks)

    @staticmethod
    def select_globally(layers: list["KVzipCache"]) -> None:
        """After the probes: the best sum_l H_kv min(budget_l, T) tokens of all layers and
        heads at once (per sequence); each layer keeps what it won."""
        total = sum(c.kv_shape[1] * min(c.budget, c.offset) for c in layers)
        ctx = layers[0].context
        if ctx is None:
            chosen = global_top_k([c.ranking_scores() for c in layers], total)
        else:  # a sharded model: the ranking covers every rank's layers and heads
            mine = ctx.select_over_model({c.layer: c.ranking_scores() for c in layers}, total, global_top_k)
            chosen = [mine[c.layer] for c in layers]
        for c, mine in zip(layers, chosen):
            c.keep_chosen(mine)

    def keep_chosen(self, chosen: mx.array) -> None:
        """Keep the tokens the global selection chose for this layer (B, Hkv, T)."""
        counts = chosen.sum(axis=-1)
        if int(counts.min()) < chosen.shape[-1]:
            self.chosen = chosen
            self.padded_rows = max(1, int(counts.max()))  # a layer that won nothing keeps one padded slot
            ScoredEvictionCache._evict(self, ScoreInputs(self, None, 1.0), decode_step=False)
        else:  # nothing evicted: give back the room the repeat blocks grew
            self.store.restore({name: self.store.view(name) for name in self.store.names}, None)
        self.pass_pending, self.settled = False, True
        self.reliance = self.chosen = None

    # -- the eviction base's hooks ------------------------------------------------------------
    def head_budgets(self, inputs):
        return None if self.chosen is None else self.chosen.sum(axis=-1).astype(mx.int32)

    def score(self, inputs):
        if self.chosen is not None:  # the global choice, ranked above every other token
            return mx.where(self.chosen, 2.0, self.reliance)
        queries = inputs.window_queries  # the fall-back: the prompt's last queries
        w = queries.shape[2]
        weights = attention_weights(queries, inputs.keys, inputs.scale,
                                    mx.arange(self.offset - w, self.offset), inputs.positions)
        return weights.max(axis=(2, 3))

    def _evict(self, inputs, decode_step):
        if self.settled or self.pass_pending or self.store.rows <= self.budget:
            return
        warnings.warn(
            "kvzip: this prompt ended without the reconstruction pass (mlx-lm's server or a "
            "plain generate call cannot run it), so it was compressed by the fall-back, not "
            "KVzip: per head, the sinks and the top tokens by the last 32 prompt queries' max "
            "attention. Prefill with veloxquant_mlx.integrations.mlx_lm."
            "prefill_with_reconstruction(model, tokenizer, context, cache) for KVzip's scores.",
            RuntimeWarning, stacklevel=2,
        )
        self.settled = True
        super()._evict(inputs, decode_step)

    # -- trim and state ------------------------------------------------------------------------
    def trim(self, n: int) -> int:
        trimmed = super().trim(n)
        if trimmed:  # what was scored is gone: a later prompt is compressed afresh
            self.settled = False
        return trimmed

    def _arrays(self):
        return {**super()._arrays(), "reliance": self.reliance}

    def _restore_arrays(self, arrays):
        super()._restore_arrays(arrays)
        self.reliance = arrays.get("reliance")

    def _meta(self):
        return {**super()._meta(), "settled": self.settled}

    def _restore_meta(self, meta):
        super()._restore_meta(meta)
        self.settled = bool(meta.get("settled", False))
