"""Imports only point down the data-flow picture (docs/architecture.md).

Every ``import`` and ``from ... import`` in the package, at module level or inside a function,
relative or absolute, is mapped from its module's layer to the imported module's layer; an
import into a higher layer fails, with no exception.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGE = ROOT / "sparseconv"

# Lowest first, in the order data flows (docs/architecture.md). A module belongs to the longest
# prefix that matches it (the prefix itself or prefix + ".").
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("settings", ("sparseconv._args", "sparseconv.config", "sparseconv.parallel", "sparseconv.precision")),
    ("coords", ("sparseconv.coords",)),
    ("tensor", ("sparseconv.tensor",)),
    ("backends", ("sparseconv.backends",)),
    ("tune", ("sparseconv.tune",)),
    ("ops", ("sparseconv.ops",)),
    ("nn", ("sparseconv.nn",)),
    ("models", ("sparseconv.models",)),
    ("front ends", ("sparseconv.data", "sparseconv.viz", "sparseconv.metrics", "sparseconv.cli",
                    "sparseconv.__main__")),
    ("package", ("sparseconv",)),  # sparseconv/__init__.py: the public names, over everything
)


def layer_of(module: str) -> tuple[int, str]:
    """(rank, name) of the layer ``module`` belongs to; KeyError for a module no layer claims."""
    best: tuple[int, int, str] | None = None
    for rank, (name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), rank, name)
    if best is None:
        raise KeyError(f"no layer for {module}: add it to LAYERS in tests/test_layering.py")
    return best[1], best[2]


def package_modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__.py)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imports_of(module: str, source: str, is_package: bool, known: set[str]) -> list[tuple[str, int]]:
    """(imported module of the package, line) for every import in ``source``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                # ``from .. import tune`` imports the submodule sparseconv.tune, not sparseconv
                submodule = f"{origin}.{alias.name}"
                found.append((submodule if submodule in known else origin, node.lineno))
    return [(name, line) for name, line in found if name == "sparseconv" or name.startswith("sparseconv.")]


def upward_imports(modules: dict[str, Path]) -> list[tuple[str, str, int, str]]:
    """(importer, imported, line, 'layer -> layer') for every import into a higher layer."""
    known = set(modules)
    upward = []
    for module, path in modules.items():
        rank, name = layer_of(module)
        for imported, line in imports_of(module, path.read_text(), path.name == "__init__.py", known):
            imported_rank, imported_name = layer_of(imported)
            if imported_rank > rank:
                upward.append((module, imported, line, f"{name} -> {imported_name}"))
    return upward


def test_every_module_has_a_layer():
    for module in package_modules():
        layer_of(module)


def test_imports_only_point_down():
    modules = package_modules()
    wrong = [
        f"{modules[module].relative_to(ROOT)}:{line}: {module} imports {imported} ({direction})"
        for module, imported, line, direction in upward_imports(modules)
    ]
    assert not wrong, "imports that point up the layers:\n" + "\n".join(wrong)


@pytest.mark.parametrize("statement", [
    "from ..nn import conv",                    # relative, module level
    "def f():\n    from ..tune import pools",    # relative, inside a function
    "import sparseconv.models.minkunet",        # absolute
    "from sparseconv import tune",              # absolute, a submodule by name
])
def test_an_upward_import_is_found(tmp_path, statement):
    # A copy of the package with one bad import added to a coords module must fail the check.
    copy = tmp_path / "sparseconv"
    for module, path in package_modules().items():
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    bad = copy / "coords" / "kernel_map.py"
    bad.write_text(bad.read_text() + "\n\n" + statement + "\n")
    found = [(m, i) for m, i, _, _ in upward_imports(package_modules(copy))]
    assert found and all(m == "sparseconv.coords.kernel_map" for m, _ in found)
