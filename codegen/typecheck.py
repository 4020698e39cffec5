"""Whether a value is of a spec type: used by the parser for defaults, and copied verbatim
into the generated validators (``generated/validators.py``), so both judge alike."""

import math
from typing import Any


def conforms(value: Any, base: str, item: str | None = None, literals: tuple = ()) -> bool:
    """Whether ``value`` (not None) is a valid value of the base type ``base``."""
    if base == "any":
        return True
    if base == "literal":
        return any(value == v and type(value) is type(v) for v in literals)
    if base == "bool":
        return isinstance(value, bool)
    if base == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if base == "float":
        return (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and not math.isnan(value)
        )
    if base == "str":
        return isinstance(value, str)
    if base == "tuple":
        return isinstance(value, (tuple, list)) and (
            item is None or all(conforms(v, item) for v in value)
        )
    raise AssertionError(base)
