"""The index's writer: KV events applied to a `PrefixIndex` (store.py), one way, by one object.

`IndexWriter(index)` is what every producer of events hands them to (`service.py` builds one per
index; subscribers, snapshots and replays go through it): `apply(backend, events)` for decoded
events, `apply_payloads(backend, payloads)` for a stream's in-order payloads as they came off the
wire (each scanned by the wire protocol's frame reader, `kvwire.frames.scan_batch`, and applied
without decoding it where the compiled writer is built and the scan accepts it, else decoded),
`apply_wire(backend, batches)` for payloads scanned already, `replace_backend` for a snapshot.
The store never calls back into this module: the writer changes it through its public state and
`*_locked` methods, under its writer lock.

Where the compiled writer is built (`router/index/_ingest.pyx`, loaded and checked here) it is
the implementation of the shapes engines publish most: a decode step's one-block stores, a
prefill alone in its batch, removals of plain blocks, read from decoded events or straight from
the payload's bytes. Every other event goes to the Python rules (`python_writer.PythonWriter`),
once: no event is offered to the compiled writer twice. Without the extension (or with
`compiled=False`) the Python rules apply every event; that same code run alone is the oracle of
the differential test (`kvgate_testing.index_oracle`, tests/test_index_differential.py).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from kvwire import BlockRemoved, BlockStored, KVEvent, MalformedBatch, decode_batch
from kvwire.frames import scan_batch
from router.compiled import load_compiled, rebuild_hint
from router.index.keys import (
    FINALISER_STEPS,
    POSITION_WEIGHT_INT,
    ROUTER_BLOCK_TOKENS,
    WORD_WEIGHT_INTS,
    Namespace,
    block_value,
    prefix_keys,
    use_compiled_prompt_keys,
)
from router.index.python_writer import PythonWriter, paused_gc
from router.index.store import (
    NODE_FIELDS,
    PREVIEW_TOKENS,
    SHARED_MASKS_LIMIT,
    Chain,
    IndexedBackend,
    PrefixIndex,
    use_compiled_held_runs,
)

logger = logging.getLogger(__name__)

# What this module uses of the compiled ingest module: a build that lacks one is stale.
_COMPILED_INGEST_NAMES = (
    "configure", "block_value", "BackendWriter", "next_compiled_candidate", "CompiledEntry", "WriterLock",
    "prompt_keys", "held_runs",
)  # fmt: skip
_INGEST_SOURCE = "router/index/_ingest.pyx"
_REBUILD_HINT = rebuild_hint(_INGEST_SOURCE)


def load_compiled_ingest() -> Any:
    """The compiled ingest module (`router/index/_ingest.pyx`), configured with the index's key
    constants and checked against `keys.block_value`; None when it is not built, or built from
    another version of the index (then the Python writer applies every event; a stale build is
    named in a warning)."""
    compiled = load_compiled("router.index._ingest", _INGEST_SOURCE, _COMPILED_INGEST_NAMES, logger)
    if compiled is None:
        return None
    try:
        compiled.configure(
            WORD_WEIGHT_INTS, POSITION_WEIGHT_INT, FINALISER_STEPS, ROUTER_BLOCK_TOKENS,
            NODE_FIELDS, BlockStored, Chain,
            block_removed_class=BlockRemoved, preview_tokens=PREVIEW_TOKENS, capacity_field="max_blocks",
            namespace_class=Namespace,
        )  # fmt: skip
    except (ValueError, TypeError) as mismatch:  # built from another version of the index: stale
        logger.warning("compiled ingest does not match the index (%s): not used; %s", mismatch, _REBUILD_HINT)
        return None
    # A build whose key math differs would file blocks under keys no lookup computes: refuse it.
    check = np.random.default_rng(7)
    for position in (0, 1, 37, 2**20 + 3):
        block = check.integers(0, 2**32, size=ROUTER_BLOCK_TOKENS).tolist()
        if compiled.block_value(block, position) != block_value(block, position):
            logger.warning("compiled ingest computes other keys than the index: not used; %s", _REBUILD_HINT)
            return None
    tokens = check.integers(0, 2**32, size=ROUTER_BLOCK_TOKENS * 5 + 3, dtype=np.uint32)
    if compiled.prompt_keys(tokens, 12345) != prefix_keys(tokens, 12345).tolist():
        logger.warning(
            "compiled ingest computes other prompt keys than the index: not used; %s", _REBUILD_HINT
        )
        return None
    return compiled


# The compiled ingest module, or None when it is not built (or stale); `INGEST_PATH` says which
# writer takes the shapes engines publish most in an index made with the default arguments.
_compiled_ingest = load_compiled_ingest()
use_compiled_prompt_keys(_compiled_ingest.prompt_keys if _compiled_ingest is not None else None)
use_compiled_held_runs(_compiled_ingest.held_runs if _compiled_ingest is not None else None)
INGEST_PATH = "compiled" if _compiled_ingest is not None else "python"


def writer_lock(compiled: bool = True) -> Any:
    """The writer lock for an index whose writer is `IndexWriter(index, compiled=compiled)`: the
    compiled entry's (it takes it in C) when that is used, else a `threading.Lock`."""
    return _compiled_ingest.WriterLock() if compiled and _compiled_ingest is not None else threading.Lock()


