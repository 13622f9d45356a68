"""KV events over real ZMQ: vLLM's wire format, replay with its end marker, and the snapshot request."""

import time

import msgspec
import pytest
import zmq

from kvgate_testing.cachelayer import CHUNK, make_engine, request
from kvwire import (
    END_SEQ,
    SNAPSHOT_REQUEST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    SnapshotUnavailable,
    decode_batch,
    fetch_snapshot,
)


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def engine():
    engine = make_engine(
        4,
        enable_kv_events=True,
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
        kv_events_topic="kv@test",
    )
    yield engine
    engine.close()


def subscribe(context, engine):
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(engine.publisher.endpoint)
    # A PUB drops what it sends before the subscription arrives: publish probes until one lands.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        engine.publisher.publish([])
        if socket.poll(50):
            socket.recv_multipart()
            while socket.poll(50):
                socket.recv_multipart()
            return socket
    raise AssertionError("subscription never became active")


def receive(socket, timeout_ms=2000):
    assert socket.poll(timeout_ms), "no event batch arrived"
    topic, seq, payload = socket.recv_multipart()
    return topic, int.from_bytes(seq, "big"), decode_batch(payload)


def replay(context, engine, request_frame, timeout_ms=2000):
    dealer = context.socket(zmq.DEALER)
    dealer.connect(engine.publisher.replay_endpoint)
    dealer.send_multipart((b"", request_frame))
    replies = []
    try:
        while True:
            assert dealer.poll(timeout_ms), "replay did not finish (no end marker)"
            frames = dealer.recv_multipart()
            assert frames[0] == b"" and len(frames) == 4
            if frames[2] == END_SEQ:
                assert frames[3] == b""
                return replies
            replies.append((frames[1], int.from_bytes(frames[2], "big"), decode_batch(frames[3])))
    finally:
        dealer.close(linger=0)


def test_stored_events_carry_exact_chunk_tokens_parents_and_medium(context, engine):
    socket = subscribe(context, engine)
    tokens, kv = request(1, 2)
    tokens, kv = tokens[:-3], kv[:, :, :-3]
    engine.store(tokens, kv)
    topic, _, batch = receive(socket)
    assert topic == b"kv@test"
    stored = batch.events
    assert [type(event) for event in stored] == [BlockStored, BlockStored]
    assert stored[0].token_ids == tokens[:CHUNK] and stored[0].block_size == CHUNK
    assert stored[1].token_ids == tokens[CHUNK:] and stored[1].block_size == CHUNK - 3  # no overlap
    assert stored[0].parent_block_hash is None
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]
    assert {event.medium for event in stored} == {"cpu"}


def test_eviction_and_clear_are_announced(context, engine):
    socket = subscribe(context, engine)
    first_tokens, first_kv = request(1, 4)
    engine.store(first_tokens, first_kv)
    first_batch = receive(socket)[2]
    engine.store(*request(2, 2))  # the pool holds 4 chunks: two of the first request leave
    removal_batch, stored_batch = receive(socket)[2], receive(socket)[2]
    assert removal_batch.events == [
        BlockRemoved(block_hashes=[event.block_hashes[0] for event in first_batch.events[:2]], medium="cpu")
    ]
    assert [type(event) for event in stored_batch.events] == [BlockStored, BlockStored]
    engine.clear()
    assert receive(socket)[2].events == [AllBlocksCleared()]


def test_wire_format_is_vllms_tagged_arrays(context, engine):
    socket = subscribe(context, engine)
    engine.store(*request(3, 1))
    assert socket.poll(2000)
    _, seq, payload = socket.recv_multipart()
    assert len(seq) == 8
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and isinstance(raw[0], float)
    event = raw[1][0]
    assert event[0] == "BlockStored" and event[4] == CHUNK and event[6] == "cpu"


def test_replay_returns_buffered_batches_then_the_end_marker(context, engine):
    socket = subscribe(context, engine)
    for seed in range(3):
        engine.store(*request(10 + seed, 1))
    seqs = [receive(socket)[1] for _ in range(3)]
    replies = replay(context, engine, seqs[1].to_bytes(8, "big"))
    assert [seq for _, seq, _ in replies] == seqs[1:]
    assert all(topic == b"kv@test" for topic, _, _ in replies)


def test_snapshot_lists_everything_held_so_a_late_subscriber_starts_informed(context, engine):
    engine.store(*request(20, 2))
    engine.store(*request(21, 1))
    replies = replay(context, engine, SNAPSHOT_REQUEST)
    assert len(replies) == 1
    _, next_seq, batch = replies[0]
    fetched_seq, fetched = fetch_snapshot(engine.publisher.replay_endpoint, context=context)
    assert (fetched_seq, fetched.events) == (next_seq, batch.events)
    assert next_seq == engine.publisher.last_seq + 1
    assert isinstance(batch.events[0], AllBlocksCleared)
    stored = batch.events[1:]
    assert len(stored) == 3
    keys = [event.block_hashes[0] for event in stored]
    # Parents come before their children.
    for event in stored:
        if event.parent_block_hash is not None:
            assert keys.index(event.parent_block_hash) < keys.index(event.block_hashes[0])


def test_fetch_snapshot_times_out_on_a_silent_endpoint(context):
    silent = context.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(SnapshotUnavailable, match="no complete snapshot"):
            fetch_snapshot(f"tcp://127.0.0.1:{port}", timeout_s=0.3, context=context)
    finally:
        silent.close(linger=0)


def test_publisher_connects_out_when_the_endpoint_names_a_host(context):
    # vLLM's rule: bind on "*" (or ipc/inproc), connect otherwise, so a subscriber can bind instead.
    from kvwire import EventPublisher

    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    publisher = EventPublisher(f"tcp://127.0.0.1:{port}", topic="t", encoding="vllm-array")
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            publisher.publish([AllBlocksCleared()])
            if sub.poll(50):
                topic, _, payload = sub.recv_multipart()
                assert topic == b"t" and decode_batch(payload).events == [AllBlocksCleared()]
                return
        raise AssertionError("the connecting publisher never reached the bound subscriber")
    finally:
        publisher.close()
        sub.close(linger=0)
