"""The subscriber against a publisher speaking vLLM's protocol over real ZMQ sockets: live stream,
gaps and replay (both reply formats), a lost replay, a restart, a late start, malformed frames,
bind mode, reconnection and data-parallel ranks."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from kvgate_testing import waiting
from kvgate_testing.event_publisher import EventPublisher, all_blocks_cleared, block_removed, block_stored
from kvgate_testing.index_oracle import WritableIndex
from kvgate_testing.ports import free_port
from router.backends import BackendState
from router.config import KVAwarePolicy, KVEvents
from router.index.keys import Namespace
from router.index.service import KVIndexService
from router.index.transport import EventSubscriber, connectable, rank_endpoint
from router.policies.base import RouteRequest
from router.policies.kv_aware import KVAware

rng = np.random.default_rng(3)
PROMPTS = [rng.integers(0, 150_000, size=64).tolist() for _ in range(8)]
wait_until = functools.partial(waiting.wait_for, timeout_s=5.0)


def stored(n: int, first_hash: int | None = None) -> dict:
    """Prompt n as four 16-token blocks in one event."""
    base = (first_hash if first_hash is not None else n * 10) + 1
    return block_stored(list(range(base, base + 4)), PROMPTS[n], 16)


class Harness:
    """A publisher, an index and a subscriber wired together on free loopback ports."""

    def __init__(
        self,
        *,
        replay: bool = True,
        replay_format: str = "new",
        buffer_steps: int = 10_000,
        wire: bool = False,
    ) -> None:
        """`wire`: in-order payloads go to the index writer raw (`apply_payloads`: it scans most of
        them, as the gateway wires its subscribers); else the subscriber decodes every payload."""
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.replay_endpoint = f"tcp://127.0.0.1:{free_port()}" if replay else None
        self.replay_format = replay_format
        self.buffer_steps = buffer_steps
        self.index = WritableIndex()
        self.publisher = self.new_publisher()
        self.subscriber = EventSubscriber(
            "engine",
            self.endpoint,
            apply=lambda events: self.index.apply("engine", events),
            clear=lambda: self.index.clear_backend("engine"),
            replay_endpoint=self.replay_endpoint,
            topic="kv-events",
            replay_timeout_s=0.5,
            apply_payloads=functools.partial(self.index.apply_payloads, "engine") if wire else None,
        )

    def new_publisher(self) -> EventPublisher:
        return EventPublisher(
            self.endpoint,
            self.replay_endpoint,
            replay_format=self.replay_format,  # type: ignore[arg-type]
            buffer_steps=self.buffer_steps,
        )

    def start(self) -> None:
        self.subscriber.start()
        wait_until(lambda: self.subscriber.stats.connected)
        time.sleep(0.3)  # PUB/SUB: let the subscription reach the publisher before the first message

    def cached(self, n: int) -> int:
        return self.index.longest_cached_prefix(PROMPTS[n])["engine"].tokens

    def close(self) -> None:
        self.subscriber.stop()
        self.publisher.close()


@pytest.fixture(params=["decoded", "wire"])
def harness(request) -> Iterator[Harness]:
    h = Harness(wire=request.param == "wire")
    try:  # (a start that fails still closes the subscriber: a live one would hold up the exit)
        h.start()
        yield h
    finally:
        h.close()


def test_live_stream_applies_stores_and_removals(harness: Harness) -> None:
    harness.publisher.publish([stored(0)])
    harness.publisher.publish([stored(1)], encoding="map")
    wait_until(lambda: harness.subscriber.stats.last_seq == 1)
    assert harness.cached(0) == 64 and harness.cached(1) == 64
    harness.publisher.publish([block_removed([13])])
    wait_until(lambda: harness.subscriber.stats.last_seq == 2)
    assert harness.cached(1) == 32
    assert harness.subscriber.stats.events == {"BlockStored": 2, "BlockRemoved": 1}
    assert harness.subscriber.stats.replays == 0
    # Given to the writer raw, the in-order payloads (all but the first) reach the index undecoded.
    scanned = harness.subscriber.stats.scanned_batches
    wired = harness.subscriber._apply_payloads != harness.subscriber._decode_and_apply
    assert scanned == (2 if wired else 0)


def test_stop_wakes_an_idle_subscriber_whose_poll_has_no_timeout(harness: Harness) -> None:
    # The thread waits for messages without a timer; only stop()'s wake-up can end that wait.
    time.sleep(0.2)
    harness.subscriber.stop(wait=False)
    wait_until(lambda: not harness.subscriber.running)
    harness.subscriber.stop()  # a second stop is harmless
    assert harness.subscriber._wake_reader.fileno() == -1
    assert harness.subscriber._wake_writer.fileno() == -1


def test_a_subscriber_stopped_before_it_started_closes_its_wake_up_pair() -> None:
    subscriber = EventSubscriber("engine", f"tcp://127.0.0.1:{free_port()}", apply=lambda events: None,
                                 clear=lambda: None)  # fmt: skip
    subscriber.stop()
    assert not subscriber.running
    assert subscriber._wake_reader.fileno() == -1 and subscriber._wake_writer.fileno() == -1


@pytest.mark.parametrize("replay_format", ["new", "old"])
def test_a_gap_is_filled_by_replay_in_either_reply_format(replay_format: str) -> None:
    h = Harness(replay_format=replay_format)
    try:
        h.start()
        h.publisher.publish([stored(0)])
        h.publisher.publish([stored(1)], send=False)  # lost on the wire, still in the engine's buffer
        h.publisher.publish([stored(2)], send=False)
        h.publisher.publish([stored(3)])
        wait_until(lambda: h.subscriber.stats.last_seq == 3)
        assert [h.cached(n) for n in range(4)] == [64, 64, 64, 64]
        stats = h.subscriber.stats
        assert stats.replays == 1
        assert stats.replayed_batches == 2
        assert stats.unrecovered_gaps == 0 and not stats.uncertain
        assert h.publisher.replay_requests == [0, 1]  # the catch-up on connect, then the gap
    finally:
        h.close()


def test_a_lost_replay_times_out_and_marks_the_backend_uncertain(harness: Harness) -> None:
    harness.publisher.drop_replays = True
    harness.publisher.publish([stored(0)])
    harness.publisher.publish([stored(1)], send=False)
    harness.publisher.publish([stored(2)])
    wait_until(lambda: harness.subscriber.stats.last_seq == 2)
    stats = harness.subscriber.stats
    assert stats.unrecovered_gaps == 1
    assert stats.uncertain and "lost seq 1..1" in (stats.uncertain_reason or "")
    assert harness.cached(1) == 0 and harness.cached(2) == 64
    # The subscriber keeps going, and a later gap is replayed again on a fresh socket.
    harness.publisher.drop_replays = False
    harness.publisher.publish([stored(3)], send=False)
    harness.publisher.publish([stored(4)])
    wait_until(lambda: harness.subscriber.stats.last_seq == 4)
    assert harness.cached(3) == 64
    assert stats.replays == 2 and stats.unrecovered_gaps == 1


def test_a_gap_older_than_the_engine_buffer_is_unrecoverable() -> None:
    h = Harness(buffer_steps=2)
    try:
        h.start()
        h.publisher.publish([stored(0)])
        for n in (1, 2, 3):
            h.publisher.publish([stored(n)], send=False)
        h.publisher.publish([stored(4)])
        wait_until(lambda: h.subscriber.stats.last_seq == 4)
        stats = h.subscriber.stats
        # The buffer kept seq 3 and 4 only: seq 3 is applied, 1 and 2 are lost.
        assert h.cached(3) == 64 and h.cached(1) == 0
        assert stats.unrecovered_gaps == 1 and stats.uncertain
    finally:
        h.close()


def test_without_a_replay_endpoint_a_gap_is_counted() -> None:
    h = Harness(replay=False)
    try:
        h.start()
        h.publisher.publish([stored(0)])
        h.publisher.publish([stored(1)], send=False)
        h.publisher.publish([stored(2)])
        wait_until(lambda: h.subscriber.stats.last_seq == 2)
        assert h.subscriber.stats.unrecovered_gaps == 1 and h.subscriber.stats.replays == 0
    finally:
        h.close()


def test_engine_restart_clears_the_backend_and_continues(harness: Harness) -> None:
    harness.publisher.publish([stored(0)])
    harness.publisher.publish([stored(1)])
    wait_until(lambda: harness.subscriber.stats.last_seq == 1)
    harness.publisher.close()
    harness.publisher = harness.new_publisher()  # a new engine process: seq starts at 0 again
    wait_until(lambda: harness.subscriber.stats.connected)
    time.sleep(0.5)
    harness.publisher.publish([stored(2)])
    wait_until(lambda: harness.subscriber.stats.restarts == 1)
    assert harness.cached(0) == 0 and harness.cached(1) == 0
    assert harness.cached(2) == 64
    assert harness.subscriber.stats.last_seq == 0


def test_a_duplicated_or_stepped_back_seq_is_ignored_while_a_reset_to_zero_clears(harness: Harness) -> None:
    publisher = harness.publisher
    for n in range(3):
        publisher.publish([stored(n)])
    wait_until(lambda: harness.subscriber.stats.last_seq == 2)
    sent = dict(publisher.buffer)
    # The same messages again: the last one twice, then one stepped back (published earlier).
    for seq in (2, 2, 1):
        publisher.send_raw([publisher.topic, seq.to_bytes(8, "big"), sent[seq]])
    publisher.publish([stored(3)])  # seq 3, the next one: applied, no gap
    wait_until(lambda: harness.subscriber.stats.last_seq == 3)
    stats = harness.subscriber.stats
    # Not taken for a restart: nothing was cleared (nor replayed back from seq 0).
    assert (stats.restarts, stats.replays) == (0, 0)
    assert stats.duplicates == 3
    assert [harness.cached(n) for n in range(4)] == [64, 64, 64, 64]
    # The engine restarts as vLLM's does: a new process publishes from seq 0 again, later.
    publisher.next_seq = 0
    publisher.publish([stored(4)])
    wait_until(lambda: harness.subscriber.stats.restarts == 1)
    assert [harness.cached(n) for n in range(5)] == [0, 0, 0, 0, 64]
    assert stats.last_seq == 0 and stats.duplicates == 3


def test_a_restart_is_counted_once_the_new_engine_batch_is_in_the_index() -> None:
    """A reader that waits for `restarts` finds the backend cleared and the new engine's batch
    applied: the restart is counted after both, not when it is noticed."""
    h = Harness()
    clearing, release = threading.Event(), threading.Event()
    clear_backend = h.index.clear_backend

    def slow_clear(name: str) -> None:
        clearing.set()
        release.wait(10)
        clear_backend(name)

    h.index.clear_backend = slow_clear  # type: ignore[method-assign]
    try:
        h.start()
        h.publisher.publish([stored(0)])
        h.publisher.publish([stored(1)])
        wait_until(lambda: h.subscriber.stats.last_seq == 1)
        h.publisher.next_seq = 0  # a new engine process, publishing later
        h.publisher.publish([stored(2)])
        assert clearing.wait(5), "the restart was not noticed"
        time.sleep(0.1)
        assert h.subscriber.stats.restarts == 0  # the backend is not cleared yet
        release.set()
        wait_until(lambda: h.subscriber.stats.restarts == 1)
        assert [h.cached(n) for n in range(3)] == [0, 0, 64]
        assert h.subscriber.stats.last_seq == 0
    finally:
        release.set()
        h.close()


def test_a_late_subscriber_recovers_the_engine_history_by_replay() -> None:
    h = Harness()
    try:
        for n in range(3):  # published before anyone listened
            h.publisher.publish([stored(n)])
        h.start()
        h.publisher.publish([stored(3)])
        wait_until(lambda: h.subscriber.stats.last_seq == 3)
        assert [h.cached(n) for n in range(4)] == [64, 64, 64, 64]
        assert h.publisher.replay_requests == [0]
        assert not h.subscriber.stats.uncertain
    finally:
        h.close()


def test_a_late_subscriber_whose_history_is_gone_is_uncertain() -> None:
    h = Harness(buffer_steps=1)
    try:
        for n in range(3):
            h.publisher.publish([stored(n)])
        h.start()
        h.publisher.publish([stored(3)])
        wait_until(lambda: h.subscriber.stats.last_seq == 3)
        assert h.subscriber.stats.uncertain
        assert "subscribed late" in (h.subscriber.stats.uncertain_reason or "")
        assert h.cached(3) == 64 and h.cached(0) == 0
    finally:
        h.close()


def test_malformed_messages_are_counted_and_never_stop_the_subscriber(harness: Harness) -> None:
    pub = harness.publisher
    pub.send_raw([b"kv-events", b"\x00" * 8])  # two frames
    pub.send_raw([b"kv-events", b"\x00\x01", b"payload"])  # short seq
    pub.send_raw([b"kv-events", b"\x00" * 8, b"\xc1garbage", b"extra"])  # four frames
    seq = pub.publish_payload(b"\xc1 not msgpack")  # a good seq with a bad payload
    pub.publish([{"type": "Unknown"}, stored(0)])
    wait_until(lambda: harness.subscriber.stats.last_seq == seq + 1)
    stats = harness.subscriber.stats
    assert stats.malformed == 5  # 3 bad frames, 1 bad payload, 1 batch with an undecodable event
    assert stats.skipped_events == 1
    assert harness.cached(0) == 64
    assert stats.replays == 0  # the bad payload's seq still counted: no false gap


def test_clear_and_cleared_events_over_the_wire(harness: Harness) -> None:
    harness.publisher.publish([stored(0), stored(1)])
    harness.publisher.publish([all_blocks_cleared(encoding="array")])
    wait_until(lambda: harness.subscriber.stats.last_seq == 1)
    assert harness.cached(0) == 0 and harness.cached(1) == 0


def test_bind_mode_accepts_a_publisher_that_connects_out() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    index = WritableIndex()
    subscriber = EventSubscriber(
        "engine", endpoint, apply=lambda e: index.apply("engine", e), clear=lambda: None, bind=True
    )
    subscriber.start()
    publisher = EventPublisher(endpoint, connect=True, topic="")
    try:
        wait_until(lambda: subscriber.stats.connected)
        time.sleep(0.3)
        publisher.publish([stored(0)])
        wait_until(lambda: subscriber.stats.last_seq == 0)
        assert index.longest_cached_prefix(PROMPTS[0])["engine"].tokens == 64
    finally:
        subscriber.stop()
        publisher.close()


def test_subscriber_started_before_the_engine_connects_when_it_comes_up() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    index = WritableIndex()
    subscriber = EventSubscriber(
        "engine",
        endpoint,
        apply=lambda e: index.apply("engine", e),
        clear=lambda: None,
        reconnect_initial_s=0.05,
        reconnect_max_s=0.2,
    )
    subscriber.start()
    try:
        time.sleep(0.5)
        assert not subscriber.stats.connected
        publisher = EventPublisher(endpoint, topic="")
        try:
            wait_until(lambda: subscriber.stats.connected)
            time.sleep(0.3)
            publisher.publish([stored(0)])
            wait_until(lambda: subscriber.stats.last_seq == 0)
        finally:
            publisher.close()
        wait_until(lambda: not subscriber.stats.connected)
    finally:
        subscriber.stop()


def test_endpoint_helpers() -> None:
    assert rank_endpoint("tcp://10.0.0.1:5557", 0) == "tcp://10.0.0.1:5557"
    assert rank_endpoint("tcp://10.0.0.1:5557", 2) == "tcp://10.0.0.1:5559"
    assert rank_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert connectable("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert connectable("tcp://10.1.1.1:5557") == "tcp://10.1.1.1:5557"


def test_service_subscribes_to_every_dp_rank_and_merges_them() -> None:
    for _attempt in range(20):  # two adjacent free ports for two ranks
        base = free_port()
        try:
            rank0 = EventPublisher(f"tcp://127.0.0.1:{base}", topic="kv")
        except zmq.ZMQError:
            continue
        try:
            rank1 = EventPublisher(f"tcp://127.0.0.1:{base + 1}", topic="kv")
            break
        except zmq.ZMQError:
            rank0.close()
    else:
        pytest.fail("no two adjacent free ports")
    service = KVIndexService()
    service.add_backend("dp-engine", KVEvents(endpoint=f"tcp://127.0.0.1:{base}", topic="kv", dp_ranks=2))
    service.start()
    try:
        subscribers = service.subscribers("dp-engine")
        assert [s.endpoint for s in subscribers] == [f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"]
        wait_until(lambda: all(s.stats.connected for s in subscribers))
        time.sleep(0.3)
        rank0.publish([stored(0)])
        rank1.publish([stored(1)])
        rank1.publish([block_stored([500], PROMPTS[0][:16], 16)])
        wait_until(lambda: subscribers[1].stats.last_seq == 1 and subscribers[0].stats.last_seq == 0)
        assert service.longest_cached_prefix(PROMPTS[0])["dp-engine"].tokens == 64
        assert service.longest_cached_prefix(PROMPTS[1])["dp-engine"].tokens == 64
        status = service.status()["dp-engine"]
        assert status["connected"] and status["last_seq"] == [0, 1]
        assert status["blocks"] == {"gpu": 9}
        # Each stream's first message goes through the gap rules (decoded); rank 1's next one is
        # in order and reaches the index undecoded, through the wire ingest the service wires.
        assert (status["batches"], status["scanned_batches"]) == (3, 1)
        service.remove_backend("dp-engine")
        assert service.longest_cached_prefix(PROMPTS[0]) == {}
    finally:
        service.stop()
        rank0.close()
        rank1.close()


def test_a_batch_the_index_cannot_apply_is_logged_and_the_stream_continues(harness: Harness) -> None:
    applied: list[int] = []

    def flaky_apply(events: list) -> None:
        applied.append(len(events))
        if len(applied) == 1:
            raise RuntimeError("boom")
        harness.index.apply("engine", events)

    harness.subscriber._apply = flaky_apply
    harness.publisher.publish([stored(0)])
    harness.publisher.publish([stored(1)])
    wait_until(lambda: harness.subscriber.stats.last_seq == 1)
    stats = harness.subscriber.stats
    assert stats.apply_errors == 1 and stats.uncertain
    assert harness.cached(1) == 64


def test_kv_aware_does_not_credit_the_entries_of_a_disconnected_stream() -> None:
    endpoints = {name: f"tcp://127.0.0.1:{free_port()}" for name in ("e0", "e1")}
    publishers = {name: EventPublisher(endpoint, topic="") for name, endpoint in endpoints.items()}
    service = KVIndexService()
    for name, endpoint in endpoints.items():
        service.add_backend(name, KVEvents(endpoint=endpoint))
    service.start()
    policy = KVAware(KVAwarePolicy(hot_prefix_requests=0), service)
    candidates = [BackendState(name=name, url="http://127.0.0.1:1") for name in endpoints]
    prompt = np.asarray(PROMPTS[0], dtype=np.uint32)

    def cached_per_backend() -> dict[str, int]:
        request = RouteRequest(request_id="r", model="m", body={}, tokens=prompt, namespace=Namespace())
        choice = policy.choose(request, candidates)
        return {name: score["cached"] for name, score in choice.candidates.items()}

    try:
        wait_until(lambda: all(s.stats.connected for name in endpoints for s in service.subscribers(name)))
        time.sleep(0.3)
        publishers["e0"].publish([stored(0)])
        wait_until(lambda: service.longest_cached_prefix(PROMPTS[0])["e0"].tokens == 64)
        assert cached_per_backend() == {"e0": 64, "e1": 0}
        publishers.pop("e0").close()  # e0's event stream goes away; its HTTP side may well be up
        wait_until(lambda: not service.subscribers("e0")[0].stats.connected)
        assert cached_per_backend() == {"e0": 0, "e1": 0}
        assert service.disconnected_streams() == {"e0": "event stream disconnected"}
        # The entries are kept (the stream may come back); asked for, they are still there.
        assert service.longest_cached_prefix(PROMPTS[0], disconnected=True)["e0"].tokens == 64
    finally:
        service.stop()
        for publisher in publishers.values():
            publisher.close()
