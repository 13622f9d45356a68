"""The one KV-event publisher: a PUB socket, a replay ROUTER over a bounded buffer, snapshots.

It speaks vLLM's protocol (`kvwire.replay`). `publish` sends at once on the PUB socket from the
caller's thread (serialized by a lock; a PUB send never waits: past the high-water mark ZMQ drops,
as it does for vLLM). A background thread, started only with a replay endpoint, answers replay and
snapshot requests; it sleeps in a poll that `close` wakes, so an idle publisher costs nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import msgspec
import zmq

from kvwire.encode import ENCODINGS, Encoding, encode_batch
from kvwire.errors import PublisherBindError, PublisherConfigError
from kvwire.events import AllBlocksCleared, KVEvent
from kvwire.replay import END_SEQ, SNAPSHOT_REQUEST, encode_seq

log = logging.getLogger(__name__)

SnapshotSource = Callable[[], list[KVEvent]]
_wake_ids = itertools.count()


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=False):
    """vLLM's --kv-events-config JSON (unknown keys ignored, as a newer vLLM's would be)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """Parse --kv-events-config; a `PublisherConfigError` (a ValueError) names what is wrong."""
    try:
        config = msgspec.json.decode(text, type=KVEventsConfig)
    except msgspec.DecodeError as exc:
        raise PublisherConfigError(
            f"--kv-events-config is not valid JSON for vLLM's KVEventsConfig: {exc}"
        ) from None
    if config.enable_kv_cache_events and config.publisher not in ("zmq", "null"):
        raise PublisherConfigError(
            f'--kv-events-config: publisher {config.publisher!r} is not supported; use "zmq"'
        )
    for name in ("endpoint", "replay_endpoint"):
        value = getattr(config, name)
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise PublisherConfigError(
                f"--kv-events-config: {name} {value!r} must start with tcp://, ipc:// or inproc://"
            )
    return config


def binds_by_default(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: bind on a wildcard host or a local transport, else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventPublisher:
    """Publishes event batches on PUB (seq from 0), keeps the last `buffer_steps` for replay.

    - `bind`: None follows vLLM's rule (`binds_by_default`); the replay ROUTER always binds.
    - `encoding`: how `publish` writes events (`kvwire.encode`); `publish_payload` takes bytes.
    - `snapshot_source`: the events describing everything held; without it snapshot requests are
      answered as vLLM's publisher answers them (the end marker alone). `state_lock` is the lock
      under which the owner both changes its state and calls `publish`, so that a snapshot and the
      seq it reports agree.
    - `context`: the ZMQ context to use; without one the publisher makes its own and ends it on close.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        encoding: Encoding = "vllm",
        data_parallel_rank: int | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        bind: bool | None = None,
        snapshot_source: SnapshotSource | None = None,
        state_lock: threading.RLock | threading.Lock | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        if encoding not in ENCODINGS:
            raise PublisherConfigError(
                f"unknown KV-event encoding {encoding!r}; choose one of {', '.join(ENCODINGS)}"
            )
        self.encoding: Encoding = encoding
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self._snapshot_source = snapshot_source
        self._state_lock = state_lock or threading.RLock()
        # Guards the seq, the buffer and the PUB socket (publishers may call from any thread).
        self._lock = threading.RLock()
        self._next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._closed = False
        self._owns_context = context is None
        self._context = context or zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        self._wake_receiver: zmq.Socket | None = None
        self._wake_sender: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self.endpoint = endpoint
        self.replay_endpoint: str | None = None
        try:
            if binds_by_default(endpoint) if bind is None else bind:
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            message = f"cannot open the KV-event sockets (PUB {endpoint}, replay {replay_endpoint}): {exc}"
            raise PublisherBindError(exc.errno, message) from None
        if self._replay is not None:
            wake_address = f"inproc://kvwire-publisher-wake-{next(_wake_ids)}"
            self._wake_receiver = self._context.socket(zmq.PAIR)
            self._wake_receiver.bind(wake_address)
            self._wake_sender = self._context.socket(zmq.PAIR)
            self._wake_sender.connect(wake_address)
            self._thread = threading.Thread(target=self._serve_replay, name="kvwire-replay", daemon=True)
            self._thread.start()

    # ---- publishing (any thread) ----
    def publish(self, events: Sequence[KVEvent]) -> int:
        """Encode `events` as one batch stamped now, publish it; returns its seq."""
        payload = encode_batch(
            events, ts=time.time(), data_parallel_rank=self.data_parallel_rank, encoding=self.encoding
        )
        return self.publish_payload(payload)

    def publish_payload(self, payload: bytes) -> int:
        """Publish an encoded batch under the next seq and keep it for replay; returns its seq."""
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            self._buffer.append((seq, payload))
            self._send_live([self.topic, encode_seq(seq), payload])
        return seq

    @property
    def last_seq(self) -> int:
        """The seq of the last batch published, -1 before the first."""
        with self._lock:
            return self._next_seq - 1

    def _send_live(self, frames: list[bytes]) -> None:
        """Send one live message (called under `_lock`); a closed publisher sends nothing."""
        if self._closed:
            return
        try:
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("KV event batch %d not sent: %s", int.from_bytes(frames[1], "big"), exc)

    def close(self) -> None:
        """Stop answering requests and close the sockets; later `publish` calls send nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread is not None and self._wake_sender is not None:
            self._wake_sender.send(b"")
            self._thread.join(timeout=5)
        with self._lock:
            self._close_sockets()

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay, self._wake_sender, self._wake_receiver):
            if socket is not None:
                with contextlib.suppress(zmq.ZMQError):
                    socket.close(linger=0)
        if self._owns_context:
            self._context.term()

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- replay and snapshots (the replay thread) ----
    def _serve_replay(self) -> None:
        assert self._replay is not None and self._wake_receiver is not None
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        poller.register(self._wake_receiver, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._wake_receiver in ready:
                return
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            try:
                self._answer(frames)
            except Exception:  # a failing snapshot source must not end replay for good
                log.exception("KV-event replay request not answered")

    def _answer(self, frames: list[bytes]) -> None:
        """Answer one request `[client, b"", request]`: a replay from a seq, or a snapshot."""
        if len(frames) < 3:
            log.warning("ignoring a malformed replay request of %d frames", len(frames))
            return
        client, request = frames[0], frames[-1]
        if not self._accepts(request):
            return
        if request == SNAPSHOT_REQUEST:
            if self._snapshot_source is not None:
                self._answer_snapshot(client)
        elif len(request) == 8:
            start_seq = int.from_bytes(request, "big")
            with self._lock:
                batches = [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]
            for seq, payload in batches:
                self._reply(client, encode_seq(seq), payload)
        else:
            log.warning("replay request of %d bytes is neither a seq nor a snapshot request", len(request))
        self._reply(client, END_SEQ, b"")

    def _accepts(self, request: bytes) -> bool:
        """Whether to answer this request at all (a hook: a test publisher drops some)."""
        return True

    def _reply(self, client: bytes, seq_frame: bytes, payload: bytes) -> None:
        assert self._replay is not None
        self._replay.send_multipart([client, b"", self.topic, seq_frame, payload])

    def _answer_snapshot(self, client: bytes) -> None:
        assert self._snapshot_source is not None
        with self._state_lock:
            next_seq = self.last_seq + 1
            events: list[KVEvent] = [AllBlocksCleared()]
            events.extend(self._snapshot_source())
        payload = encode_batch(
            events, ts=time.time(), data_parallel_rank=self.data_parallel_rank, encoding=self.encoding
        )
        self._reply(client, encode_seq(next_seq), payload)
