"""Per-tenant quotas of L1: a tenant past its share evicts only its own chunks, another tenant's
survive, free space is usable under the share, pins count against their tenant, and the books
always equal the pool's allocations (back to zero after a clear)."""

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from cachelayer.config import CacheLayerConfigError, parse_config
from cachelayer.server import KeySpace, StoreClient
from kvgate_testing.cachelayer import CHUNK, assert_no_leak, make_engine, request
from kvgate_testing.controller import controller_process, registered, wait_registered, worker_config
from kvgate_testing.ports import free_port
from kvgate_testing.processes import ManagedProcess, wait_for_http

REPO_ROOT = Path(__file__).resolve().parent.parent

# A pool of 20 chunks: tenant "a" may hold 6 (0.3), "b" 10 (0.5); the rest get 4 each (0.2).
POOL_CHUNKS = 20
QUOTAS = {
    "tenants": {"a": {"l1_share": 0.3}, "b": {"l1_share": 0.5}},
    "default": {"l1_share": 0.2},
}


def quota_engine(**config):
    return make_engine(POOL_CHUNKS, tenant_quotas=QUOTAS, **config)


def usage(engine) -> dict[str, dict[str, int]]:
    return engine.stats()["cpu_tenant_usage"]


def assert_books_balance(engine) -> None:
    """The tenants' bytes add up to exactly what the pool has allocated."""
    total = sum(row["bytes"] for row in usage(engine).values())
    assert total == engine.cpu.allocator.allocated_bytes


@pytest.mark.parametrize("cache_policy", ["LRU", "LFU", "FIFO"])
def test_a_tenant_past_its_share_evicts_only_its_own_oldest_chunks(cache_policy):
    engine = quota_engine(cache_policy=cache_policy)
    b_prompts = [request(100 + i, 2) for i in range(5)]  # 10 chunks: b's whole share
    for tokens, kv in b_prompts:
        assert engine.store(tokens, kv, cache_salt="b:client-1") == len(tokens)
    a_prompts = [request(200 + i, 2) for i in range(8)]  # 16 chunks for a share of 6
    for tokens, kv in a_prompts:
        assert engine.store(tokens, kv, cache_salt="a") == len(tokens)
        assert usage(engine)["a"]["chunks"] <= 6
    # Every one of b's chunks survived a's flood, bytes intact.
    for tokens, kv in b_prompts:
        hit, loaded = engine.retrieve(tokens, cache_salt="b:client-1")
        assert hit == len(tokens) and torch.equal(loaded, kv)
    # a kept its three most recent prompts; its oldest went.
    held = [engine.lookup(tokens, cache_salt="a") for tokens, _ in a_prompts]
    assert held == [0] * 5 + [2 * CHUNK] * 3
    a_row = usage(engine)["a"]
    assert (a_row["bytes"], a_row["chunks"]) == (6 * engine.layout.raw_nbytes(CHUNK), 6)
    assert (a_row["evicted_for_cap"], usage(engine)["b"]["evicted_for_cap"]) == (10, 0)
    assert engine.stats()["cpu_evicted_chunks"] == 10
    assert_books_balance(engine)
    assert_no_leak(engine)


def test_the_tenant_of_a_salt_is_its_part_before_the_first_colon():
    engine = quota_engine()
    for index, salt in enumerate(["a", "a:x", "a:y:z"]):
        tokens, kv = request(300 + index, 2)
        engine.store(tokens, kv, cache_salt=salt)
    # Three client salts of one tenant share its 6 chunks: the first prompt made room.
    assert usage(engine)["a"]["chunks"] == 6
    tokens, kv = request(310, 2)
    engine.store(tokens, kv, cache_salt="a:w")
    assert usage(engine)["a"]["chunks"] == 6
    assert engine.lookup(request(300, 2)[0], cache_salt="a") == 0


def test_tenants_under_their_share_use_free_space_and_unlisted_ones_are_counted_apart():
    engine = quota_engine()
    tokens, kv = request(400, 6)
    assert engine.store(tokens, kv, cache_salt="a") == 6 * CHUNK  # exactly its share, nothing evicted
    for index, tenant in enumerate(["c", "d"]):  # unlisted: 4 chunks each, on their own
        tokens, kv = request(410 + index, 4)
        assert engine.store(tokens, kv, cache_salt=tenant) == 4 * CHUNK
    tokens, kv = request(420, 3)
    assert engine.store(tokens, kv) == 3 * CHUNK  # no salt: the shared tenant (share 1.0)
    report = usage(engine)
    assert (report["a"]["chunks"], report["_other"]["chunks"], report["_shared"]["chunks"]) == (6, 8, 3)
    assert report["b"]["chunks"] == 0
    assert engine.stats()["cpu_evicted_chunks"] == 0
    assert_books_balance(engine)


