"""Strict spec parser: ruamel.yaml round-trip nodes -> frozen models, every error at once.

Each error is reported as ``file:line:col: path: message``. Nothing is written when any
error is found; the caller exits with status 2.
"""

from __future__ import annotations

import ast
import difflib
import keyword
import math
import re
from pathlib import Path
from typing import Any, Callable

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import MarkedYAMLError

from .typecheck import conforms
from .model import (
    FAMILIES,
    STATUSES,
    Check,
    Field,
    FieldType,
    Interval,
    Loc,
    Method,
    Paper,
    Spec,
    field_bounds,
)

TOP_KEYS = {"config": False, "methods": True}  # key -> required
CONFIG_KEYS = {"fields": True}
METHOD_KEYS = {
    "key": True,
    "class": False,
    "title": True,
    "family": True,
    "category": False,
    "status": True,
    "status_note": False,
    "paper": False,
    "card": False,
    "implementation": False,
    "checks": False,
    "fields": False,
}
FIELD_KEYS = {
    "name": True,
    "type": True,
    "default": True,
    "doc": True,
    "choices": False,
    "range": False,
    "sweep": False,
    "divides": False,
}
MODEL_DIMENSIONS = ("head_dim",)  # what ``divides`` may name
CONFIG_FIELD_KEYS = {**FIELD_KEYS, "used_by": False}
PAPER_KEYS = {"title": True, "venue": True, "year": True, "arxiv": True}
CHECK_KEYS = {"expr": True, "message": True}

_SCALAR_TYPES = ("int", "float", "bool", "str", "Any", "tuple")
_TUPLE_ITEMS = ("int", "float", "bool", "str")
KNOWN_TYPE_SPELLINGS = (
    *_SCALAR_TYPES,
    *(f"tuple[{t}, ...]" for t in _TUPLE_ITEMS),
    "Literal[...]",
)
CHECK_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "len": len,
    "min": min,
    "max": max,
    "abs": abs,
    "all": all,
    "any": any,
    "sorted": sorted,
    "set": set,
    "tuple": tuple,
}
# KVCacheConfig's built-in attributes: no spec field may take these names.
RESERVED_NAMES = ("method", "options", "to_dict", "from_dict")
_INTERVAL_RE = re.compile(r"^\s*([\[(])\s*([^,\s]+)\s*,\s*([^,\s]+)\s*([\])])\s*$")


class SpecError(Exception):
    """The spec has errors; ``messages`` holds every one, formatted and sorted."""

    def __init__(self, messages: list[str]):
        super().__init__("\n".join(messages))
        self.messages = messages


def did_you_mean(word: str, candidates) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def is_identifier(name: Any) -> bool:
    return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)


def parse_type(text: str) -> FieldType | None:
    """``int | None``, ``tuple[int, ...]``, ``Literal['a', 'b']``...; None if unknown."""
    text = text.strip()
    optional = False
    if re.search(r"\|\s*None$", text):
        optional, text = True, re.sub(r"\s*\|\s*None$", "", text)
    if text in _SCALAR_TYPES:
        return FieldType(base="any" if text == "Any" else text, optional=optional)
    m = re.fullmatch(r"tuple\[\s*(\w+)\s*,\s*\.\.\.\s*\]", text)
    if m and m.group(1) in _TUPLE_ITEMS:
        return FieldType(base="tuple", item=m.group(1), optional=optional)
    m = re.fullmatch(r"Literal\[(.+)\]", text)
    if m:
        try:
            values = ast.literal_eval("(" + m.group(1) + ",)")
        except (ValueError, SyntaxError):
            return None
        if values and all(isinstance(v, (str, int, bool)) for v in values):
            return FieldType(base="literal", literals=tuple(values), optional=optional)
    return None


def parse_interval(text: Any) -> Interval | None:
    if not isinstance(text, str):
        return None
    m = _INTERVAL_RE.match(text)
    if not m:
        return None
    lo_br, lo, hi, hi_br = m.groups()
    try:
        low = None if lo == "-inf" else _number(lo)
        high = None if hi in ("inf", "+inf") else _number(hi)
    except ValueError:
        return None
    # A closed infinite bound ("[0, inf]") admits that infinity: float fields only (range()).
    if low is not None and high is not None and low > high:
        return None
    return Interval(low, high, lo_br == "[", hi_br == "]", text.strip())


