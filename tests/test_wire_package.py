"""kvwire on its own: importable without torch or the rest of kvgate, one error root, the encodings
decoding back to the events written, and the one publisher's replay and snapshot answers over
real ZMQ sockets."""

from __future__ import annotations

import errno
import inspect
import subprocess
import sys

import pytest
import zmq

import kvwire
from kvgate_testing.ports import free_port
from kvwire import (
    ENCODINGS,
    END_SEQ,
    SNAPSHOT_REQUEST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisher,
    PublisherBindError,
    WireError,
    decode_batch,
    encode_batch,
    event_kind,
)
from kvwire import errors as wire_errors


def test_kvwire_imports_without_torch_router_or_cachelayer() -> None:
    code = (
        "import sys, kvwire\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'router', 'cachelayer'))\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == ""


def test_every_wire_error_has_the_one_root_and_its_builtin_base() -> None:
    classes = [
        cls for _, cls in inspect.getmembers(wire_errors, inspect.isclass) if issubclass(cls, Exception)
    ]
    assert {cls.__name__ for cls in classes} >= {"MalformedBatch", "MalformedFrame", "SnapshotUnavailable"}
    assert all(issubclass(cls, WireError) for cls in classes)
    assert issubclass(kvwire.MalformedBatch, ValueError) and issubclass(kvwire.MalformedFrame, ValueError)
    assert issubclass(kvwire.PublisherConfigError, ValueError) and issubclass(PublisherBindError, OSError)
    with pytest.raises(ValueError):
        kvwire.decode_seq(b"\x00")


EVENTS = [
    BlockStored(
        block_hashes=[11, 12],
        parent_block_hash=10,
        token_ids=list(range(32)),
        block_size=16,
        medium="GPU",
        lora_name="adapter",
        extra_keys=[["adapter", "salt"], None],
    ),
    BlockRemoved(block_hashes=[12], medium="GPU"),
    AllBlocksCleared(),
]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_each_encoding_decodes_back_to_the_events_written(encoding: str) -> None:
    batch = decode_batch(encode_batch(EVENTS, ts=2.5, data_parallel_rank=1, encoding=encoding))  # type: ignore[arg-type]
    assert (batch.ts, batch.data_parallel_rank, batch.skipped_events) == (2.5, 1, 0)
    kinds = [event_kind(event) for event in batch.events]
    assert kinds == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    stored, removed = batch.events[0], batch.events[1]
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert (stored.block_hashes, stored.parent_block_hash) == ([11, 12], 10)
    assert stored.token_ids == list(range(32))
    assert (stored.block_size, stored.medium, removed.block_hashes) == (16, "GPU", [12])
    if encoding != "sglang":  # SGLang's field set ends at the medium
        assert (stored.lora_name, stored.extra_keys) == ("adapter", [["adapter", "salt"], None])


def test_sglang_encoding_writes_hashes_as_signed_64_bit_ints() -> None:
    big = (1 << 64) - 5
    event = BlockStored(block_hashes=[big], parent_block_hash=big, token_ids=[1], block_size=1)
    stored = decode_batch(encode_batch([event], ts=0.0, encoding="sglang")).events[0]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [big - (1 << 64)] and stored.parent_block_hash == big - (1 << 64)


def request(replay_endpoint: str, body: bytes) -> list[list[bytes]]:
    """The replies to one request on a replay socket, through the end marker."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    replies: list[list[bytes]] = []
    try:
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", body])
        while True:
            assert dealer.poll(5000), "no end marker"
            frames = dealer.recv_multipart()
            replies.append(frames)
            if frames[2] == END_SEQ:
                return replies
    finally:
        dealer.close(linger=0)
        context.term()


def test_the_publisher_replays_from_a_seq_and_answers_what_it_cannot_read_with_the_end_marker() -> None:
    with EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="t") as publisher:
        seqs = [publisher.publish([AllBlocksCleared()]) for _ in range(3)]
        assert seqs == [0, 1, 2] and publisher.last_seq == 2
        assert publisher.replay_endpoint is not None
        replies = request(publisher.replay_endpoint, (1).to_bytes(8, "big"))
        assert [kvwire.decode_seq(frames[2]) for frames in replies] == [1, 2, -1]
        assert all(frames[:2] == [b"", b"t"] for frames in replies)
        assert [event_kind(e) for e in decode_batch(replies[0][3]).events] == ["AllBlocksCleared"]
        assert request(publisher.replay_endpoint, b"not a seq") == [[b"", b"t", END_SEQ, b""]]
        # Without a snapshot source a snapshot request is answered as vLLM answers it.
        assert request(publisher.replay_endpoint, SNAPSHOT_REQUEST) == [[b"", b"t", END_SEQ, b""]]


def test_a_snapshot_holds_everything_under_the_first_seq_it_does_not_include() -> None:
    held = [BlockStored(block_hashes=[1], token_ids=list(range(16)), block_size=16, medium="cpu")]
    with EventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", encoding="vllm-array", snapshot_source=lambda: list(held)
    ) as publisher:
        publisher.publish(held)
        assert publisher.replay_endpoint is not None
        next_seq, snapshot = kvwire.fetch_snapshot(publisher.replay_endpoint)
        assert next_seq == 1
        assert snapshot.events == [AllBlocksCleared(), *held]


def test_a_publisher_that_cannot_bind_says_where_as_an_os_and_zmq_error() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with EventPublisher(endpoint, bind=True), pytest.raises(PublisherBindError, match=endpoint) as raised:
        EventPublisher(endpoint, bind=True)
    assert isinstance(raised.value, OSError) and isinstance(raised.value, zmq.ZMQError)
    assert raised.value.errno == errno.EADDRINUSE
