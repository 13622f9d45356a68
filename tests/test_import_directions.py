"""The gateway (`router`) and the cache layer (`cachelayer`) import nothing of each other: the cache
layer runs inside engines, beside no gateway, and the gateway installs beside any engine without
the cache layer's dependencies. What both need is the wire protocol's (`kvwire`), which imports
neither.

Every module of each package is read as source (no import runs), so an import inside a function or
under `if TYPE_CHECKING:` counts as well, and a new module is checked without being listed here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
# package -> the packages none of its modules may import
FORBIDDEN = {
    "cachelayer": ("router",),
    "router": ("cachelayer",),
    "kvwire": ("router", "cachelayer"),
}


def imported_packages(source: str) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def test_the_walk_sees_imports_in_functions_and_type_checking_blocks() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from router.config import Config\n"
        "def f():\n    import cachelayer.engine\n"
        "from . import sibling\n"
    )
    assert imported_packages(source) == [(1, "typing"), (3, "router"), (5, "cachelayer")]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_of_the_packages_it_must_not_know(package: str) -> None:
    modules = sorted((REPOSITORY / package).rglob("*.py"))
    assert len(modules) > 5, f"the walk of {package} found too few modules: {modules}"
    crossings = [
        f"{path.relative_to(REPOSITORY)}:{line} imports {imported}"
        for path in modules
        for line, imported in imported_packages(path.read_text())
        if imported in FORBIDDEN[package]
    ]
    assert not crossings, f"{package} must not import {', '.join(FORBIDDEN[package])}: {crossings}"
