"""Imports between the repository's top-level packages flow one way.

- The gateway (`router`) and the cache layer (`cachelayer`) import nothing of each other: the cache
  layer runs inside engines, beside no gateway, and the gateway installs beside any engine without
  the cache layer's dependencies. What both need is the wire protocol's (`kvwire`), which imports
  neither, and the ground floor's (`kvgate_common`: wording and layout both sides share), which
  imports none of the three.
- What the wheel ships (those four) imports nothing that runs only from a checkout: the test
  helpers (`kvgate_testing`), the benchmarks and the tests.
- A test imports no benchmark: what a test and a benchmark share (a report writer, a workload)
  lives in `kvgate_testing`, which imports no benchmark and no test either. A test may still run a
  benchmark as a program (`python -m benchmarks.NAME`): that is not an import.

Every module of each package is read as source (no import runs), so an import inside a function or
under `if TYPE_CHECKING:` counts as well, and a new module is checked without being listed here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
# Run from a checkout only, never shipped (tests/test_packaging.py): no shipped module may need them.
CHECKOUT_ONLY = ("kvgate_testing", "benchmarks", "tests")
# package -> the packages none of its modules may import
FORBIDDEN = {
    "kvgate_common": ("router", "cachelayer", "kvwire", *CHECKOUT_ONLY),
    "kvwire": ("router", "cachelayer", *CHECKOUT_ONLY),
    "cachelayer": ("router", *CHECKOUT_ONLY),
    "router": ("cachelayer", *CHECKOUT_ONLY),
    "kvgate_testing": ("benchmarks", "tests"),
    "tests": ("benchmarks",),
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


def crossings(package: str, root: Path = REPOSITORY) -> list[str]:
    """`path:line imports X` for every import in `package` of a package FORBIDDEN to it."""
    modules = sorted((root / package).rglob("*.py"))
    # A walk that found nothing would pass: the package's own __init__ and one more module at least.
    assert root / package / "__init__.py" in modules and len(modules) > 1, (
        f"the walk of {package} found too few modules: {modules}"
    )
    return [
        f"{path.relative_to(root)}:{line} imports {imported}"
        for path in modules
        for line, imported in imported_packages(path.read_text())
        if imported in FORBIDDEN[package]
    ]


def test_the_walk_sees_imports_in_functions_and_type_checking_blocks() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from router.config import Config\n"
        "def f():\n    import cachelayer.engine\n"
        "from . import sibling\n"
        "from benchmarks.gateway_overhead import main\n"
    )
    assert sorted(imported_packages(source)) == [
        (1, "typing"),
        (3, "router"),
        (5, "cachelayer"),
        (7, "benchmarks"),
    ]


def test_a_test_importing_a_benchmark_is_found(tmp_path) -> None:
    """The rule "no test imports a benchmark" catches the import the report test once made."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / "tests" / "test_report.py").write_text(
        "import subprocess\n"
        "subprocess.run(['python', '-m', 'benchmarks.gateway_overhead'])\n"  # running one is fine
        "from benchmarks.gateway_overhead import write_report\n"
    )
    assert crossings("tests", root=tmp_path) == ["tests/test_report.py:3 imports benchmarks"]


def _top_level_definitions(path: Path) -> set[str]:
    return {
        node.name
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef | ast.ClassDef)
    }


def test_what_the_ground_floor_defines_is_defined_there_only() -> None:
    """kvgate_common holds the one copy of what router/ and cachelayer/ each kept (the config-error
    wording, the help formatter): neither side, nor the wire, defines a function or class of the
    same name again, and both import it."""
    shared = set().union(*map(_top_level_definitions, (REPOSITORY / "kvgate_common").rglob("*.py")))
    assert {"yaml_syntax_error", "with_bad_value", "DefaultsHelpFormatter"} <= shared
    for package in ("router", "cachelayer", "kvwire"):
        again = [
            f"{path.relative_to(REPOSITORY)}: {name}"
            for path in sorted((REPOSITORY / package).rglob("*.py"))
            for name in sorted(_top_level_definitions(path) & shared)
        ]
        assert not again, f"{package} defines again what kvgate_common holds: {again}"
    for package in ("router", "cachelayer"):
        imported = {
            name
            for path in (REPOSITORY / package).rglob("*.py")
            for _, name in imported_packages(path.read_text())
        }
        assert "kvgate_common" in imported, f"{package} no longer imports kvgate_common"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_of_the_packages_it_must_not_know(package: str) -> None:
    found = crossings(package)
    assert not found, f"{package} must not import {', '.join(FORBIDDEN[package])}: {found}"
