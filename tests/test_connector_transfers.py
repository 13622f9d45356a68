"""The vLLM connector's worker-side moves with real tensors: paged layouts <-> store chunks, loads,
saves, and load failures reported block by block (no vLLM needed)."""

from __future__ import annotations

import threading

import pytest
import torch

from cachelayer.config import parse_config
from cachelayer.connectors.transfers import (
    BackgroundLoader,
    BackgroundSaver,
    LocalChunkStore,
    PagedKV,
    RemoteChunkStore,
    RequestLoad,
    detect_layout,
    load_request,
    save_request,
    store_now,
)
from cachelayer.engine import CacheEngine
from cachelayer.server import KeySpace, StoreClient, StoreServer
from kvgate_testing.ports import free_port

LAYERS, HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, CHUNK = 2, 2, 8, 32, 40, 64


def cpu_cache(seed: int) -> list[torch.Tensor]:
    """vLLM's CPU layout: one storage, per layer [num_blocks, heads, block_size, 2 * head_dim]."""
    generator = torch.Generator().manual_seed(seed)
    storage = torch.randn(LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, generator=generator).to(
        torch.bfloat16
    )
    return list(storage.unbind(0))


def flash_cache(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]


def paged(layers: list[torch.Tensor]) -> PagedKV:
    layout = detect_layout(layers[0], num_kv_heads=HEADS, head_dim=HEAD_DIM, block_size=BLOCK)
    return PagedKV(layers, layout=layout, block_size=BLOCK, num_kv_heads=HEADS, head_dim=HEAD_DIM)


def engine() -> CacheEngine:
    return CacheEngine.from_config(
        {"chunk_size": CHUNK, "max_local_cpu_size": 0.01, "save_unfull_chunk": True},
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
        model_name="test-model",
    )


@pytest.mark.parametrize("make_cache", [cpu_cache, flash_cache], ids=["cpu_blocks", "flash_attn"])
def test_blocks_round_trip_into_other_block_ids(make_cache):
    source, target = paged(make_cache(0)), paged(make_cache(1))
    chunk = source.gather([3, 7, 1, 12])
    assert chunk.shape == (LAYERS, 2, 4 * BLOCK, HEADS * HEAD_DIM)
    target.scatter(chunk, [20, 21, 22, 23])
    for layer in range(LAYERS):
        for src, dst in zip([3, 7, 1, 12], [20, 21, 22, 23], strict=True):
            if source.layout == "cpu_blocks":
                assert torch.equal(target.kv_caches[layer][dst], source.kv_caches[layer][src])
            else:
                assert torch.equal(target.kv_caches[layer][:, dst], source.kv_caches[layer][:, src])


def test_cpu_blocks_chunks_of_a_token_range_hold_exactly_their_own_blocks():
    source = paged(cpu_cache(0))
    blocks = [5, 9, 2, 30]
    whole = source.gather(blocks)
    second_half = source.gather(blocks[2:])
    # The store slices chunks by token ranges; a block-aligned range must be those blocks' bytes.
    assert torch.equal(whole[:, :, 2 * BLOCK :], second_half)


def test_flash_attn_chunks_are_plain_k_and_v_rows():
    source = paged(flash_cache(0))
    chunk = source.gather([4, 6])
    layer = source.kv_caches[1]
    token = BLOCK + 5  # block 6, offset 5
    assert torch.equal(chunk[1, 0, token], layer[0, 6, 5].reshape(-1))
    assert torch.equal(chunk[1, 1, token], layer[1, 6, 5].reshape(-1))


def test_unknown_layouts_are_refused_with_what_is_supported():
    expected = r"unsupported KV cache layout .* cpu_blocks, flash_attn, flashinfer"
    with pytest.raises(ValueError, match=expected):
        detect_layout(torch.zeros(4, 4, 4), num_kv_heads=HEADS, head_dim=HEAD_DIM, block_size=BLOCK)


