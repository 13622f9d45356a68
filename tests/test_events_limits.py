"""The KV-event channel's bounds, against real ZMQ sockets on loopback and a publisher speaking
vLLM's protocol: a backend's index entries stay within `kv_events.max_blocks` however many
distinct blocks it announces (both ingest paths)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvgate_testing.event_publisher import EventPublisher, block_removed, block_stored, encode_batch
from kvgate_testing.index_oracle import WritableIndex
from kvgate_testing.metrics import metric_samples, sample_key
from kvgate_testing.ports import free_port
from kvgate_testing.waiting import wait_for
from kvwire import decode_batch
from router.config import KVEvents
from router.index.service import KVIndexService, new_index
from router.index.store import PrefixIndex


@pytest.fixture
def endpoints() -> Iterator[tuple[str, str]]:
    yield f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


REQUESTS, STEPS, LONE_STEPS = 100, 1000, 5000


def block_hash(request: int, step: int) -> int:
    return request * 1_000_000 + step + 1


def block_event(request: int, step: int) -> list:
    """The block request `request` filled at decode step `step` (its first at step 0)."""
    tokens = [request, step, *range(14)]
    parent = block_hash(request, step - 1) if step else None
    return block_stored([block_hash(request, step)], tokens, 16, parent, encoding="array")


@pytest.mark.parametrize("ingest", ["compiled", "python"])
def test_distinct_blocks_past_the_cap_keep_the_backend_at_the_cap_and_count_evictions(
    endpoints, ingest
) -> None:
    endpoint, replay_endpoint = endpoints
    cap = 2000
    registry = CollectorRegistry()
    service = KVIndexService(registry=registry)
    service.index, service.writer = new_index(compiled_ingest=ingest == "compiled")
    publisher = EventPublisher(endpoint, replay_endpoint, topic="")
    service.add_backend(
        "engine", KVEvents(endpoint=endpoint, replay_endpoint=replay_endpoint, max_blocks=cap)
    )
    service.start()
    try:
        wait_for(lambda: service.all_synced(), what="the subscriber's catch-up")
        time.sleep(0.3)  # the subscription reaches the publisher
        # An engine that announces 105k distinct blocks and never evicts one: 100 requests
        # decoding 1000 steps (a block each per step, one message per step), then one request
        # alone for 5000 more steps (a message per block: the compiled entry's lone events).
        for step in range(STEPS):
            publisher.publish_payload(encode_batch([block_event(r, step) for r in range(REQUESTS)]))
        for step in range(STEPS, STEPS + LONE_STEPS):
            publisher.publish_payload(encode_batch([block_event(0, step)]))
        total = REQUESTS * STEPS + LONE_STEPS
        subscriber = service.subscribers("engine")[0]
        wait_for(
            lambda: subscriber.stats.last_seq == publisher.next_seq - 1, timeout_s=60, what="every message"
        )
        assert subscriber.stats.events == {"BlockStored": total}
        nodes = service.index._backends["engine"].nodes
        status = service.status()["engine"]
        assert len(nodes) <= cap
        assert status["blocks"] == {"gpu": len(nodes)}
        assert status["evicted_blocks"] == total - len(nodes)
        assert len(service.index.holders) <= cap  # the router keys went with their blocks
        # The newest blocks are the ones kept.
        assert block_hash(0, STEPS + LONE_STEPS - 1) in nodes and block_hash(0, 0) not in nodes
        samples = metric_samples(generate_latest(registry).decode())
        assert samples[sample_key("kvgate_index_evicted_blocks_total", backend="engine")] == total - len(
            nodes
        )
        # At the cap the index still takes and finds a new prompt.
        prompt = list(range(7000, 7064))
        publisher.publish([block_stored([9, 10, 11, 12], prompt, 16)])
        wait_for(lambda: service.longest_cached_prefix(prompt)["engine"].tokens == 64, what="a new prompt")
        if ingest == "compiled":
            assert service.writer.compiled_applied >= LONE_STEPS
    finally:
        service.stop()
        publisher.close()


def held_by_tier(index: PrefixIndex, name: str) -> tuple[dict, dict]:
    """A backend's router keys and tails, each with the tiers holding it (slot numbers aside)."""
    tiers = {1 << slot: tier for tier, slot in index._backends[name].tier_slots.items()}

    def named(mask: int) -> frozenset[str]:
        return frozenset(tier for bit, tier in tiers.items() if mask & bit)

    keys = {key: named(mask) for key, mask in index.holders.items() if named(mask)}
    tails = {
        (boundary, tail): named(mask)
        for boundary, by_tail in index._tails.items()
        for tail, mask in by_tail.items()
        if named(mask)
    }
    return keys, tails


