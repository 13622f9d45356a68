"""CacheEngine: store/retrieve/lookup in chunks, identity isolation, threads, move, clear, compress."""

import threading

import pytest
import torch

from cachelayer import CacheEngine
from cachelayer.engine import CacheEngineError
from kvgate_testing.cachelayer import CHUNK, HEAD_DIM, HEADS, LAYERS, assert_no_leak, make_engine, request


def test_store_retrieve_roundtrip_with_a_partial_tail_chunk():
    engine = make_engine(16)
    tokens, kv = request(1, 3)
    tokens, kv = tokens[:-5], kv[:, :, :-5]
    assert engine.store(tokens, kv) == len(tokens)
    assert engine.lookup(tokens) == len(tokens)
    hit, loaded = engine.retrieve(tokens)
    assert hit == len(tokens) and torch.equal(loaded, kv)
    # A longer prompt sharing the first two full chunks hits exactly those.
    longer = tokens[: 2 * CHUNK] + [7] * 20
    assert engine.lookup(longer) == 2 * CHUNK
    hit, loaded = engine.retrieve(longer)
    assert hit == 2 * CHUNK and torch.equal(loaded, kv[:, :, : 2 * CHUNK])
    assert engine.retrieve([5, *tokens]) == (0, None)


def test_store_twice_does_not_rewrite_and_unfull_chunks_can_be_skipped():
    engine = make_engine(16, save_unfull_chunk=False)
    tokens, kv = request(2, 2)
    assert engine.store(tokens[:-3], kv[:, :, :-3]) == CHUNK
    assert engine.store(tokens, kv) == 2 * CHUNK
    assert engine.stats()["write_chunks"] == 2


def test_retrieve_into_a_caller_buffer():
    engine = make_engine(16)
    tokens, kv = request(3, 2)
    engine.store(tokens, kv)
    out = torch.zeros(LAYERS, 2, 3 * CHUNK, HEADS * HEAD_DIM, dtype=torch.bfloat16)
    hit, view = engine.retrieve(tokens + [1] * CHUNK, out=out)
    assert hit == 2 * CHUNK
    assert view.data_ptr() == out.data_ptr()
    assert torch.equal(out[:, :, : 2 * CHUNK], kv)
    assert torch.count_nonzero(out[:, :, 2 * CHUNK :]) == 0


def test_cache_salt_and_lora_isolate_entries():
    engine = make_engine(16)
    tokens, kv = request(4, 2)
    engine.store(tokens, kv, cache_salt="tenant-a")
    assert engine.lookup(tokens) == 0
    assert engine.lookup(tokens, cache_salt="tenant-b") == 0
    assert engine.lookup(tokens, cache_salt="tenant-a") == 2 * CHUNK
    engine.store(tokens, kv, lora="adapter")
    assert engine.lookup(tokens, lora="adapter") == 2 * CHUNK
    assert engine.lookup(tokens, lora="other") == 0


def test_bad_shapes_dtypes_and_locations_are_refused_clearly():
    engine = make_engine(16)
    tokens, kv = request(5, 1)
    with pytest.raises(CacheEngineError, match=r"kv must be \[num_layers=2, 2, 15 tokens, channels=16\]"):
        engine.store(tokens[:-1], kv)
    with pytest.raises(CacheEngineError, match=r"dtype torch\.float32"):
        engine.store(tokens, kv.float())
    with pytest.raises(CacheEngineError, match="unknown location 'GPU'"):
        engine.clear("GPU")
    with pytest.raises(CacheEngineError, match="not configured"):
        engine.move(tokens, "LocalCPUBackend", "LocalDiskBackend")
    with pytest.raises(CacheEngineError, match=r"token 1 is -3: token ids must be integers"):
        engine.lookup([1, -3])
    with pytest.raises(CacheEngineError, match=r"token 0 is 1\.5"):
        engine.retrieve([1.5])
    assert engine.lookup(tokens) == 0  # nothing half-stored


@pytest.mark.parametrize("with_disk", [False, True])
def test_threads_storing_and_retrieving_at_once_see_only_their_own_data(tmp_path, with_disk):
    # The pool is smaller than the working set: eviction (and disk promotion) runs during the test.
    disk = {"local_disk": str(tmp_path), "max_local_disk_size": 0.01} if with_disk else {}
    engine = make_engine(12, **disk)
    requests = [request(100 + i, 2) for i in range(8)]
    errors: list[str] = []

    def worker(index: int) -> None:
        for round_index in range(25):
            tokens, kv = requests[(index + round_index) % len(requests)]
            engine.store(tokens, kv)
            hit, loaded = engine.retrieve(tokens)
            if hit and not torch.equal(loaded, kv[:, :, :hit]):
                errors.append(f"thread {index} round {round_index}: wrong KV for a hit of {hit}")
            if hit % CHUNK:
                errors.append(f"hit {hit} not on a chunk boundary")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert_no_leak(engine)  # waits for the disk writer
    if with_disk:
        assert all(entry.refcount == 0 for entry in engine.disk.committed_entries())
        assert engine.disk.used_bytes == sum(entry.nbytes for entry in engine.disk.committed_entries())


