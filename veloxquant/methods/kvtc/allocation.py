"""Bit allocation across transform components by dynamic programming, under a bit budget.

Component i (variance ``λ_i``) coded at ``b`` bits costs ``D_i(b)``; choose ``b_i`` from a
set of allowed widths to minimise ``Σ D_i(b_i)`` subject to ``Σ b_i <= budget``.
``dp[c]`` is the least distortion of the components so far spending exactly ``c`` bits;
each component relaxes it for every allowed width in one numpy pass (O(p * budget *
|choices|) work in p passes, not p * |choices|), then the widths are read back. Ties go to fewer bits (a component of zero variance gets
none), so the optimum spends the whole budget whenever more bits still lower the
distortion and the budget is a sum of allowed widths.

``allocate_by_variance`` runs the DP on the only components that can get bits (issue 31: the
DP ran over all H*d components, 1,024 at the 8B shape, twice a layer at every prompt). A
width whose modelled distortion is no lower than the component's variance (1 bit at
β >= √3) is never chosen: dropping the component costs no more and spends no bits. Among the
other widths ``D_i(b) = λ_i r(b)`` with r strictly decreasing, so swapping the widths of
two components whose order disagrees with their variances' lowers the sum: an optimal
allocation's widths do not increase down the variances, and at most ``budget // w``
components (w the narrowest width left) get any. The widths are those of the whole DP
(tests check it on random spectra), unless two equal positive variances straddle that cut,
where the whole DP may choose between them the other way at the same distortion.

``uniform_distortion``: the model of a uniform quantizer over ``[-β σ, β σ]`` with
``2**b`` levels (step ``Δ = 2 β σ / (2**b - 1)``): ``D(b) = Δ² / 12``, ``D(0) = λ`` (the
component dropped); clipping beyond ``β σ`` is ignored (KVTC's card, inferred).
"""

from __future__ import annotations

import numpy as np


def uniform_step(variances: np.ndarray, bits: np.ndarray, beta: float) -> np.ndarray:
    """Δ of each component's uniform quantizer (0 where it gets no bits)."""
    levels = np.maximum((1 << np.asarray(bits, np.int64)) - 1, 1)
    step = 2 * beta * np.sqrt(np.maximum(variances, 0.0)) / levels
    return np.where(np.asarray(bits) > 0, step, 0.0)


def uniform_distortion(variances: np.ndarray, choices, beta: float) -> np.ndarray:
    """(p, len(choices)) distortions D_i(b) of the uniform model."""
    lam = np.maximum(np.asarray(variances, np.float64), 0.0)[:, None]
    b = np.asarray(choices, np.int64)[None]
    step = 2 * beta * np.sqrt(lam) / np.maximum((1 << b) - 1, 1)
    return np.where(b > 0, step**2 / 12, lam)


def allocate(distortion: np.ndarray, choices, budget: int) -> np.ndarray:
    """Widths (p,) from ``choices`` minimising Σ distortion[i, choice] with Σ widths <= budget."""
    d = np.asarray(distortion, np.float64)
    widths = np.asarray(choices, np.int64)
    p = d.shape[0]
    order = np.argsort(widths, kind="stable")  # ascending, so a tie keeps the fewer bits
    order = order[widths[order] <= budget]
    if not order.size and p:
        raise ValueError(f"no allocation of widths {sorted(set(widths.tolist()))} fits {budget} bits")
    top = int(widths[order].max()) if order.size else 0
    # every allowed width at once (issue 31: one pass a component, not one a width): row j of
    # ``shifted`` reads dp[c - w_j], through ``top`` leading infinities for c < w_j
    shifted = np.arange(budget + 1)[None] - widths[order][:, None] + top
    dp = np.full(budget + 1, np.inf)
    dp[0] = 0.0
    pick = np.zeros((p, budget + 1), np.int16)
    padded = np.full(budget + 1 + top, np.inf)
    for i in range(p):
        padded[top:] = dp
        cand = padded[shifted] + d[i, order][:, None]
        j = np.argmin(cand, axis=0)  # the first of equal minima: the fewer bits, as before
        dp, pick[i] = np.take_along_axis(cand, j[None], axis=0)[0], order[j]
    spent = int(np.argmin(dp))  # the first of equal minima: the fewest bits
    if not np.isfinite(dp[spent]):
        raise ValueError(f"no allocation of widths {sorted(set(widths.tolist()))} fits {budget} bits")
    out = np.zeros(p, np.int64)
    for i in range(p - 1, -1, -1):
        out[i] = widths[pick[i, spent]]
        spent -= out[i]
    return out


def useful_widths(choices, beta: float) -> tuple[int, ...]:
    """The widths an optimal allocation may choose: 0 and those whose modelled distortion is
    below dropping the component (``D(b) < λ``), ascending."""
    widths = sorted(set(int(w) for w in choices))
    ratio = uniform_distortion(np.ones(1), widths, beta)[0]  # D(b) / λ for each width
    return tuple(w for w, r in zip(widths, ratio) if w == 0 or r < 1)


def leading_count(p: int, choices, budget: int, beta: float) -> int:
    """How many of ``p`` components, by decreasing variance, can get bits (module
    docstring): ``budget //`` the narrowest useful width, at most p; 0 where none fits; p
    where 0 is not an allowed width (every component then takes one: no cut)."""
    if 0 not in {int(w) for w in choices}:
        return p
    positive = [w for w in useful_widths(choices, beta) if 0 < w <= budget]
    return min(p, budget // min(positive)) if positive else 0


def allocate_by_variance(variances: np.ndarray, choices, budget: int, beta: float) -> np.ndarray:
    """``allocate(uniform_distortion(variances, choices, beta), choices, budget)`` for
    variances by decreasing value, over the leading components that can get bits (module
    docstring): widths (p,)."""
    lam = np.asarray(variances, np.float64)
    if 0 not in {int(w) for w in choices}:  # no component may be dropped: the whole DP
        return allocate(uniform_distortion(lam, choices, beta), choices, budget)
    out = np.zeros(lam.size, np.int64)
    k = leading_count(lam.size, choices, budget, beta)
    if k:
        useful = useful_widths(choices, beta)
        out[:k] = allocate(uniform_distortion(lam[:k], useful, beta), useful, budget)
    return out
