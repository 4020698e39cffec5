"""The bench's task generators (standard library only) imported without the package,
whose ``__init__`` needs MLX: the training machine has PyTorch, not MLX."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

_BENCH = Path(__file__).resolve().parents[1] / "veloxquant" / "bench"


def load():
    """(tasks, ruler): ``veloxquant/bench/tasks.py`` and ``ruler.py`` as modules."""
    if "vq_bench" not in sys.modules:
        pkg = types.ModuleType("vq_bench")
        pkg.__path__ = [str(_BENCH)]
        sys.modules["vq_bench"] = pkg
    return importlib.import_module("vq_bench.tasks"), importlib.import_module("vq_bench.ruler")
