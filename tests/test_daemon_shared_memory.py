"""The daemon's same-host shared-memory path over real ZMQ, a real shared segment and real processes:
bit-exact with TCP, leases against eviction and expiry, clients killed mid-transfer."""

from __future__ import annotations

import sys
import time

import httpx
import pytest
import torch

from cachelayer.config import parse_config
from cachelayer.server import KeySpace, StoreClient, StoreServer, StoreUnavailable
from cachelayer.server.client import LeaseExpired
from cachelayer.server.protocol import kv_nbytes
from kvgate_testing.ports import free_port
from kvgate_testing.processes import ManagedProcess, wait_for_http

CHUNK = 16
SPACE = KeySpace(
    model="m@rev|block_size=16|layout=x", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8
)
CHUNK_BYTES = kv_nbytes(SPACE, CHUNK)  # 2 KiB


def any_bits_kv(num_tokens: int, seed: int) -> torch.Tensor:
    """KV whose bf16 values are arbitrary bit patterns (NaNs, infinities, -0 included)."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, (SPACE.num_layers, 2, num_tokens, 16), generator=generator)
    return bits.to(torch.int16).view(torch.bfloat16)


def same_bits(left: torch.Tensor, right: torch.Tensor) -> bool:
    return torch.equal(left.view(torch.int16), right.view(torch.int16))


def start_daemon(l1_bytes: int, lease_ttl_s: float = 30.0, shared_memory: bool = True) -> StoreServer:
    config = parse_config(
        {"chunk_size": CHUNK, "max_local_cpu_size": l1_bytes / (1 << 30), "save_unfull_chunk": True}
    )
    return StoreServer(
        config, "tcp://127.0.0.1:0", shared_memory=shared_memory, lease_ttl_s=lease_ttl_s
    ).start()


@pytest.fixture
def clients():
    made: list[StoreClient] = []

    def make(server: StoreServer, transport: str = "auto", register_with_cuda: bool = False) -> StoreClient:
        client = StoreClient(
            server.endpoint,
            chunk_size=CHUNK,
            timeout_s=5,
            transport=transport,  # type: ignore[arg-type]
            register_with_cuda=register_with_cuda,
        )
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def test_shared_memory_and_tcp_clients_of_one_daemon_exchange_bit_exact_kv(clients):
    server = start_daemon(1 << 20)
    try:
        shared, tcp = clients(server), clients(server, "tcp")
        assert shared.transport == "shm" and tcp.transport == "tcp"
        first, second = list(range(64)), list(range(1000, 1064))
        kv_first, kv_second = any_bits_kv(64, seed=1), any_bits_kv(64, seed=2)

        held_shm, events_shm = shared.store(SPACE, first, kv_first)
        held_tcp, events_tcp = tcp.store(SPACE, second, kv_second)
        assert held_shm == held_tcp == 64
        assert [e.kind for e in events_shm] == [e.kind for e in events_tcp] == ["stored"] * 4
        assert events_shm[0].token_ids == first[:CHUNK] and events_shm[1].parent_key == events_shm[0].key

        for reader in (shared, tcp):
            for tokens, kv in ((first, kv_first), (second, kv_second)):
                hit, loaded = reader.retrieve(SPACE, [*tokens, 5, 5, 5])
                assert hit == 64 and same_bits(loaded, kv), reader.transport
        # Into a caller's buffer, as a connector does: the same bytes, no other tensor.
        out = torch.zeros(2, 2, 80, 16, dtype=torch.bfloat16)
        hit, view = shared.retrieve(SPACE, first, out=out)
        assert hit == 64 and view.data_ptr() == out.data_ptr() and same_bits(out[:, :, :64], kv_first)
        # A store of held chunks through either path writes nothing and reports nothing.
        assert shared.store(SPACE, second, kv_first) == (64, [])
        assert same_bits(tcp.retrieve(SPACE, second)[1], kv_second)
        metrics = server.metric_values()
        assert metrics["cachelayer_daemon_open_leases"] == 0
        # The shm client's store, its two retrieves and its retrieve into `out`; TCP opens none.
        assert metrics["cachelayer_daemon_leases_total"] == 4
    finally:
        server.close()


def test_a_tail_chunk_is_shared_for_exactly_its_prefix_through_both_paths(clients):
    """A prefill engine's handoff stores its prompt's tail chunk (fewer tokens than a chunk) for the
    decode engine's lookup of that very prefix (cachelayer/connectors/planning.py)."""
    server = start_daemon(1 << 20)
    try:
        shared, tcp = clients(server), clients(server, "tcp")
        handoff = list(range(500, 500 + 2 * CHUNK + 8))  # two whole chunks and an 8-token tail
        kv = any_bits_kv(len(handoff), seed=4)
        held, events = shared.store(SPACE, handoff, kv)
        assert held == len(handoff)
        assert [len(e.token_ids) for e in events] == [CHUNK, CHUNK, 8]
        assert events[2].parent_key == events[1].key
        for reader in (shared, tcp):
            assert reader.lookup(SPACE, handoff) == len(handoff), reader.transport
            hit, loaded = reader.retrieve(SPACE, handoff)
            assert hit == len(handoff) and same_bits(loaded, kv), reader.transport
            # A prompt going on past the tail, or stopping inside it, finds the whole chunks only.
            assert reader.lookup(SPACE, [*handoff, 1, 2, 3, 4, 5, 6, 7, 8]) == 2 * CHUNK
            assert reader.lookup(SPACE, handoff[:-4]) == 2 * CHUNK
        with shared.leased(SPACE, handoff) as lease:
            assert [(chunk.start, chunk.end) for chunk in lease.chunks] == [(0, 16), (16, 32), (32, 40)]
            assert same_bits(lease.chunks[2].kv, kv[:, :, 32:40])
    finally:
        server.close()


