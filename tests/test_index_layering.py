"""The index's modules import one way (docs/index.md): keys <- store <- python_writer <- ingest <-
service, and the wire protocol imports none of them. A KV event flows the same way: the store never
calls back into whoever writes it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# module -> the modules it must not import (what sits above it)
FORBIDDEN = {
    "router/index/keys.py": ("router.index.store", "router.index.python_writer", "router.index.ingest"),
    "router/index/store.py": ("router.index.python_writer", "router.index.ingest", "router.index.service"),
    "router/index/python_writer.py": (
        "router.index.ingest",
        "router.index.service",
        "router.index.transport",
    ),
    "router/index/ingest.py": ("router.index.service", "router.index.transport", "router.index.stream"),
    "kvwire/frames.py": ("router",),
}


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (a function-level import counts too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("module", FORBIDDEN)
def test_an_index_module_imports_nothing_above_it(module: str) -> None:
    imported = imported_modules(ROOT / module)
    above = sorted(name for name in imported for banned in FORBIDDEN[module] if name.startswith(banned))
    assert not above, f"{module} imports {above}, which sit above it (docs/index.md, 'Prefix index')"


def test_the_compiled_writer_reads_frames_through_kvwire_alone() -> None:
    """The msgpack layout is read in kvwire/_frames.pyx only: the writer cimports its readers."""
    writer = (ROOT / "router/index/_ingest.pyx").read_text() + (
        ROOT / "router/index/_ingest_entry.pxi"
    ).read_text()
    assert "from kvwire._frames cimport" in writer
    for reader in ("cdef struct EventView", "def scan_batch", "cdef inline int int_at", "0xDC"):
        assert reader not in writer, reader
