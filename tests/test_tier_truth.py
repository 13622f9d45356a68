"""Every tier's truth reaches the router: what Redis loses (evicted under maxmemory, expired) is
retracted in the engine's KV events and leaves the router's index, over a real redis-server and real
ZMQ; a one-medium clear (a restarted shared daemon) empties that medium only."""

from __future__ import annotations

import functools
import time

import pytest

from kvgate_testing import waiting
from kvgate_testing.cachelayer import make_engine, request
from kvgate_testing.redis_server import running_redis
from kvwire import AllBlocksCleared, BlockRemoved, BlockStored, EventPublisher
from router.config import KVEvents
from router.index.service import KVIndexService

wait_for = functools.partial(waiting.wait_for, timeout_s=30.0)
FAST = {"remote_timeout_s": 0.5, "remote_failure_threshold": 2, "remote_retry_after_s": 0.3}


def subscribed_index(publisher: EventPublisher, name: str = "cache-a") -> KVIndexService:
    service = KVIndexService(replay_timeout_s=1.0)
    service.add_backend(
        name, KVEvents(endpoint=publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
    )
    service.start()

    def subscribed():  # PUB/SUB drops what is sent before the subscription lands
        publisher.publish([])
        return service.status()[name]["last_seq"] is not None

    wait_for(subscribed)
    return service


def engine_with_events(redis_url: str, **config):
    return make_engine(
        64,
        remote_url=redis_url,
        enable_kv_events=True,
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
        **{**FAST, **config},
    )


def remote_prefix(service: KVIndexService, tokens: list[int]) -> int:
    return service.longest_cached_prefix(tokens)["cache-a"].by_tier.get("remote", 0)


def chunk_keys(engine, tokens: list[int]) -> list[bytes]:
    return [engine.remote.redis_key(span.key).encode() for span in engine._spans(tokens, None, None)]


def held_prefix_in_redis(client, keys: list[bytes]) -> int:
    present = [bool(client.exists(key)) for key in keys]
    return next((index for index, held in enumerate(present) if not held), len(present))


def test_keys_evicted_under_maxmemory_reach_the_router_as_removals_of_the_remote_medium():
    with running_redis("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru") as server:
        engine = engine_with_events(server.url, remote_reconcile_interval_s=0.2)
        service = subscribed_index(engine.publisher)
        try:
            tokens, kv = request(1, 3)
            assert engine.store(tokens, kv) == len(tokens)
            assert engine.flush_remote(timeout_s=20)
            wait_for(lambda: remote_prefix(service, tokens) == len(tokens))
            keys = chunk_keys(engine, tokens)
            with server.client() as client:
                assert held_prefix_in_redis(client, keys) == 3
                # Other writers fill Redis past maxmemory until LRU has evicted the prompt's chunks.
                filler = b"x" * 16384
                for round_number in range(200):
                    with client.pipeline(transaction=False) as pipe:
                        for index in range(64):
                            pipe.set(f"filler:{round_number}:{index}", filler)
                        pipe.execute()
                    if not any(client.exists(key) for key in keys):
                        break
                assert not any(client.exists(key) for key in keys), "LRU never evicted the prompt"
                assert int(client.info("stats")["evicted_keys"]) > 0
            # Each of the three is retracted (some may have gone, and been retracted, while filling).
            wait_for(lambda: engine.stats()["remote_retracted_chunks"] == 3)
            assert engine.stats()["remote_announced_chunks"] == 0
            wait_for(lambda: remote_prefix(service, tokens) == 0)
            # Retracted as removals of that medium, in the engine's own stream (seq-numbered).
            assert service.status()["cache-a"]["ranks"][0]["events"]["BlockRemoved"] >= 1
            # The CPU tier still holds the prompt: only the remote medium lost it.
            assert service.longest_cached_prefix(tokens)["cache-a"].by_tier.get("cpu") == len(tokens)
        finally:
            service.stop()
            engine.close()


def test_an_expired_key_is_retracted_by_its_keyspace_notification():
    # Reconciliation off: only the notification can tell the engine.
    with running_redis("--notify-keyspace-events", "Exeg") as server:
        engine = engine_with_events(
            server.url, remote_reconcile_interval_s=0, remote_eviction_notifications=True
        )
        service = subscribed_index(engine.publisher)
        try:
            wait_for(lambda: engine.remote_truth.counters.subscriptions >= 1)
            tokens, kv = request(2, 3)
            engine.store(tokens, kv)
            assert engine.flush_remote(timeout_s=20)
            wait_for(lambda: remote_prefix(service, tokens) == len(tokens))
            keys = chunk_keys(engine, tokens)
            with server.client() as client:
                client.pexpire(keys[1], 1)  # the second chunk expires: the prefix ends after the first
                wait_for(lambda: not client.exists(keys[1]))
            wait_for(lambda: remote_prefix(service, tokens) == len(tokens) // 3)
            assert engine.stats()["remote_retracted_by_notification"] == 1
            assert engine.remote_truth.counters.reconciliations <= 1  # the one after subscribing
        finally:
            service.stop()
            engine.close()


def test_without_reconciliation_or_notifications_the_router_keeps_crediting_what_redis_lost():
    """The behaviour before this work, kept as the off switch: nothing retracts an evicted chunk."""
    with running_redis() as server:
        engine = engine_with_events(server.url, remote_reconcile_interval_s=0)
        service = subscribed_index(engine.publisher)
        try:
            tokens, kv = request(3, 2)
            engine.store(tokens, kv)
            assert engine.flush_remote(timeout_s=20)
            wait_for(lambda: remote_prefix(service, tokens) == len(tokens))
            with server.client() as client:
                client.flushall()
            time.sleep(1.0)  # long enough for a reconciliation, were one running
            assert remote_prefix(service, tokens) == len(tokens)
            assert engine.remote_truth.reconcile() == 2  # asked by hand, it finds both lost
            wait_for(lambda: remote_prefix(service, tokens) == 0)
        finally:
            service.stop()
            engine.close()


def test_a_chunk_written_back_after_an_eviction_is_not_retracted_by_a_stale_look():
    with running_redis() as server:
        engine = engine_with_events(server.url, remote_reconcile_interval_s=0)
        try:
            tokens, kv = request(4, 1)
            engine.store(tokens, kv)
            assert engine.flush_remote(timeout_s=20)
            key = engine._spans(tokens, None, None)[0].key
            truth = engine.remote_truth
            ask_redis = engine.remote.missing

            def evicted_then_written_back(keys):
                # The look finds the chunk evicted; before it is retracted, the writer puts it back
                # and the engine announces it again.
                with engine._lock:
                    truth.announced([key])
                return [key]

            engine.remote.missing = evicted_then_written_back
            assert truth.reconcile() == 0  # announced since the look: not retracted
            assert truth.announced_chunks == 1
            engine.remote.missing = ask_redis
            assert held_in_redis(server, engine, key)
        finally:
            engine.close()


def held_in_redis(server, engine, key) -> bool:
    with server.client() as client:
        return bool(client.exists(engine.remote.redis_key(key)))


@pytest.mark.parametrize("encoding", ["vllm", "vllm-array"])
def test_a_one_medium_clear_empties_that_medium_only(encoding):
    publisher = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", encoding=encoding, buffer_steps=100)
    service = subscribed_index(publisher)
    try:
        tokens = list(range(1, 33))
        for medium, first_hash in (("GPU", 1), ("SHARED", 101)):
            publisher.publish(
                [
                    BlockStored(
                        block_hashes=[first_hash, first_hash + 1],
                        token_ids=tokens,
                        block_size=16,
                        medium=medium,
                    )
                ]
            )

        def tiers():
            return service.longest_cached_prefix(tokens)["cache-a"].by_tier

        wait_for(lambda: tiers().get("gpu") == 32 and tiers().get("shared") == 32)
        publisher.publish([AllBlocksCleared(medium="SHARED")])  # the daemon restarted
        wait_for(lambda: tiers().get("shared", 0) == 0)
        assert tiers().get("gpu") == 32
        publisher.publish([AllBlocksCleared()])  # a whole clear still empties everything
        wait_for(lambda: service.longest_cached_prefix(tokens)["cache-a"].tokens == 0)
    finally:
        service.stop()
        publisher.close()


@pytest.mark.slow  # two daemon starts: ~20 s each on a loaded 2-core machine
def test_a_restarted_daemon_is_seen_by_its_client_as_an_emptied_store():
    """What the connector turns into AllBlocksCleared(medium="SHARED") for its engine's stream."""
    from cachelayer.server.client import StoreClient, StoreUnavailable
    from kvgate_testing.daemon import running_daemon
    from kvgate_testing.ports import free_port

    port, http_port = free_port(), free_port()
    client = StoreClient(f"tcp://127.0.0.1:{port}", chunk_size=16, timeout_s=2, transport="tcp")
    try:
        with running_daemon(port=port, http_port=http_port):
            assert client.hello() == 16
            assert client.hello() == 16
            assert client.take_restarts() == 0  # the first daemon seen is no restart
        with running_daemon(port=port, http_port=http_port):

            def answered():
                try:
                    return client.hello() == 16
                except StoreUnavailable:
                    return False

            wait_for(answered)
            assert client.take_restarts() == 1
            assert client.take_restarts() == 0  # told once
    finally:
        client.close()


@pytest.mark.parametrize("encoding", ["vllm", "vllm-array"])
def test_a_shared_tier_removal_reported_by_one_member_leaves_every_member(encoding):
    """The daemon's eviction caused by b's store is reported by b; a, which stored the chunk, loses it."""
    from router.config import SharedTier

    publishers = {
        name: EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", encoding=encoding) for name in "abc"
    }
    service = KVIndexService(replay_timeout_s=1.0)
    service.share_removals([SharedTier(name="shared", backends=["a", "b"])])
    try:
        for name, publisher in publishers.items():
            service.add_backend(
                name, KVEvents(endpoint=publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
            )
        service.start()

        def subscribed():
            for publisher in publishers.values():
                publisher.publish([])
            return all(service.status()[name]["last_seq"] is not None for name in publishers)

        wait_for(subscribed)
        tokens = list(range(1, 33))
        stored = BlockStored(block_hashes=[101, 102], token_ids=tokens, block_size=16, medium="SHARED")
        publishers["a"].publish([stored])
        publishers["c"].publish([stored])  # c is no member: its copy is its own

        def shared(name):
            return service.longest_cached_prefix(tokens)[name].by_tier.get("shared", 0)

        wait_for(lambda: shared("a") == 32 and shared("c") == 32)
        publishers["b"].publish([BlockRemoved(block_hashes=[102], medium="SHARED")])
        wait_for(lambda: shared("a") == 16)
        publishers["c"].publish([BlockRemoved(block_hashes=[101], medium="SHARED")])
        wait_for(lambda: shared("c") == 0)
        assert shared("a") == 16  # a removal from a non-member reaches no member
    finally:
        service.stop()
        for publisher in publishers.values():
            publisher.close()


@pytest.mark.real_engine
def test_the_connectors_one_medium_clear_goes_through_vllms_own_encoder_as_kvwire_reads_it():
    """What the connector sends when its daemon restarted, encoded by vLLM's KV-event batch (in the
    vLLM venv, where the connector runs), decodes here as AllBlocksCleared(medium="SHARED")."""
    from kvgate_testing.vllm import kv_batch_encoded_by_vllm
    from kvwire import decode_batch

    payload = kv_batch_encoded_by_vllm(
        "[MediumCleared(medium=SHARED_DAEMON_MEDIUM)]",
        "from cachelayer.connectors.vllm import MediumCleared, SHARED_DAEMON_MEDIUM",
    )
    (event,) = decode_batch(payload).events
    assert isinstance(event, AllBlocksCleared) and event.medium == "SHARED"
