"""The message protocol around the batches: seq frames, replay, and the snapshot extension.

- Live (PUB): `[topic, seq, payload]`, seq an 8-byte big-endian int counting from 0 per process.
- Replay (ROUTER, asked by a DEALER): `[b"", start_seq]` is answered with `[b"", topic, seq,
  payload]` for every buffered batch whose seq >= start_seq (some vLLM versions leave the topic
  out), then the end marker `[b"", topic, END_SEQ, b""]`.
- Snapshot (kvgate's extension; vLLM's publisher answers it with the end marker alone):
  `[b"", SNAPSHOT_REQUEST]` is answered with one `[b"", topic, next_seq, payload]` whose events are
  AllBlocksCleared and then a BlockStored per block held, then the end marker. `next_seq` is the
  first live batch the snapshot does not include: apply the snapshot, then live batches from it on.
"""

from __future__ import annotations

import time

import zmq

from kvwire.decode import DecodedBatch, decode_batch
from kvwire.errors import MalformedBatch, MalformedFrame, SnapshotUnavailable

# The seq of the replay end marker: -1, eight 0xff bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
SNAPSHOT_REQUEST = b"KVSNAPSHOT"


def encode_seq(seq: int) -> bytes:
    """The 8-byte big-endian seq frame; -1 is the replay end marker."""
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    """Read a seq frame (`MalformedFrame` unless it is exactly 8 bytes); the end marker reads -1."""
    if len(frame) != 8:
        raise MalformedFrame(f"seq frame has {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def fetch_snapshot(
    replay_endpoint: str, *, timeout_s: float = 2.0, context: zmq.Context | None = None
) -> tuple[int, DecodedBatch]:
    """Ask a publisher that serves snapshots for everything it holds: (next_seq, batch).

    Apply `batch.events`, then the live batches from `next_seq` on. Uses a DEALER, as replay must
    (a REQ socket sees only the first reply). Raises `SnapshotUnavailable` on a timeout, an answer
    without a snapshot, or one that is not a batch.
    """
    context = context or zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(replay_endpoint)
        dealer.send_multipart((b"", SNAPSHOT_REQUEST))
        deadline = time.monotonic() + timeout_s
        snapshot: tuple[int, DecodedBatch] | None = None
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not dealer.poll(remaining_ms):
                raise SnapshotUnavailable(f"no complete snapshot from {replay_endpoint} within {timeout_s}s")
            frames = dealer.recv_multipart()
            if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
                raise SnapshotUnavailable(f"unexpected reply of {len(frames)} frames from {replay_endpoint}")
            if frames[2] == END_SEQ:
                if snapshot is None:
                    raise SnapshotUnavailable(f"{replay_endpoint} answered without a snapshot")
                return snapshot
            try:
                snapshot = (decode_seq(frames[2]), decode_batch(frames[3]))
            except MalformedBatch as exc:
                raise SnapshotUnavailable(
                    f"the snapshot from {replay_endpoint} is not a batch: {exc}"
                ) from None
    finally:
        dealer.close(linger=0)
