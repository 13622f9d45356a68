"""Storage: the pool allocator, eviction orders, tier refcounts, pins and the disk tier's restart."""

import itertools
import random

import pytest
import torch

from cachelayer.storage.allocator import ALIGNMENT, DoubleFreeError, FreeListAllocator
from cachelayer.storage.eviction import LFUPolicy, LRUPolicy, make_policy
from kvgate_testing.cachelayer import CHUNK, CHUNK_BYTES, assert_no_leak, make_engine, request


def test_allocator_serves_variable_sizes_without_overlap_and_coalesces_back():
    allocator = FreeListAllocator(1 << 20)
    rng = random.Random(7)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            offset = rng.choice(list(live))
            allocator.free(offset)
            del live[offset]
        else:
            size = rng.randint(1, 40_000)
            offset = allocator.allocate(size)
            if offset is None:
                continue
            assert offset % ALIGNMENT == 0
            live[offset] = allocator.rounded(size)
        intervals = sorted(live.items())
        for (start, size), (next_start, _) in itertools.pairwise(intervals):
            assert start + size <= next_start, "two live allocations overlap"
        assert all(start + size <= allocator.capacity for start, size in intervals)
    for offset in list(live):
        allocator.free(offset)
    assert allocator.allocated_bytes == 0
    assert allocator.largest_free == allocator.capacity  # fully coalesced


def test_allocator_refuses_double_free_and_reports_exhaustion():
    allocator = FreeListAllocator(4 * ALIGNMENT)
    first = allocator.allocate(3 * ALIGNMENT)
    assert allocator.allocate(2 * ALIGNMENT) is None
    allocator.free(first)
    with pytest.raises(DoubleFreeError):
        allocator.free(first)


def test_eviction_orders():
    lru = LRUPolicy()
    for key in (1, 2, 3):
        lru.on_insert(key)
    lru.on_access(1)
    assert list(lru.in_order()) == [2, 3, 1]
    lfu = LFUPolicy()
    for key in (1, 2, 3):
        lfu.on_insert(key)
    lfu.on_access(1)
    lfu.on_access(1)
    lfu.on_access(3)
    assert list(lfu.in_order()) == [2, 3, 1]
    fifo = make_policy("FIFO")
    for key in (1, 2):
        fifo.on_insert(key)
    fifo.on_access(1)
    assert list(fifo.in_order()) == [1, 2]


def test_eviction_under_memory_pressure_spares_pinned_chunks_and_stores_a_prefix():
    engine = make_engine(4)
    pinned_tokens, pinned_kv = request(1, 2)
    assert engine.store(pinned_tokens, pinned_kv) == 2 * CHUNK
    assert engine.pin(pinned_tokens) == 2 * CHUNK
    tokens_b, kv_b = request(2, 2)
    assert engine.store(tokens_b, kv_b) == 2 * CHUNK
    tokens_c, kv_c = request(3, 2)
    # The pool holds 4 chunks; 2 are pinned, so C can only replace B.
    assert engine.store(tokens_c, kv_c) == 2 * CHUNK
    assert engine.lookup(tokens_b) == 0
    assert engine.lookup(pinned_tokens) == 2 * CHUNK
    # A 3-chunk request cannot fit beside 2 pinned chunks: the store stops after 2, a prefix.
    tokens_d, kv_d = request(4, 3)
    assert engine.store(tokens_d, kv_d) == 2 * CHUNK
    assert engine.lookup(tokens_d) == 2 * CHUNK
    hit, kv = engine.retrieve(pinned_tokens)
    assert hit == 2 * CHUNK and torch.equal(kv, pinned_kv)
    hit, kv = engine.retrieve(tokens_d)
    assert hit == 2 * CHUNK and torch.equal(kv, kv_d[:, :, : 2 * CHUNK])
    assert engine.unpin(pinned_tokens) == 2 * CHUNK
    engine.store(tokens_b, kv_b)
    assert engine.lookup(tokens_b) == 2 * CHUNK
    assert engine.stats()["cpu_evicted_chunks"] >= 4
    assert_no_leak(engine)


def test_a_pinned_chunk_stays_pinned_when_compressed():
    engine = make_engine(6)
    pinned_tokens, pinned_kv = request(1, 2)
    engine.store(pinned_tokens, pinned_kv)
    engine.pin(pinned_tokens)
    assert engine.compress(pinned_tokens, "naive", "LocalCPUBackend") == 2 * CHUNK
    for seed in range(2, 6):
        engine.store(*request(seed, 2))
    assert engine.stats()["cpu_evicted_chunks"] >= 4
    hit, kv = engine.retrieve(pinned_tokens)
    assert hit == 2 * CHUNK and torch.equal(kv, pinned_kv)
    assert_no_leak(engine)