def test_a_client_uses_tcp_when_the_daemon_shares_no_memory(clients):
    server = start_daemon(1 << 20, shared_memory=False)
    try:
        auto = clients(server)
        assert auto.transport == "tcp"
        auto.store(SPACE, list(range(32)), any_bits_kv(32, seed=3))
        assert same_bits(auto.retrieve(SPACE, list(range(32)))[1], any_bits_kv(32, seed=3))
        with pytest.raises(StoreUnavailable, match="no shared memory with the daemon"):
            clients(server, "shm").store(SPACE, list(range(16)), any_bits_kv(16, seed=3))
    finally:
        server.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a host without CUDA")
def test_a_client_asked_to_register_the_pool_without_cuda_keeps_the_pageable_shared_path(clients):
    server = start_daemon(1 << 20)
    try:
        client = clients(server, register_with_cuda=True)
        assert client.transport == "shm" and not client.pool_registered_with_cuda
        kv = any_bits_kv(32, seed=8)
        assert client.store(SPACE, list(range(32)), kv)[0] == 32
        assert same_bits(client.retrieve(SPACE, list(range(32)))[1], kv)
    finally:
        server.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")
def test_a_pool_registered_with_cuda_moves_gpu_kv_in_and_out_bit_exact(clients):
    server = start_daemon(1 << 20)
    try:
        registered, plain = clients(server, register_with_cuda=True), clients(server)
        assert registered.pool_registered_with_cuda and not plain.pool_registered_with_cuda
        tokens, kv = list(range(64)), any_bits_kv(64, seed=9).cuda()
        # From the GPU straight into the pool; the unregistered client reads the same bytes.
        assert registered.store(SPACE, tokens, kv)[0] == 64
        assert same_bits(plain.retrieve(SPACE, tokens)[1], kv.cpu())
        # Leased chunks of a registered pool are page-locked memory: one DMA copy to the GPU.
        with registered.leased(SPACE, tokens) as lease:
            assert all(chunk.kv.is_pinned() for chunk in lease.chunks)
        out = torch.zeros(2, 2, 80, 16, dtype=torch.bfloat16, device="cuda")
        hit, view = registered.retrieve(SPACE, tokens, out=out)
        assert hit == 64 and view.data_ptr() == out.data_ptr() and same_bits(out[:, :, :64], kv)
    finally:
        server.close()


def test_a_reader_holding_a_lease_keeps_its_chunks_while_another_store_evicts(clients):
    server = start_daemon(6 * CHUNK_BYTES)  # room for 6 chunks
    try:
        writer_a, reader, writer_b = clients(server), clients(server), clients(server)
        a_tokens, a_kv = list(range(64)), any_bits_kv(64, seed=4)
        writer_a.store(SPACE, a_tokens, a_kv)
        with reader.leased(SPACE, a_tokens[:32]) as lease:
            assert lease.hit_tokens == 32
            # B's 4 chunks need 2 evictions: A's unleased chunks 3 and 4 go, the leased ones stay.
            held, events = writer_b.store(SPACE, list(range(500, 564)), any_bits_kv(64, seed=5))
            assert held == 64 and sum(e.kind == "removed" for e in events) == 2
            # More stores cycle the rest of the pool; the leased chunks are never chosen.
            for round_ in range(1, 4):
                tokens = list(range(1000 * round_, 1000 * round_ + 64))
                assert writer_b.store(SPACE, tokens, any_bits_kv(64, seed=10 + round_))[0] == 64
            assert writer_a.lookup(SPACE, a_tokens) == 32
            for chunk in lease.chunks:
                assert same_bits(chunk.kv, a_kv[:, :, chunk.start : chunk.end])
            assert server.metric_values()["cachelayer_daemon_open_leases"] == 1
        # The lease is over: A's chunks are evictable again, and a store of the whole pool reuses them.
        assert server.metric_values()["cachelayer_daemon_open_leases"] == 0
        assert writer_b.store(SPACE, list(range(9000, 9096)), any_bits_kv(96, seed=7))[0] == 96
        assert writer_a.lookup(SPACE, a_tokens) == 0
        assert server.metric_values()["cachelayer_daemon_l1_used_bytes"] <= 6 * CHUNK_BYTES
    finally:
        server.close()