def test_a_prompt_longer_than_the_share_stores_the_prefix_that_fits():
    engine = quota_engine()
    tokens, kv = request(500, 9)
    # Storing stops at the first chunk that does not fit: the prompt's own earlier chunks are still
    # being written (never evicted), so a's cap holds the first 6 and the rest is refused.
    held = engine.store(tokens, kv, cache_salt="a")
    assert held == 6 * CHUNK and usage(engine)["a"]["chunks"] == 6
    assert engine.lookup(tokens, cache_salt="a") == 6 * CHUNK
    assert_books_balance(engine)


def test_pinned_chunks_count_against_their_tenant_and_are_never_evicted_for_it():
    engine = quota_engine()
    pinned = [request(600 + i, 2) for i in range(3)]  # a's whole share, pinned
    for tokens, kv in pinned:
        engine.store(tokens, kv, cache_salt="a")
        assert engine.pin(tokens, cache_salt="a") == len(tokens)
    tokens, kv = request(610, 2)
    assert engine.store(tokens, kv, cache_salt="a") == 0  # refused: nothing of a's may leave
    assert engine.stats()["cpu_tenant_refused_chunks"] == 1
    assert (usage(engine)["a"]["refused"], usage(engine)["b"]["refused"]) == (1, 0)
    b_tokens, b_kv = request(611, 2)
    assert engine.store(b_tokens, b_kv, cache_salt="b") == 2 * CHUNK  # b is not held back by a's pins
    for tokens_pinned, _ in pinned:
        assert engine.lookup(tokens_pinned, cache_salt="a") == 2 * CHUNK
    engine.unpin(pinned[0][0], cache_salt="a")
    assert engine.store(tokens, kv, cache_salt="a") == 2 * CHUNK  # the unpinned prompt made room
    assert engine.lookup(pinned[0][0], cache_salt="a") == 0
    assert engine.lookup(pinned[1][0], cache_salt="a") == 2 * CHUNK
    assert_books_balance(engine)


def test_chunks_being_written_count_and_are_not_evicted_for_their_tenant():
    engine = quota_engine()
    tokens, _ = request(700, 6)
    reservation = engine.reserve_chunks(tokens, cache_salt="a")  # a's whole share, uncommitted
    assert usage(engine)["a"]["chunks"] == 6
    other, other_kv = request(701, 1)
    assert engine.store(other, other_kv, cache_salt="a") == 0
    engine.commit_chunks(reservation)
    assert engine.store(other, other_kv, cache_salt="a") == CHUNK  # committed: now evictable
    assert_books_balance(engine)
    assert_no_leak(engine)


def test_a_reader_holding_an_evicted_chunk_keeps_its_bytes_counted_until_it_lets_go():
    engine = quota_engine()
    tokens, kv = request(800, 6)
    engine.store(tokens, kv, cache_salt="a")
    first = engine.cpu.get(engine._spans(tokens, "a", None)[0].key)
    with engine._lock:
        engine.cpu.acquire(first)  # a reader mid-copy
    newer, newer_kv = request(801, 1)
    # The held chunk cannot make room; the next oldest does.
    assert engine.store(newer, newer_kv, cache_salt="a") == CHUNK
    assert engine.cpu.get(first.meta.key) is first
    engine.clear()
    assert usage(engine)["a"]["chunks"] == 1  # removed, but its space is the reader's until released
    with engine._lock:
        engine.cpu.release(first)
    assert all(row["bytes"] == 0 and row["chunks"] == 0 for row in usage(engine).values())
    assert engine.cpu.allocator.allocated_bytes == 0


