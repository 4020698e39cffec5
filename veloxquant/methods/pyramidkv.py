"""PyramidKV: SnapKV scoring under a budget that shrinks with depth, like a pyramid.

Scores once, when the prompt is in (mlx-lm sends its last token alone), exactly as SnapKV
does (this class is a SnapKV cache: the last 32 prompt queries vote, max-pooled with kernel
7; the sinks and the window are kept); only each layer's budget differs. The first layer
to reach the prefill end fixes every layer's budget from the prompt length n (``schedule``,
the official ``update_kv``), with B = ``pyramid_budget``, w = 32 and L compressed layers:

    n < 2(B - w): every layer keeps B (n <= B: everything);
    otherwise lo = (B - w) / beta, hi = 2(B - w) - lo, clamped to hi = n - w (and
    lo = 2(B - w) - hi) when the bottom layer would ask for more than there is;
    layer l keeps w + hi - l (hi - lo) / (L - 1): layer 0 the most, the total L B.

Decode only appends. Adapted: the shares are exact fractions rounded by largest remainder,
so the total is exactly L B and the budgets never increase with depth (the official code
floors the step); no layer's share falls below the ``pyramid_n_sink`` sinks it must keep
(the shortfall comes off the largest layers); an explicit ``pyramid_resolved_budget``
replaces the schedule. Until a prompt fixes them, ``budget`` reports the schedule of a
long prompt (it depends on n only through the short-prompt cases above).
``pyramid_backend``: both choices run SnapKV's one MLX matmul + float32 softmax path.
"""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

from ..evict.base import Roles
from ..evict.layer_budgets import LayerBudgets, apportion
from .snapkv import SnapKVCache

WINDOW = 32  # the card's fixed observation window, as in SnapKV's default


def schedule(n: int | None, layers: int, budget: int, beta: float, n_sink: int = 0) -> list[int]:
    """Tokens kept per layer (window included) for a prompt of ``n`` tokens (None: long)."""
    room = budget - WINDOW  # non-window tokens per layer on average
    if layers == 1 or n is not None and n < 2 * room:
        return [budget] * layers
    lo = Fraction(room) / Fraction(beta)
    hi = 2 * room - lo
    if n is not None and hi >= n - WINDOW:
        hi = Fraction(n - WINDOW)
        lo = 2 * room - hi
    step = (hi - lo) / (layers - 1)
    caps = apportion([hi - layer * step for layer in range(layers)], layers * room)
    for layer in range(layers):  # no share below the sinks: the shortfall comes off the largest
        while caps[layer] < n_sink:
            caps[layer] += 1
            caps[max(i for i in range(layers) if caps[i] == max(caps))] -= 1
    return [cap + WINDOW for cap in caps]


class PyramidKVCache(LayerBudgets, SnapKVCache):
    roles = Roles(budget="pyramid_budget", n_sink="pyramid_n_sink")
    resolved_field = "pyramid_resolved_budget"
    batchable = True  # packed decode: evict/batch.py runs the base's decode steps for the batch

    def _init_storage(self):
        super()._init_storage()
        # SnapKV's score reads its own options: it gets PyramidKV's with SnapKV's defaults
        # for the scoring path (float32 logits, all heads at once), which both backends run.
        self.options = SimpleNamespace(**vars(self.config.options), snap_dtype="auto",
                                       snap_batched_scoring=True)

    window = recent = WINDOW  # the observation window: its queries vote, its tokens are kept

    def layer_budgets(self, n_tokens):
        o = self.options
        return schedule(n_tokens, len(self._layers), o.pyramid_budget, o.pyramid_beta, o.pyramid_n_sink)

    def unresolved_budget(self):
        if self.explicit_budgets() is not None:
            return super().unresolved_budget()
        return self.layer_budgets(None)[self._layers.index(self.layer)]
