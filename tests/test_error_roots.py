"""Every exception class the gateway (`router`), the cache layer (`cachelayer`) or the wire protocol
(`kvwire`) defines derives from its package's root, so that `except KvgateError` /
`except CacheLayerError` / `except WireError` catches the whole family.

The packages are walked file by file (a folder without __init__.py is walked too), so a new module
or a new exception class is checked without being listed here."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
from pathlib import Path

import pytest

from cachelayer.errors import CacheLayerError
from kvwire.errors import WireError
from router.errors import KvgateError

REPOSITORY = Path(__file__).resolve().parent.parent
ROOTS: dict[str, type[Exception]] = {
    "router": KvgateError,
    "cachelayer": CacheLayerError,
    "kvwire": WireError,
}
# Engine-side dependencies this environment may lack; a module needing one is read as source instead.
OPTIONAL_DEPENDENCIES = {"vllm", "triton"}
_BUILTIN_EXCEPTIONS = {
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
}


def _module_names(package: str) -> list[str]:
    names = []
    for path in sorted((REPOSITORY / package).rglob("*.py")):
        parts = path.relative_to(REPOSITORY).with_suffix("").parts
        if parts[-1] == "__main__":  # runs a program when imported
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _source_of(module_name: str) -> str:
    path = REPOSITORY / Path(*module_name.split("."))
    return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()


def _exceptions_in_source(module_name: str, root: type[Exception]) -> list[str]:
    """For a module that cannot be imported here: the classes that subclass an exception by name and do
    not name the root among their bases."""
    source = _source_of(module_name)
    strays = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = {
            base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "") for base in node.bases
        }
        looks_like_exception = any(
            base in _BUILTIN_EXCEPTIONS or base.endswith(("Error", "Exception")) for base in bases
        )
        if looks_like_exception and root.__name__ not in bases:
            strays.append(f"{module_name}.{node.name}")
    return strays


@pytest.mark.parametrize("package", sorted(ROOTS))
def test_every_exception_class_derives_from_its_package_root(package):
    root = ROOTS[package]
    checked, strays = [], []
    for module_name in _module_names(package):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] not in OPTIONAL_DEPENDENCIES:
                raise
            strays += _exceptions_in_source(module_name, root)
            continue
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module_name
            ):
                checked.append(value)
                if not issubclass(value, root):
                    strays.append(f"{module_name}.{value.__qualname__}")
    assert root in checked and len(checked) > 5, f"the walk of {package} found too few exceptions: {checked}"
    assert not strays, (
        f"these exception classes do not derive from {root.__module__}.{root.__name__}: {strays}; "
        f"root first, then the builtin base callers catch: class X({root.__name__}, ValueError)"
    )


def test_the_shared_ground_floor_defines_no_error_of_its_own():
    """kvgate_common words messages that router/ and cachelayer/ raise under their own roots: an
    exception class there would belong to neither package's family."""
    defined = [
        f"{module_name}.{node.name}"
        for module_name in _module_names("kvgate_common")
        for node in ast.walk(ast.parse(_source_of(module_name)))
        if isinstance(node, ast.ClassDef)
        and any(
            getattr(base, "id", "") in _BUILTIN_EXCEPTIONS or getattr(base, "id", "").endswith("Error")
            for base in node.bases
        )
    ]
    assert _module_names("kvgate_common"), "the walk of kvgate_common found no module"
    assert not defined, f"kvgate_common defines exception classes: {defined}; raise the package's own"
