"""The write transaction every path into a tier shares (store, import, move, promotion from disk):
a copy that fails gives the space back and shows nothing, and a clear() during the copy wins over
the writes it is meant to drop. Each test breaks or interrupts the copy of one path."""

from __future__ import annotations

import contextlib

import pytest

from kvgate_testing.cachelayer import CHUNK, assert_no_leak, make_engine, request
from kvwire import AllBlocksCleared, BlockStored


class CopyFailed(Exception):
    pass


def fail(*args, **kwargs):
    raise CopyFailed("the copy broke")


@contextlib.contextmanager
def stored_in_both_tiers(tmp_path, seed):
    """An engine with a disk tier, holding one two-chunk request in the pool and on disk."""
    tokens, kv = request(seed, 2)
    with make_engine(4, local_disk=str(tmp_path), max_local_disk_size=0.01) as engine:
        engine.store(tokens, kv)
        engine.flush()
        yield engine, tokens, kv


def recorded_events(engine):
    events = []
    engine.add_event_listener(events.extend)
    return events


def test_a_store_whose_copy_fails_holds_nothing_and_announces_nothing(monkeypatch):
    with make_engine(4) as engine:
        events = recorded_events(engine)
        tokens, kv = request(1, 2)
        monkeypatch.setattr("cachelayer.engine.copy_tensor", fail)
        with pytest.raises(CopyFailed):
            engine.store(tokens, kv)
        monkeypatch.undo()
        assert engine.lookup(tokens) == 0 and events == []
        assert engine.cpu.allocator.num_allocations == 0
        assert engine.store(tokens, kv) == 2 * CHUNK  # the space came back: the same store fits
        assert_no_leak(engine)


def test_an_import_whose_copy_fails_or_meets_a_clear_stores_nothing(monkeypatch):
    tokens, kv = request(2, 1)
    with make_engine(4) as exporter, make_engine(4) as importer:
        exporter.store(tokens, kv)
        _, fmt, data = exporter.export_chunk(tokens, 0, "LocalCPUBackend")
        events = recorded_events(importer)
        monkeypatch.setattr(importer, "_write_payload", fail)
        with pytest.raises(CopyFailed):
            importer.import_chunk(tokens, 0, "LocalCPUBackend", fmt, data)
        assert importer.cpu.allocator.num_allocations == 0 and events == []

        write_payload = type(importer)._write_payload

        def clear_first(tier, entry, payload):
            importer.clear()  # a clear() lands while the chunk is being copied in
            write_payload(importer, tier, entry, payload)

        monkeypatch.setattr(importer, "_write_payload", clear_first)
        assert importer.import_chunk(tokens, 0, "LocalCPUBackend", fmt, data) == 0  # the clear wins
        assert importer.lookup(tokens) == 0
        assert importer.cpu.allocator.num_allocations == 0
        assert [type(event) for event in events] == [AllBlocksCleared]


def test_a_move_whose_copy_fails_leaves_the_source_whole_and_unreferenced(tmp_path, monkeypatch):
    with stored_in_both_tiers(tmp_path, 3) as (engine, tokens, _):
        engine.clear("LocalDiskBackend")
        events = recorded_events(engine)
        monkeypatch.setattr(engine, "_write_payload", fail)
        with pytest.raises(CopyFailed):
            engine.move(tokens, "LocalCPUBackend", "LocalDiskBackend")
        monkeypatch.undo()
        assert engine.lookup_location(tokens) == ("LocalCPUBackend", 2 * CHUNK)
        assert engine.stats()["disk_chunks"] == 0 and engine.disk.used_bytes == 0 and events == []
        assert all(entry.refcount == 0 for entry in engine.cpu.committed_entries())
        assert engine.move(tokens, "LocalCPUBackend", "LocalDiskBackend") == 2 * CHUNK
        assert engine.lookup_location(tokens) == ("LocalDiskBackend", 2 * CHUNK)


def test_a_promotion_from_disk_that_meets_a_clear_is_not_kept_in_the_pool(tmp_path, monkeypatch):
    with stored_in_both_tiers(tmp_path, 4) as (engine, tokens, kv):
        engine.clear("LocalCPUBackend")
        assert engine.lookup_location(tokens) == ("LocalDiskBackend", 2 * CHUNK)
        events = recorded_events(engine)
        read_into = engine.disk.read_into

        def clear_first(entry, destination):
            engine.clear()  # a clear() lands while the chunk is read from disk into the pool
            read_into(entry, destination)

        monkeypatch.setattr(engine.disk, "read_into", clear_first)
        hit, loaded = engine.retrieve(tokens)
        assert hit == 2 * CHUNK and loaded.equal(kv)  # the read itself finished: the caller has it
        assert engine.lookup(tokens) == 0  # but the pool does not keep what the clear dropped
        assert engine.cpu.allocator.num_allocations == 0 and engine.disk.used_bytes == 0
        assert not any(isinstance(event, BlockStored) for event in events)