@pytest.mark.parametrize("compiled", [True, False])
def test_an_eviction_leaves_the_index_as_removals_of_the_same_blocks_would(compiled) -> None:
    """Prefills, decode steps, a block in two tiers, blocks with tails (24-token chunks) and one
    prefix stored twice: the capped index ends as an uncapped one told to remove what it evicted."""
    events = []
    for request in range(60):
        prompt = [request, *range(1, 64)]
        events.append(block_stored([f"p{request}".encode()], prompt, 64))  # a 64-token prefill
        parent = f"p{request}".encode()
        for step in range(3):
            block = f"d{request}.{step}".encode()
            events.append(block_stored([block], [request, step, *range(14)], 16, parent))
            parent = block
        if request % 3 == 0:  # offloaded: the same block on the CPU tier too
            tokens = [request, 2, *range(14)]
            events.append(block_stored([parent], tokens, 16, f"d{request}.1".encode(), medium="cpu"))
        if request % 4 == 0:  # a cache-layer chunk of 24 tokens: a router block and a tail
            events.append(block_stored([f"c{request}".encode()], [request, *range(500, 523)], 24))
        if request % 5 == 0:  # the same prefix again under another hash (a second KV-cache group)
            events.append(block_stored([f"q{request}".encode()], prompt, 64))
    decoded = decode_batch(encode_batch(events)).events
    capped, reference = WritableIndex(compiled_ingest=compiled), WritableIndex(compiled_ingest=compiled)
    capped.add_backend("engine", max_blocks=50)
    for event in decoded:  # one event per batch: the compiled entry's lone-event path where built
        capped.apply("engine", [event])
        reference.apply("engine", [event])
    kept = capped._backends["engine"].nodes
    evicted = len(reference._backends["engine"].nodes) - len(kept)
    assert len(kept) <= 50 and evicted > 100
    assert capped.stats("engine").evicted_blocks == evicted
    removals = []
    for node_key, node in reference._backends["engine"].nodes.items():
        if node_key in kept:
            continue
        for tier, slot in reference._backends["engine"].tier_slots.items():
            if node[-1] & (1 << slot):
                removals.append(block_removed([node_key], medium=tier))
    reference.apply("engine", decode_batch(encode_batch(removals)).events)
    assert held_by_tier(capped, "engine") == held_by_tier(reference, "engine")
    assert capped._backends["engine"].nodes == reference._backends["engine"].nodes
    assert capped.stats("engine").blocks == reference.stats("engine").blocks
    assert capped.stats("engine").tokens == reference.stats("engine").tokens
    assert {c.preview for c in capped._backends["engine"].chains.values()} == {
        c.preview for c in reference._backends["engine"].chains.values()
    }


def big_batch(n: int, blocks: int = 2000) -> bytes:
    """A batch of one prefill of `blocks` 16-token blocks (about 130 kB with 2000 blocks)."""
    tokens = [(n * 7919 + i) % 150_000 for i in range(16 * blocks)]
    hashes = [n * 100_000 + i + 1 for i in range(blocks)]
    return encode_batch([block_stored(hashes, tokens, 16)])


class SilentReplayFlood:
    """Two backends: `silent`, whose replay ROUTER takes requests and never answers, flooded with
    30 gaps of 130 kB batches; `healthy`, whose events are timed meanwhile."""

    def __init__(self, **silent_kv_events: int) -> None:
        silent_live, silent_replay, healthy_live = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
        self.registry = CollectorRegistry()
        self.service = KVIndexService(registry=self.registry, replay_timeout_s=0.5)
        self.silent = EventPublisher(silent_live, silent_replay, topic="")
        self.silent.drop_replays = True
        self.healthy = EventPublisher(healthy_live, topic="")
        kv_events = KVEvents(endpoint=silent_live, replay_endpoint=silent_replay, **silent_kv_events)
        self.service.add_backend("silent", kv_events)
        self.service.add_backend("healthy", KVEvents(endpoint=healthy_live))
        self.service.start()
        [self.subscriber] = self.service.subscribers("silent")

    def run(self) -> tuple[float, list[float]]:
        """Flood `silent`; return how long after the flood its stream caught up, and the delays
        of `healthy`'s events meanwhile."""
        service, subscriber = self.service, self.subscriber
        wait_for(
            lambda: subscriber.stats.connected and service.status()["healthy"]["connected"], what="connected"
        )
        time.sleep(0.6)  # the subscriptions reach the publishers; the silent catch-up times out
        # 60 batches of 130 kB, every other one lost on the way: 30 gaps, 3.9 MB sent.
        for n in range(60):
            self.silent.publish_payload(big_batch(n), send=n % 2 == 0)
        flood_sent = time.monotonic()
        delays = []
        for n in range(20):
            prompt = list(range(100_000 + 16 * n, 100_016 + 16 * n))
            published = time.monotonic()
            self.healthy.publish([block_stored([n + 1], prompt, 16)])
            wait_for(
                lambda p=prompt: service.longest_cached_prefix(p)["healthy"].tokens == 16, what="healthy"
            )
            delays.append(time.monotonic() - published)
            time.sleep(0.05)
        # The next message shows what was lost after the last gap (a full queue's drops included).
        final = self.silent.publish([block_stored([7], list(range(16)), 16)])
        wait_for(lambda: subscriber.stats.last_seq == final, timeout_s=8, what="the silent stream's flood")
        return time.monotonic() - flood_sent, delays

    def close(self) -> None:
        self.service.stop()
        self.silent.close()
        self.healthy.close()