class WireIngest(NamedTuple):
    """Payloads straight to one backend of the index (`IndexWriter.wire_ingest`)."""

    # A payload scanned (a `kvwire.frames.WireBatch`: its length and event counts by kind:
    # stored, removed, cleared), or None: decode it (`decode_batch`) and `apply` its events.
    scan: Any
    # Apply a list of scanned batches, in order.
    apply: Any


class IndexWriter:
    """The one writer of an index (module docstring). `compiled=False` applies every event with
    the Python rules even where the compiled writer is built (the oracle's configuration)."""

    def __init__(self, index: PrefixIndex, *, compiled: bool = True) -> None:
        module = _compiled_ingest if compiled else None
        if module is not None and not isinstance(index.lock, module.WriterLock):
            raise ValueError(
                "IndexWriter(compiled=True) needs an index made with the compiled writer's lock: "
                "PrefixIndex(lock=ingest.writer_lock(True)) (service.new_index does it)"
            )
        self.index = index
        self.lock = index.lock
        self.rules = PythonWriter(index)
        # The compiled ingest module this writer hands the shapes it takes to, or None.
        self.compiled_module = module
        # "compiled" when the compiled writer takes the shapes engines publish most, else "python".
        self.path = "compiled" if module is not None else "python"
        self.apply: Callable[[str, list[KVEvent]], None]
        self.apply_wire: Callable[[str, list[Any]], None]
        # The frame reader `apply_payloads` scans payloads with (None: it decodes each).
        self._scan: Callable[[bytes], Any] | None = scan_batch if module is not None else None
        if module is None:
            self._entry: Any = None
            self.apply = self.rules.apply
            self.apply_wire = self._no_wire
        else:
            # A batch of one event of a shape the compiled writer takes is applied by the
            # compiled entry without a Python frame; it hands every other batch back here.
            self._entry = module.CompiledEntry(
                index.indexed_backends, index.shared_masks, self.lock, self._apply_refused,
                SHARED_MASKS_LIMIT, general_wire=self._apply_wire_refused,
                over_capacity=index.evict_over_capacity,
            )  # fmt: skip
            self.apply = self._entry.apply
            self.apply_wire = self._entry.apply_wire

    def apply_payloads(self, backend_name: str, payloads: list[bytes]) -> list[Any]:
        """Apply in-order EventBatch payloads (msgpack, as a stream delivered them) to a backend, in
        order, and return what was read of each, in order: its `WireBatch` where the compiled
        frame reader scanned it (applied undecoded, by the compiled writer), else its
        `DecodedBatch` (its events applied as `apply` applies them), or the `MalformedBatch` the
        decoder raised (nothing of it applied). Consecutive payloads read the same way go to the
        index in one call."""
        scan = self._scan
        read: list[Any] = []
        scanned: list[Any] = []
        events: list[KVEvent] = []
        for payload in payloads:
            batch = scan(payload) if scan is not None else None
            if batch is not None:
                if events:
                    self.apply(backend_name, events)
                    events = []
                scanned.append(batch)
            else:
                try:
                    batch = decode_batch(payload)
                except MalformedBatch as refused:
                    read.append(refused.with_traceback(None))  # (no cycle through this frame)
                    continue
                if scanned:
                    self.apply_wire(backend_name, scanned)
                    scanned = []
                events += batch.events
            read.append(batch)
        if scanned:
            self.apply_wire(backend_name, scanned)
        elif events:
            self.apply(backend_name, events)
        return read

    @property
    def compiled_applied(self) -> int:
        """Events the compiled entry applied itself (0 without it)."""
        return 0 if self._entry is None else self._entry.applied

    def wire_ingest(self, backend_name: str) -> WireIngest | None:
        """The scan and the compiled apply of scanned payloads for `backend_name`, for a caller
        that scans payloads itself (`apply_payloads` does both), or None without the compiled
        writer or the compiled frame reader (every payload is decoded then). (A partial of the
        compiled entry: no Python frame per call.)"""
        if self._entry is None or scan_batch is None:
            return None
        return WireIngest(scan_batch, functools.partial(self._entry.apply_wire, backend_name))

    def replace_backend(self, name: str, events: list[KVEvent]) -> None:
        """Replace everything a backend holds by a snapshot's events, atomically for lookups: the
        snapshot is built into a hidden backend with slots of its own (no lookup sees it
        half-built), then the index installs it (`PrefixIndex.install_snapshot_locked`)."""
        with self.lock:
            fresh = self.index.snapshot_backend_locked(name)
            with paused_gc():
                self.rules.apply_snapshot_locked(fresh, events)
                self.index.evict_over_capacity_locked(fresh)
            self.index.install_snapshot_locked(name, fresh)

    @staticmethod
    def _no_wire(backend_name: str, batches: list[Any]) -> None:
        raise RuntimeError("apply_wire needs the compiled writer: use apply (wire_ingest is None here)")

    def _backend_to_write_locked(self, backend_name: str) -> IndexedBackend:
        """`PythonWriter.backend_to_write_locked`, with the backend's compiled writer made at
        its first event."""
        backend = self.rules.backend_to_write_locked(backend_name)
        if backend.compiled_writer is None:
            backend.compiled_writer = self.compiled_module.BackendWriter(self.index, backend)
        return backend

    def _apply_refused(self, backend_name: str, events: list[KVEvent], first_refused: bool) -> None:
        """A batch the compiled entry handed over. `first_refused`: it offered the batch's only
        event to the compiled writer already, which refused it."""
        with self.lock:
            backend = self._backend_to_write_locked(backend_name)
            try:
                writer = backend.compiled_writer
                if events.__class__ is not list:  # (the compiled writer reads a list)
                    events = list(events)
                if len(events) == 1 and not first_refused and writer.apply_one(events[0]):
                    return
                with paused_gc():
                    if len(events) == 1:  # (refused)
                        self.rules.apply_general_locked(backend, events)
                    else:
                        self._apply_mixed_locked(backend, writer, events, 0, False)
            finally:
                if len(backend.nodes) > backend.max_blocks:
                    self.index.evict_over_capacity_locked(backend)

    def _apply_mixed_locked(
        self, backend: IndexedBackend, writer: Any, events: list[KVEvent], position: int, refused: bool
    ) -> None:
        """`events[position:]` in order: the compiled writer applies each run of events it takes
        in a batch (one-block stores of the decode shape, removals of plain blocks) and stops at
        the first other event; the general path takes that one and the events up to the next
        one-block event with a parent or removal (prefills among them, in one numpy pass); the
        compiled writer goes on from there, and so on. `refused`: the compiled writer refused
        `events[position]` already. No event is offered to the compiled writer twice."""
        count = len(events)
        while position < count:
            if refused:
                refused = False
            else:
                position = writer.store(events, position)
            if position < count:
                resume = self.compiled_module.next_compiled_candidate(events, position + 1)
                self.rules.apply_general_locked(backend, events[position:resume])
                position = resume

    def _apply_wire_refused(
        self, backend_name: str, batches: list[Any], refused_at: int | None = None
    ) -> None:
        """Apply scanned batches in order (the compiled entry hands them over from the first event
        its writer refuses): the compiled writer reads each batch's events from its payload while
        it takes them, and the rest of a batch is decoded and applied as `apply` applies events,
        so a decode step's token ids never become Python objects. `refused_at`: the position in
        the first batch of the event the compiled writer refused."""
        with self.lock:
            backend = self._backend_to_write_locked(backend_name)
            writer = backend.compiled_writer
            try:
                with paused_gc():
                    for number, batch in enumerate(batches):
                        refused = number == 0 and refused_at is not None
                        position = refused_at if refused else writer.store_wire(batch, 0)
                        if position < len(batch):
                            decoded = decode_batch(batch.payload)
                            if decoded.skipped_events or len(decoded.events) != len(batch):
                                # The scan accepts only what the decoder decodes one for one: never here.
                                raise RuntimeError("the decoder and the scan disagree on a payload's events")
                            self._apply_mixed_locked(backend, writer, decoded.events, position, True)
            finally:
                if len(backend.nodes) > backend.max_blocks:
                    self.index.evict_over_capacity_locked(backend)
