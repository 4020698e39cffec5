"""The method registry (generated from the spec): key -> options class -> cache class."""

from ._generated.registry import (
    METHODS,
    OPTIONS_CLASS_TO_METHOD,
    MethodInfo,
    Paper,
    implemented_methods,
)

__all__ = ["METHODS", "OPTIONS_CLASS_TO_METHOD", "MethodInfo", "Paper", "implemented_methods"]
