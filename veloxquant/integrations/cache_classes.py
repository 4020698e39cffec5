"""Make ``mlx_lm.models.cache.load_prompt_cache`` find every VeloxQuant cache class.

``load_prompt_cache`` looks a saved cache's class up by bare name among the globals of
``mlx_lm.models.cache``. Importing ``veloxquant_mlx`` must be enough to load a saved file,
without importing mlx-lm (about a second) or every method module up front. So each
implemented method's class name is bound there to a small stand-in whose ``from_state``
imports the real class on first use; the real class replaces the stand-in when its
module is imported. If mlx-lm's cache module is not imported yet, an import hook binds
the names the moment it is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

_TARGET = "mlx_lm.models.cache"


class _LazyCacheClass:
    """Stands for a cache class under its bare name until its module is imported."""

    def __init__(self, path: str):
        self.path = path
        self.__name__ = path.rpartition(":")[2]

    def load(self) -> type:
        module, _, name = self.path.partition(":")
        return getattr(importlib.import_module(module), name)

    def from_state(self, state):
        return self.load().from_state(state)

    def __repr__(self) -> str:
        return f"<lazy VeloxQuant cache class {self.path}>"


def _bind(module) -> None:
    from ..registry import METHODS

    for info in METHODS.values():
        if info.implementation is None:
            continue
        name = info.implementation.rpartition(":")[2]
        if not hasattr(module, name):
            setattr(module, name, _LazyCacheClass(info.implementation))


class _BindOnImport(importlib.abc.MetaPathFinder):
    """Binds the names right after ``mlx_lm.models.cache`` executes, then steps aside."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            _bind(module)

        spec.loader.exec_module = exec_module
        return spec


def register_cache_classes() -> None:
    """Bind every implemented cache class's name in mlx-lm's cache module (now or on import)."""
    module = sys.modules.get(_TARGET)
    if module is not None:
        _bind(module)
    elif not any(isinstance(f, _BindOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _BindOnImport())
