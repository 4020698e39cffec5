"""SqueezeAttention: layers whose attention changes the residual stream least keep fewer tokens.

Measures while the prompt is read, scores never. In every layer the cosine similarity of
the residual stream before the attention block and after its output is added (the hook in
integrations/mlx_lm.py hands ``observe_hidden`` the block's input and the attention
output), averaged over the prompt's tokens, goes into the model context.

When budgets are fixed: at the prefill end, by the first layer to get there (layer 0).
mlx-lm runs every prompt chunk through all layers before it sends the last prompt token
alone, so by then every layer's chunks are measured; that last token is not (no layer
could use it before layer 0 evicts, after attending to it).

The L similarities are clustered by a deterministic 1-D 3-means (centres started at the
quantiles 1/6, 1/2, 5/6). The highest cluster (attention changed the residual least) gets
B_low = round((1 - ``squeeze_strength``/2) B), at least the sinks + 1; the other layers
share the rest equally (remainders to the lower layers), so the total is exactly L B.
Fewer than 3 distinct similarities, or strength 0, give every layer B. Each layer then
keeps its ``squeeze_n_sink`` sinks and its most recent tokens (StreamingLLM, the official
real-drop policy): at the prefill end, then every ``EVICT_EVERY`` (32) decode steps, when
the 32 oldest leave together.

Adapted: absolute budgets instead of prompt fractions; the official code drops the oldest
token at every decode step, here the 32 oldest go at once, as for the other per-step
evictors (a decode step attends over B_l + 1 to B_l + 32 tokens: attention runs before
eviction everywhere on the eviction base); a prompt that continues an exchange adds to the
measurement and the budgets are fixed again at its end; ``squeeze_resolved_budget``
replaces the measurement (nothing is measured). Architectures that normalise the
attention output before adding it to the residual (Gemma 2/3) are measured with the raw
output, as the hook sees it.
"""

from __future__ import annotations

from fractions import Fraction
from math import floor

import mlx.core as mx

from ..evict.base import EVICT_EVERY, Roles, Schedule, ScoredEvictionCache
from ..evict.layer_budgets import LayerBudgets, apportion

CLUSTERS = 3


def three_means(values: list[float], iterations: int = 100) -> list[bool]:
    """Which values fall in the highest of 3 clusters (Lloyd's 1-D k-means, quantile start)."""
    ranked = sorted(values)
    centres = [ranked[(2 * i + 1) * len(ranked) // (2 * CLUSTERS)] for i in range(CLUSTERS)]
    labels = None
    for _ in range(iterations):
        new = [min(range(CLUSTERS), key=lambda c: (abs(v - centres[c]), c)) for v in values]
        if new == labels:
            break
        labels = new
        for c in range(CLUSTERS):
            members = [v for v, label in zip(values, labels) if label == c]
            if members:
                centres[c] = sum(members) / len(members)
    top = max(range(CLUSTERS), key=lambda c: centres[c])
    return [label == top for label in labels]


def squeeze_budgets(similarity: list[float], budget: int, strength: float, n_sink: int) -> list[int]:
    """Tokens kept per layer from each layer's mean before/after-attention cosine similarity."""
    layers = len(similarity)
    if strength == 0 or len(set(similarity)) < CLUSTERS:
        return [budget] * layers
    squeezed = three_means(similarity)
    g = sum(squeezed)
    if g in (0, layers):
        return [budget] * layers
    low = max(n_sink + 1, floor((1 - Fraction(strength) / 2) * budget + Fraction(1, 2)))
    high = Fraction(layers * budget - g * low, layers - g)
    return apportion([low if s else high for s in squeezed], layers * budget)


class SqueezeAttentionCache(LayerBudgets, ScoredEvictionCache):
    roles = Roles(budget="squeeze_budget", n_sink="squeeze_n_sink")
    schedule = Schedule(prefill_end=True, decode_every=EVICT_EVERY)
    resolved_field = "squeeze_resolved_budget"
    batchable = True  # packed decode: evict/batch.py runs the base's decode steps for the batch
    observes_hidden_states = True  # the integration calls observe_hidden in every layer

    def observe_hidden(self, before, attention):
        """Add this layer's cos(h, h + attention) over a prompt chunk's tokens to the context."""
        if before.shape[1] < 2 or self.context is None or self.options.squeeze_resolved_budget:
            return  # decode steps and the lone last prompt token are not measured
        b = before.astype(mx.float32)
        a = b + attention.astype(mx.float32)
        norms = mx.linalg.norm(b, axis=-1) * mx.linalg.norm(a, axis=-1)
        cos = (b * a).sum(axis=-1) / mx.maximum(norms, 1e-30)
        sums = self.context.shared.setdefault("squeeze_similarity", {})
        total, count = sums.get(self.layer, (0.0, 0))
        total = total + cos.sum()
        mx.async_eval(total)  # frees the hidden states; nothing waits for it
        sums[self.layer] = (total, count + cos.size)

    @property
    def similarity(self) -> list[float] | None:
        """Each compressed layer's mean similarity so far (None: some layer has none yet)."""
        sums = self.context.shared.get("squeeze_similarity", {}) if self.context else {}
        if not all(layer in sums for layer in self.context.local_compressed_layers):
            return None
        # A pipelined model's other layers are measured on other ranks (exact: sums of zeros)
        sums = self.context.over_all_layers({layer: mx.stack([total, mx.array(count, mx.float32)])
                                             for layer, (total, count) in sums.items()})
        return [float(sums[layer][0]) / int(sums[layer][1]) for layer in self._layers]

    def layer_budgets(self, n_tokens):
        o, similarity = self.options, self.similarity
        if similarity is None:
            return [o.squeeze_budget] * len(self._layers)
        return squeeze_budgets(similarity, o.squeeze_budget, o.squeeze_strength, o.squeeze_n_sink)

    def score(self, inputs):
        return inputs.positions.astype(mx.float32)  # the newest are kept (the sinks are protected)
