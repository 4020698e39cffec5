"""KVCacheConfig: one method key, that method's options, and a few common knobs.

The fields themselves are generated from the spec (``KVCacheConfigFields``). This class
adds the behaviour the public contract promises:

- ``options`` populate every flat field still at its default, and the flat fields always
  hold the effective values (``config.h2o_budget``);
- ``config.options`` is rebuilt from the flat fields, so it always shows effective values;
- setting a flat per-method field directly works but warns
  (``VeloxQuantDeprecationWarning``), pointing at the caller's line;
- a config field the method does not read (``kv_bits`` for kitty) given at a value
  other than its default warns (``UnreadFieldWarning``): it would change nothing, and
  ``veloxquant generate --set`` refuses it;
- a field given both flat and in ``options`` at different (non-default) values warns
  (``ConflictingFieldWarning``); the flat value holds;
- every value is validated against the spec: wrong types and out-of-range values raise
  ``ValueError`` naming the field, the value and what is allowed;
- ``storage`` (eviction methods only): a quantizer's options (``KIVIOptions``) that say how
  the kept tokens are held, at ``kv_bits``; refused for other methods, other options
  classes, and beside a ``residual_window`` of its own (the full-precision window of the
  kept tokens is the method's own recent window);
- a method without an implementation is accepted (configs of every family are the public
  contract and serialise) with an ``UnimplementedMethodWarning``; building its caches
  fails.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import sys
import warnings
from typing import Any, Mapping

from .._generated import validators
from .._generated.config_fields import KVCacheConfigFields
from .._generated.deprecations import CONFIG_FIELD_USERS, CONFIG_FIELDS, FLAT_FIELDS
from .._generated.registry import METHODS, OPTIONS_CLASS_TO_METHOD, implemented_methods
from ..diagnostics import UnimplementedMethodWarning, UnreadFieldWarning

_PACKAGE_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (sys.modules["veloxquant_mlx"], sys.modules["veloxquant_mlx._generated"])
)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(KVCacheConfigFields)}

# What ``storage`` may be: a quantizer's options class -> the config fields that storage
# reads beside its own (its bit width). Decode attention over the packed kept rows:
# evict/quantized_slots.py.
STORAGE_READS = {"KIVIOptions": ("kv_bits",)}
# Config fields that a storage contradicts: a full-precision window of recent tokens (a
# composed cache's is the method's own recent window, the tokens it never evicts).
STORAGE_CONFLICTS = ("residual_window",)


class VeloxQuantDeprecationWarning(DeprecationWarning):
    """A deprecated VeloxQuant API was used; the message names the replacement."""


class ConflictingFieldWarning(UserWarning):
    """A field was given both as a flat KVCacheConfig field and in ``options``, at different values."""


def _did_you_mean(word: str, candidates) -> str:
    by_lower = {str(c).lower(): c for c in candidates}  # "KIVY" is as close to "kivi" as "kivy"
    close = difflib.get_close_matches(str(word).lower(), list(by_lower), n=1)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first frame outside us."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE_DIRS)
        or frame.f_code in _INIT_CODES
    ):
        frame, level = frame.f_back, level + 1
    return level


def _warn_flat(name: str, value: Any, active_method: str) -> None:
    method, cls = FLAT_FIELDS[name]
    message = (
        f"setting KVCacheConfig.{name} directly is deprecated; "
        f"use options={cls}({name}={value!r}) with method={method!r}"
    )
    if method != active_method:
        message += f" (the config's method is {active_method!r}, so it has no effect)"
    warnings.warn(message, VeloxQuantDeprecationWarning, stacklevel=_caller_stacklevel())


def _warn_unread(name: str, value: Any, method: str, storage: Any = None) -> None:
    """Warn when config field ``name`` holds a value of its own that ``method`` (and its
    ``storage``) ignores."""
    if name in STORAGE_READS.get(type(storage).__name__, ()):
        return
    if name in CONFIG_FIELD_USERS and method not in CONFIG_FIELD_USERS[name] and not _same(value, _DEFAULTS[name]):
        warnings.warn(
            f"KVCacheConfig.{name}={value!r} has no effect: {method} does not read {name}; "
            f"{describe_fields_read(method)}",
            UnreadFieldWarning,
            stacklevel=_caller_stacklevel(),
        )


def _check_method(method: Any) -> None:
    if method not in METHODS:
        raise ValueError(
            f"method={method!r} is not a known method{_did_you_mean(method, METHODS)}; "
            f"allowed: {', '.join(METHODS)}"
        )


def storage_problem(method: str, storage: Any, values: Mapping[str, Any]) -> None:
    """Raise (TypeError, ValueError) when ``storage`` cannot hold ``method``'s kept tokens
    with these config ``values``; the message names the field, the value and what is
    allowed."""
    if storage is None:
        return
    name = type(storage).__name__
    key = OPTIONS_CLASS_TO_METHOD.get(name)
    if name not in STORAGE_READS or not isinstance(storage, METHODS[key].options_class):
        raise TypeError(
            f"storage={storage!r}: allowed are None or {', '.join(STORAGE_READS)} (a quantizer "
            "for the tokens an eviction method keeps)")
    if METHODS[method].family != "eviction":
        evictors = [k for k, m in METHODS.items() if m.family == "eviction"]
        raise ValueError(
            f"storage={name}(...) with method={method!r}: storage holds the tokens an eviction "
            f"method keeps, and {method} is a {METHODS[method].family} method; allowed "
            f"methods: {', '.join(evictors)}")
    for field in METHODS[key].fields:
        validators.validate_field(field, getattr(storage, field))
    for field in STORAGE_CONFLICTS:
        if not _same(values.get(field, _DEFAULTS[field]), _DEFAULTS[field]):
            raise ValueError(
                f"{field}={values[field]!r} with storage={name}(...): a composed cache holds in "
                f"full precision the tokens its method protects as recent (its own option), not "
                f"a window of {field}; allowed: {field} left at {_DEFAULTS[field]!r}")


def _storage_dict(storage: Any) -> dict[str, Any]:
    key = OPTIONS_CLASS_TO_METHOD[type(storage).__name__]
    return {"method": key, "options": {n: getattr(storage, n) for n in METHODS[key].fields}}


def _storage_from(data: Any) -> Any:
    """``storage`` as ``to_dict`` writes it (``{"method": "kivi", "options": {...}}``), or
    an options object."""
    if not isinstance(data, Mapping):
        return data
    unknown = set(data) - {"method", "options"}
    if unknown or "method" not in data:
        raise ValueError(
            f"storage={dict(data)!r}: expected {{'method': ..., 'options': {{...}}}}, e.g. "
            "{'method': 'kivi', 'options': {'kivi_group_size': 32}}")
    _check_method(data["method"])
    return _options_from_mapping(data["method"], data.get("options") or {})


def fields_read_by(method: str) -> tuple[str, ...]:
    """Every field ``method`` reads: its options fields, then the config fields whose
    ``used_by`` names it."""
    own = tuple(n for n in CONFIG_FIELDS if method in CONFIG_FIELD_USERS[n])
    return (*METHODS[method].fields, *own)


def head_dim_problem(config: "KVCacheConfig", head_dim: int) -> str | None:
    """Why a field that must divide the model's head_dim (``divides: [head_dim]`` in the
    spec) does not, as ``field=value must divide head_dim=D; allowed here: ...``; None when
    every such field of ``config.method`` fits. A config alone cannot know head_dim: this
    runs when the model is known (cache construction)."""
    storage = getattr(config, "storage", None)
    if storage is not None:
        group = getattr(storage, "kivi_group_size", None)
        if isinstance(group, int) and group > 0 and head_dim % group:
            return f"storage kivi_group_size={group} must divide head_dim={head_dim}"
    for name in METHODS[config.method].head_dim_divisors:
        value = getattr(config.options, name, None)
        if isinstance(value, int) and value > 0 and head_dim % value:
            allowed = ", ".join(str(d) for d in range(1, head_dim + 1)
                                if head_dim % d == 0 and validators.field_problem(name, d) is None)
            return f"{name}={value} must divide head_dim={head_dim}; allowed here: {allowed}"
    return None


def describe_fields_read(method: str) -> str:
    """``kivi reads kivi_group_size (KIVIOptions); kv_bits, ... (config fields)``."""
    info = METHODS[method]
    own = fields_read_by(method)[len(info.fields) :]
    parts = []
    if info.fields:
        parts.append(f"{', '.join(info.fields)} ({info.options_class_name})")
    if own:
        parts.append(f"{', '.join(own)} (config fields)")
    return f"{method} reads " + ("; ".join(parts) if parts else "no field")


def _warn_unimplemented(method: str) -> None:
    if METHODS[method].implemented:
        return
    warnings.warn(
        f"method {method!r} has no implementation yet: this config validates and "
        "serialises, but make_prompt_cache and patch_model_kv_cache refuse it; "
        f"implemented: {', '.join(implemented_methods())}",
        UnimplementedMethodWarning,
        stacklevel=_caller_stacklevel(),
    )


def _expected_options(method: str) -> type | None:
    return METHODS[method].options_class


@dataclasses.dataclass(eq=True, repr=False)
class KVCacheConfig(KVCacheConfigFields):
    """How the KV cache of a model is compressed: ``method`` plus its ``options``.

    >>> from veloxquant_mlx.cache.options import SnapKVOptions
    >>> KVCacheConfig(method="snapkv", options=SnapKVOptions(snap_budget=1024)).snap_budget
    1024

    When ``method`` is left at ``"full"`` and ``options`` are given, the method is the
    one those options belong to. See the generated API reference for every field.
    """

    def __post_init__(self) -> None:
        options = self.__dict__.pop("_pending_options", None)
        if options is not None and self.method == "full":
            inferred = OPTIONS_CLASS_TO_METHOD.get(type(options).__name__)
            if inferred is not None and isinstance(options, METHODS[inferred].options_class):
                object.__setattr__(self, "method", inferred)
        _check_method(self.method)
        _warn_unimplemented(self.method)
        storage_problem(self.method, self.storage, {n: getattr(self, n) for n in CONFIG_FIELDS})
        for name in CONFIG_FIELDS:
            validators.validate_field(name, getattr(self, name))
            _warn_unread(name, getattr(self, name), self.method, self.storage)
        for name in FLAT_FIELDS:
            value = getattr(self, name)
            if not _same(value, _DEFAULTS[name]):
                validators.validate_field(name, value)
                _warn_flat(name, value, self.method)
        if options is not None:
            self._warn_conflicts(options)
            self._apply_options(options, only_defaults=True)
        for name in FLAT_FIELDS:  # a table (an ``Any`` field's array) kept as nested tuples: the
            value = getattr(self, name)  # config stays comparable, and to_dict/from_dict round-trip it
            if _is_table(value):
                object.__setattr__(self, name, _nested_tuples(value))
        self._validate_active()
        object.__setattr__(self, "_ready", True)

    def _warn_conflicts(self, options: Any) -> None:
        """A field given both flat and in ``options``, at two different values (the options'
        not at its default, which cannot be told from one left unset): the caller hears which
        holds. A flat value other than its default holds; one the caller named at its
        default gives way to the options'."""
        expected = _expected_options(self.method)
        if expected is None or not isinstance(options, expected):
            return  # _apply_options refuses it
        named = self.__dict__.get("_named", frozenset())
        for name in METHODS[self.method].fields:
            flat, given = getattr(self, name), getattr(options, name)
            if _same(given, _DEFAULTS[name]) or _same(flat, given):
                continue
            if not _same(flat, _DEFAULTS[name]):
                used = f"the flat {flat!r} is used"
            elif name in named:
                used = f"the options' {given!r} is used (a flat value at its default gives way)"
            else:
                continue
            warnings.warn(
                f"KVCacheConfig: {name} is given twice, {name}={flat!r} and "
                f"options={type(options).__name__}({name}={given!r}); {used}: give it in "
                f"options only",
                ConflictingFieldWarning, stacklevel=_caller_stacklevel())

    # -- options ---------------------------------------------------------------
    @property
    def options(self) -> Any:
        """The active method's options, built from the effective flat values."""
        cls = _expected_options(self.method)
        if cls is None:
            return None
        return cls(**{name: getattr(self, name) for name in METHODS[self.method].fields})

    @options.setter
    def options(self, value: Any) -> None:
        if not self.__dict__.get("_ready"):
            object.__setattr__(self, "_pending_options", value)  # applied in __post_init__
            return
        if value is None:
            return
        expected = _expected_options(self.method)
        if expected is not None and isinstance(value, expected):  # all rules first: all or nothing
            self._validate_active(**{n: getattr(value, n) for n in METHODS[self.method].fields})
        self._apply_options(value, only_defaults=False)
        self._validate_active()

    def _apply_options(self, options: Any, only_defaults: bool) -> None:
        expected = _expected_options(self.method)
        if expected is None or not isinstance(options, expected):
            want = expected.__name__ if expected else "None (this method has no options)"
            raise TypeError(
                f"options for method={self.method!r} must be {want}, "
                f"got {type(options).__name__}"
            )
        for name in METHODS[self.method].fields:
            value = getattr(options, name)
            validators.validate_field(name, value)
            if not only_defaults or _same(getattr(self, name), _DEFAULTS[name]):
                object.__setattr__(self, name, value)

    def _validate_active(self, **changes: Any) -> None:
        """The active method's rules over the current values, or over them with ``changes``."""
        method = changes.get("method", self.method)
        names = (*METHODS[method].fields, *CONFIG_FIELDS)
        validators.validate_values(method, {n: changes.get(n, getattr(self, n)) for n in names})

    # -- assignment after construction ------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if not self.__dict__.get("_ready") or name == "options":
            object.__setattr__(self, name, value)
            return
        if name in ("method", "storage") or name in STORAGE_CONFLICTS:
            now = {n: getattr(self, n) for n in (*CONFIG_FIELDS, "method", "storage")}
            now[name] = value
            if name == "method":
                _check_method(value)
            storage_problem(now["method"], now["storage"], now)  # a refusal changes nothing
            if name == "storage":
                object.__setattr__(self, name, value)
                for field in CONFIG_FIELDS:  # kv_bits may have been the storage's
                    _warn_unread(field, getattr(self, field), self.method, value)
                return
        if name == "method":
            _warn_unimplemented(value)
        elif name in CONFIG_FIELDS or name in FLAT_FIELDS:
            validators.validate_field(name, value)
        else:
            raise AttributeError(
                f"KVCacheConfig has no field {name!r}"
                f"{_did_you_mean(name, _DEFAULTS)}"
            )
        if not (name in FLAT_FIELDS and FLAT_FIELDS[name][0] != self.method):
            self._validate_active(**{name: value})  # before assigning: a refusal changes nothing
        if name in FLAT_FIELDS:
            _warn_flat(name, value, self.method)
        if name in CONFIG_FIELDS:
            _warn_unread(name, value, self.method, self.storage)
        object.__setattr__(self, name, value)

    # -- serialisation -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The nested form: ``{"method": ..., "options": {...}, <own fields>}``."""
        out: dict[str, Any] = {"method": self.method}
        out["options"] = {name: getattr(self, name) for name in METHODS[self.method].fields}
        out.update({name: getattr(self, name) for name in CONFIG_FIELDS})
        if self.storage is not None:  # absent otherwise: configs without one serialise as before
            out["storage"] = _storage_dict(self.storage)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "KVCacheConfig":
        """Inverse of ``to_dict``; also accepts the legacy flat form (with a warning)."""
        if not isinstance(data, Mapping):
            raise TypeError(
                "KVCacheConfig.from_dict expects a dict with 'method' and 'options' "
                "(e.g. {'method': 'kivi', 'options': {'kivi_group_size': 32}}), "
                f"got {type(data).__name__} {data!r}"
            )
        data = dict(data)
        method = data.pop("method", "full")
        options = data.pop("options", None)
        if "storage" in data:
            data["storage"] = _storage_from(data["storage"])
        unknown = [k for k in data if k not in CONFIG_FIELDS and k not in FLAT_FIELDS
                   and k != "storage"]
        if unknown:
            k = unknown[0]
            raise ValueError(
                f"unknown KVCacheConfig key {k!r}{_did_you_mean(k, _DEFAULTS)}"
            )
        if isinstance(options, Mapping):
            _check_method(method)
            options = _options_from_mapping(method, options)
        return cls(method=method, options=options, **data)

    def __repr__(self) -> str:
        own = ", ".join(f"{name}={getattr(self, name)!r}" for name in CONFIG_FIELDS)
        if self.storage is not None:
            own += f", storage={self.storage!r}"
        return f"KVCacheConfig(method={self.method!r}, options={self.options!r}, {own})"


