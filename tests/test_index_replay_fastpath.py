"""Replays that skip dead work, and readiness you can see: over real ZMQ sockets with the test
publisher, a replay holding an AllBlocksCleared applies only what follows the clear (the index ends
exactly as one that applied every batch, the skipped batches are counted), and `synced` says when a
new subscriber has caught up with what the engine still buffers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import zmq

from kvgate_testing.event_publisher import (
    EventPublisher,
    all_blocks_cleared,
    block_removed,
    block_stored,
)
from kvgate_testing.index_oracle import WritableIndex
from kvgate_testing.ports import free_port
from kvgate_testing.waiting import wait_for
from kvwire import END_SEQ, decode_batch
from router.config import KVEvents
from router.index.service import KVIndexService
from router.index.store import PrefixIndex
from router.index.transport import EventSubscriber

rng = np.random.default_rng(11)
PROMPTS = [rng.integers(0, 150_000, size=64).tolist() for _ in range(12)]


def publish_until(publisher: EventPublisher, predicate: Callable[[], bool]) -> None:
    """Publish empty batches until `predicate` holds: PUB/SUB drops what is sent before the
    subscription reaches the publisher, and a loaded machine makes that take a while."""
    deadline = time.monotonic() + 10.0
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        publisher.publish([])
        time.sleep(0.05)


def stored(n: int, *, medium: str = "GPU") -> dict:
    """Prompt n as four 16-token blocks (engine hashes 10n+1..10n+4) in one event."""
    base = n * 10 + 1
    return block_stored(list(range(base, base + 4)), PROMPTS[n], 16, medium=medium)


def replayed_everything(publisher: EventPublisher) -> PrefixIndex:
    """The index one gets by applying every batch the engine published, one call per batch."""
    index = WritableIndex()
    for _seq, payload in publisher.buffer:
        index.apply("engine", decode_batch(payload).events)
    return index


def held(index: PrefixIndex) -> list[int]:
    """Per prompt, the leading tokens the index says the engine holds."""
    matches = [index.longest_cached_prefix(prompt).get("engine") for prompt in PROMPTS]
    return [0 if match is None else match.tokens for match in matches]


def nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {tier: count for tier, count in counts.items() if count}


def assert_same_index(index: PrefixIndex, reference: PrefixIndex) -> None:
    assert held(index) == held(reference)
    ours, theirs = index.stats("engine"), reference.stats("engine")
    assert ours is not None and theirs is not None
    assert nonzero(ours.blocks) == nonzero(theirs.blocks)
    assert nonzero(ours.tokens) == nonzero(theirs.tokens)


class Harness:
    """A publisher and a subscriber feeding an index, on free loopback ports."""

    def __init__(self, *, buffer_steps: int = 10_000, replay_endpoint: str | None = None) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.replay_endpoint = replay_endpoint or f"tcp://127.0.0.1:{free_port()}"
        # With a replay endpoint of the test's own, the publisher has none (the test answers).
        own_router = replay_endpoint is None
        self.publisher = EventPublisher(
            self.endpoint, self.replay_endpoint if own_router else None, buffer_steps=buffer_steps
        )
        self.index = WritableIndex()
        self.apply_calls = 0
        self.subscriber = EventSubscriber(
            "engine",
            self.endpoint,
            apply=self._apply,
            clear=lambda: self.index.clear_backend("engine"),
            replay_endpoint=self.replay_endpoint,
            topic="kv-events",
            replay_timeout_s=3.0,
        )

    def _apply(self, events: list) -> None:
        self.apply_calls += 1
        self.index.apply("engine", events)

    def start(self) -> None:
        self.subscriber.start()
        wait_for(lambda: self.subscriber.stats.connected)

    def close(self) -> None:
        self.subscriber.stop()
        self.publisher.close()


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


def test_a_late_subscriber_applies_only_what_follows_the_last_clear(harness: Harness) -> None:
    pub = harness.publisher
    for n in range(4):  # history a reset made moot, in both tiers
        pub.publish([stored(n)])
    pub.publish([stored(4, medium="cpu")])
    pub.publish([block_removed([2])])
    clear_seq = pub.publish([stored(5), all_blocks_cleared(), stored(6)])  # a clear inside a batch
    pub.publish([stored(7)])
    pub.publish([stored(8, medium="cpu")])
    last = pub.publish([block_removed([84], medium="cpu")])

    harness.start()  # the catch-up replay runs on connect, before any live message
    wait_for(lambda: harness.subscriber.stats.synced)
    stats = harness.subscriber.stats
    assert stats.last_seq == last
    assert stats.superseded_batches == clear_seq  # seq 0..clear_seq-1, never decoded nor applied
    assert stats.superseded_events == 1  # stored(5), before the clear in its own batch
    assert stats.replays == 1 and stats.replayed_batches == last + 1
    assert not stats.uncertain
    assert harness.apply_calls == 1  # everything after the clear in one index call
    assert_same_index(harness.index, replayed_everything(pub))
    assert held(harness.index)[6:9] == [64, 64, 48]
    assert held(harness.index)[:6] == [0] * 6

    # Live batches go on from there.
    pub.publish([stored(9)])
    publish_until(pub, lambda: held(harness.index)[9] == 64)
    assert_same_index(harness.index, replayed_everything(pub))


def test_a_gap_whose_replay_holds_a_clear_skips_what_the_clear_undoes(harness: Harness) -> None:
    pub = harness.publisher
    harness.start()
    stats = harness.subscriber.stats
    publish_until(pub, lambda: stats.last_seq is not None)
    pub.publish([stored(0)])
    seq = pub.publish([stored(1)])
    wait_for(lambda: stats.last_seq == seq)
    replays, replayed_batches = stats.replays, stats.replayed_batches
    for n in (2, 3):  # lost on the wire
        pub.publish([stored(n)], send=False)
    pub.publish([all_blocks_cleared(encoding="array")], send=False)
    pub.publish([stored(4)], send=False)
    seq = pub.publish([stored(5)])  # the gap shows here
    wait_for(lambda: stats.last_seq == seq)
    assert stats.replays == replays + 1 and stats.replayed_batches == replayed_batches + 4
    assert stats.superseded_batches == 2  # stored(2) and stored(3)
    assert stats.superseded_events == 0
    assert not stats.uncertain and stats.unrecovered_gaps == 0
    assert_same_index(harness.index, replayed_everything(pub))
    assert held(harness.index)[:6] == [0, 0, 0, 0, 64, 64]


def test_a_replay_missing_only_what_a_clear_undid_is_not_uncertain() -> None:
    # The engine's buffer lost seq 0..2; seq 3 clears everything: what came before cannot matter.
    h = Harness(buffer_steps=3)
    try:
        for n in range(3):
            h.publisher.publish([stored(n)])
        h.publisher.publish([all_blocks_cleared()])
        h.publisher.publish([stored(3)])
        h.publisher.publish([stored(4)])
        h.start()
        wait_for(lambda: h.subscriber.stats.synced)
        stats = h.subscriber.stats
        assert stats.last_seq == 5 and not stats.uncertain
        assert held(h.index)[:5] == [0, 0, 0, 64, 64]
    finally:
        h.close()


def test_a_late_subscriber_without_a_clear_in_a_cut_buffer_stays_uncertain() -> None:
    h = Harness(buffer_steps=2)
    try:
        for n in range(4):
            h.publisher.publish([stored(n)])
        h.start()
        wait_for(lambda: h.subscriber.stats.synced)
        stats = h.subscriber.stats
        assert stats.uncertain and "subscribed late" in (stats.uncertain_reason or "")
        assert stats.superseded_batches == 0 and held(h.index)[:4] == [0, 0, 64, 64]
    finally:
        h.close()


class HeldReplay:
    """A replay ROUTER that answers from the publisher's buffer only once released (a slow engine),
    `spacing_s` between replies (an engine replaying a long buffer on a busy machine)."""

    def __init__(self, endpoint: str, spacing_s: float = 0.0) -> None:
        self.endpoint = endpoint
        self.spacing_s = spacing_s
        self.release = threading.Event()
        self.publisher: EventPublisher | None = None
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            identity, _empty, start_frame = self._router.recv_multipart()
            while not self.release.wait(0.05):
                if self._stop.is_set():
                    return
            assert self.publisher is not None
            start = int.from_bytes(start_frame, "big")
            for seq, payload in list(self.publisher.buffer):
                if self._stop.is_set():
                    return
                if seq >= start:
                    time.sleep(self.spacing_s)
                    self._router.send_multipart(
                        [identity, b"", b"kv-events", seq.to_bytes(8, "big"), payload]
                    )
            self._router.send_multipart([identity, b"", b"kv-events", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._router.close(0)
        self._context.term()


def test_synced_is_false_during_a_slow_catch_up_and_true_after() -> None:
    replay = HeldReplay(f"tcp://127.0.0.1:{free_port()}")
    h = Harness(replay_endpoint=replay.endpoint)
    replay.publisher = h.publisher
    try:
        for n in range(3):
            h.publisher.publish([stored(n)])
        h.start()
        time.sleep(0.5)
        assert not h.subscriber.stats.synced and h.subscriber.stats.last_seq is None
        replay.release.set()
        wait_for(lambda: h.subscriber.stats.synced)
        assert h.subscriber.stats.last_seq == 2 and held(h.index)[:3] == [64, 64, 64]
    finally:
        h.close()
        replay.close()


def test_a_replay_answer_still_flowing_is_not_cut_at_the_replay_timeout() -> None:
    # Eight replies 0.15 s apart: 1.2 s in all, more than the 0.5 s timeout but never 0.5 s silent.
    replay = HeldReplay(f"tcp://127.0.0.1:{free_port()}", spacing_s=0.15)
    replay.release.set()
    h = Harness(replay_endpoint=replay.endpoint)
    h.subscriber.replay_timeout_s = 0.5
    replay.publisher = h.publisher
    try:
        for n in range(8):
            h.publisher.publish([stored(n)])
        h.start()
        wait_for(lambda: h.subscriber.stats.synced)
        stats = h.subscriber.stats
        assert stats.last_seq == 7 and stats.replayed_batches == 8 and not stats.uncertain
        assert held(h.index)[:8] == [64] * 8
    finally:
        h.close()
        replay.close()


def test_a_replay_answer_that_never_ends_stops_at_ten_timeouts() -> None:
    replay = HeldReplay(f"tcp://127.0.0.1:{free_port()}", spacing_s=0.05)
    replay.release.set()
    h = Harness(replay_endpoint=replay.endpoint)
    h.subscriber.replay_timeout_s = 0.2
    replay.publisher = h.publisher
    try:
        for n in range(200):  # 10 s of replies: far past the 2 s cap
            h.publisher.publish([stored(n % len(PROMPTS))])
        started = time.monotonic()
        h.start()
        wait_for(lambda: h.subscriber.stats.synced)
        # Bounds, not timings: it waited the ten timeouts (2 s; a busy machine only lengthens that),
        # and stopped there instead of reading the 10 s of replies.
        assert 1.8 <= time.monotonic() - started < 6
        assert 0 < h.subscriber.stats.replayed_batches < 200
    finally:
        h.close()
        replay.close()


def test_a_catch_up_without_an_answer_syncs_at_the_first_message() -> None:
    h = Harness()
    h.subscriber.replay_timeout_s = 0.3
    h.publisher.drop_replays = True  # the engine's ROUTER drops the catch-up request
    try:
        h.publisher.publish([stored(0)])
        h.start()
        time.sleep(0.6)  # the catch-up has timed out by now
        assert not h.subscriber.stats.synced
        h.publisher.drop_replays = False
        h.publisher.publish([stored(1)])  # a late start: replay from 0
        publish_until(h.publisher, lambda: h.subscriber.stats.synced)
        assert held(h.index)[:2] == [64, 64] and not h.subscriber.stats.uncertain
        assert h.publisher.replay_requests[:2] == [0, 0]
    finally:
        h.close()


def test_without_a_replay_endpoint_a_subscriber_is_synced_on_connect() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = EventPublisher(endpoint)
    subscriber = EventSubscriber("engine", endpoint, apply=lambda events: None, clear=lambda: None)
    try:
        assert not subscriber.stats.synced
        subscriber.start()
        wait_for(lambda: subscriber.stats.synced)
    finally:
        subscriber.stop()
        publisher.close()


def test_the_service_shows_synced_per_backend_and_rank() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay = HeldReplay(f"tcp://127.0.0.1:{free_port()}")
    publisher = EventPublisher(endpoint, topic="kv-events")
    replay.publisher = publisher
    publisher.publish([stored(0)])
    service = KVIndexService(replay_timeout_s=3.0)
    service.add_backend(
        "engine", KVEvents(endpoint=endpoint, replay_endpoint=replay.endpoint, topic="kv-events")
    )
    service.start()
    try:
        wait_for(lambda: service.status()["engine"]["connected"])
        status = service.status()["engine"]
        assert status["synced"] is False and status["ranks"][0]["synced"] is False
        assert not service.all_synced()
        replay.release.set()
        wait_for(service.all_synced)
        status = service.status()["engine"]
        assert status["synced"] is True and status["superseded_batches"] == 0
        assert service.longest_cached_prefix(PROMPTS[0])["engine"].tokens == 64
    finally:
        service.stop()
        publisher.close()
        replay.close()