def test_save_then_load_through_the_cache_engine_skipping_blocks_the_engine_computed():
    tokens = list(range(1000, 1000 + 4 * BLOCK))  # 2 chunks
    store = LocalChunkStore(engine())
    writer, reader = paged(cpu_cache(0)), paged(cpu_cache(1))
    events = save_request(writer, store, token_ids=tokens, block_ids=[1, 2, 3, 4], cache_salt=None)
    assert [event.kind for event in events] == ["stored", "stored"]

    untouched = reader.kv_caches[0][10].clone()
    failed = load_request(
        reader, store, token_ids=tokens, block_ids=[10, 11, 12, 13], first_block=1, cache_salt=None
    )
    assert failed == set()
    assert torch.equal(reader.kv_caches[0][10], untouched)  # the engine's own block is left alone
    for src, dst in zip([2, 3, 4], [11, 12, 13], strict=True):
        for layer in range(LAYERS):
            assert torch.equal(reader.kv_caches[layer][dst], writer.kv_caches[layer][src])


def test_a_shorter_hit_than_planned_fails_the_missing_blocks():
    tokens = list(range(4 * BLOCK))
    store = LocalChunkStore(engine())
    writer, reader = paged(cpu_cache(0)), paged(cpu_cache(1))
    save_request(writer, store, token_ids=tokens[: 2 * BLOCK], block_ids=[1, 2], cache_salt=None)  # 1 chunk
    failed = load_request(
        reader, store, token_ids=tokens, block_ids=[10, 11, 12, 13], first_block=0, cache_salt=None
    )
    assert failed == {12, 13}
    assert torch.equal(reader.kv_caches[0][11], writer.kv_caches[0][2])


def test_a_salted_load_of_unsalted_chunks_fails_every_block():
    tokens = list(range(2 * BLOCK))
    store = LocalChunkStore(engine())
    save_request(paged(cpu_cache(0)), store, token_ids=tokens, block_ids=[1, 2], cache_salt=None)
    failed = load_request(
        paged(cpu_cache(1)), store, token_ids=tokens, block_ids=[5, 6], first_block=0, cache_salt="x"
    )
    assert failed == {5, 6}


def test_an_unreachable_daemon_fails_the_load_and_skips_the_save():
    space = KeySpace(model="m", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM)
    client = StoreClient(f"tcp://127.0.0.1:{free_port()}", chunk_size=CHUNK, timeout_s=0.2)
    store = RemoteChunkStore(client, space)
    try:
        tokens = list(range(2 * BLOCK))
        assert (
            save_request(paged(cpu_cache(0)), store, token_ids=tokens, block_ids=[1, 2], cache_salt=None)
            == []
        )
        reader = paged(cpu_cache(1))
        before = reader.kv_caches[0][5].clone()
        failed = load_request(
            reader, store, token_ids=tokens, block_ids=[5, 6], first_block=0, cache_salt=None
        )
        assert failed == {5, 6}
        assert torch.equal(reader.kv_caches[0][5], before)
    finally:
        client.close()


def test_a_handoff_save_is_in_the_store_when_it_returns_and_reports_what_it_holds():
    tokens = list(range(2000, 2000 + 5 * BLOCK))  # 2 whole chunks and half a one
    store = LocalChunkStore(engine())
    writer, reader = paged(cpu_cache(0)), paged(cpu_cache(1))
    done = store_now(
        writer,
        store,
        request_id="r",
        token_ids=tokens,
        block_ids=[1, 2, 3, 4, 5],
        cache_salt=None,
        flush_timeout_s=5,
    )
    # The store holds the whole chunks and the tail chunk (its decode engine asks for this prefix).
    assert done.tokens == 5 * BLOCK
    assert [event.kind for event in done.events] == ["stored"] * 3
    assert len(done.events[-1].token_ids) == BLOCK and done.events[-1].parent_key == done.events[1].key
    assert done.seconds >= 0
    # Visible at once to another reader of the store: no background thread is involved.
    assert store.lookup(tokens, None) == 5 * BLOCK
    # The tail chunk's key covers exactly its block: a prompt that goes on past it misses it.
    assert store.lookup([*tokens, *range(9000, 9000 + BLOCK)], None) == 4 * BLOCK
    failed = load_request(
        reader, store, token_ids=tokens, block_ids=[6, 7, 8, 9, 10], first_block=0, cache_salt=None
    )
    assert failed == set()
    for block, source in ((9, 4), (10, 5)):
        assert torch.equal(reader.kv_caches[1][block], writer.kv_caches[1][source])


