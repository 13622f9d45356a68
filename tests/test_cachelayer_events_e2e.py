"""Events end to end: the router's own subscriber and index consume the cache layer's events."""

import functools

import pytest

from kvgate_testing import waiting
from kvgate_testing.cachelayer import CHUNK, make_engine, request
from router.config import KVEvents
from router.index.service import KVIndexService

wait_for = functools.partial(waiting.wait_for, timeout_s=30.0)


@pytest.fixture
def engine_and_index(tmp_path):
    engine = make_engine(
        4,
        enable_kv_events=True,
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
        local_disk=str(tmp_path / "l2"),
        max_local_disk_size=0.01,
    )
    service = KVIndexService(replay_timeout_s=1.0)
    try:
        service.add_backend(
            "cache-a",
            KVEvents(endpoint=engine.publisher.endpoint, replay_endpoint=engine.publisher.replay_endpoint),
        )
        service.start()

        # PUB/SUB drops what is sent before the subscription lands: send empty batches until one arrives.
        def subscribed():
            engine.publisher.publish([])
            return service.status()["cache-a"]["last_seq"] is not None

        wait_for(subscribed)
        yield engine, service
    finally:
        service.stop()
        engine.close()


def test_router_index_follows_stores_evictions_and_clears(engine_and_index):
    engine, service = engine_and_index

    def match(tokens):
        return service.longest_cached_prefix(tokens)["cache-a"]

    tokens, kv = request(1, 3)
    tokens, kv = tokens[:-4], kv[:, :, :-4]  # a short tail chunk
    assert engine.store(tokens, kv) == len(tokens)
    try:
        held = wait_for(lambda: match(tokens) if match(tokens).tokens == len(tokens) else None)
    except AssertionError:
        subscriber = service.subscribers("cache-a")[0]
        print("STATUS", service.status(), match(tokens), "subscriber running:", subscriber.running)
        raise
    assert held.by_tier.get("cpu") == len(tokens)
    wait_for(lambda: match(tokens).by_tier.get("disk") == len(tokens))
    # A prompt sharing the first chunk only.
    assert match(tokens[:CHUNK] + [1] * CHUNK).tokens == CHUNK

    # Evict from the CPU pool (it holds 4 chunks): the router sees the CPU tier shrink, disk stays.
    other_tokens, other_kv = request(2, 3)
    engine.store(other_tokens, other_kv)
    wait_for(lambda: match(other_tokens).by_tier.get("cpu") == 3 * CHUNK)
    wait_for(lambda: match(tokens).by_tier.get("cpu", 0) < len(tokens))
    assert match(tokens).by_tier.get("disk") == len(tokens)
    assert match(tokens).tokens == len(tokens)

    engine.clear()
    wait_for(lambda: match(tokens).tokens == 0 and match(other_tokens).tokens == 0)
