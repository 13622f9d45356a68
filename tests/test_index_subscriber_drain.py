"""The subscriber drains queued live messages and gives the index their payloads in few calls (to
the index writer raw, or decoded by the subscriber into one `apply` call): the index ends exactly
as if every batch had been applied alone, in order, around a gap's replay, a removal and a
malformed message, and no call holds much more than `_DRAIN_APPLY_BYTES` of payloads."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvgate_testing import waiting
from kvgate_testing.event_publisher import EventPublisher, block_removed, block_stored, encode_batch
from kvgate_testing.index_oracle import WritableIndex
from kvgate_testing.ports import free_port
from kvwire import BlockRemoved, BlockStored, KVEvent, decode_batch
from router.index import transport
from router.index.transport import EventSubscriber

wait_for = functools.partial(waiting.wait_for, timeout_s=20.0)
REQUESTS = 4  # concurrent decode chains, one block per message, round robin


class BlockingRecorder:
    """The subscriber's callbacks: `apply` (events) and `apply_payloads` (the held payloads, raw,
    applied by the index writer) record each call's events (and payload bytes), apply them to an
    index, and hold the first call until released (so that the messages published meanwhile
    queue up)."""

    def __init__(self, index: WritableIndex) -> None:
        self.index = index
        self.calls: list[list[KVEvent]] = []
        self.payload_bytes: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def _record(self, events: list[KVEvent]) -> None:
        self.calls.append(list(events))
        self.entered.set()
        self.release.wait(10)

    def __call__(self, events: list[KVEvent]) -> None:
        self._record(events)
        self.index.apply("engine", events)

    def apply_payloads(self, payloads: list[bytes]) -> list:
        decodable = [payload for payload in payloads if payload[:1] != b"\xc1"]
        self.payload_bytes.append(sum(map(len, payloads)))
        self._record([event for payload in decodable for event in decode_batch(payload).events])
        return self.index.apply_payloads("engine", payloads)


@pytest.fixture(params=["decoded", "writer"])
def wired(request) -> Iterator[tuple[EventPublisher, EventSubscriber, BlockingRecorder]]:
    """`writer`: the held payloads go to the index writer raw (`apply_payloads`), as the gateway
    wires its subscribers; `decoded`: the subscriber decodes them and calls `apply`."""
    endpoint, replay_endpoint = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    publisher = EventPublisher(endpoint, replay_endpoint)
    recorder = BlockingRecorder(WritableIndex())
    subscriber = EventSubscriber(
        "engine",
        endpoint,
        apply=recorder,
        clear=lambda: recorder.index.clear_backend("engine"),
        replay_endpoint=replay_endpoint,
        topic="kv-events",
        replay_timeout_s=1.0,
        apply_payloads=recorder.apply_payloads if request.param == "writer" else None,
    )
    try:
        subscriber.start()
        wait_for(lambda: subscriber.stats.connected and subscriber.stats.synced, what="subscriber synced")
        time.sleep(0.3)  # PUB/SUB: the subscription reaches the publisher before the first message
        yield publisher, subscriber, recorder
    finally:
        recorder.release.set()
        subscriber.stop()
        publisher.close()


def decode_chain_messages(count: int, rng: np.random.Generator) -> tuple[list[bytes], list[list[int]]]:
    """`count` one-block messages over REQUESTS chains, and each chain's tokens."""
    tokens: list[list[int]] = [[] for _ in range(REQUESTS)]
    payloads = []
    for n in range(count):
        request = n % REQUESTS
        block = rng.integers(0, 150_000, size=16).tolist()
        parent = None if n < REQUESTS else 1000 + n - REQUESTS
        payloads.append(encode_batch([block_stored([1000 + n], block, 16, parent)], encoding="array"))
        tokens[request] += block
    return payloads, tokens