def test_a_handoff_save_to_an_unreachable_daemon_reports_nothing_stored():
    space = KeySpace(model="m", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM)
    client = StoreClient(f"tcp://127.0.0.1:{free_port()}", chunk_size=CHUNK, timeout_s=0.2)
    try:
        done = store_now(
            paged(cpu_cache(0)),
            RemoteChunkStore(client, space),
            request_id="r",
            token_ids=list(range(2 * BLOCK)),
            block_ids=[1, 2],
            cache_salt=None,
            flush_timeout_s=1,
        )
        assert (done.tokens, done.events) == (0, [])
    finally:
        client.close()


class _GatedStore:
    """A real store whose stores wait for a gate: a daemon that is slow to answer."""

    def __init__(self, store: LocalChunkStore) -> None:
        self.inner, self.gate = store, threading.Event()

    def lookup(self, tokens, cache_salt):
        return self.inner.lookup(tokens, cache_salt)

    def store(self, tokens, kv, cache_salt):
        assert self.gate.wait(10), "the test never opened the gate"
        return self.inner.store(tokens, kv, cache_salt)

    def retrieve(self, tokens, cache_salt):
        return self.inner.retrieve(tokens, cache_salt)

    def held_chunks(self, tokens, cache_salt):
        return self.inner.held_chunks(tokens, cache_salt)


@pytest.mark.parametrize("make_cache", [cpu_cache, flash_cache], ids=["cpu_blocks", "flash_attn"])
def test_a_background_save_returns_at_once_and_stores_the_blocks_as_they_were(make_cache):
    tokens = list(range(500, 500 + 4 * BLOCK))  # 2 chunks
    store = _GatedStore(LocalChunkStore(engine()))
    writer, reader = paged(make_cache(0)), paged(make_cache(1))
    expected = writer.gather([1, 2, 3, 4])
    saver = BackgroundSaver(writer, store)
    try:
        # submit returns while the store is blocked on its gate: the save is still pending.
        assert saver.submit(request_id="r1", token_ids=tokens, block_ids=[1, 2, 3, 4], cache_salt=None)
        assert saver.take_completed() == [] and not saver.wait_idle(0.05)
        for layer in writer.kv_caches:  # the engine frees and reuses the blocks at once
            layer.zero_()
        store.gate.set()
        assert saver.wait_idle(10)
        [completed] = saver.take_completed()
        assert completed.request_id == "r1" and completed.tokens == 4 * BLOCK
        assert [event.kind for event in completed.events] == ["stored", "stored"]
        failed = load_request(
            reader, store, token_ids=tokens, block_ids=[20, 21, 22, 23], first_block=0, cache_salt=None
        )
        assert failed == set()
        assert torch.equal(reader.gather([20, 21, 22, 23]), expected)  # the KV as it was when submitted
    finally:
        store.gate.set()
        saver.close()


def test_saves_beyond_the_pending_budget_are_dropped_not_queued():
    store = _GatedStore(LocalChunkStore(engine()))
    writer = paged(cpu_cache(0))
    one_save = 2 * BLOCK * LAYERS * 2 * HEADS * HEAD_DIM * 2  # 2 blocks of bf16 KV
    saver = BackgroundSaver(writer, store, max_pending_bytes=one_save)
    try:
        assert saver.submit(
            request_id="a", token_ids=list(range(2 * BLOCK)), block_ids=[1, 2], cache_salt=None
        )
        assert not saver.submit(
            request_id="b", token_ids=list(range(9, 9 + 2 * BLOCK)), block_ids=[3, 4], cache_salt=None
        )
        assert saver.dropped_saves == 1
        store.gate.set()
        assert saver.wait_idle(10)
        assert [save.request_id for save in saver.take_completed()] == ["a"]
        # Room again once the first save is stored.
        assert saver.submit(
            request_id="c", token_ids=list(range(7, 7 + 2 * BLOCK)), block_ids=[5, 6], cache_salt=None
        )
    finally:
        saver.close()


