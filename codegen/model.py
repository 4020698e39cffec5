"""The parsed spec: frozen attrs models that remember where each value came from."""

from __future__ import annotations

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


@attrs.frozen
class Loc:
    file: str
    line: int  # 1-based
    col: int  # 1-based

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@attrs.frozen
class Interval:
    """A closed, open or half-open interval; ``None`` bounds are infinite."""

    low: float | None
    high: float | None
    low_closed: bool
    high_closed: bool
    text: str

    def contains(self, x: float) -> bool:
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
    loc: Loc = attrs.field(eq=False)

    @property
    def constraint_text(self) -> str:
        parts = []
        if self.type.base == "literal":
            parts.append("one of " + ", ".join(repr(v) for v in self.type.literals))
        if self.choices is not None:
            parts.append("one of " + ", ".join(repr(v) for v in self.choices))
        if self.range is not None:
            parts.append(f"in {self.range.text}")
        text = "; ".join(parts)
        if text and self.type.base == "tuple":
            text = "each item " + text
        if text and self.type.optional:
            text = "None or " + text
        return text or "any value of its type"


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
            return attribute.name not in ("loc", "source")

        return attrs.asdict(self, filter=strip)
