"""The shared cache daemon over real ZMQ and HTTP: store, lookup, retrieve, identity, metrics, errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import pytest
import torch
import zmq

from cachelayer.config import parse_config
from cachelayer.server import KeySpace, StoreClient, StoreServer, StoreUnavailable
from cachelayer.server.daemon import start_http
from kvgate_testing.ports import free_port
from kvgate_testing.processes import ManagedProcess, wait_for_http

CHUNK = 16
SPACE = KeySpace(
    model="m@rev|block_size=16|layout=x", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8
)


def make_kv(num_tokens: int, seed: int = 0, space: KeySpace = SPACE) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    channels = space.num_kv_heads * space.head_dim
    return torch.randn(space.num_layers, 2, num_tokens, channels, generator=generator).to(torch.bfloat16)


@pytest.fixture(params=["tcp", "shared-memory"])
def daemon(request):
    """The daemon, without and with its shared-memory path (its clients pick the path on their own)."""
    config = parse_config({"chunk_size": CHUNK, "max_local_cpu_size": 0.001, "save_unfull_chunk": True})
    server = StoreServer(config, "tcp://127.0.0.1:0", shared_memory=request.param == "shared-memory").start()
    http = start_http(server, "127.0.0.1", 0)
    yield server, f"http://127.0.0.1:{http.server_address[1]}"
    http.shutdown()
    server.close()


@pytest.fixture
def client(daemon):
    server, _ = daemon
    client = StoreClient(server.endpoint, chunk_size=CHUNK, timeout_s=5)
    yield client
    client.close()


def test_store_then_lookup_and_retrieve_return_the_same_tensor(client):
    tokens = list(range(100, 148))  # 3 chunks
    kv = make_kv(48)
    held, events = client.store(SPACE, tokens, kv)
    assert held == 48
    assert [event.kind for event in events] == ["stored"] * 3
    assert events[0].token_ids == tokens[:CHUNK] and events[1].parent_key == events[0].key

    assert client.lookup(SPACE, tokens) == 48
    assert client.lookup(SPACE, [*tokens[:40], 9, 9, 9, 9, 9, 9, 9, 9]) == 32  # diverges in chunk 3
    hit, loaded = client.retrieve(SPACE, tokens)
    assert hit == 48
    assert torch.equal(loaded, kv)


def test_a_second_store_of_held_chunks_reports_no_new_chunks(client):
    tokens = list(range(32))
    client.store(SPACE, tokens, make_kv(32))
    held, events = client.store(SPACE, tokens, make_kv(32, seed=1))
    assert held == 32 and events == []


@pytest.mark.parametrize(
    "other",
    [
        KeySpace(
            model="m@other-rev|block_size=16|layout=x",
            dtype="bfloat16",
            num_layers=2,
            num_kv_heads=2,
            head_dim=8,
        ),
        KeySpace(
            model="m@rev|block_size=32|layout=x", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8
        ),
        KeySpace(
            model="m@rev|block_size=16|layout=x", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8
        ),
        KeySpace(
            model="m@rev|block_size=16|layout=x",
            dtype="bfloat16",
            world_size=2,
            num_layers=2,
            num_kv_heads=2,
            head_dim=8,
        ),
    ],
    ids=["revision", "block-size", "kv-dtype", "tp-size"],
)
def test_a_different_key_space_is_a_miss(client, other):
    tokens = list(range(32))
    client.store(SPACE, tokens, make_kv(32))
    assert client.lookup(other, tokens) == 0
    assert client.retrieve(other, tokens) == (0, None)


def test_cache_salt_isolates_entries(client, daemon):
    server, _ = daemon
    tokens = list(range(32))
    client.store(SPACE, tokens, make_kv(32), cache_salt="alice")
    assert client.lookup(SPACE, tokens) == 0
    assert client.lookup(SPACE, tokens, cache_salt="bob") == 0
    reads_before = server.metric_values()["lmcache_mp_l1_read_chunks_total"]
    assert client.retrieve(SPACE, tokens, cache_salt="bob") == (0, None)
    assert server.metric_values()["lmcache_mp_l1_read_chunks_total"] == reads_before
    assert client.retrieve(SPACE, tokens, cache_salt="alice")[0] == 32


def test_a_client_with_another_chunk_size_is_refused_with_the_fix(daemon):
    server, _ = daemon
    other = StoreClient(server.endpoint, chunk_size=CHUNK * 2, timeout_s=5)
    try:
        with pytest.raises(
            StoreUnavailable, match=r"chunk size 32 differs from the daemon's 16.*--chunk-size"
        ):
            other.lookup(SPACE, list(range(64)))
    finally:
        other.close()


def test_malformed_requests_get_an_error_and_the_daemon_keeps_serving(daemon, client):
    server, _ = daemon
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(server.endpoint)
    try:
        socket.send_multipart([b"", b"\xc1 not msgpack"])
        assert socket.poll(5000)
        reply = socket.recv_multipart()
        assert b"ok" in reply[1] and b"error" in reply[1]
    finally:
        socket.close(linger=0)
    # A store whose payload does not match its tokens is refused, nothing is stored.
    with pytest.raises(StoreUnavailable, match="KV payload has"):
        client.store(SPACE, list(range(32)), make_kv(16))
    assert client.lookup(SPACE, list(range(32))) == 0
    client.store(SPACE, list(range(16)), make_kv(16))
    assert client.lookup(SPACE, list(range(16))) == 16


def test_an_unreachable_daemon_times_out_with_a_clear_error():
    client = StoreClient(f"tcp://127.0.0.1:{free_port()}", chunk_size=CHUNK, timeout_s=0.2)
    try:
        with pytest.raises(StoreUnavailable, match="did not answer lookup within 200 ms"):
            client.lookup(SPACE, list(range(16)))
    finally:
        client.close()


def test_metrics_use_lmcache_names_and_count_reads_writes_evictions(daemon, client):
    _, http_url = daemon
    # About 1 MiB of L1, 2 KiB per chunk (2 layers x 2 x 16 tokens x 16 channels x 2 bytes): the
    # second prompt of 400 chunks must evict most of the first.
    tokens = list(range(16 * 400))
    client.store(SPACE, tokens, make_kv(len(tokens)))
    client.store(SPACE, [t + 1_000_000 for t in tokens], make_kv(len(tokens), seed=1))
    client.retrieve(SPACE, tokens[:32])
    client.lookup(SPACE, tokens[:64])
    assert httpx.get(f"{http_url}/healthcheck").status_code == 200
    text = httpx.get(f"{http_url}/metrics").text
    values = {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")
    }
    assert set(values) == {
        "lmcache_mp_l1_read_chunks_total",
        "lmcache_mp_l1_write_chunks_total",
        "lmcache_mp_l1_evicted_chunks_total",
        "lmcache_mp_l1_usage_ratio",
        "lmcache_mp_lookup_requested_tokens_total",
        "lmcache_mp_lookup_hit_tokens_total",
        "cachelayer_daemon_l1_used_bytes",
        "cachelayer_daemon_open_leases",
        "cachelayer_daemon_leases_total",
        "cachelayer_daemon_expired_leases_total",
        "cachelayer_daemon_reclaimed_leases_total",
    }
    assert values["lmcache_mp_l1_write_chunks_total"] > 0
    assert values["lmcache_mp_l1_evicted_chunks_total"] > 0
    assert values["lmcache_mp_l1_read_chunks_total"] >= 0
    assert 0 < values["lmcache_mp_l1_usage_ratio"] <= 1
    assert values["lmcache_mp_lookup_requested_tokens_total"] == 64
    assert "# TYPE lmcache_mp_l1_read_chunks_total counter" in text


def test_the_cachelayer_server_command_serves_healthcheck_and_the_data_plane():
    port, http_port = free_port(), free_port()
    args = [sys.executable, "-m", "cachelayer.cli", "server", "--host", "127.0.0.1", "--port", str(port),
            "--http-port", str(http_port), "--chunk-size", "256", "--l1-size-gb", "0.01",
            "--eviction-policy", "LRU"]  # fmt: skip
    with ManagedProcess(args) as process:
        wait_for_http(f"http://127.0.0.1:{http_port}/healthcheck", process, timeout_s=60)
        client = StoreClient(f"tcp://127.0.0.1:{port}", chunk_size=256, timeout_s=10)
        try:
            assert client.hello() == 256
            client.store(SPACE, list(range(256)), make_kv(256))
            assert client.lookup(SPACE, list(range(300))) == 256
            # A handoff's tail chunk (fewer tokens than a chunk) is kept for its exact prefix.
            assert client.store(SPACE, list(range(288)), make_kv(288))[0] == 288
            assert client.lookup(SPACE, list(range(288))) == 288
            assert client.lookup(SPACE, list(range(300))) == 256
        finally:
            client.close()
    bad_flags = ["--chunk-size", "0", "--port", "0", "--http-port", "0"]
    bad = subprocess.run(
        [sys.executable, "-m", "cachelayer.cli", "server", *bad_flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "chunk_size" in bad.stdout


def _resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_the_l1_budget_bounds_the_daemon_over_every_key_space_clients_invent():
    """Issue 21 item 12: eight invented model names, each storing a full budget's worth of KV,
    must not grow a real `cachelayer server` past one budget (it grew by one budget per name)."""
    port, http_port = free_port(), free_port()
    budget_gb = 0.016  # ~16 MiB of L1 in total
    args = [sys.executable, "-m", "cachelayer.cli", "server", "--host", "127.0.0.1", "--port", str(port),
            "--http-port", str(http_port), "--chunk-size", "256", "--l1-size-gb", str(budget_gb)]  # fmt: skip
    space = KeySpace(model="m", dtype="bfloat16", num_layers=4, num_kv_heads=8, head_dim=128)
    tokens_per_store = 2048  # 4 layers x 2 x 2048 x 1024 channels x 2 bytes = 32 MiB > the budget
    with ManagedProcess(args) as process:
        wait_for_http(f"http://127.0.0.1:{http_port}/healthcheck", process, timeout_s=60)
        client = StoreClient(f"tcp://127.0.0.1:{port}", chunk_size=256, timeout_s=30)
        try:
            warm = KeySpace(**{**msgspec.structs.asdict(space), "model": "warm-up"})
            client.store(warm, list(range(256)), make_kv(256, space=warm))
            baseline = _resident_bytes(process.pid)
            kv = make_kv(tokens_per_store, space=space)
            for index in range(8):
                invented = KeySpace(**{**msgspec.structs.asdict(space), "model": f"invented-{index}"})
                held, _ = client.store(invented, list(range(tokens_per_store)), kv)
                assert held > 0
            grown = _resident_bytes(process.pid) - baseline
            usage = httpx.get(f"http://127.0.0.1:{http_port}/metrics").text
        finally:
            client.close()
    budget_bytes = budget_gb * (1 << 30)
    # One budget of KV plus the transient receive buffers of one store; eight budgets before the fix.
    assert grown < 3 * budget_bytes + 32 * (1 << 20), f"daemon grew by {grown / (1 << 20):.0f} MiB"
    values = {line.split()[0]: float(line.split()[1]) for line in usage.splitlines() if line[0] != "#"}
    assert values["lmcache_mp_l1_evicted_chunks_total"] > 0  # the stores competed for one pool
    assert values["lmcache_mp_l1_usage_ratio"] <= 1


def test_the_forgetful_test_daemon_stores_and_answers_every_read_as_a_miss():
    """kvgate_testing.forgetful_daemon (the real-engine tests' lost-chunk daemon) still plugs into the
    serving loop: it stores and answers lookups, and every retrieve is a miss."""
    from kvgate_testing.forgetful_daemon import ForgetfulStoreServer

    config = parse_config({"chunk_size": CHUNK, "max_local_cpu_size": 0.001, "save_unfull_chunk": True})
    server = ForgetfulStoreServer(config, "tcp://127.0.0.1:0").start()
    client = StoreClient(server.endpoint, chunk_size=CHUNK, timeout_s=5, transport="tcp")
    try:
        assert client.store(SPACE, list(range(32)), make_kv(32))[0] == 32
        assert client.lookup(SPACE, list(range(32))) == 32
        assert client.retrieve(SPACE, list(range(32))) == (0, None)
    finally:
        client.close()
        server.close()