def test_books_follow_move_compress_clear_and_return_to_zero(tmp_path):
    engine = quota_engine(local_disk=str(tmp_path), max_local_disk_size=0.01)
    a_tokens, a_kv = request(900, 3)
    b_tokens, b_kv = request(901, 2)
    engine.store(a_tokens, a_kv, cache_salt="a")
    engine.store(b_tokens, b_kv, cache_salt="b")
    engine.flush()
    assert engine.move(a_tokens, "cpu", "disk", cache_salt="a") == 3 * CHUNK
    assert "a" not in {name for name, row in usage(engine).items() if row["chunks"]}
    assert engine.retrieve(a_tokens, cache_salt="a")[0] == 3 * CHUNK  # promoted back, counted as a's
    assert usage(engine)["a"]["chunks"] == 3
    assert engine.compress(b_tokens, "naive", cache_salt="b") == 2 * CHUNK
    assert usage(engine)["b"]["chunks"] == 2  # the re-encoded chunks replaced the raw ones
    assert_books_balance(engine)
    engine.clear("cpu")
    assert all(row["bytes"] == 0 for row in usage(engine).values())
    engine.retrieve(b_tokens, cache_salt="b")  # from disk again
    assert usage(engine)["b"]["chunks"] == 2
    engine.clear()
    assert all(row["bytes"] == 0 and row["chunks"] == 0 for row in usage(engine).values())
    assert engine.cpu.allocator.allocated_bytes == 0
    assert_no_leak(engine)


def test_usage_reports_configured_tenants_only_and_sums_the_rest():
    engine = quota_engine()
    for index in range(30):  # thirty invented tenants: one label for them all
        tokens, kv = request(1000 + index, 1)
        engine.store(tokens, kv, cache_salt=f"invented-{index}")
    assert set(usage(engine)) == {"_shared", "a", "b", "_other"}
    assert usage(engine)["_other"]["chunks"] == POOL_CHUNKS


def test_without_quotas_nothing_is_counted():
    engine = make_engine(4)
    tokens, kv = request(1100, 2)
    engine.store(tokens, kv, cache_salt="a")
    assert "cpu_tenant_usage" not in engine.stats()
    assert engine.cpu.ledger is None


@pytest.mark.parametrize(
    ("quotas", "message"),
    [
        ({"tenants": {"a:b": {"l1_share": 0.5}}}, "before the first ':'"),
        ({"tenants": {"": {"l1_share": 0.5}}}, "non-empty"),
        ({"tenants": {"_other": {"l1_share": 0.5}}}, "reserved"),
        ({"tenants": {"a": {"l1_share": 1.5}}}, r"tenants\[...\].l1_share`: Expected `float` <= 1.0"),
        ({"tenants": {"a": {"l1_share": 0}}}, r"Expected `float` > 0"),
        ({"tenants": {"a": {"l1_shares": 0.5}}}, "unknown field `l1_shares`"),
        ({"default": {"remote_share": -1}}, r"tenant_quotas.default.remote_share"),
        ({"remote_size_gb": 0}, "remote_size_gb"),
    ],
)
def test_a_bad_quota_configuration_is_refused_naming_the_key(quotas, message):
    with pytest.raises(CacheLayerConfigError, match=message) as refused:
        parse_config({"tenant_quotas": quotas}, source="cache.yaml")
    assert "cache.yaml" in str(refused.value)


# ---- the shared daemon (`cachelayer server --tenant-quotas FILE`), a real process ----