@pytest.fixture
def shared_daemon():
    config = parse_config({"chunk_size": CHUNK, "max_local_cpu_size": 0.01, "save_unfull_chunk": True})
    servers: list[StoreServer] = []

    def start(lease_ttl_s: float = 30.0) -> StoreServer:
        server = StoreServer(config, "tcp://127.0.0.1:0", shared_memory=True, lease_ttl_s=lease_ttl_s)
        servers.append(server.start())
        return server

    yield start
    for server in servers:
        server.close()


def test_a_load_through_the_daemon_reads_its_shared_pool_in_place_like_the_tcp_path(shared_daemon):
    server = shared_daemon()
    space = KeySpace(model="m", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM)
    shm = StoreClient(server.endpoint, chunk_size=CHUNK, timeout_s=5)
    tcp = StoreClient(server.endpoint, chunk_size=CHUNK, timeout_s=5, transport="tcp")
    try:
        assert shm.transport == "shm"
        tokens = list(range(300, 300 + 4 * BLOCK))  # 2 chunks
        writer = paged(cpu_cache(0))
        save_request(
            writer, RemoteChunkStore(shm, space), token_ids=tokens, block_ids=[1, 2, 3, 4], cache_salt=None
        )
        readers = {"shm": paged(cpu_cache(1)), "tcp": paged(cpu_cache(1))}
        untouched = readers["shm"].kv_caches[0][10].clone()
        for name, client in (("shm", shm), ("tcp", tcp)):
            failed = load_request(
                readers[name],
                RemoteChunkStore(client, space),
                token_ids=tokens,
                block_ids=[10, 11, 12, 13],
                first_block=1,
                cache_salt=None,
            )
            assert failed == set(), name
        for layer in range(LAYERS):
            assert torch.equal(readers["shm"].kv_caches[layer], readers["tcp"].kv_caches[layer])
            for src, dst in zip([2, 3, 4], [11, 12, 13], strict=True):
                assert torch.equal(readers["shm"].kv_caches[layer][dst], writer.kv_caches[layer][src])
        assert torch.equal(readers["shm"].kv_caches[0][10], untouched)  # the engine's own block
        metrics = server.metric_values()
        assert metrics["cachelayer_daemon_leases_total"] == 2  # the save and the shm load
        assert metrics["cachelayer_daemon_open_leases"] == 0
    finally:
        shm.close()
        tcp.close()


def test_a_lease_the_daemon_ends_during_the_load_fails_every_block(shared_daemon, monkeypatch):
    server = shared_daemon(lease_ttl_s=0.2)
    space = KeySpace(model="m", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM)
    client = StoreClient(server.endpoint, chunk_size=CHUNK, timeout_s=5)
    try:
        store = RemoteChunkStore(client, space)
        tokens = list(range(4 * BLOCK))
        save_request(paged(cpu_cache(0)), store, token_ids=tokens, block_ids=[1, 2, 3, 4], cache_salt=None)
        reader = paged(cpu_cache(1))
        start_load = reader.start_load

        def slow_start_load(*args, **kwargs):  # a worker descheduled mid-load, past the lease's TTL
            load = start_load(*args, **kwargs)
            threading.Event().wait(0.5)
            return load

        monkeypatch.setattr(reader, "start_load", slow_start_load)
        failed = load_request(
            reader, store, token_ids=tokens, block_ids=[5, 6, 7, 8], first_block=0, cache_salt=None
        )
        assert failed == {5, 6, 7, 8}  # recomputed: the daemon may have reused what was read
        assert server.metric_values()["cachelayer_daemon_expired_leases_total"] == 1
    finally:
        client.close()