def test_compressing_while_other_threads_read_never_shows_wrong_data():
    # Room for every version alive at once, so that no re-encoding has to evict a chunk of the
    # prompt (which would rightly make compress/decompress return fewer tokens): 3 chunks, the old
    # version of each that 3 readers may still hold (their space returns when released), one chunk
    # being reserved, and the free list's fragmentation between raw and encoded sizes. With 16,
    # about one run in fifteen evicted the first chunk under that transient load.
    engine = make_engine(64)
    tokens, kv = request(8, 3)
    engine.store(tokens, kv)
    errors: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            hit, loaded = engine.retrieve(tokens)
            if hit != 3 * CHUNK or not torch.equal(loaded, kv):
                errors.append(f"hit {hit}, data equal: {hit and torch.equal(loaded, kv[:, :, :hit])}")

    readers = [threading.Thread(target=reader) for _ in range(3)]
    for thread in readers:
        thread.start()
    try:
        for _ in range(20):
            assert engine.compress(tokens, "naive", "LocalCPUBackend") == 3 * CHUNK
            assert engine.decompress(tokens, "naive", "LocalCPUBackend") == 3 * CHUNK
    finally:
        stop.set()
        for thread in readers:
            thread.join()
    assert errors == []
    assert_no_leak(engine)


def test_move_between_tiers_and_clear_by_location(tmp_path):
    engine = make_engine(16, local_disk=str(tmp_path), max_local_disk_size=0.01)
    tokens, kv = request(6, 2)
    engine.store(tokens, kv)
    engine.flush()
    assert engine.clear("LocalDiskBackend") == 2 * CHUNK
    assert engine.lookup_location(tokens) == ("LocalCPUBackend", 2 * CHUNK)
    assert engine.move(tokens, "LocalCPUBackend", "LocalDiskBackend") == 2 * CHUNK
    assert engine.lookup_location(tokens) == ("LocalDiskBackend", 2 * CHUNK)
    assert engine.move(tokens, "LocalDiskBackend", "LocalCPUBackend", copy=True) == 2 * CHUNK
    assert engine.stats()["disk_chunks"] == 2 and engine.stats()["cpu_chunks"] == 2
    hit, loaded = engine.retrieve(tokens)
    assert hit == 2 * CHUNK and torch.equal(loaded, kv)
    assert engine.clear() == 2 * CHUNK
    assert engine.lookup(tokens) == 0
    assert engine.cpu.allocator.num_allocations == 0 and engine.disk.used_bytes == 0


@pytest.mark.parametrize("location", ["LocalCPUBackend", "LocalDiskBackend"])
def test_compress_then_decompress_with_naive_is_lossless(tmp_path, location):
    engine = make_engine(16, local_disk=str(tmp_path), max_local_disk_size=0.01)
    tokens, kv = request(7, 2)
    engine.store(tokens, kv)
    engine.flush()
    assert engine.compress(tokens, "naive", location) == 2 * CHUNK
    tier = engine._tier(location)
    assert {entry.meta.fmt for entry in tier.committed_entries()} == {"naive"}
    if location == "LocalDiskBackend":
        engine.clear("LocalCPUBackend")
    hit, loaded = engine.retrieve(tokens)
    assert hit == 2 * CHUNK and torch.equal(loaded, kv)
    assert engine.decompress(tokens, "naive", location) == 2 * CHUNK
    assert {entry.meta.fmt for entry in tier.committed_entries()} == {"raw"}
    hit, loaded = engine.retrieve(tokens)
    assert torch.equal(loaded, kv)
    with pytest.raises(ValueError, match="unknown compression method 'zip'"):
        engine.compress(tokens, "zip", location)
    assert_no_leak(engine)


def test_from_config_reads_the_environment_file(tmp_path, monkeypatch):
    file = tmp_path / "c.yaml"
    file.write_text("chunk_size: 32\nmax_local_cpu_size: 0.01\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(file))
    monkeypatch.delenv("CACHELAYER_CONFIG_FILE", raising=False)
    engine = CacheEngine.from_config(None, num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16")
    assert engine.chunk_size == 32 and engine.dtype == torch.float16


def test_chunks_exported_as_bytes_import_into_an_engine_of_the_same_identity_bit_for_bit():
    source, destination = make_engine(8), make_engine(2)
    try:
        assert source.transfer_identity() == destination.transfer_identity()
        tokens, kv = request(40, 3)
        tokens, kv = tokens[:-5], kv[:, :, :-5]  # a partial tail chunk travels too
        source.store(tokens, kv)
        ends = []
        for index in range(3):
            exported = source.export_chunk(tokens, index, "LocalCPUBackend")
            assert exported is not None
            span, chunk_format, data = exported
            assert chunk_format == "raw" and span.end == min((index + 1) * CHUNK, len(tokens))
            ends.append(destination.import_chunk(tokens, index, "cpu", chunk_format, data))
            if index == 1:  # a pool of two pinned chunks leaves no room for the third
                assert destination.pin(tokens) == 2 * CHUNK
        assert ends == [CHUNK, 2 * CHUNK, 0]
        hit, retrieved = destination.retrieve(tokens)
        assert hit == 2 * CHUNK and torch.equal(
            retrieved.view(torch.int16), kv[:, :, : 2 * CHUNK].view(torch.int16)
        )
        assert source.export_chunk(tokens, 3, "cpu") is None
        assert source.drop(tokens, "cpu") == len(tokens) and source.lookup(tokens) == 0
        assert source.export_chunk(tokens, 0, "cpu") is None
        assert_no_leak(source)
        assert_no_leak(destination)
    finally:
        source.close()
        destination.close()


def test_import_chunk_refuses_bytes_that_do_not_fit_the_chunk():
    engine = make_engine(4)
    try:
        tokens, _ = request(41, 2)
        with pytest.raises(CacheEngineError, match="need"):
            engine.import_chunk(tokens, 0, "cpu", "raw", b"\0" * 10)
        with pytest.raises(CacheEngineError, match="out of range"):
            engine.import_chunk(tokens, 2, "cpu", "raw", b"\0" * 10)
        with pytest.raises(ValueError, match="unknown"):
            engine.import_chunk(tokens, 0, "cpu", "no-such-codec", b"\0" * 10)
        assert engine.cpu.num_chunks == 0
        assert_no_leak(engine)
    finally:
        engine.close()
