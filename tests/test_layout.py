"""The package's rooms, read from its imports: shared folders hold only what two or more
methods (or the integration, the bench, the CLI) use, and imports run downward only.

Layers, bottom up: cache/ (protocol, config, context, buffers); kernels/; quant/, evict/,
lowrank/ (machinery methods share); methods/ (one module or package a method); then the
integration, the bench and the CLI. A method's package (``methods/<key>/``) keeps what
only it uses.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "veloxquant"
SHARED = ("cache", "kernels", "quant", "evict", "lowrank")
ABOVE_SHARED = ("methods", "integrations", "bench", "cli", "cli_common")
# Public homes whose users are outside the package (the options classes' import path).
PUBLIC = {"cache.options"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Modules of the package that ``name`` imports (anywhere in its body)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1] + ([node.module] if node.module else [])
            elif node.module and node.module.split(".")[0] == "veloxquant_mlx":
                base = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                sub = ".".join(base + [alias.name])
                out.add(sub if sub in MODULES else ".".join(base))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "veloxquant_mlx":
                    out.add(".".join(alias.name.split(".")[1:]))
    out.discard(name)
    return {m for m in out if m in MODULES}


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _room(name: str) -> str:
    return name.split(".")[0] if name else ""


def _users(name: str) -> set[str]:
    """Who uses ``name``, through shared modules: methods by key, other rooms by name."""
    users, todo, seen = set(), [name], {name}
    while todo:
        current = todo.pop()
        for importer, targets in IMPORTS.items():
            if current not in targets or importer in seen:
                continue
            seen.add(importer)
            parts = importer.split(".")
            if parts[0] in SHARED:
                todo.append(importer)
            elif parts[0] == "methods" and len(parts) > 1:
                users.add("method " + parts[1])
            else:
                users.add(importer)
    return users


def test_the_layout_is_read_from_the_real_package():
    assert {"cache.base", "quant.store", "evict.base", "methods.kivi", "integrations.mlx_lm"} <= set(MODULES)
    assert "cache.config" in IMPORTS["cache.base"]


@pytest.mark.parametrize("name", sorted(m for m in MODULES if _room(m) in SHARED and "." in m))
def test_a_shared_module_has_two_users(name):
    if name in PUBLIC:
        return
    users = _users(name)
    assert len(users) >= 2, f"{name} is used only by {sorted(users) or 'nobody'}: it belongs in that user's room"


def test_no_shared_module_imports_upward():
    upward = sorted(
        f"{m} -> {t}" for m, ts in IMPORTS.items() if _room(m) in SHARED for t in ts if _room(t) in ABOVE_SHARED
    )
    assert not upward, upward


def test_cache_imports_nothing_above_it():
    upward = sorted(f"{m} -> {t}" for m, ts in IMPORTS.items() if _room(m) == "cache" for t in ts if _room(t) != "cache"
                    and _room(t) not in ("registry", "diagnostics", "_generated"))
    assert not upward, upward


def test_the_bench_does_not_import_the_cli():
    assert not [f"{m} -> {t}" for m, ts in IMPORTS.items() if _room(m) == "bench" for t in ts if t == "cli"]


def test_a_method_package_keeps_its_helpers_to_itself():
    """Code under methods/<key>/ is imported from outside that package only through its
    ``__init__`` (the class the spec names)."""
    leaks = sorted(
        f"{m} -> {t}"
        for m, ts in IMPORTS.items()
        for t in ts
        if t.startswith("methods.") and t.count(".") >= 2 and not m.startswith(".".join(t.split(".")[:2]))
        and _room(m) != "cli"
    )
    assert not leaks, leaks


def test_quant_holds_at_most_twenty_files():
    assert len(list((PACKAGE / "quant").glob("*.py"))) <= 20
