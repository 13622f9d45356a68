"""One engine's KV-event stream: ZMQ SUB, sequence checks, replay over DEALER, restarts.

Each subscriber runs in its own thread (blocking zmq polls release the GIL), decodes every batch
with `router.index.events` and hands the events to a callback (the index). The request path never
waits on it.

Sequence rules (protocols.md section 1):
- seq == last + 1: apply.
- seq > last + 1: a gap. Replay from last + 1 over a DEALER socket (`[b"", start_seq]`), accept
  replies of 2 or 3 frames after the empty delimiter, stop at the end marker (seq -1) or a timeout,
  drop duplicates. A gap the replay cannot fill marks the backend uncertain (shown and counted).
- seq <= last: the engine restarted (seq starts at 0 in every engine process): clear the backend
  and continue from this message.
- The first message after subscribing with seq > 0 (a late start): replay from 0 to recover what
  the engine still buffers; if that does not reach back to seq 0, the backend is uncertain.
Malformed messages are counted and logged, never fatal. ZMQ reconnects on its own, with
exponential backoff between `reconnect_initial_s` and `reconnect_max_s`.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from router.index.events import (
    DecodedBatch,
    KVEvent,
    MalformedBatch,
    decode_batch,
    decode_seq,
    encode_seq,
    event_kind,
)

logger = logging.getLogger("kvgate.index")

# Callbacks: apply(events), clear() on a restart. Both run in the subscriber's thread.
ApplyEvents = Callable[[list[KVEvent]], None]
ClearBackend = Callable[[], None]


@dataclass
class SubscriberStats:
    connected: bool = False
    last_seq: int | None = None
    batches: int = 0
    events: dict[str, int] = field(default_factory=dict)
    skipped_events: int = 0
    malformed: int = 0
    replays: int = 0
    replayed_batches: int = 0
    unrecovered_gaps: int = 0
    restarts: int = 0
    # Set when a gap could not be filled or a late start found the engine's history gone: the
    # index may hold blocks the engine already dropped (or lack some it holds).
    uncertain: bool = False
    uncertain_reason: str | None = None
    last_message_at: float | None = None
    apply_errors: int = 0
    last_error: str | None = None


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of data-parallel rank `rank`: the port plus the rank (a suffix for ipc/inproc)."""
    if rank == 0:
        return endpoint
    match = re.fullmatch(r"(tcp://.+):(\d+)", endpoint)
    if match:
        return f"{match.group(1)}:{int(match.group(2)) + rank}"
    return f"{endpoint}_dp{rank}"


def connectable(endpoint: str) -> str:
    """An engine-side bind address (`tcp://*:5557`) as an address to connect to (loopback)."""
    return re.sub(r"^tcp://(\*|0\.0\.0\.0|\[::\]|::)(?=:)", "tcp://127.0.0.1", endpoint)


