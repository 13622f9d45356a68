"""The index's pure-Python reference (the oracle), and an index bundled with its writer for tests.

`WritableIndex(compiled_ingest=...)` is a `PrefixIndex` with its one `IndexWriter` (as
`router.index.service.new_index` wires them) and the writer's entry points bound onto it, so a
test reads and writes one object: `apply`, `apply_payloads`, `apply_wire`, `wire_ingest`,
`replace_backend`, `ingest_path`. `oracle_index()` is the reference: the same index applying
every event with the Python rules (`router/index/python_writer.py`), the code an install without
a compiler runs.
The compiled writer (`router/index/_ingest.pyx`) is checked against it event stream by event
stream (tests/test_index_differential.py, tests/test_index_ingest_compiled.py).
"""

from __future__ import annotations

from router.index.ingest import IndexWriter, writer_lock
from router.index.store import PrefixIndex


class WritableIndex(PrefixIndex):
    """A `PrefixIndex` and its writer as one object (tests and benchmarks only)."""

    def __init__(self, *, compiled_ingest: bool = True) -> None:
        super().__init__(lock=writer_lock(compiled_ingest))
        self.writer = IndexWriter(self, compiled=compiled_ingest)
        # (bound methods of the writer: no extra Python frame per call)
        self.apply = self.writer.apply
        self.apply_payloads = self.writer.apply_payloads
        self.apply_wire = self.writer.apply_wire
        self.wire_ingest = self.writer.wire_ingest
        self.replace_backend = self.writer.replace_backend
        self.ingest_path = self.writer.path


def oracle_index() -> WritableIndex:
    """The reference index: every event applied by the pure-Python rules."""
    return WritableIndex(compiled_ingest=False)
