"""Snapshots (kv_events.snapshot): a router that starts late, or sees a restart, asks the cache
layer's publisher for everything it holds instead of starting blind.

Real ZMQ sockets and a real cachelayer CacheEngine publishing its events; the vLLM-style test
publisher stands for an engine that does not answer snapshots.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import httpx
import pytest
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from cachelayer import CacheEngine
from kvgate_testing import event_publisher, waiting
from kvgate_testing.backend import start_backend
from kvgate_testing.cachelayer import CHUNK, make_engine, request
from kvgate_testing.event_publisher import block_stored
from kvgate_testing.gateway import start_gateway
from kvgate_testing.index_oracle import WritableIndex
from kvgate_testing.ports import free_port
from kvwire import AllBlocksCleared, BlockStored, EventPublisher
from router.config import KVEvents, parse_config
from router.index.python_writer import snapshot_order
from router.index.service import KVIndexService

BACKEND = "cache-a"


wait_for = functools.partial(waiting.wait_for, timeout_s=20.0)


def events_engine(endpoint: str, replay_endpoint: str, **config) -> CacheEngine:
    return make_engine(
        4,
        enable_kv_events=True,
        kv_events_endpoint=endpoint,
        kv_events_replay_endpoint=replay_endpoint,
        **config,
    )


def start_service(
    endpoint: str, replay_endpoint: str, registry: CollectorRegistry | None = None
) -> KVIndexService:
    service = KVIndexService(registry, replay_timeout_s=1.0)
    service.add_backend(BACKEND, KVEvents(endpoint=endpoint, replay_endpoint=replay_endpoint, snapshot=True))
    service.start()
    return service


def status(service: KVIndexService) -> dict:
    return service.status()[BACKEND]


def held(service: KVIndexService, tokens: list[int]) -> int:
    return service.longest_cached_prefix(tokens)[BACKEND].tokens


def probes(prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt, its prefixes at and between chunk boundaries, and a variant that diverges."""
    out = []
    for tokens in prompts:
        out.append(tokens)
        out.append(tokens[: CHUNK + 5])
        out.append(tokens[:CHUNK] + [7] * CHUNK)
    return out


Bound = TypeVar("Bound")


