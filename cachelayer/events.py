"""The cache layer's KV events and the ZMQ publisher that speaks vLLM's event protocol.

Wire types (msgpack, array-like, tagged by class name as vLLM encodes them):
- BlockStored: one per chunk; block_hashes = [chunk key], parent_block_hash = the previous
  chunk's key, token_ids = exactly the chunk's tokens (no one-token overlap), block_size = the
  chunk's token count, medium "cpu", "disk" or "remote" (the shared Redis tier); a salted
  chain's first chunk carries [(cache_salt,)] in extra_keys, as vLLM's events do.
- BlockRemoved: the keys of chunks that left a tier (eviction, clear, move).
- AllBlocksCleared: everything is gone.

Transport (as vLLM's ZmqEventPublisher): PUB sends `[topic, seq (8 bytes big-endian), payload]`
with seq counting from 0; the ROUTER replay socket answers `[b"", start_seq]` with
`[b"", topic, seq, payload]` for each buffered batch whose seq >= start_seq, then the end marker
`[b"", topic, seq=-1 (eight 0xff bytes), b""]`.

Extension: the request `[b"", b"KVSNAPSHOT"]` on the replay socket returns everything held now
as one batch `[b"", topic, seq, payload]` whose events start with AllBlocksCleared followed by a
BlockStored per chunk and tier. Here seq is the first live batch NOT included in the snapshot
(one past the last batch published when it was taken): a late subscriber applies the snapshot,
then applies live batches from seq on (replaying from seq if it already missed some). The end
marker follows.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SNAPSHOT_REQUEST = b"KVSNAPSHOT"


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the event types; the tag is the class name, as vLLM writes it."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # As vLLM: per block, the extra keys of its hash; the cache layer sets [(cache_salt,)] on a
    # salted chain's first chunk.
    extra_keys: list[tuple[str, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    return _decoder.decode(payload)


def _binds(endpoint: str) -> bool:
    # vLLM's rule: bind on a wildcard host or a local transport, otherwise connect.
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes event batches on PUB, keeps the last `buffer_steps` for replay, answers snapshots.

    `publish` may be called from any thread; one background thread owns the sockets.
    `snapshot_source` returns the events describing everything held; `state_lock` is the lock
    under which the owner both mutates its state and calls `publish`, so a snapshot and its seq agree.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int | None = None,
        snapshot_source: Callable[[], list[Event]] | None = None,
        state_lock: threading.RLock | threading.Lock | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self._topic = topic.encode()
        self._dp_rank = data_parallel_rank
        self._snapshot_source = snapshot_source
        self._state_lock = state_lock or threading.RLock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._outgoing: queue.SimpleQueue[tuple[int, bytes] | None] = queue.SimpleQueue()
        self._seq_lock = threading.Lock()
        self._next_seq = 0
        self._context = context or zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if _binds(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cachelayer-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Event]) -> int:
        """Queue one batch; returns its seq."""
        batch = EventBatch(ts=time.time(), events=events, data_parallel_rank=self._dp_rank)
        payload = encode_batch(batch)
        with self._seq_lock:
            seq = self._next_seq
            self._next_seq += 1
            self._outgoing.put((seq, payload))
        return seq

    @property
    def last_seq(self) -> int:
        """The seq of the last batch published, -1 before the first."""
        with self._seq_lock:
            return self._next_seq - 1

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._outgoing.put(None)
        self._thread.join(timeout=5)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # ---- the socket thread ----
    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._closed.is_set():
            try:
                item = self._outgoing.get(timeout=0.005 if self._replay is not None else 0.1)
            except queue.Empty:
                item = ()
            while item:
                seq, payload = item
                self._buffer.append((seq, payload))
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
                try:
                    item = self._outgoing.get_nowait()
                except queue.Empty:
                    item = ()
            if item is None:
                break
            if self._replay is not None and poller.poll(0):
                self._answer_replay()

    def _answer_replay(self) -> None:
        assert self._replay is not None
        try:
            frames = self._replay.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(frames) < 3:
            log.warning("cachelayer events: malformed replay request (%d frames), ignored", len(frames))
            return
        client, request = frames[0], frames[-1]
        if request == SNAPSHOT_REQUEST:
            self._answer_snapshot(client)
        elif len(request) == 8:
            start_seq = int.from_bytes(request, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        else:
            log.warning(
                "cachelayer events: replay request of %d bytes is neither a seq nor a snapshot", len(request)
            )
        self._replay.send_multipart((client, b"", self._topic, END_SEQ, b""))

    def _answer_snapshot(self, client: bytes) -> None:
        assert self._replay is not None
        with self._state_lock:
            seq = self.last_seq
            events: list[Event] = [AllBlocksCleared()]
            if self._snapshot_source is not None:
                events.extend(self._snapshot_source())
        payload = encode_batch(EventBatch(ts=time.time(), events=events, data_parallel_rank=self._dp_rank))
        next_seq = (seq + 1).to_bytes(8, "big")
        self._replay.send_multipart((client, b"", self._topic, next_seq, payload))


class SnapshotUnavailable(Exception):
    """The publisher did not answer a snapshot request in time (or answered something else)."""


def fetch_snapshot(
    replay_endpoint: str, *, timeout_s: float = 2.0, context: zmq.Context | None = None
) -> tuple[int, EventBatch]:
    """Ask a cache-layer publisher for everything it holds: (next_seq, batch).

    Apply `batch.events` (AllBlocksCleared, then one BlockStored per chunk and tier), then the live
    batches from `next_seq` on. Uses a DEALER, as replay must (a REQ socket sees only the first reply).
    """
    context = context or zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(replay_endpoint)
        dealer.send_multipart((b"", SNAPSHOT_REQUEST))
        deadline = time.monotonic() + timeout_s
        snapshot: tuple[int, EventBatch] | None = None
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not dealer.poll(remaining_ms):
                raise SnapshotUnavailable(f"no complete snapshot from {replay_endpoint} within {timeout_s}s")
            frames = dealer.recv_multipart()
            if len(frames) != 4 or frames[0] != b"":
                raise SnapshotUnavailable(f"unexpected reply of {len(frames)} frames from {replay_endpoint}")
            if frames[2] == END_SEQ:
                if snapshot is None:
                    raise SnapshotUnavailable(f"{replay_endpoint} answered without a snapshot")
                return snapshot
            snapshot = (int.from_bytes(frames[2], "big"), decode_batch(frames[3]))
    finally:
        dealer.close(linger=0)