def _number(text: str) -> int | float:
    """'3' -> 3, '0.5' -> 0.5; ValueError for anything else (including 'inf')."""
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def _plain(value: Any) -> Any:
    """ruamel scalars and containers -> plain Python values (lists stay lists)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


class _Parser:
    def __init__(self, source: str):
        self.source = source
        self.errors: list[tuple[int, int, str]] = []
        self.config_fields: list[Field] = []  # in scope for every method's checks

    # -- locations and errors --------------------------------------------------
    def loc(self, node: Any, key: Any = None, index: int | None = None, of: str = "key") -> Loc:
        try:
            if key is not None:
                line, col = node.lc.key(key) if of == "key" else node.lc.value(key)
            elif index is not None:
                line, col = node.lc.item(index)
            else:
                line, col = node.lc.line, node.lc.col
        except (AttributeError, KeyError, IndexError, TypeError):
            line, col = 0, 0
        return Loc(self.source, line + 1, col + 1)

    def error(self, loc: Loc, path: str, message: str) -> None:
        self.errors.append((loc.line, loc.col, f"{loc}: {path}: {message}"))

    def mapping(self, node: Any, path: str, keys: dict[str, bool], where: Loc) -> bool:
        """Check a mapping's keys: unknown keys and missing required keys."""
        if not isinstance(node, CommentedMap):
            self.error(where, path, f"expected a mapping, got {_kind(node)}")
            return False
        for k in node:
            if k not in keys:
                self.error(
                    self.loc(node, key=k),
                    f"{path}.{k}" if path else str(k),
                    f"unknown key '{k}'{did_you_mean(k, keys)}"
                    f"; allowed: {', '.join(keys)}",
                )
        for k, required in keys.items():
            if required and k not in node:
                self.error(where, path or "<top>", f"missing key '{k}'")
        return True

    def string(self, node: CommentedMap, key: str, path: str, optional: bool = False):
        if key not in node or (optional and node[key] is None):
            return None
        value = node[key]
        if not isinstance(value, str) or not value.strip():
            self.error(
                self.loc(node, key, of="value"),
                f"{path}.{key}",
                f"expected a non-empty string, got {_kind(value)}",
            )
            return None
        if "\n" in value.strip():
            self.error(self.loc(node, key, of="value"), f"{path}.{key}", "must be one line")
        return str(value).strip()

    def choice(self, node: CommentedMap, key: str, path: str, allowed) -> str | None:
        value = self.string(node, key, path)
        if value is not None and value not in allowed:
            self.error(
                self.loc(node, key, of="value"),
                f"{path}.{key}",
                f"unknown {key} '{value}'{did_you_mean(value, allowed)}; "
                f"allowed: {', '.join(allowed)}",
            )
            return None
        return value

    # -- the spec --------------------------------------------------------------
    def spec(self, root: Any) -> Spec | None:
        where = Loc(self.source, 1, 1)
        if not self.mapping(root, "", TOP_KEYS, where):
            return None
        config_fields: list[Field] = []
        if "config" in root:
            cfg = root["config"]
            if self.mapping(cfg, "config", CONFIG_KEYS, self.loc(root, "config", of="value")):
                config_fields = self.field_list(cfg, "config", CONFIG_FIELD_KEYS)
        self.config_fields = config_fields
        methods: list[Method] = []
        seq = root.get("methods")
        if "methods" in root and not isinstance(seq, CommentedSeq):
            self.error(self.loc(root, "methods", of="value"), "methods", "expected a list")
        elif seq is not None:
            for i, node in enumerate(seq):
                m = self.method(node, f"methods[{i}]", self.loc(seq, index=i))
                if m is not None:
                    methods.append(m)
        self.cross_checks(config_fields, methods)
        return Spec(tuple(config_fields), tuple(methods), self.source)

    def method(self, node: Any, path: str, where: Loc) -> Method | None:
        if not self.mapping(node, path, METHOD_KEYS, where):
            return None
        key = self.string(node, "key", path)
        if key is not None and not (is_identifier(key) and key == key.lower()):
            self.error(
                self.loc(node, "key", of="value"),
                f"{path}.key",
                f"method key '{key}' must be a lowercase Python identifier",
            )
        class_name = self.string(node, "class", path, optional=True)
        if class_name is not None and not is_identifier(class_name):
            self.error(
                self.loc(node, "class", of="value"),
                f"{path}.class",
                f"class name '{class_name}' is not a Python identifier",
            )
        title = self.string(node, "title", path)
        family = self.choice(node, "family", path, FAMILIES)
        category = self.string(node, "category", path, optional=True) or family
        status = self.choice(node, "status", path, STATUSES)
        status_note = self.string(node, "status_note", path, optional=True)
        card = self.string(node, "card", path, optional=True)
        implementation = self.string(node, "implementation", path, optional=True)
        if implementation is not None and not re.fullmatch(
            r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", implementation
        ):
            self.error(
                self.loc(node, "implementation", of="value"),
                f"{path}.implementation",
                f"'{implementation}' is not of the form 'package.module:ClassName'",
            )
        paper = None
        if node.get("paper") is not None:
            paper = self.paper(node["paper"], f"{path}.paper", self.loc(node, "paper", of="value"))
        fields = self.field_list(node, path, FIELD_KEYS) if "fields" in node else []
        if fields and class_name is None:
            self.error(where, path, "a method with fields needs a 'class' for its options")
        checks = []
        if node.get("checks") is not None:
            declared = [
                f.get("name")
                for f in (node.get("fields") or [])
                if isinstance(f, CommentedMap) and isinstance(f.get("name"), str)
            ]
            checks = self.check_list(node, path, fields, declared)
        if key is None:
            return None
        # Even a method with errors takes part in the whole-spec checks (duplicates...).
        return Method(
            key=key,
            class_name=class_name,
            title=title or "",
            family=family or "",
            category=category or "",
            status=status or "",
            status_note=status_note,
            paper=paper,
            card=card,
            implementation=implementation,
            checks=tuple(checks),
            fields=tuple(fields),
            loc=where,
        )

    def paper(self, node: Any, path: str, where: Loc) -> Paper | None:
        if not self.mapping(node, path, PAPER_KEYS, where):
            return None
        title = self.string(node, "title", path)
        venue = self.string(node, "venue", path, optional=True)
        arxiv = node.get("arxiv")
        if arxiv is not None and not (
            isinstance(arxiv, str) and re.fullmatch(r"\d{4}\.\d{4,5}", arxiv)
        ):
            self.error(
                self.loc(node, "arxiv", of="value"),
                f"{path}.arxiv",
                f"arXiv id must be a quoted string like \"2402.02750\" or null, got {arxiv!r}",
            )
            arxiv = None
        year = node.get("year")
        if year is not None and not (isinstance(year, int) and 1900 < year < 2100):
            self.error(
                self.loc(node, "year", of="value"), f"{path}.year", f"bad year {year!r}"
            )
            year = None
        if title is None:
            return None
        return Paper(title, venue, year, arxiv)

    def field_list(self, owner: CommentedMap, path: str, keys: dict[str, bool]) -> list[Field]:
        seq = owner["fields"]
        if seq is None:
            return []
        if not isinstance(seq, CommentedSeq):
            self.error(self.loc(owner, "fields", of="value"), f"{path}.fields", "expected a list")
            return []
        out = []
        for i, node in enumerate(seq):
            f = self.field(node, f"{path}.fields[{i}]", self.loc(seq, index=i), keys)
            if f is not None:
                out.append(f)
        return out

    def field(self, node: Any, path: str, where: Loc, keys: dict[str, bool]) -> Field | None:
        if not self.mapping(node, path, keys, where):
            return None
        ok = True
        name = node.get("name")
        if "name" in node and not is_identifier(name):
            self.error(
                self.loc(node, "name", of="value"),
                f"{path}.name",
                f"field name {name!r} is not a Python identifier"
                + (" (it is a keyword)" if keyword.iskeyword(str(name)) else ""),
            )
            ok = False
        doc = self.string(node, "doc", path)
        ftype = None
        if "type" in node:
            raw = node["type"]
            ftype = parse_type(raw) if isinstance(raw, str) else None
            if ftype is None:
                self.error(
                    self.loc(node, "type", of="value"),
                    f"{path}.type",
                    f"unknown type {str(raw)!r}{did_you_mean(raw, KNOWN_TYPE_SPELLINGS)}",
                )
        if not ("name" in node and "default" in node and doc is not None and ftype is not None):
            return None
        choices = self.choices(node, path, ftype)
        interval = self.range(node, path, ftype)
        default = self.value(node, "default", path, ftype, choices, interval)
        used_by = ()
        if node.get("used_by") is not None:
            ub = _plain(node["used_by"])
            if not (isinstance(ub, list) and all(isinstance(u, str) for u in ub)):
                self.error(
                    self.loc(node, "used_by", of="value"),
                    f"{path}.used_by",
                    "expected a list of method keys",
                )
            else:
                used_by = tuple(ub)
        sweep, sweep_locs = self.sweep(node, path, ftype, choices, interval)
        divides = self.divides(node, path, ftype)
        if not ok or default is _INVALID:
            return None
        return Field(
            name, ftype, default, doc, choices, interval, used_by, sweep, where, sweep_locs,
            divides,
        )

    def divides(self, node: CommentedMap, path: str, ftype: FieldType) -> tuple[str, ...]:
        """``divides: [head_dim]``: model dimensions an int field's value must divide."""
        if node.get("divides") is None:
            return ()
        seq = _plain(node["divides"])
        at = self.loc(node, "divides", of="value")
        if ftype.base != "int":
            self.error(at, f"{path}.divides", f"only an int field can divide a model dimension, not {ftype.base}")
            return ()
        if not (isinstance(seq, list) and seq and all(d in MODEL_DIMENSIONS for d in seq)):
            self.error(at, f"{path}.divides",
                       f"expected a non-empty list of {', '.join(MODEL_DIMENSIONS)}, got {seq!r}")
            return ()
        return tuple(seq)

    def sweep(self, node: CommentedMap, path: str, ftype: FieldType, choices, interval):
        """``sweep: [v, ...]``: each value valid for the field, no repeats."""
        if node.get("sweep") is None:
            return None, ()
        seq = node["sweep"]
        at = self.loc(node, "sweep", of="value")
        if not isinstance(seq, CommentedSeq) or not seq:
            self.error(at, f"{path}.sweep", f"expected a non-empty list of values, got {_kind(seq)}")
            return None, ()
        values, ok = [], True
        for i, item in enumerate(seq):
            raw = _plain(item)
            problem = describe_invalid(raw, ftype, choices, interval)
            if not problem and any(_same(raw, v) for v in values):
                problem = "repeats an earlier value"
            if problem:
                self.error(self.loc(seq, index=i), f"{path}.sweep[{i}]", f"sweep value {raw!r} {problem}")
                ok = False
            values.append(raw)
        if not ok:
            return None, ()
        locs = tuple(self.loc(seq, index=i) for i in range(len(seq)))
        return tuple(_coerce(v, ftype) for v in values), locs

    def choices(self, node: CommentedMap, path: str, ftype: FieldType):
        if node.get("choices") is None:
            return None
        raw = _plain(node["choices"])
        at = self.loc(node, "choices", of="value")
        if ftype.base in ("literal", "bool", "any") or not isinstance(raw, list) or not raw:
            why = (
                f"not allowed on a {ftype.annotation} field"
                if ftype.base in ("literal", "bool", "any")
                else "expected a non-empty list"
            )
            self.error(at, f"{path}.choices", why)
            return None
        item = ftype.item if ftype.base == "tuple" else ftype.base
        for v in raw:
            if item is not None and not conforms(v, item):
                self.error(at, f"{path}.choices", f"choice {v!r} is not a valid {item}")
                return None
        if len(set(map(repr, raw))) != len(raw):
            self.error(at, f"{path}.choices", "duplicate choices")
        return tuple(raw)

    def range(self, node: CommentedMap, path: str, ftype: FieldType):
        if node.get("range") is None:
            return None
        at = self.loc(node, "range", of="value")
        numeric = ftype.base in ("int", "float") or (
            ftype.base == "tuple" and ftype.item in ("int", "float")
        )
        if not numeric:
            self.error(at, f"{path}.range", f"a range needs a numeric type, not {ftype.annotation}")
            return None
        interval = parse_interval(node["range"])
        if interval is None:
            self.error(
                at,
                f"{path}.range",
                f"bad interval {node['range']!r}; write e.g. \"[0, 1]\", \"(0, 1]\" or \"[1, inf)\"",
            )
            return None
        item = ftype.item if ftype.base == "tuple" else ftype.base
        infinite = (interval.low is None and interval.low_closed) or (
            interval.high is None and interval.high_closed
        )
        if infinite and item != "float":
            self.error(
                at,
                f"{path}.range",
                f"{interval.text}: only a float range may include an infinity; "
                "write the bound open, e.g. \"[1, inf)\"",
            )
            return None
        return interval

    def value(self, node, key, path, ftype: FieldType, choices, interval):
        raw = _plain(node[key])
        at = self.loc(node, key, of="value")
        problem = describe_invalid(raw, ftype, choices, interval)
        if problem:
            self.error(at, f"{path}.{key}", f"default {raw!r} {problem}")
            return _INVALID
        return _coerce(raw, ftype)

    def check_list(
        self, node: CommentedMap, path: str, fields: list[Field], declared: list[str]
    ) -> list[Check]:
        """Parse the checks; names may be any declared field, even one with errors."""
        seq = node["checks"]
        if not isinstance(seq, CommentedSeq):
            self.error(self.loc(node, "checks", of="value"), f"{path}.checks", "expected a list")
            return []
        out = []
        for i, item in enumerate(seq):
            p = f"{path}.checks[{i}]"
            if not self.mapping(item, p, CHECK_KEYS, self.loc(seq, index=i)):
                continue
            expr, message = self.string(item, "expr", p), self.string(item, "message", p)
            if expr is None or message is None:
                continue
            at = self.loc(item, "expr", of="value")
            try:
                tree = ast.parse(expr, mode="eval")
            except SyntaxError as exc:
                self.error(at, f"{p}.expr", f"not a Python expression: {exc.msg}")
                continue
            found = sorted(
                (n.col_offset, n.id) for n in ast.walk(tree) if isinstance(n, ast.Name)
            )
            names = list(dict.fromkeys(name for _, name in found))  # in reading order
            in_scope = list(fields) + self.config_fields
            field_names = declared + [f.name for f in self.config_fields]
            unknown = [n for n in names if n not in field_names and n not in CHECK_FUNCTIONS]
            unknown = [n for n in unknown if n not in ("None", "True", "False")]
            for n in unknown:
                self.error(
                    at,
                    f"{p}.expr",
                    f"unknown name '{n}'{did_you_mean(n, field_names)}; "
                    "checks may use this method's fields and the config's own fields",
                )
            if unknown:
                continue
            defaults = {f.name: f.default for f in in_scope}
            if any(n in field_names and n not in defaults for n in names):
                continue  # a field it uses has errors of its own, already reported
            try:
                holds = eval(compile(tree, "<check>", "eval"), {"__builtins__": {}}, {**CHECK_FUNCTIONS, **defaults})  # noqa: S307 - spec-authored expression over literal defaults
            except Exception as exc:  # noqa: BLE001 - report any failure as a spec error
                self.error(at, f"{p}.expr", f"fails on the defaults: {exc!r}")
                continue
            if not holds:
                self.error(at, f"{p}.expr", f"is False for the defaults: {message}")
                continue
            used = tuple(n for n in names if n in field_names)
            out.append(Check(expr, message, used, at))
        return out

    # -- whole-spec rules ------------------------------------------------------
    def cross_checks(self, config_fields: list[Field], methods: list[Method]) -> None:
        seen_keys: dict[str, Method] = {}
        seen_classes: dict[str, Method] = {}
        owner: dict[str, tuple[str, Loc]] = {}
        for name in RESERVED_NAMES:
            owner[name] = ("the config's own fields", Loc(self.source, 0, 0))
        for f in config_fields:
            if f.name in owner:
                at = owner[f.name][1]
                where = f" (first defined at {at})" if at.line else " (a built-in name)"
                self.error(f.loc, f"config.fields.{f.name}", f"duplicate field '{f.name}'{where}")
            owner.setdefault(f.name, ("the config's own fields", f.loc))
        for m in methods:
            if m.key in seen_keys:
                self.error(m.loc, m.key, f"duplicate method key '{m.key}' "
                           f"(first defined at {seen_keys[m.key].loc})")
            seen_keys.setdefault(m.key, m)
            if m.class_name is not None:
                if m.class_name in seen_classes:
                    self.error(m.loc, m.key, f"duplicate class '{m.class_name}' (also used by "
                               f"method '{seen_classes[m.class_name].key}')")
                seen_classes.setdefault(m.class_name, m)
            for f in m.fields:
                if f.name not in owner:
                    owner[f.name] = (m.key, f.loc)
                    continue
                first, at = owner[f.name]
                where = f" (defined at {at})" if at.line else ""
                if first == m.key:
                    why = f"duplicate field '{f.name}'{where}"
                else:
                    whose = first if first.startswith("the ") else f"method '{first}'"
                    why = f"field name '{f.name}' collides with {whose}{where}"
                self.error(f.loc, f"{m.key}.fields.{f.name}", why)
        keys = set(seen_keys)
        for f in config_fields:
            for k in f.used_by:
                if k not in keys:
                    self.error(f.loc, f"config.fields.{f.name}.used_by",
                               f"unknown method '{k}'{did_you_mean(k, keys)}")
        for m in methods:
            for f in m.fields:
                self.sweep_checks(m, f, f"{m.key}.fields.{f.name}", config_fields)
            for f in config_fields:
                if m.key in f.used_by:
                    self.sweep_checks(m, f, f"config.fields.{f.name}", config_fields)

    def sweep_checks(self, m: Method, swept: Field, path: str, config_fields) -> None:
        """Each sweep value, the method's other fields at their defaults, passes its checks:
        the bench runs exactly that setting."""
        if not swept.sweep:
            return
        defaults = {f.name: f.default for f in (*m.fields, *config_fields)}
        for i, (value, at) in enumerate(zip(swept.sweep, swept.sweep_locs)):
            scope = {**CHECK_FUNCTIONS, **defaults, swept.name: value}
            for c in m.checks:
                if swept.name not in c.names or any(n not in scope for n in c.names):
                    continue
                try:
                    holds = eval(c.expr, {"__builtins__": {}}, scope)  # noqa: S307 - spec-authored expression over literal values
                except Exception as exc:  # noqa: BLE001 - report any failure as a spec error
                    holds, why = False, f"{c.expr} fails: {exc!r}"
                else:
                    why = c.message
                if not holds:
                    self.error(at, f"{path}.sweep[{i}]",
                               f"sweep value {value!r} breaks a check of method '{m.key}' "
                               f"(its other fields at their defaults): {why}")