def rebind(make: Callable[[], Bound], timeout_s: float = 10.0) -> Bound:
    """Bind again the endpoints a closed engine or publisher held (ZMQ releases them in the background)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return make()
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.fixture
def cache_engine(tmp_path) -> Iterator[CacheEngine]:
    engine = events_engine(
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:*",
        local_disk=str(tmp_path / "l2"),
        max_local_disk_size=0.01,
    )
    try:
        yield engine
    finally:
        engine.close()


def test_a_late_router_answers_from_the_snapshot_before_any_new_event(cache_engine):
    engine = cache_engine
    prompts = []
    for seed, chunks in ((1, 3), (2, 2), (3, 3), (4, 2)):
        tokens, kv = request(seed, chunks)
        assert engine.store(tokens, kv) == len(tokens)
        prompts.append(tokens)
    tail_tokens, tail_kv = request(5, 2)
    tail_tokens, tail_kv = tail_tokens[:-3], tail_kv[:, :, :-3]  # a short tail chunk
    engine.store(tail_tokens, tail_kv)
    prompts.append(tail_tokens)
    engine.flush()  # the disk tier settled: the engine's answers no longer change
    # The CPU pool holds 4 chunks: most of the 13 stored were evicted from it (disk keeps them).
    assert engine.publisher.last_seq > 0

    registry = CollectorRegistry()
    service = start_service(engine.publisher.endpoint, engine.publisher.replay_endpoint, registry)
    try:
        wait_for(lambda: status(service)["snapshots"] == 1, what="the first snapshot")
        state = status(service)
        assert state["snapshot_failures"] == 0
        assert state["last_seq"] == engine.publisher.last_seq
        assert state["uncertain"] is False
        assert state["replays"] == 0
        for tokens in probes(prompts):
            assert held(service, tokens) == engine.lookup(tokens), tokens[:4]
        assert any(held(service, tokens) > 0 for tokens in prompts)
        # Per tier too: the CPU tier alone covers the prefix exactly when the engine needs no disk.
        cpu_only = 0
        for tokens in prompts:
            location, matched = engine.lookup_location(tokens)
            in_cpu = service.longest_cached_prefix(tokens)[BACKEND].by_tier.get("cpu", 0)
            if location == engine.cpu.name:
                cpu_only += 1
                assert in_cpu == matched
            else:
                assert in_cpu < matched or matched == 0
        assert cpu_only < len(prompts)  # evictions happened: some prompts live on disk only
        # Every block of the snapshot is in the index, or counted unplaced (its parent is held in
        # no tier, so no lookup can reach it: the engine's lookup does not count it either).
        placed = sum(state["blocks"].values())
        assert placed + state["unplaced_blocks"] == state["ranks"][0]["snapshot_blocks"] > 0

        # Live events continue from the snapshot's seq, with no gap to replay.
        time.sleep(0.5)  # the SUB subscription reaches the publisher (PUB drops until it does)
        more, more_kv = request(6, 3)
        engine.store(more, more_kv)
        wait_for(lambda: held(service, more) == len(more), what="the new prompt indexed")
        engine.flush()
        wait_for(lambda: status(service)["last_seq"] == engine.publisher.last_seq, what="live events")
        for tokens in probes([*prompts, more]):
            assert held(service, tokens) == engine.lookup(tokens)
        state = status(service)
        assert state["replays"] == 0
        assert state["unrecovered_gaps"] == 0
        assert state["snapshots"] == 1

        metrics = generate_latest(registry).decode()
        assert f'kvgate_kv_snapshots_total{{backend="{BACKEND}",outcome="ok"}} 1.0' in metrics
        assert f'kvgate_kv_snapshots_total{{backend="{BACKEND}",outcome="failed"}} 0.0' in metrics
    finally:
        service.stop()


def test_a_publisher_restart_triggers_a_fresh_snapshot(tmp_path):
    # A wildcard host: the cache layer binds it (a plain host would make its PUB connect out).
    endpoint = f"tcp://*:{free_port()}"
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = events_engine(endpoint, replay_endpoint)
    service = None
    try:
        first, first_kv = request(1, 2)
        engine.store(first, first_kv)
        service = start_service(endpoint, replay_endpoint)
        wait_for(lambda: status(service)["snapshots"] == 1, what="the first snapshot")
        assert held(service, first) == len(first)

        # A new engine process on the same endpoints: seq starts at 0 again, and it holds other
        # prompts (stored before its first event reaches the router, so a replay from 0 alone
        # would show them only if its buffer still held them: the snapshot does not depend on it).
        engine.close()
        engine = rebind(lambda: events_engine(endpoint, replay_endpoint))
        second, second_kv = request(2, 3)
        third, third_kv = request(3, 1)
        engine.store(second, second_kv)
        engine.store(third, third_kv)

        wait_for(lambda: status(service)["snapshots"] >= 2, what="a snapshot after the restart")
        wait_for(lambda: held(service, second) == len(second), what="the restarted engine's prompt")
        assert held(service, first) == 0  # the old engine's entries are gone
        assert held(service, third) == len(third)
        state = status(service)
        assert state["uncertain"] is False
        assert state["snapshot_failures"] == 0

        # And live events go on from there.
        fourth, fourth_kv = request(4, 2)
        engine.store(fourth, fourth_kv)
        wait_for(lambda: held(service, fourth) == len(fourth), what="live events after the restart")
        wait_for(lambda: status(service)["last_seq"] == engine.publisher.last_seq, what="seq caught up")
    finally:
        if service is not None:
            service.stop()
        engine.close()


def test_a_publisher_without_snapshots_falls_back_to_replay_and_counts_the_failure():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    registry = CollectorRegistry()
    with event_publisher.EventPublisher(endpoint, replay_endpoint, topic="") as publisher:
        tokens = list(range(1000, 1032))
        publisher.publish([block_stored([11], tokens[:16], 16)])
        publisher.publish([block_stored([12], tokens[16:], 16, 11)])
        service = start_service(endpoint, replay_endpoint, registry)
        try:
            wait_for(lambda: status(service)["snapshot_failures"] >= 1, what="a failed snapshot")
            assert status(service)["snapshots"] == 0
            # The stream goes on as without snapshots: a late start replays from seq 0.
            time.sleep(0.3)
            publisher.publish([block_stored([13], list(range(16)), 16)])
            wait_for(lambda: held(service, tokens) == 32, what="the replayed blocks")
            state = status(service)
            assert state["replays"] >= 1
            assert state["uncertain"] is False
            assert state["ranks"][0]["last_snapshot_error"]
            assert service.subscribers(BACKEND)[0].running
            metrics = generate_latest(registry).decode()
            assert f'kvgate_kv_snapshots_total{{backend="{BACKEND}",outcome="ok"}} 0.0' in metrics
            assert f'kvgate_kv_snapshots_total{{backend="{BACKEND}",outcome="failed"}}' in metrics
            assert f'kvgate_kv_snapshots_total{{backend="{BACKEND}",outcome="failed"}} 0.0' not in metrics
        finally:
            service.stop()


def test_garbage_in_answer_to_a_snapshot_is_a_failed_snapshot_not_a_crash():
    """A publisher that answers the snapshot request with an undecodable batch."""
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(replay_endpoint)
    stop = threading.Event()

    def answer_garbage() -> None:
        while not stop.is_set():
            if router.poll(50):
                identity, *_ = router.recv_multipart()
                router.send_multipart([identity, b"", b"", (5).to_bytes(8, "big"), b"\xc1not msgpack"])
                router.send_multipart([identity, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    thread = threading.Thread(target=answer_garbage, daemon=True)
    thread.start()
    service = start_service(endpoint, replay_endpoint)
    try:
        wait_for(lambda: status(service)["snapshot_failures"] >= 1, what="a failed snapshot")
        state = status(service)
        assert state["snapshots"] == 0
        assert "decoded" in state["ranks"][0]["last_snapshot_error"]
        # Nothing was taken from the garbage: the catch-up replay that follows the failed snapshot
        # got the same garbage, counted it as malformed and applied nothing.
        wait_for(lambda: status(service)["malformed"] >= 1, what="the garbage counted")
        assert status(service)["blocks"] == {}
        assert service.subscribers(BACKEND)[0].running
    finally:
        service.stop()
        stop.set()
        thread.join(timeout=2)
        pub.close(0)
        router.close(0)
        context.term()


def test_a_lookup_never_sees_a_half_applied_snapshot():
    """Lookups racing snapshots that swap between two states see one state or the other."""
    index = WritableIndex()
    index.add_backend("a")
    prompt = list(range(5000, 5000 + 64 * 16))

    def chain(length_blocks: int, first_hash: int) -> list:
        events: list = [AllBlocksCleared()]
        parent = None
        for block in range(length_blocks):
            block_hash = first_hash + block
            events.append(
                BlockStored(
                    block_hashes=[block_hash],
                    parent_block_hash=parent,
                    token_ids=prompt[block * 16 : (block + 1) * 16],
                    block_size=16,
                    medium="cpu",
                )
            )
            parent = block_hash
        return events

    long_state, short_state = chain(64, 1_000), chain(8, 9_000)
    index.replace_backend("a", long_state)
    seen: set[int] = set()
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            index.replace_backend("a", short_state)
            index.replace_backend("a", long_state)

    writer = threading.Thread(target=swap, daemon=True)
    writer.start()
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            seen.add(index.longest_cached_prefix(prompt)["a"].tokens)
    finally:
        stop.set()
        writer.join(timeout=5)
    assert seen <= {64 * 16, 8 * 16}, seen
    assert index.stats("a").blocks == {"cpu": 64}


def test_snapshot_order_places_children_after_parents_held_in_another_tier():
    parent = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=list(range(16)), block_size=16)
    child_cpu = BlockStored(
        block_hashes=[2], parent_block_hash=1, token_ids=list(range(16, 32)), block_size=16, medium="cpu"
    )
    parent_disk = BlockStored(
        block_hashes=[1], parent_block_hash=None, token_ids=list(range(16)), block_size=16, medium="disk"
    )
    ordered = snapshot_order([AllBlocksCleared(), child_cpu, parent_disk, parent])
    assert isinstance(ordered[0], AllBlocksCleared)
    assert ordered.index(child_cpu) > ordered.index(parent_disk)
    index = WritableIndex()
    index.replace_backend("a", [AllBlocksCleared(), child_cpu, parent_disk])
    match = index.longest_cached_prefix(list(range(32)))["a"]
    assert match.tokens == 32
    assert match.by_tier == {"cpu": 0, "disk": 16}


def test_snapshot_needs_a_replay_endpoint():
    with pytest.raises(ValueError, match="replay_endpoint"):
        KVEvents(endpoint="tcp://127.0.0.1:5557", snapshot=True)
    kv_events = {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}
    backend = {"name": "a", "url": "http://127.0.0.1:8000", "kv_events": {**kv_events, "snapshot": True}}
    config = parse_config({"models": [{"name": "m"}], "backends": [backend]})
    assert config.backends[0].kv_events.snapshot is True
    default = parse_config({"models": [{"name": "m"}], "backends": [{**backend, "kv_events": kv_events}]})
    assert default.backends[0].kv_events.snapshot is False


def test_the_gateway_shows_snapshots_on_the_page_metrics_and_lookup(cache_engine):
    """The real gateway process with `snapshot: true` against a CacheEngine that stored first."""
    engine = cache_engine
    prompts = []
    for seed, chunks in ((1, 2), (2, 3)):
        tokens, kv = request(seed, chunks)
        engine.store(tokens, kv)
        prompts.append(tokens)
    engine.flush()
    backend = start_backend("b1", ["m"])
    try:
        kv_events = {
            "endpoint": engine.publisher.endpoint,
            "replay_endpoint": engine.publisher.replay_endpoint,
            "snapshot": True,
        }
        config = {
            "models": [{"name": "m", "tokenizer": "builtin:qwen3"}],
            "backends": [{"name": "b1", "url": backend.url, "kv_events": kv_events}],
            "policy": {"name": "kv_aware"},
        }
        with start_gateway(config) as gateway, httpx.Client(base_url=gateway.url, timeout=30) as client:

            def page() -> dict:
                return client.get("/debug/prefix-map", params={"format": "json"}).json()["backends"]["b1"]

            wait_for(lambda: page()["snapshots"] == 1, what="the snapshot on /debug/prefix-map")
            entry = page()
            assert entry["snapshot_failures"] == 0
            assert entry["last_seq"] == engine.publisher.last_seq
            held_by_engine = [engine.lookup(tokens) for tokens in prompts]
            for tokens, engine_tokens in zip(prompts, held_by_engine, strict=True):
                answer = client.post("/lookup", json={"tokens": tokens}).json()
                assert answer["layout_info"].get("b1", [None, 0])[1] == engine_tokens, (answer, entry)
            assert max(held_by_engine) > 0
            html_page = client.get("/debug/prefix-map").text
            assert "<th>Snapshots</th>" in html_page
            metrics = client.get("/metrics").text
            assert 'kvgate_kv_snapshots_total{backend="b1",outcome="ok"} 1.0' in metrics
    finally:
        backend.stop()


class SnapshotReplaySocket:
    """The cache layer's real publisher serving only the replay socket (with snapshots), its
    state set by the test; the live stream comes from the vLLM-style test publisher, so the test
    picks every live seq (lost messages, a seq going back)."""

    def __init__(self, replay_endpoint: str) -> None:
        self.held: list = []
        self.publisher = rebind(
            lambda: EventPublisher(
                "tcp://127.0.0.1:*",
                replay_endpoint,
                encoding="vllm-array",
                buffer_steps=1,
                snapshot_source=lambda: list(self.held),
            )
        )

    def advance_to(self, next_seq: int) -> None:
        """Publish empty batches until the next seq the snapshot reports is `next_seq`."""
        while self.publisher.last_seq + 1 < next_seq:
            self.publisher.publish([])


def chunks_of(tokens: list[int], first_hash: int, medium: str = "cpu") -> list[BlockStored]:
    """Cache-layer BlockStored events for `tokens` in 16-token chunks, chained from `first_hash`."""
    events = []
    for index in range(len(tokens) // 16):
        events.append(
            BlockStored(
                block_hashes=[first_hash + index],
                parent_block_hash=first_hash + index - 1 if index else None,
                token_ids=tokens[index * 16 : (index + 1) * 16],
                block_size=16,
                medium=medium,
            )
        )
    return events


def test_an_unfillable_gap_and_a_seq_going_back_are_answered_by_snapshots():
    live_endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    prompt_a = list(range(100, 148))
    prompt_b = list(range(200, 232))
    prompt_c = list(range(300, 316))
    prompt_e = list(range(500, 532))
    snapshots = SnapshotReplaySocket(replay_endpoint)
    live = event_publisher.EventPublisher(live_endpoint, topic="")
    service = None
    try:
        snapshots.held = chunks_of(prompt_a[:32], 1)
        snapshots.advance_to(3)
        service = start_service(live_endpoint, replay_endpoint)
        wait_for(lambda: status(service)["snapshots"] == 1, what="the first snapshot")
        assert status(service)["last_seq"] == 2
        assert held(service, prompt_a) == 32
        time.sleep(0.3)  # the SUB subscription reaches the live publisher

        live.next_seq = 3
        live.publish([block_stored([3], prompt_a[32:], 16, 2, medium="cpu")])
        wait_for(lambda: held(service, prompt_a) == 48, what="live seq 3 applied")

        # Seq 4 is lost and the replay buffer no longer has it: the engine meanwhile dropped A
        # and holds B. Seq 5 (C) was published before the snapshot, which includes it.
        live.publish([block_stored([4], list(range(900, 916)), 16, medium="cpu")], send=False)
        snapshots.held = chunks_of(prompt_b, 10)
        snapshots.advance_to(6)
        live.publish([block_stored([99], prompt_c, 16, medium="cpu")])
        wait_for(lambda: status(service)["snapshots"] == 2, what="a snapshot after the lost gap")
        state = status(service)
        assert state["unrecovered_gaps"] == 1
        assert state["uncertain"] is False
        assert state["last_seq"] == 5
        assert held(service, prompt_a) == 0
        assert held(service, prompt_b) == 32
        assert held(service, prompt_c) == 0  # seq 5 is in the snapshot, not applied again
        live.publish([block_stored([100], prompt_c, 16, medium="cpu")])  # seq 6
        wait_for(lambda: held(service, prompt_c) == 16, what="live seq 6 applied")

        # The engine restarts: its replay socket comes back on the same endpoint, seq from 0.
        snapshots.publisher.close()
        snapshots = SnapshotReplaySocket(replay_endpoint)
        snapshots.held = chunks_of(prompt_e, 50)
        snapshots.advance_to(1)
        time.sleep(0.3)  # the subscriber's DEALER reconnects to the new ROUTER
        live.next_seq = 0
        live.publish([block_stored([7], list(range(700, 716)), 16, medium="cpu")])  # seq 0, in the snapshot
        wait_for(lambda: status(service)["snapshots"] == 3, what="a snapshot after the restart")
        state = status(service)
        assert state["restarts"] == 1
        assert state["last_seq"] == 0
        assert held(service, prompt_b) == 0 and held(service, prompt_c) == 0
        assert held(service, prompt_e) == 32
        assert held(service, list(range(700, 716))) == 0
        live.publish([block_stored([52], list(range(600, 616)), 16, 51, medium="cpu")])  # seq 1: E's child
        wait_for(lambda: held(service, [*prompt_e, *range(600, 616)]) == 48, what="live seq 1 applied")
        assert status(service)["restarts"] == 1
    finally:
        if service is not None:
            service.stop()
        live.close()
        snapshots.publisher.close()
