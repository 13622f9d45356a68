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
- Inside router/ and cachelayer/, each part imports only the parts below it in docs/README.md's
  diagram (the ground floor, then index, tokenize, policies, the front faces; the cache side from
  gpu and compress up to the connectors).

Every module of each package is read as source (no import runs), so an import inside a function or
under `if TYPE_CHECKING:` counts as well, and a new module is checked without being listed here."""

from __future__ import annotations

import ast
import sys
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


# The parts inside each package and what each may import (docs/README.md, "Parts and import
# directions"). A module is placed by the longest prefix that names it (a package's own name names
# its __init__ alone); a module of router/ or
# cachelayer/ that no prefix names sits in the outermost part (the front faces, the cache layer's
# cli), so nothing lower may import it until it is placed here. Imports of other packages (kvwire,
# third parties) are the rule above's business, not these.
ROUTER_PARTS = {
    "router": "ground",
    "router.config": "ground",
    "router.discovery_config": "ground",
    "router.epp_config": "ground",
    "router.errors": "ground",
    "router.backends": "ground",
    "router.metrics": "ground",
    "router.upstream": "ground",
    "router.api_formats": "ground",
    "router.compiled": "ground",
    "router.recent_keys": "ground",
    "router.tenants": "ground",
    "router.missed_reuse": "ground",
    "router.index.keys": "keys",
    "router.route_request": "keys",
    "router.index": "index",
    "router.tokenize": "tokenize",
    "router.template_sandbox": "tokenize",
    "router.policies": "policies",
    "router.cluster": "policies",
    "router.sim": "sim",
}
CACHE_PARTS = {
    "cachelayer.errors": "ground",
    "cachelayer.config": "ground",
    "cachelayer.keys": "ground",
    "cachelayer.shared_secret": "ground",
    "cachelayer.gpu": "gpu",
    "cachelayer.compress": "compress",
    "cachelayer.storage": "storage",
    "cachelayer.kv_layout": "storage",
    "cachelayer": "engine",
    "cachelayer.engine": "engine",
    "cachelayer.controller": "controller",
    "cachelayer.server": "server",
    "cachelayer.connectors": "connectors",
}
OUTERMOST = {"router": "front", "cachelayer": "cli"}
# part -> the parts its modules may import (its own included): whatever lies below it along the
# diagram's lines; the outermost parts may import any.
MAY_IMPORT = {
    "ground": {"ground"},
    "keys": {"ground", "keys"},
    "index": {"ground", "keys", "index"},
    "tokenize": {"ground", "keys", "tokenize"},
    "policies": {"ground", "keys", "index", "policies"},
    "sim": {"ground", "sim"},
    "gpu": {"ground", "gpu"},
    "compress": {"ground", "gpu", "compress"},
    "storage": {"ground", "gpu", "compress", "storage"},
    "engine": {"ground", "gpu", "compress", "storage", "engine"},
    "controller": {"ground", "gpu", "compress", "storage", "engine", "controller"},
    "server": {"ground", "gpu", "compress", "storage", "engine", "controller", "server"},
    "connectors": {"ground", "gpu", "compress", "storage", "engine", "controller", "server", "connectors"},
}


def part_of(module: str) -> str | None:
    """The part of a module of router/ or cachelayer/ (None for any other package)."""
    top = module.split(".")[0]
    if top not in OUTERMOST:
        return None
    parts = ROUTER_PARTS if top == "router" else CACHE_PARTS
    for prefix in sorted(parts, key=len, reverse=True):
        if module == prefix or ("." in prefix and module.startswith(prefix + ".")):
            return parts[prefix]
    return OUTERMOST[top]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, relative ones resolved; `from a import b` gives
    both `a` and `a.b`, so a submodule imported by name is placed by its own name."""
    package = list(path.relative_to(REPOSITORY).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def part_crossings(package: str) -> set[tuple[str, str, str]]:
    """(file, line, imported module) of every import out of the parts its file's part may import."""
    found = set()
    for path in sorted((REPOSITORY / package).rglob("*.py")):
        relative = path.relative_to(REPOSITORY)
        own = part_of(".".join(relative.with_suffix("").parts).removesuffix(".__init__"))
        if own not in MAY_IMPORT:
            continue  # an outermost part may import any
        for line, module in imported_modules(path):
            target = part_of(module)
            if target is not None and target not in MAY_IMPORT[own]:
                found.add((str(relative), str(line), module))
    return found


def test_parts_are_placed_by_their_longest_prefix() -> None:
    assert part_of("router.index.keys") == "keys"
    assert part_of("router.index.store") == "index"
    assert part_of("router.policies.base.RouteRequest") == "policies"
    assert part_of("router.forward") == "front"
    assert part_of("router") == "ground"
    assert part_of("cachelayer.storage.remote") == "storage"
    assert part_of("cachelayer.cli") == "cli"
    assert part_of("kvwire.frames") is None


def test_the_part_check_finds_an_import_against_the_diagram(tmp_path, monkeypatch) -> None:
    """The checker itself: an index module importing a policy, a relative import of the front faces
    and a type-only import are found; imports the diagram allows are not."""
    monkeypatch.setattr(sys.modules[__name__], "REPOSITORY", tmp_path)
    sample = tmp_path / "router" / "index" / "sample.py"
    sample.parent.mkdir(parents=True)
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "from router.config import Config\n"
        "from router.index.keys import Namespace\n"
        "from ..forward import ProxyEndpoint\n"
        "if TYPE_CHECKING:\n    from router.policies.base import Choice\n"
        "import kvwire\n"
    )
    assert part_crossings("router") == {
        ("router/index/sample.py", "4", "router.forward.ProxyEndpoint"),
        ("router/index/sample.py", "6", "router.policies.base.Choice"),
    }


@pytest.mark.parametrize("package", ["router", "cachelayer"])
def test_each_part_imports_only_the_parts_below_it(package: str) -> None:
    found = sorted(f"{file}:{line} imports {module}" for file, line, module in part_crossings(package))
    assert not found, f"imports against docs/README.md's diagram (move the shared thing down): {found}"