def test_every_new_engine_announces_its_stores_even_at_a_freed_engines_address():
    # Engines freed and made one after another often sit at the same address: the event dispatcher
    # once remembered engines by id(), and a new engine at an old one's address announced nothing.
    import gc

    from cachelayer.server.daemon import store_with_events

    tokens = list(range(7, 7 + 2 * CHUNK))
    for _ in range(30):
        fresh = engine()
        kv = torch.zeros(fresh.num_layers, 2, len(tokens), fresh.channels, dtype=fresh.dtype)
        _, events = store_with_events(fresh, tokens, kv, None)
        assert [event.kind for event in events] == ["stored", "stored"]
        del fresh
        gc.collect()


def same_blocks(reader: PagedKV, writer: PagedKV, layer: int, dst: int, src: int) -> bool:
    if reader.layout == "cpu_blocks":
        return torch.equal(reader.kv_caches[layer][dst], writer.kv_caches[layer][src])
    return torch.equal(reader.kv_caches[layer][:, dst], writer.kv_caches[layer][:, src])


def stored_then_loading(
    writer: PagedKV, reader: PagedKV, store, first_token: int, *, into=(10, 11, 12, 13), first_block: int = 0
) -> RequestLoad:
    """A 4-block prompt saved from blocks 1-4 of `writer`, and a layer-by-layer load of it into
    blocks `into` of `reader` (started: no layer asked for yet)."""
    tokens = list(range(first_token, first_token + 4 * BLOCK))
    save_request(writer, store, token_ids=tokens, block_ids=[1, 2, 3, 4], cache_salt=None)
    return RequestLoad(
        reader,
        store,
        token_ids=tokens,
        block_ids=list(into),
        first_block=first_block,
        cache_salt=None,
        layerwise=True,
    )


@pytest.mark.parametrize("make_cache", [cpu_cache, flash_cache], ids=["cpu_blocks", "flash_attn"])
def test_a_layerwise_load_fills_each_layer_when_its_attention_asks(make_cache):
    writer, reader = paged(make_cache(0)), paged(make_cache(1))
    load = stored_then_loading(writer, reader, LocalChunkStore(engine()), 500)
    assert not same_blocks(reader, writer, 0, 10, 1) and not same_blocks(reader, writer, 1, 10, 1)
    load.load_layer(0)  # the first layer's attention is about to read its KV
    assert all(
        same_blocks(reader, writer, 0, d, s) for s, d in zip([1, 2, 3, 4], [10, 11, 12, 13], strict=True)
    )
    assert not same_blocks(reader, writer, 1, 10, 1)  # the next layer is not needed yet
    load.load_layer(1)
    assert load.finish(layers_awaited=True) == set() and load.late_layers == 0
    assert all(
        same_blocks(reader, writer, 1, d, s) for s, d in zip([1, 2, 3, 4], [10, 11, 12, 13], strict=True)
    )


def test_a_layer_the_engine_read_before_asking_for_it_fails_the_load():
    writer, reader = paged(flash_cache(0)), paged(flash_cache(1))
    load = stored_then_loading(writer, reader, LocalChunkStore(engine()), 700, first_block=1)
    load.load_layer(0)  # layer 1's attention ran without asking: it read stale KV
    assert load.finish(layers_awaited=True) == {11, 12, 13} and load.late_layers == 1


def test_a_layerwise_load_keeps_the_daemons_chunks_leased_until_it_finishes(shared_daemon):
    server = shared_daemon()
    space = KeySpace(model="m", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM)
    client = StoreClient(server.endpoint, chunk_size=CHUNK, timeout_s=5)
    try:
        store = RemoteChunkStore(client, space)
        assert client.transport == "shm"
        writer, reader = paged(flash_cache(0)), paged(flash_cache(1))
        load = stored_then_loading(writer, reader, store, 0, into=(5, 6, 7, 8))
        load.load_layer(0)
        # Mid forward pass: the layers still to come read the pool, so the daemon may not reuse it.
        assert server.metric_values()["cachelayer_daemon_open_leases"] == 1
        load.load_layer(1)
        assert load.finish(layers_awaited=True) == set()
        assert server.metric_values()["cachelayer_daemon_open_leases"] == 0
        assert same_blocks(reader, writer, 1, 8, 4)
    finally:
        client.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")
