"""Per-tenant shares of the remote tier, on a real redis-server: a tenant past its share loses its
own oldest chunks (never another tenant's), across engines, and a tier of unknown size writes
nothing of a limited tenant rather than let it past its share."""

import logging

import pytest

from cachelayer.storage.remote_quota import index_keys
from kvgate_testing.cachelayer import CHUNK, CHUNK_BYTES, make_engine, request
from kvgate_testing.redis_server import RedisServer, running_redis

FAST = {"remote_timeout_s": 2.0, "remote_failure_threshold": 2, "remote_retry_after_s": 0.3}
# A remote tier of 10 raw chunks: "a" may hold 4 values (a value is a chunk plus its trailer), "b" 4.
QUOTAS = {
    "tenants": {"a": {"remote_share": 0.45}, "b": {"remote_share": 0.5}},
    "remote_size_gb": 10 * CHUNK_BYTES / 2**30,
}


def remote_engine(server: RedisServer, quotas=QUOTAS):
    return make_engine(64, remote_url=server.url, tenant_quotas=quotas, **FAST)


def held_in_redis(server: RedisServer, engine, tokens: list[int], salt: str | None) -> list[bool]:
    keys = [engine.remote.redis_key(span.key) for span in engine._spans(tokens, salt, None)]
    with server.client() as client:
        return [bool(client.exists(key)) for key in keys]


def store_and_flush(engine, seed: int, chunks: int, salt: str | None) -> list[int]:
    tokens, kv = request(seed, chunks)
    assert engine.store(tokens, kv, cache_salt=salt) == chunks * CHUNK
    assert engine.flush_remote(timeout_s=20)
    return tokens


@pytest.fixture
def redis_server():
    with running_redis() as server:
        yield server


def test_a_tenant_past_its_remote_share_loses_only_its_own_oldest_chunks(redis_server):
    with remote_engine(redis_server) as engine:
        b_prompts = [store_and_flush(engine, 100 + i, 1, "b:client") for i in range(4)]
        a_prompts = [store_and_flush(engine, 200 + i, 1, "a") for i in range(10)]
        assert [held_in_redis(redis_server, engine, tokens, "b:client") for tokens in b_prompts] == [
            [True]
        ] * 4
        assert [held_in_redis(redis_server, engine, tokens, "a")[0] for tokens in a_prompts] == [
            False
        ] * 6 + [True] * 4
        stats = engine.stats()
        # What the write removed, the engine retracted from its KV events.
        assert stats["remote_retracted_chunks"] == 6
        report = stats["remote_tenant_usage"]
        assert report["a"]["bytes"] <= report["a"]["cap_bytes"] < 5 * CHUNK_BYTES
        with redis_server.client() as client:
            order, sizes = index_keys("a")
            assert client.zcard(order) == 4
            assert int(client.hget(sizes, "")) == report["a"]["bytes"]


def test_a_chain_longer_than_the_share_keeps_its_head(redis_server):
    with remote_engine(redis_server) as engine:
        tokens = store_and_flush(engine, 300, 6, "a")
        # Within one batch the tail leaves first: the head stays a prefix hit.
        assert held_in_redis(redis_server, engine, tokens, "a") == [True] * 4 + [False] * 2


def test_the_share_holds_across_engines_writing_one_redis(redis_server):
    with remote_engine(redis_server) as first, remote_engine(redis_server) as second:
        older = [store_and_flush(first, 400 + i, 1, "a") for i in range(3)]
        newer = [store_and_flush(second, 410 + i, 1, "a:other-client") for i in range(3)]
        held = [held_in_redis(redis_server, first, tokens, "a")[0] for tokens in older]
        held += [held_in_redis(redis_server, second, tokens, "a:other-client")[0] for tokens in newer]
        assert held == [False, False, True, True, True, True]
        with redis_server.client() as client:
            assert client.zcard(index_keys("a")[0]) == 4


def test_unlimited_tenants_keep_no_index(redis_server):
    with remote_engine(redis_server) as engine:
        store_and_flush(engine, 500, 3, None)  # the shared tenant: share 1
        store_and_flush(engine, 501, 3, "unlisted")  # the default: share 1
        with redis_server.client() as client:
            assert client.keys("cachelayer:v1:tenant:*") == []
            assert len(client.keys("cachelayer:*")) == 6


def test_a_tier_of_unknown_size_writes_nothing_of_a_limited_tenant(redis_server, caplog):
    quotas = {"tenants": {"a": {"remote_share": 0.5}}}  # no remote_size_gb, and maxmemory is 0
    with caplog.at_level(logging.ERROR), remote_engine(redis_server, quotas) as engine:
        a_tokens = store_and_flush(engine, 600, 2, "a")
        shared = store_and_flush(engine, 601, 2, None)
        assert held_in_redis(redis_server, engine, a_tokens, "a") == [False, False]
        assert held_in_redis(redis_server, engine, shared, None) == [True, True]
        assert engine.stats()["remote_dropped_writes"] == 2
    assert "set tenant_quotas.remote_size_gb, or maxmemory on the server" in caplog.text


def test_the_tier_size_is_the_servers_maxmemory_when_not_configured():
    with running_redis("--maxmemory", "1048576") as server:
        quotas = {"tenants": {"a": {"remote_share": 0.25}}}
        with remote_engine(server, quotas) as engine:
            store_and_flush(engine, 700, 1, "a")
            assert engine.stats()["remote_tenant_usage"]["a"]["cap_bytes"] == 262144