def test_a_silent_replay_endpoint_costs_its_own_stream_a_few_timeouts_and_another_backend_nothing() -> None:
    flood = SilentReplayFlood()
    try:
        caught_up_s, delays = flood.run()
        replay_timeout_s = flood.service.replay_timeout_s
        # Asking the silent endpoint for each of the 30 gaps would take 30 timeouts: the stream caught
        # up in under half of that (replays < 10 below counts the asks).
        assert caught_up_s < 30 * replay_timeout_s / 2
        # An event of `healthy` held behind a replay of `silent` would wait a whole timeout, and with
        # 30 gaps most of the 20 would: at most two (a busy machine's stalls) took that long.
        assert sorted(delays)[len(delays) // 2] < replay_timeout_s / 2, delays
        assert sum(delay >= replay_timeout_s for delay in delays) <= 2, delays
        stats = flood.subscriber.stats
        assert stats.unrecovered_gaps >= 30 and stats.uncertain
        assert stats.skipped_replays > 0 and stats.replays < 10
    finally:
        flood.close()


def test_live_messages_read_while_a_replay_waits_stay_within_max_queued_bytes() -> None:
    budget = 1024 * 1024
    flood = SilentReplayFlood(max_queued_bytes=budget)
    try:
        flood.run()
        stats = flood.subscriber.stats
        # What was read while a request waited stayed within the budget; the rest was dropped.
        assert 0 < stats.queued_bytes_peak <= budget
        assert stats.dropped_messages > 0 and stats.queued_bytes == 0
        samples = metric_samples(generate_latest(flood.registry).decode())
        key = sample_key("kvgate_kv_dropped_messages_total", backend="silent", reason="queue_full")
        assert samples[key] == stats.dropped_messages
    finally:
        flood.close()


def test_an_oversized_message_is_dropped_counted_and_the_stream_goes_on(endpoints) -> None:
    endpoint, replay_endpoint = endpoints
    registry = CollectorRegistry()
    service = KVIndexService(registry=registry)
    publisher = EventPublisher(endpoint, replay_endpoint, topic="")
    service.add_backend(
        "engine", KVEvents(endpoint=endpoint, replay_endpoint=replay_endpoint, max_message_bytes=64 * 1024)
    )
    service.start()
    try:
        wait_for(lambda: service.all_synced(), what="the subscriber's catch-up")
        time.sleep(0.3)
        first, last = list(range(16)), list(range(16, 32))
        publisher.publish([block_stored([1], first, 16)])
        publisher.publish_payload(big_batch(1))  # seq 1: 130 kB
        publisher.publish([block_stored([2], last, 16)])
        [subscriber] = service.subscribers("engine")
        wait_for(lambda: subscriber.stats.last_seq == 2, what="seq 2")
        assert service.longest_cached_prefix(last)["engine"].tokens == 16
        assert service.index.stats("engine").blocks == {"gpu": 2}  # the big batch's 2000 blocks are not in
        stats = subscriber.stats
        assert stats.oversized == 1 and stats.replays == 0
        assert stats.uncertain and "seq 1 dropped" in (stats.uncertain_reason or "")
        samples = metric_samples(generate_latest(registry).decode())
        assert (
            samples[sample_key("kvgate_kv_dropped_messages_total", backend="engine", reason="oversized")] == 1
        )
    finally:
        service.stop()
        publisher.close()