def _metric(text: str, name: str, tenant: str) -> float:
    prefix = f'{name}{{tenant="{tenant}"}} '
    return float(next(line for line in text.splitlines() if line.startswith(prefix))[len(prefix) :])


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_the_daemon_holds_each_tenant_to_its_share_of_its_one_pool(tmp_path, transport):
    quotas = tmp_path / "quotas.yaml"
    quotas.write_text("tenants:\n  a: {l1_share: 0.25}\n  b: {l1_share: 0.5}\ndefault: {l1_share: 0.1}\n")
    port, http_port = free_port(), free_port()
    chunk = 256
    space = KeySpace(model="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=64)
    chunk_bytes = 2 * 2 * chunk * 128 * 2  # 256 KiB
    pool_gb = 16 * chunk_bytes / (1 << 30)  # 16 chunks: a may hold 4, b 8
    args = [sys.executable, "-m", "cachelayer.cli", "server", "--host", "127.0.0.1", "--port", str(port),
            "--http-port", str(http_port), "--chunk-size", str(chunk), "--l1-size-gb", str(pool_gb),
            "--tenant-quotas", str(quotas)]  # fmt: skip
    if transport == "tcp":
        args.append("--no-shared-memory")
    generator = torch.Generator().manual_seed(5)

    def prompt(seed: int) -> tuple[list[int], torch.Tensor]:
        tokens = list(range(seed * 10_000, seed * 10_000 + 2 * chunk))
        return tokens, torch.randn(2, 2, 2 * chunk, 128, generator=generator).to(torch.bfloat16)

    with ManagedProcess(args) as process:
        wait_for_http(f"http://127.0.0.1:{http_port}/healthcheck", process, timeout_s=60)
        engine_of_b = StoreClient(f"tcp://127.0.0.1:{port}", chunk_size=chunk, timeout_s=30)
        engine_of_a = StoreClient(f"tcp://127.0.0.1:{port}", chunk_size=chunk, timeout_s=30)
        try:
            # Same-host stores write the shared pool under leases; --no-shared-memory sends the KV.
            assert engine_of_a.transport == transport
            b_prompts = [prompt(seed) for seed in range(4)]  # 8 chunks: b's share
            for tokens, kv in b_prompts:
                assert engine_of_b.store(space, tokens, kv, cache_salt="b:user-7")[0] == 2 * chunk
            for seed in range(10, 18):  # 16 chunks of a, share 4
                tokens, kv = prompt(seed)
                assert engine_of_a.store(space, tokens, kv, cache_salt="a")[0] == 2 * chunk
            for tokens, kv in b_prompts:
                hit, loaded = engine_of_b.retrieve(space, tokens, cache_salt="b:user-7")
                assert hit == 2 * chunk and torch.equal(loaded, kv)
            assert [engine_of_a.lookup(space, prompt(seed)[0], cache_salt="a") for seed in range(10, 18)] == [
                0
            ] * 6 + [2 * chunk] * 2
            metrics = httpx.get(f"http://127.0.0.1:{http_port}/metrics").text
        finally:
            engine_of_a.close()
            engine_of_b.close()
    assert _metric(metrics, "cachelayer_tenant_l1_chunks", "a") == 4
    assert _metric(metrics, "cachelayer_tenant_l1_chunks", "b") == 8
    assert _metric(metrics, "cachelayer_tenant_l1_used_bytes", "b") == 8 * chunk_bytes
    assert _metric(metrics, "cachelayer_tenant_l1_cap_bytes", "a") == 4 * chunk_bytes
    assert _metric(metrics, "cachelayer_tenant_l1_chunks", "_other") == 0
    assert _metric(metrics, "cachelayer_tenant_l1_evicted_for_cap_total", "a") == 12
    assert _metric(metrics, "cachelayer_tenant_l1_evicted_for_cap_total", "b") == 0


def test_the_daemon_refuses_a_bad_quota_file_naming_it_and_the_key(tmp_path):
    quotas = tmp_path / "quotas.yaml"
    quotas.write_text("tenants:\n  a: {l1_share: 2}\n")
    refused = subprocess.run(
        [sys.executable, "-m", "cachelayer.cli", "server", "--port", "0", "--http-port", "0",
         "--tenant-quotas", str(quotas)],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )  # fmt: skip
    assert refused.returncode == 2
    assert str(quotas) in refused.stdout and "l1_share" in refused.stdout and "<= 1.0" in refused.stdout


# ---- the controller API (a real `cachelayer controller` process) ----


def test_the_controller_reports_each_workers_usage_by_configured_tenant():
    with controller_process() as (url, monitor_port), httpx.Client(base_url=url, timeout=10) as client:
        engine = registered(
            make_engine(POOL_CHUNKS, tenant_quotas=QUOTAS, **worker_config(monitor_port, "quota"))
        )
        plain = registered(make_engine(4, **worker_config(monitor_port, "no-quota")))
        try:
            wait_registered(client, "quota", 1)
            wait_registered(client, "no-quota", 1)
            for seed, salt in ((1, "a"), (2, "b:x"), (3, "invented")):
                tokens, kv = request(seed, 2)
                engine.store(tokens, kv, cache_salt=salt)
            answer = client.post("/tenant_usage", json={"instance_id": "quota"}).json()
            l1 = answer["tenant_usage"]["0"]["l1"]
            assert {label: row["chunks"] for label, row in l1.items()} == {
                "_shared": 0,
                "a": 2,
                "b": 2,
                "_other": 2,
            }
            assert l1["a"]["cap_bytes"] == usage(engine)["a"]["cap_bytes"]
            assert answer["tenant_usage"]["0"]["remote"] is None  # no remote tier
            without = client.post("/tenant_usage", json={"instance_id": "no-quota"}).json()
            assert without["tenant_usage"]["0"] == {"l1": None, "remote": None}
            missing = client.post("/tenant_usage", json={"instance_id": "nobody"})
            assert missing.status_code == 404 and "nobody" in missing.json()["detail"]
        finally:
            engine.close()
            plain.close()