class EventSubscriber:
    """Subscribes to one engine stream (one DP rank) and feeds the index from its own thread."""

    def __init__(
        self,
        name: str,
        endpoint: str,
        apply: ApplyEvents,
        clear: ClearBackend,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        bind: bool = False,
        replay_timeout_s: float = 1.0,
        reconnect_initial_s: float = 0.1,
        reconnect_max_s: float = 5.0,
        on_batch: Callable[[str, DecodedBatch], None] | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.bind = bind
        self.replay_timeout_s = replay_timeout_s
        self.reconnect_initial_s = reconnect_initial_s
        self.reconnect_max_s = reconnect_max_s
        self.stats = SubscriberStats()
        self._apply = apply
        self._clear = clear
        self._on_batch = on_batch
        self._context = context or zmq.Context.instance()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{name}", daemon=True)
        self._dealer: zmq.Socket | None = None
        self._last_malformed_log = 0.0

    # ---- lifecycle ----

    def start(self) -> None:
        self._thread.start()
        # The socket is set up (bound or connecting) once this returns.
        self._ready.wait(timeout=5)

    def stop(self, wait: bool = True) -> None:
        """Ask the thread to end (it notices within 0.1 s, or after a running replay); wait for it."""
        self._stop.set()
        if wait and self._thread.is_alive():
            self._thread.join(timeout=5)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    # ---- thread ----

    def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.RECONNECT_IVL, int(self.reconnect_initial_s * 1000))
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, int(self.reconnect_max_s * 1000))
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_CLOSED
        )
        try:
            if self.bind:
                sub.bind(self.endpoint)
            else:
                sub.connect(connectable(self.endpoint))
        except zmq.ZMQError as exc:
            self.stats.last_error = f"cannot {'bind' if self.bind else 'connect'} {self.endpoint}: {exc}"
            logger.error("kv events %s: %s", self.name, self.stats.last_error)
            self._ready.set()
            sub.close(0)
            monitor.close(0)
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if monitor in ready:
                    self._drain_monitor(monitor)
                if sub in ready:
                    # Drain what is queued, but come back to check the stop flag now and then.
                    for _ in range(1000):
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle_live(frames)
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)
            if self._dealer is not None:
                self._dealer.close(0)
            self.stats.connected = False

    def _drain_monitor(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = int.from_bytes(frames[0][:2], "little")
            if event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                self.stats.connected = True
            elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                self.stats.connected = False

    # ---- messages ----

    def _malformed(self, reason: str) -> None:
        self.stats.malformed += 1
        self.stats.last_error = reason
        now = time.monotonic()
        if now - self._last_malformed_log > 5.0:  # rate-limited: a broken peer must not flood the log
            self._last_malformed_log = now
            logger.warning("kv events %s: malformed message skipped: %s", self.name, reason)

    def _handle_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._malformed(f"{len(frames)} frames, expected 3 [topic, seq, payload]")
            return
        _topic, seq_frame, payload = frames
        try:
            seq = decode_seq(seq_frame)
        except ValueError as exc:
            self._malformed(str(exc))
            return
        if seq < 0:
            self._malformed(f"negative seq {seq} on the live stream")
            return
        try:
            batch = decode_batch(payload)
        except MalformedBatch as exc:
            self._malformed(f"seq {seq}: {exc}")
            # The seq itself is good: advance it so the next message is not taken for a gap.
            self._advance(seq, None)
            return
        self._advance(seq, batch)

    def _advance(self, seq: int, batch: DecodedBatch | None) -> None:
        stats = self.stats
        stats.last_message_at = time.time()
        last = stats.last_seq
        if last is None:
            if seq > 0:
                self._recover(0, seq, late_start=True)
        elif seq <= last:
            stats.restarts += 1
            logger.warning(
                "kv events %s: seq went back from %d to %d: engine restarted, its cache entries dropped",
                self.name,
                last,
                seq,
            )
            self._clear()
            stats.uncertain = False
            stats.uncertain_reason = None
            if seq > 0:
                self._recover(0, seq, late_start=True)
        elif seq > last + 1:
            self._recover(last + 1, seq, late_start=False)
        self._apply_batch(seq, batch)

    def _apply_batch(self, seq: int, batch: DecodedBatch | None) -> None:
        self.stats.last_seq = seq
        if batch is None:
            return
        self.stats.batches += 1
        if batch.skipped_events:
            self.stats.skipped_events += batch.skipped_events
            self._malformed(f"seq {seq}: {batch.skipped_events} undecodable events: {batch.skip_reasons[:1]}")
        if batch.events:
            counts = self.stats.events
            for event in batch.events:
                kind = event_kind(event)
                counts[kind] = counts.get(kind, 0) + 1
            try:
                self._apply(batch.events)
            except Exception:  # a bug applying one batch must not end the stream
                self.stats.apply_errors += 1
                self.stats.uncertain = True
                self.stats.uncertain_reason = f"seq {seq}: the index failed to apply the batch (see the log)"
                logger.exception("kv events %s: applying seq %d failed", self.name, seq)
        if self._on_batch is not None:
            self._on_batch(self.name, batch)

    # ---- replay ----

    def _recover(self, start: int, until: int, *, late_start: bool) -> None:
        """Replay batches start..until-1 and apply them; mark the backend uncertain when that fails."""
        missing = set(range(start, until)) if until - start <= 1_000_000 else None
        got = 0
        if self.replay_endpoint is not None:
            self.stats.replays += 1
            for seq, batch in self._replay(start):
                if seq >= until:
                    continue  # the live stream delivers these
                if missing is not None:
                    if seq not in missing:
                        continue  # duplicate
                    missing.discard(seq)
                got += 1
                self.stats.replayed_batches += 1
                self._apply_batch(seq, batch)
        complete = (missing is not None and not missing) or (missing is None and got == until - start)
        if complete:
            return
        if late_start:
            reason = f"subscribed late (first seq {until}); the engine no longer buffers seq {start}.."
        else:
            self.stats.unrecovered_gaps += 1
            reason = f"lost seq {start}..{until - 1}; replay recovered {got} of {until - start}"
        self.stats.uncertain = True
        self.stats.uncertain_reason = reason
        logger.warning("kv events %s: index uncertain: %s", self.name, reason)

    def _replay(self, start: int) -> list[tuple[int, DecodedBatch | None]]:
        """Ask the engine's ROUTER for batches from `start`; returns what arrived before the deadline."""
        assert self.replay_endpoint is not None
        if self._dealer is None:
            self._dealer = self._context.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(connectable(self.replay_endpoint))
        dealer = self._dealer
        dealer.send_multipart([b"", encode_seq(start)])
        deadline = time.monotonic() + self.replay_timeout_s
        replies: list[tuple[int, DecodedBatch | None]] = []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not dealer.poll(int(remaining * 1000) + 1):
                # The ROUTER drops at its high-water mark, end marker included. A late answer
                # must not be taken for the next replay's: start that one on a fresh socket.
                logger.warning("kv events %s: replay from seq %d timed out", self.name, start)
                dealer.close(0)
                self._dealer = None
                return replies
            frames = dealer.recv_multipart()
            # [b"", seq, payload] (vLLM < 0.26) or [b"", topic, seq, payload] (later).
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 3:
                frames = frames[1:]
            if len(frames) != 2:
                self._malformed(f"replay reply with {len(frames)} frames")
                continue
            try:
                seq = decode_seq(frames[0])
            except ValueError as exc:
                self._malformed(f"replay: {exc}")
                continue
            if seq == -1:
                return replies
            try:
                replies.append((seq, decode_batch(frames[1])))
            except MalformedBatch as exc:
                self._malformed(f"replay seq {seq}: {exc}")
                replies.append((seq, None))