def test_chunks_in_use_are_never_evicted():
    engine = make_engine(2)
    tokens_a, kv_a = request(1, 2)
    engine.store(tokens_a, kv_a)
    first = engine.cpu.get(engine._spans(tokens_a, None, None)[0].key)
    engine.cpu.acquire(first)  # a reader in the middle of a copy
    tokens_b, kv_b = request(2, 2)
    assert engine.store(tokens_b, kv_b) == CHUNK  # only the unreferenced chunk could make room
    assert engine.cpu.get(first.meta.key) is first
    engine.cpu.release(first)
    with pytest.raises(RuntimeError, match="released more often"):
        engine.cpu.release(first)
    assert_no_leak(engine)


def test_lfu_keeps_the_frequently_read_request():
    engine = make_engine(4, cache_policy="LFU")
    hot, hot_kv = request(1, 2)
    cold, cold_kv = request(2, 2)
    engine.store(hot, hot_kv)
    engine.store(cold, cold_kv)
    for _ in range(3):
        engine.retrieve(hot)
    newcomer, newcomer_kv = request(3, 2)
    engine.store(newcomer, newcomer_kv)
    assert engine.lookup(hot) == 2 * CHUNK
    assert engine.lookup(cold) == 0


def test_disk_tier_survives_a_restart_and_promotes_to_the_pool(tmp_path):
    config = {"local_disk": str(tmp_path / "l2"), "max_local_disk_size": 0.01}
    tokens, kv = request(5, 3)
    with make_engine(8, **config) as engine:
        assert engine.store(tokens, kv) == 3 * CHUNK
        engine.flush()  # disk writes run behind the store
        assert engine.stats()["disk_chunks"] == 3
    (tmp_path / "l2" / "0000000000000000-dead.kvchunk.tmp").write_bytes(b"half-written")
    (tmp_path / "l2" / "0000000000000001-dead.kvchunk").write_bytes(b"garbage")
    with make_engine(8, **config) as restarted:
        assert restarted.stats()["cpu_chunks"] == 0
        assert restarted.lookup(tokens) == 3 * CHUNK
        assert restarted.lookup_location(tokens) == ("LocalDiskBackend", 3 * CHUNK)
        hit, loaded = restarted.retrieve(tokens)
        assert hit == 3 * CHUNK and torch.equal(loaded, kv)
        assert restarted.stats()["cpu_chunks"] == 3  # promoted
        assert restarted.lookup_location(tokens) == ("LocalCPUBackend", 3 * CHUNK)
        assert_no_leak(restarted)
    assert sorted(path.suffix for path in (tmp_path / "l2").iterdir()) == [".kvchunk"] * 3


def test_disk_tier_evicts_within_its_size(tmp_path):
    config = {"local_disk": str(tmp_path / "l2"), "max_local_disk_size": 2.5 * CHUNK_BYTES / 2**30}
    with make_engine(8, **config) as engine:
        for seed in range(3):
            engine.store(*request(seed, 1))
        engine.flush()
        assert engine.stats()["disk_chunks"] == 2
        assert engine.disk.used_bytes <= engine.disk.capacity
        assert len(list((tmp_path / "l2").glob("*.kvchunk"))) == 2


def test_engines_sharing_a_disk_directory_keep_to_their_own_files(tmp_path):
    import torch

    from cachelayer import CacheEngine

    def worker(rank):
        return CacheEngine.from_config(
            {
                "chunk_size": CHUNK,
                "max_local_cpu_size": 0.01,
                "local_disk": str(tmp_path),
                "max_local_disk_size": 1.5 * CHUNK_BYTES / 2**30,
            },
            num_layers=2,
            num_kv_heads=2,
            head_dim=8,
            dtype=torch.bfloat16,
            world_size=2,
            worker_id=rank,
        )

    tokens, kv = request(9, 1)
    with worker(0) as first, worker(1) as second:
        first.store(tokens, kv)
        second.store(tokens, kv)
    with worker(0) as first, worker(1) as second:
        # Each found its own chunk after the restart and did not evict the other's.
        assert first.lookup(tokens) == CHUNK and second.lookup(tokens) == CHUNK
        assert first.disk.num_chunks == 1 and second.disk.num_chunks == 1


def test_disk_writes_queued_before_a_clear_are_dropped(tmp_path):
    with make_engine(8, local_disk=str(tmp_path), max_local_disk_size=0.01) as engine:
        tokens, kv = request(10, 2)
        # Holding the engine lock keeps the disk writer from starting before the clear.
        with engine._lock:
            engine.store(tokens, kv)
            assert engine.clear("LocalDiskBackend") == 0
        engine.flush()
        assert engine.stats()["disk_chunks"] == 0
        assert list(tmp_path.glob("*.kvchunk")) == []
        assert engine.lookup_location(tokens) == ("LocalCPUBackend", 2 * CHUNK)