def test_a_layerwise_load_into_a_gpu_cache_lands_each_layer_on_the_compute_stream():
    writer = paged(flash_cache(0))
    reader = paged([layer.cuda() for layer in flash_cache(1)])
    load = stored_then_loading(writer, reader, LocalChunkStore(engine()), 900)
    for layer in range(LAYERS):
        load.load_layer(layer)  # queued: work the compute stream runs next sees the layer loaded
        loaded = reader.kv_caches[layer][:, 10:14].clone()  # on the compute stream, after the wait
        assert torch.equal(loaded.cpu(), writer.kv_caches[layer][:, 1:5])
    assert load.finish(layers_awaited=True) == set() and load.late_layers == 0


class _GatedReads(_GatedStore):
    """A real store whose reads wait for a gate (a slow daemon); `broken`: reads raise."""

    broken = False

    def held_chunks(self, tokens, cache_salt):
        assert self.gate.wait(10), "the test never opened the gate"
        if self.broken:
            raise RuntimeError("a bug in the store")
        return self.inner.held_chunks(tokens, cache_salt)


def test_a_background_load_fills_the_blocks_off_the_caller_and_reports_each_load_once():
    tokens = list(range(700, 700 + 4 * BLOCK))  # 2 chunks
    inner = LocalChunkStore(engine())
    writer, reader = paged(cpu_cache(0)), paged(cpu_cache(1))
    save_request(writer, inner, token_ids=tokens, block_ids=[1, 2, 3, 4], cache_salt=None)
    store = _GatedReads(inner)
    loader = BackgroundLoader(reader, store)
    try:
        untouched = reader.kv_caches[0][10].clone()
        loader.submit(
            request_id="r", token_ids=tokens, block_ids=[10, 11, 12, 13], first_block=1, cache_salt=None
        )
        # submit returned while the store is blocked: nothing finished, nothing reported.
        assert loader.take_completed(wait_s=0.05) == [] and loader.outstanding == 1
        store.gate.set()
        [done] = loader.take_completed(wait_s=10)
        assert (done.request_id, done.failed_blocks, done.loaded_tokens) == ("r", set(), 3 * BLOCK)
        assert torch.equal(reader.kv_caches[0][10], untouched)  # the engine's own block is left alone
        for src, dst in zip([2, 3, 4], [11, 12, 13], strict=True):
            for layer in range(LAYERS):
                assert torch.equal(reader.kv_caches[layer][dst], writer.kv_caches[layer][src])
        assert loader.take_completed() == [] and loader.outstanding == 0
    finally:
        store.gate.set()
        loader.close()


def test_a_background_load_that_misses_or_breaks_fails_its_blocks_and_still_finishes():
    tokens = list(range(4 * BLOCK))
    inner = LocalChunkStore(engine())
    save_request(paged(cpu_cache(0)), inner, token_ids=tokens[: 2 * BLOCK], block_ids=[1, 2], cache_salt=None)
    store = _GatedReads(inner)
    store.gate.set()
    loader = BackgroundLoader(paged(cpu_cache(1)), store)
    try:
        loader.submit(
            request_id="short", token_ids=tokens, block_ids=[10, 11, 12, 13], first_block=0, cache_salt=None
        )
        [short] = loader.take_completed(wait_s=10)
        assert (short.failed_blocks, short.loaded_tokens) == ({12, 13}, 2 * BLOCK)
        store.broken = True  # an error of any kind: every block it was to write is recomputed
        loader.submit(
            request_id="bug", token_ids=tokens, block_ids=[20, 21, 22, 23], first_block=1, cache_salt=None
        )
        [bug] = loader.take_completed(wait_s=10)
        assert (bug.request_id, bug.failed_blocks, bug.loaded_tokens) == ("bug", {21, 22, 23}, 0)
        assert loader.wait_idle(1)
    finally:
        loader.close()
