"""The fused attentions a decode read calls, as a test sees them: each CUDA read's step is
one ``mx.fast.scaled_dot_product_attention`` over its rows."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx


class Call(NamedTuple):
    rows: int  # query rows (1: a decode step)
    width: int  # the queries' head width
    keys: int  # keys read


def recorded(monkeypatch) -> list[Call]:
    """Every ``scaled_dot_product_attention`` call from now on, appended as it is made."""
    calls = []
    real = mx.fast.scaled_dot_product_attention

    def sdpa(q, k, *rest, **kw):
        calls.append(Call(q.shape[2], q.shape[-1], k.shape[2]))
        return real(q, k, *rest, **kw)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", sdpa)
    return calls


def one_row(calls: list[Call]) -> list[Call]:
    """The decode steps' calls: one query row."""
    return [c for c in calls if c.rows == 1]