class _Invalid:
    pass


_INVALID = _Invalid()


def describe_invalid(value: Any, ftype: FieldType, choices, interval: Interval | None) -> str:
    """Why ``value`` is not valid for the field, or '' when it is."""
    if value is None:
        return "" if ftype.optional or ftype.base == "any" else f"is not a valid {ftype.annotation} (None not allowed)"
    items = list(value) if ftype.base == "tuple" and isinstance(value, list) else [value]
    if ftype.base in ("float", "tuple") and any(isinstance(v, float) and math.isnan(v) for v in items):
        return "is NaN, which no range admits"
    if not conforms(value, ftype.base, ftype.item, ftype.literals):
        if ftype.base == "literal":
            allowed = ", ".join(repr(v) for v in ftype.literals)
            return f"is not among the Literal's choices ({allowed})"
        return f"is not a valid {ftype.annotation}"
    bounds = field_bounds(ftype, choices, interval)
    for v in items:
        if choices is not None and v not in choices:
            allowed = ", ".join(repr(c) for c in choices)
            return f"is not among the choices ({allowed})"
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not bounds.contains(v):
            if interval is not None and not interval.contains(v):
                return f"is outside the range {interval.text}"
            return f"is beyond the int limit ({bounds.cap_text})"
    return ""


def _coerce(raw: Any, ftype: FieldType) -> Any:
    """A valid YAML value as the field holds it: lists as tuples, ints as floats."""
    if ftype.base == "tuple" and raw is not None:
        return tuple(raw)
    if ftype.base == "float" and isinstance(raw, int):
        return float(raw)
    return raw


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, CommentedMap):
        return "a mapping"
    if isinstance(value, CommentedSeq):
        return "a list"
    return type(value).__name__


def load_spec(path: Path, source: str | None = None) -> Spec:
    """Parse and check the spec at ``path``; raise SpecError listing every problem."""
    source = source or str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError([f"{source}: cannot read: {exc.strerror}"]) from None
    try:
        root = YAML(typ="rt").load(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        what = exc.problem or str(exc)
        if exc.context:
            what = f"{exc.context}; {what}"
        raise SpecError([f"{source}:{line}:{col}: YAML syntax error: {what}"]) from None
    parser = _Parser(source)
    spec = parser.spec(root)
    if parser.errors:
        raise SpecError([msg for _, _, msg in sorted(parser.errors)])
    assert spec is not None
    return spec
