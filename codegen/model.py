"""The parsed spec: frozen attrs models that remember where each value came from."""

from __future__ import annotations

import math
from typing import Any

import attrs

FAMILIES = (
    "baseline",
    "quantization",
    "vector-quantization",
    "low-rank",
    "cross-layer",
    "eviction",
    "merging",
    "hybrid",
    "coding",
)
STATUSES = ("faithful", "adapted", "no-verified-venue")

# Every int field is bounded, so that no value reaches a cache that MLX cannot represent.
# An int whose range is open above (token counts, budgets, windows, group sizes, ranks)
# stops at 2**31 - 1: MLX's array shapes and indices are int32, so no cache can hold or
# index more rows than that. An int without a range (seeds) must fit int64.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@attrs.frozen
class Loc:
    file: str
    line: int  # 1-based
    col: int  # 1-based

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@attrs.frozen
class Interval:
    """A closed, open or half-open interval; ``None`` bounds are infinite.

    An infinite bound is closed only where the spec wrote it so (``"[0, inf]"``, float
    fields only): then that infinity itself is allowed.
    """

    low: float | None
    high: float | None
    low_closed: bool
    high_closed: bool
    text: str

    def contains(self, x: float) -> bool:
        if isinstance(x, float) and math.isinf(x):
            bound, closed = (self.high, self.high_closed) if x > 0 else (self.low, self.low_closed)
            return bound is None and closed
        if self.low is not None and (x < self.low or (x == self.low and not self.low_closed)):
            return False
        if self.high is not None and (
            x > self.high or (x == self.high and not self.high_closed)
        ):
            return False
        return True


@attrs.frozen
class FieldType:
    """A field's type: a base kind, maybe a tuple of items, maybe ``| None``."""

    base: str  # int float bool str any tuple literal
    item: str | None = None  # for tuple[<item>, ...]
    literals: tuple[Any, ...] = ()
    optional: bool = False

    @property
    def annotation(self) -> str:
        if self.base == "any":
            text = "Any"
        elif self.base == "literal":
            text = "Literal[" + ", ".join(repr(v) for v in self.literals) + "]"
        elif self.base == "tuple" and self.item is not None:
            text = f"tuple[{self.item}, ...]"
        else:
            text = self.base
        return text + " | None" if self.optional else text


@attrs.frozen
class Field:
    name: str
    type: FieldType
    default: Any
    doc: str
    choices: tuple[Any, ...] | None
    range: Interval | None
    used_by: tuple[str, ...]
    sweep: tuple[Any, ...] | None  # the values `veloxquant bench --sweep` runs
    loc: Loc = attrs.field(eq=False)
    sweep_locs: tuple[Loc, ...] = attrs.field(eq=False, default=())
    # model dimensions the value must divide (``divides: [head_dim]``), checked when the
    # model is known (cache construction), since a config alone does not know them
    divides: tuple[str, ...] = ()

    @property
    def bounds(self) -> "Bounds":
        return field_bounds(self.type, self.choices, self.range)

    @property
    def constraint_text(self) -> str:
        parts = []
        if self.type.base == "literal":
            parts.append("one of " + ", ".join(repr(v) for v in self.type.literals))
        if self.choices is not None:
            parts.append("one of " + ", ".join(repr(v) for v in self.choices))
        bounds = self.bounds
        if self.range is not None:
            parts.append(f"in {self.range.text}" + (bounds.cap_text and ", " + bounds.cap_text))
        elif bounds.cap_text:
            parts.append(bounds.cap_text)
        text = "; ".join(parts)
        if text and self.type.base == "tuple":
            text = "each item " + text
        if text and self.type.optional:
            text = "None or " + text
        return text or "any value of its type"


@attrs.frozen
class Bounds:
    """What a numeric field accepts in fact: its range, with the int caps applied."""

    low: float | None
    high: float | None
    low_closed: bool
    high_closed: bool
    pos_inf: bool  # float fields: +inf allowed (the range ends in "inf]")
    neg_inf: bool
    cap_text: str  # how the int cap reads in messages, "" when none applies

    def contains(self, x: float) -> bool:
        if isinstance(x, float) and math.isnan(x):
            return False
        if isinstance(x, float) and math.isinf(x):
            return self.pos_inf if x > 0 else self.neg_inf
        if self.low is not None and (x < self.low or (x == self.low and not self.low_closed)):
            return False
        return self.high is None or x < self.high or (x == self.high and self.high_closed)


def field_bounds(ftype: FieldType, choices, interval: Interval | None) -> Bounds:
    numeric = ftype.item if ftype.base == "tuple" else ftype.base
    if interval is None:
        low = high = None
        low_closed = high_closed = True
    else:
        low, high = interval.low, interval.high
        low_closed, high_closed = interval.low_closed, interval.high_closed
    pos_inf = numeric == "float" and high is None and high_closed and interval is not None
    neg_inf = numeric == "float" and low is None and low_closed and interval is not None
    cap_text = "finite" if numeric == "float" and interval is None and choices is None else ""
    if numeric == "int" and choices is None:
        if interval is None:
            low, high, cap_text = INT64_MIN, INT64_MAX, "in [-2**63, 2**63 - 1]"
        else:
            if high is None:
                high, high_closed, cap_text = INT32_MAX, True, "at most 2**31 - 1"
            if low is None:
                low, low_closed = -INT32_MAX - 1, True
                cap_text = "at least -2**31" + (cap_text and " and " + cap_text)
    return Bounds(low, high, low_closed, high_closed, pos_inf, neg_inf, cap_text)


@attrs.frozen
class Paper:
    title: str
    venue: str | None
    year: int | None
    arxiv: str | None


@attrs.frozen
class Check:
    expr: str
    message: str
    names: tuple[str, ...]
    loc: Loc = attrs.field(eq=False)


@attrs.frozen
class Method:
    key: str
    class_name: str | None
    title: str
    family: str
    category: str
    status: str
    status_note: str | None
    paper: Paper | None
    card: str | None
    implementation: str | None
    checks: tuple[Check, ...]
    fields: tuple[Field, ...]
    loc: Loc = attrs.field(eq=False)


@attrs.frozen
class Spec:
    config_fields: tuple[Field, ...]
    methods: tuple[Method, ...]
    source: str  # the spec path as shown in headers and messages

    def canonical(self) -> Any:
        """Everything that defines the output, without source positions."""

        def strip(attribute: attrs.Attribute, value: Any) -> bool:
            return attribute.name not in ("loc", "source", "sweep_locs")

        return attrs.asdict(self, filter=strip)