def test_a_lease_that_outlives_its_ttl_is_ended_and_the_reader_discards_what_it_read(clients):
    server = start_daemon(2 * CHUNK_BYTES, lease_ttl_s=0.3)
    try:
        slow_reader, writer = clients(server), clients(server)
        writer.store(SPACE, list(range(16)), any_bits_kv(16, seed=8))
        with pytest.raises(LeaseExpired), slow_reader.leased(SPACE, list(range(16))) as lease:
            assert lease.hit_tokens == 16
            time.sleep(0.6)
            # The daemon ended the lease: the chunk can be evicted and its memory reused.
            assert writer.store(SPACE, list(range(100, 132)), any_bits_kv(32, seed=9))[0] == 32
        metrics = server.metric_values()
        assert metrics["cachelayer_daemon_expired_leases_total"] == 1
        assert metrics["cachelayer_daemon_open_leases"] == 0
        # A writer whose reservation expired is told so at commit; nothing of it is stored.
        with (
            pytest.raises(StoreUnavailable, match="expired"),
            writer.reserved(SPACE, list(range(300, 316))) as res,
        ):
            res.chunks[0].kv.fill_(1)
            time.sleep(0.6)
            # Expired, but its owner may still be writing: the space stays allocated meanwhile.
            metrics = server.metric_values()
            assert metrics["cachelayer_daemon_expired_leases_total"] == 2
            assert metrics["cachelayer_daemon_l1_used_bytes"] == 2 * CHUNK_BYTES
        assert writer.lookup(SPACE, list(range(300, 316))) == 0
        # Freed at the refused commit (the reservation had evicted one chunk of 100..132).
        assert server.metric_values()["cachelayer_daemon_l1_used_bytes"] == CHUNK_BYTES
    finally:
        server.close()


def _metrics(http_url: str) -> dict[str, float]:
    text = httpx.get(f"{http_url}/metrics", timeout=5).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}


def test_a_client_killed_mid_transfer_leaves_no_lease_and_no_memory_behind():
    port, http_port = free_port(), free_port()
    endpoint, http_url = f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
    daemon_args = [sys.executable, "-m", "cachelayer.cli", "server", "--host", "127.0.0.1",
                   "--port", str(port), "--http-port", str(http_port), "--chunk-size", str(CHUNK),
                   "--l1-size-gb", "0.001"]  # fmt: skip
    with ManagedProcess(daemon_args) as daemon:
        wait_for_http(f"{http_url}/healthcheck", daemon, timeout_s=60)
        with ManagedProcess(
            [sys.executable, "-m", "kvgate_testing.lease_holder", endpoint, str(CHUNK)]
        ) as holder:
            deadline = time.monotonic() + 30
            while "holding" not in holder.output():
                assert holder.alive() and time.monotonic() < deadline, holder.output()
                time.sleep(0.05)
            during = _metrics(http_url)
            assert during["cachelayer_daemon_open_leases"] == 2
            assert during["cachelayer_daemon_l1_used_bytes"] == 2 * CHUNK_BYTES  # stored + reserved
            holder.kill()
        deadline = time.monotonic() + 5
        while (after := _metrics(http_url))["cachelayer_daemon_open_leases"]:
            assert time.monotonic() < deadline, after
            time.sleep(0.05)
        assert after["cachelayer_daemon_reclaimed_leases_total"] == 2
        assert after["cachelayer_daemon_l1_used_bytes"] == CHUNK_BYTES  # the committed chunk only
        # The chunk the dead client was writing is not stuck "being written": another client stores it.
        client = StoreClient(endpoint, chunk_size=CHUNK, timeout_s=10)
        try:
            assert client.transport == "shm"
            holder_space = KeySpace(
                model="lease-holder", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8
            )
            tokens = list(range(CHUNK)) + [7] * CHUNK
            assert client.lookup(holder_space, tokens) == CHUNK
            kv = any_bits_kv(2 * CHUNK, seed=10)
            assert client.store(holder_space, tokens, kv)[0] == 2 * CHUNK
            assert same_bits(client.retrieve(holder_space, tokens)[1][:, :, CHUNK:], kv[:, :, CHUNK:])
        finally:
            client.close()


def test_a_block_that_raises_under_a_lease_releases_it_and_stores_nothing(clients):
    server = start_daemon(4 * CHUNK_BYTES)
    try:
        writer = clients(server)
        writer.store(SPACE, list(range(16)), any_bits_kv(16, seed=10))
        with pytest.raises(RuntimeError, match="copy broke"), writer.reserved(SPACE, list(range(500, 532))):
            raise RuntimeError("the copy broke")
        with pytest.raises(RuntimeError, match="read broke"), writer.leased(SPACE, list(range(16))):
            raise RuntimeError("the read broke")
        metrics = server.metric_values()
        assert metrics["cachelayer_daemon_open_leases"] == 0
        assert metrics["cachelayer_daemon_leases_total"] == 3
        assert writer.lookup(SPACE, list(range(500, 532))) == 0
        assert metrics["cachelayer_daemon_l1_used_bytes"] == CHUNK_BYTES  # the reservation's space is back
    finally:
        server.close()