def _options_from_mapping(method: str, values: Mapping[str, Any]) -> Any:
    cls = METHODS[method].options_class
    allowed = METHODS[method].fields
    for key in values:
        if key in CONFIG_FIELDS:
            raise ValueError(
                f"{key!r} is one of KVCacheConfig's own fields, not a field of "
                f"{cls.__name__ if cls else repr(method) + ' (no options)'}: give it beside "
                f"'options' (KVCacheConfig({key}=...)); {describe_fields_read(method)}"
            )
        if key not in allowed:
            raise ValueError(
                f"{key!r} is not a field of "
                f"{cls.__name__ if cls else repr(method) + ' (no options)'}"
                f"{_did_you_mean(key, fields_read_by(method))}; "
                f"{describe_fields_read(method)}"
            )
    if cls is None:
        return None
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


_FIELDS_INIT = KVCacheConfig.__init__


@functools.wraps(_FIELDS_INIT)
def _is_table(value: Any) -> bool:
    """An array, or a sequence of sequences (an array as JSON gives it back)."""
    return (hasattr(value, "shape") and hasattr(value, "tolist")) or (
        isinstance(value, (list, tuple)) and any(isinstance(v, (list, tuple)) for v in value))


def _nested_tuples(value: Any) -> Any:
    value = value.tolist() if hasattr(value, "tolist") else value
    return tuple(_nested_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _same(a: Any, b: Any) -> bool:
    """Field values equal, arrays too (an ``Any`` field may hold one: ``==`` on an array is
    elementwise, and against None it raises)."""
    if a is None or b is None:
        return a is b
    if hasattr(a, "shape") or hasattr(b, "shape"):
        return a is b or (hasattr(a, "shape") and hasattr(b, "shape") and a.shape == b.shape
                          and bool((a == b).all()))
    return a == b


def _init_naming_fields(self, *args, **kwargs):
    # Which fields the caller named: a flat field given at its default is still given, and
    # a conflict with ``options`` over it is reported (``_warn_conflicts``).
    names = [f.name for f in dataclasses.fields(KVCacheConfig)]
    object.__setattr__(self, "_named", frozenset(kwargs) | frozenset(names[: len(args)]))
    _FIELDS_INIT(self, *args, **kwargs)


KVCacheConfig.__init__ = _init_naming_fields
_INIT_CODES = (_FIELDS_INIT.__code__, _init_naming_fields.__code__)