def test_queued_messages_reach_the_index_in_few_calls_with_the_same_result(wired) -> None:
    publisher, subscriber, recorder = wired
    payloads, chains = decode_chain_messages(1201, np.random.default_rng(5))
    publisher.publish_payload(payloads[0])
    assert recorder.entered.wait(10), "the first message never reached the index"
    lost = 300
    sent = [payloads[0]]
    for n, payload in enumerate(payloads[1:], start=1):
        publisher.publish_payload(payload, send=n != lost)  # seq `lost` is a gap: replayed
        sent.append(payload)
        if n == 700:  # a removal and a malformed payload inside the burst
            removal = encode_batch([block_removed([1000 + 3])], encoding="array")
            publisher.publish_payload(removal)
            sent.append(removal)
            publisher.publish_payload(b"\xc1 not msgpack")
            sent.append(b"")
    time.sleep(0.5)  # the burst is queued in the SUB socket
    recorder.release.set()
    last = len(sent) - 1
    wait_for(lambda: subscriber.stats.last_seq == last, what=f"seq {last} applied")

    expected = WritableIndex()
    applied_alone: list[KVEvent] = []
    for payload in sent:
        if payload:
            events = decode_batch(payload).events
            expected.apply("engine", events)
            applied_alone += events
    # The same events in the same order, and the same index.
    applied = [event for call in recorder.calls for event in call]
    shapes = [(type(e), getattr(e, "block_hashes", None)) for e in applied]
    assert shapes == [(type(e), getattr(e, "block_hashes", None)) for e in applied_alone]
    assert recorder.index.stats("engine") == expected.stats("engine")
    for chain in chains:
        assert recorder.index.longest_cached_prefix(chain) == expected.longest_cached_prefix(chain)
    assert recorder.index.longest_cached_prefix(chains[3])["engine"].tokens == 0  # its first block went
    assert recorder.index.longest_cached_prefix(chains[0])["engine"].tokens == len(chains[0])
    assert publisher.replay_requests == [0, lost]  # the catch-up on connect, then the gap
    assert subscriber.stats.malformed == 1 and not subscriber.stats.uncertain
    assert subscriber.stats.events == {"BlockStored": 1201, "BlockRemoved": 1}
    # 1203 messages, a gap and a malformed one: a handful of calls, none much over the cap (a
    # drain releases what it holds once the held payloads reach it).
    assert len(recorder.calls) <= 20, [len(call) for call in recorder.calls]
    smallest, largest = min(map(len, payloads)), max(map(len, payloads))
    assert max(map(len, recorder.calls)) <= transport._DRAIN_APPLY_BYTES // smallest + 1
    assert all(size < transport._DRAIN_APPLY_BYTES + largest for size in recorder.payload_bytes)
    if subscriber._apply_payloads == recorder.apply_payloads:  # the writer read most of them undecoded
        assert subscriber.stats.scanned_batches > 1000
    assert any(isinstance(call[0], BlockRemoved) or len(call) > 100 for call in recorder.calls)
    assert all(isinstance(event, (BlockStored, BlockRemoved)) for event in applied)


def test_a_lone_message_is_applied_at_once(wired) -> None:
    """Nothing waits for more messages: a message alone is in the index when its drain ends."""
    publisher, _subscriber, recorder = wired
    recorder.release.set()
    payloads, chains = decode_chain_messages(1, np.random.default_rng(6))
    publisher.publish_payload(payloads[0])
    wait_for(lambda: recorder.index.held_tokens("engine") == 16, what="the block in the index")
    assert recorder.index.longest_cached_prefix(chains[0])["engine"].tokens == 16
    assert [len(call) for call in recorder.calls] == [1]


def test_last_seq_shows_a_batch_only_once_its_events_are_in_the_index() -> None:
    """A reader that waits for `stats.last_seq` (the debug page, a test) then looks at the index
    finds the batch there: alone or held by a drain, a batch's seq is shown after its apply."""
    endpoint, replay_endpoint = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    publisher = EventPublisher(endpoint, replay_endpoint)
    entered = [threading.Event(), threading.Event()]
    release = [threading.Event(), threading.Event()]
    calls: list[list[KVEvent]] = []

    def apply(events: list[KVEvent]) -> None:
        call = len(calls)
        calls.append(list(events))
        if call < 2:  # the first two calls wait to be released
            entered[call].set()
            release[call].wait(10)

    subscriber = EventSubscriber(
        "engine",
        endpoint,
        apply=apply,
        clear=lambda: None,
        replay_endpoint=replay_endpoint,
        topic="kv-events",
        replay_timeout_s=1.0,
    )
    try:
        subscriber.start()
        wait_for(lambda: subscriber.stats.connected and subscriber.stats.synced, what="subscriber synced")
        time.sleep(0.3)  # PUB/SUB: the subscription reaches the publisher before the first message
        payloads, _chains = decode_chain_messages(5, np.random.default_rng(7))
        publisher.publish_payload(payloads[0])  # the first batch: applied alone
        assert entered[0].wait(10), "the first message never reached the index"
        time.sleep(0.1)
        assert subscriber.stats.last_seq is None  # its apply has not returned
        for payload in payloads[1:]:  # queued meanwhile: the drain holds them, one apply call
            publisher.publish_payload(payload)
        time.sleep(0.3)
        release[0].set()
        assert entered[1].wait(10), "the held batches never reached the index"
        time.sleep(0.1)
        assert subscriber.stats.last_seq == 0  # seqs 1..4 wait for their apply
        release[1].set()
        wait_for(lambda: subscriber.stats.last_seq == 4, what="seq 4 applied")
        assert [len(call) for call in calls] == [1, 4]
    finally:
        for event in release:
            event.set()
        subscriber.stop()
        publisher.close()
