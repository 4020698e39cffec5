"""Budgets that differ by layer, fixed when a prompt ends, kept in the model context.

PyramidKV (a schedule over depth) and SqueezeAttention (budgets from a measurement of the
prompt) keep a different number of tokens in each layer and can only fix those numbers
once the prompt is in. ``LayerBudgets``, a mixin placed before ``ScoredEvictionCache`` (or
a subclass of it), does the bookkeeping they share:

- at each prefill end the first compressed layer to get there (layer 0 under mlx-lm, which
  runs every prompt chunk through all layers in order and then sends the last prompt token
  alone) computes every layer's budget with the method's ``layer_budgets(n_tokens)`` (or
  takes the options' explicit list) and writes them to ``context.layer_budgets``, which
  the base's ``budget`` reads; the other layers of the same prefill find them there;
- budgets someone else put into the context (a caller, a test) are left as they are;
- ``resolved_budgets`` is the list in force; a cache loaded without its context (as
  ``load_prompt_cache`` makes them) keeps the budget its layer had when it was saved.
"""

from __future__ import annotations

from fractions import Fraction
from math import floor
from typing import Sequence


def apportion(shares: Sequence[Fraction | int], total: int) -> list[int]:
    """Integers within 1 of ``shares`` that sum to ``total``: every share's floor, then one
    more for the largest remainders (ties: the earlier share), so non-increasing shares
    stay non-increasing. ``shares`` must sum to ``total`` (pass exact fractions)."""
    base = [floor(s) for s in shares]
    rest = total - sum(base)
    assert 0 <= rest <= len(shares), (shares, total)
    order = sorted(range(len(shares)), key=lambda i: (base[i] - shares[i], i))
    for i in order[:rest]:
        base[i] += 1
    return base


class LayerBudgets:
    """Per-layer budgets resolved once per prefill for all layers of one prompt cache."""

    resolved_field: str  # the options field holding an explicit per-layer list, or None

    def layer_budgets(self, n_tokens: int | None) -> list[int]:
        """One budget per compressed layer for a prompt of ``n_tokens`` (None: not known)."""
        raise NotImplementedError

    @property
    def min_budget(self) -> int:
        """The least budget a layer may have: its protected tokens plus one."""
        return self.n_sink + self.window + 1

    def _init_storage(self) -> None:
        super()._init_storage()
        self.prefills = 0  # prefill ends this layer went through: a resolution belongs to one
        self.saved_budget = None  # this layer's budget, when loaded without its context
        if self.context is not None:
            self.explicit_budgets()  # a list of the wrong length fails when the cache is built

    @property
    def _layers(self) -> tuple[int, ...]:
        return tuple(self.context.compressed_layers)

    def explicit_budgets(self) -> list[int] | None:
        """The options' per-layer list, checked against this model's layers (None: none)."""
        value = getattr(self.options, self.resolved_field)
        if value is None:
            return None
        layers = self._layers
        if len(value) != len(layers):
            raise ValueError(
                f"{self.resolved_field}={tuple(value)!r} has {len(value)} budgets; allowed: "
                f"one per compressed layer of this model, {len(layers)} (layers {list(layers)})"
            )
        if min(value) < self.min_budget:
            raise ValueError(
                f"{self.resolved_field}={tuple(value)!r} holds a budget below {self.min_budget}; "
                f"allowed: budgets of at least {self.min_budget} (the {self.n_sink} sinks and "
                f"{self.window} window tokens every layer keeps, plus one)"
            )
        return list(value)

    # -- the budget in force -------------------------------------------------------------
    @property
    def budget(self) -> int:
        if self.context is None:
            return self.saved_budget or self._option("budget")
        per_layer = self.context.layer_budgets
        if self.layer in per_layer:
            return per_layer[self.layer]
        return self.unresolved_budget()

    def unresolved_budget(self) -> int:
        """Before a prompt fixed the budgets: the explicit list's entry, or the options' budget."""
        explicit = self.explicit_budgets()
        return explicit[self._layers.index(self.layer)] if explicit else self._option("budget")

    @property
    def resolved_budgets(self) -> list[int] | None:
        """The budgets in force, one per compressed layer (None until a prompt fixed them)."""
        if self.context is None:
            return None
        per_layer = self.context.layer_budgets
        if not all(layer in per_layer for layer in self._layers):
            return None
        return [per_layer[layer] for layer in self._layers]

    # -- resolution: at each prefill end, by the first layer there -------------------------
    def _evict(self, inputs, decode_step: bool) -> None:
        if not decode_step:
            self._resolve()
        super()._evict(inputs, decode_step)

    def _resolve(self) -> None:
        self.prefills += 1
        ctx = self.context
        if ctx is None:
            return
        key = f"layer_budgets:{self.config.method}"
        mine = ctx.shared.get(key)
        if ctx.layer_budgets and ctx.layer_budgets != (mine or {}).get("budgets"):
            return  # budgets set by someone else
        if mine is not None and mine["prefill"] == self.prefills:
            return  # an earlier layer resolved them for this prefill
        explicit = self.explicit_budgets()
        budgets = explicit if explicit is not None else self.layer_budgets(self.offset)
        ctx.layer_budgets.clear()
        ctx.layer_budgets.update(zip(self._layers, (int(b) for b in budgets)))
        ctx.shared[key] = {"prefill": self.prefills, "budgets": dict(ctx.layer_budgets)}

    # -- state -------------------------------------------------------------------------------
    def _meta(self):
        resolved = self.context is not None and self.layer in self.context.layer_budgets
        saved = self.budget if resolved or self.context is None and self.saved_budget else 0
        return {**super()._meta(), "prefills": self.prefills, "layer_budget": saved}

    def _restore_meta(self, meta):
        super()._restore_meta(meta)
        self.prefills = int(meta.get("prefills", 0))
        self.saved_budget = int(meta.get("layer_budget", 0)) or None
