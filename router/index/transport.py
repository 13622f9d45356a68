"""One engine's KV-event stream over ZMQ: the SUB, the replay DEALER and the thread that drains them.

`EventSubscriber` runs in its own thread (blocking zmq polls release the GIL; the request path
never waits on it). It reads live batches (decoded by `kvwire`), asks `stream.EventStream` what
each one means (apply, drop, replay a gap, take a snapshot, clear a restarted engine's entries)
and carries that out: replays and snapshots over a DEALER, events into the index through the
callbacks it is given.

Live messages are drained, not read one per wakeup: every message queued when the socket turns
readable is handled in that wakeup, and the payloads of consecutive in-order batches are held, as
they came, and go to the index in one call (`_drain`, `apply_payloads`: the index writer scans or
decodes each itself), flushed before anything else touches the index (a gap's replay, a restart,
a snapshot) and at the end of the drain, so the index sees the same events in the same order and a
burst of one-block messages pays one index call, not one per message. A replay skips dead work:
AllBlocksCleared empties the whole backend, so replayed batches before the last one holding a
clear are neither decoded nor applied.

Malformed messages are counted and logged, never fatal. ZMQ reconnects on its own, with
exponential backoff between `reconnect_initial_s` and `reconnect_max_s`.

Bounds (one bad engine costs its own stream little and the others nothing):
- A live message whose payload is over `max_message_bytes` is dropped (counted in `oversized`,
  logged rate-limited): its seq advances and the backend is uncertain (its events are lost). ZMQ
  refuses a frame over twice that before buffering it (MAXMSGSIZE: the connection is dropped and
  comes back, and what it carried shows as a gap); a replay reply over it is dropped like a lost one.
- While a replay or snapshot request waits, live messages keep being read, into a queue of at
  most `max_queued_bytes` (tail drop past it: `dropped_messages`; the lost seqs are a gap the next
  message finds), handled in order once the request ends; ZMQ's own queue is not left to grow.
- A request waits at most `replay_timeout_s` without a reply, and a silent replay endpoint is not
  asked again for a while (`stream.ReplayWait`, `stream.ReplayBackoff`).
Each subscriber has its own thread and sockets, so these waits never hold up another backend's
stream.

Snapshots (`kv_events.snapshot: true`, cache-layer publishers only: vLLM's has no such request):
the request `[b"", b"KVSNAPSHOT"]` on the replay socket is answered with one batch holding
everything the engine holds (AllBlocksCleared, then a BlockStored per block and tier) under seq =
the first live batch it does not include, then the end marker. The stream asks for one when the
state is unknown (`EventStream.on_connected`, a restart, a gap the replay could not fill); it
replaces the backend's entries at once (`replace`). A snapshot that fails (timeout, no snapshot in
the answer, garbage) is counted and logged, and the stream goes on as without snapshots.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvwire import (
    SNAPSHOT_REQUEST,
    AllBlocksCleared,
    DecodedBatch,
    KVEvent,
    MalformedBatch,
    decode_batch,
    decode_seq,
    encode_seq,
    event_class_kind,
    event_kind,
)
from kvwire.frames import WireBatch
from router.config import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_QUEUED_BYTES
from router.errors import KvgateError
from router.index.stream import (
    EventStream,
    LiveStep,
    MalformedReply,
    ReplayWait,
    StreamStats,
    Verdict,
    parse_replay_reply,
    replies_in_range,
)

logger = logging.getLogger("kvgate.index")

# Callbacks: apply(events), clear() on a restart, replace(events) with a snapshot, and
# apply_payloads(payloads) for the raw in-order payloads a drain held, returning what was read of
# each (`IndexWriter.apply_payloads`). All run in the subscriber's thread.
ApplyEvents = Callable[[list[KVEvent]], None]
ApplyPayloads = Callable[[list[bytes]], list[Any]]
ClearBackend = Callable[[], None]
ReplaceBackend = Callable[[list[KVEvent]], None]

# The event tag as msgpack spells it in either encoding: a payload without these bytes holds no
# clear, so replayed batches are searched for the last clear without decoding them.
_CLEARED_TAG = b"AllBlocksCleared"
# Replayed events go to the index in calls of at most this many (one lock hold stays short).
_REPLAY_APPLY_CHUNK = 8192
# One wakeup handles at most this many queued live messages (then the stop flag is checked), and
# the in-order payloads it holds back go to the index whenever they reach `_DRAIN_APPLY_BYTES`, so a
# long burst is applied in steps (a lookup meanwhile sees the stream a few ms behind, not more).
# Bytes, not events: the index's work on a payload follows its hashes and token ids (a prefill of
# many blocks is one event), and a held payload is not read before its apply.
_DRAIN_MAX_MESSAGES = 1000
_DRAIN_APPLY_BYTES = 64 * 1024
# Replies queued per DEALER.
_REPLAY_RCVHWM = 200_000
# Live messages read into the queue per wakeup of a request's wait (then the wait goes on).
_QUEUE_READ_BATCH = 1000
# Seconds between two log lines of one kind per stream: a broken or flooding peer must not flood the log.
_LOG_INTERVAL_S = 5.0


def receive_frames(socket: zmq.Socket) -> list[bytes]:
    """The frames of the next queued message (zmq.Again when none is queued).

    `recv_multipart` asks the socket for RCVMORE after every frame, a getsockopt that is costly in
    pyzmq (docs/benchmarks.md); a frame received without copying carries the flag (`Frame.more`).
    Parts after the first are there already (ZMQ delivers a multipart message whole)."""
    frame = socket.recv(zmq.NOBLOCK, copy=False)
    frames = [frame.bytes]
    while frame.more:
        frame = socket.recv(copy=False)
        frames.append(frame.bytes)
    return frames


class SnapshotFailed(KvgateError):
    """The publisher gave no usable snapshot (timeout, only an end marker, or garbage)."""


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
        context: zmq.Context | None = None,
        replace: ReplaceBackend | None = None,
        snapshot_after_outage_s: float = 0.0,
        apply_payloads: ApplyPayloads | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
    ) -> None:
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.bind = bind
        self.replay_timeout_s = replay_timeout_s
        self.reconnect_initial_s = reconnect_initial_s
        self.reconnect_max_s = reconnect_max_s
        self.max_message_bytes = max_message_bytes
        self.max_queued_bytes = max_queued_bytes
        # Snapshots need the replay socket and somewhere to put them.
        self._replace = replace if replay_endpoint is not None else None
        self._stream = EventStream(
            replay=replay_endpoint is not None,
            snapshot=self._replace is not None,
            replay_timeout_s=replay_timeout_s,
            snapshot_after_outage_s=snapshot_after_outage_s,
        )
        self.stats: StreamStats = self._stream.stats
        self._apply = apply
        self._clear = clear
        # The in-order live payloads go to the index raw (`KVIndexService` passes the writer's
        # `apply_payloads`, which reads most of them without decoding them); without it they are
        # decoded here and their events given to `apply`.
        self._apply_payloads = apply_payloads if apply_payloads is not None else self._decode_and_apply
        self._context = context or zmq.Context.instance()
        self._stop = threading.Event()
        # stop() writes a byte here to wake the thread's poll, which otherwise waits for messages
        # without a timeout: an idle gateway spends no CPU polling a timer to notice the stop flag.
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_writer.setblocking(False)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{name}", daemon=True)
        self._dealer: zmq.Socket | None = None
        self._sub: zmq.Socket | None = None
        # Live messages read while a request waited, in order, handled before the socket's next.
        self._queued: collections.deque[list[bytes]] = collections.deque()
        self._last_log: dict[str, float] = {}
        # While a drain runs: the payloads of in-order live batches not yet given to the index, as
        # they came, their bytes, and the seq of the first one.
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._held_from: int | None = None

    # ---- lifecycle ----

    def start(self) -> None:
        self._thread.start()
        # The socket is set up (bound or connecting) once this returns.
        self._ready.wait(timeout=5)

    def stop(self, wait: bool = True) -> None:
        """Ask the thread to end (at once, or after a running replay); wait for it."""
        self._stop.set()
        # OSError: stopped before (the pair is closed), or the buffer is full of wake-ups already.
        with contextlib.suppress(OSError):
            self._wake_writer.send(b"\0")
        if wait and self._thread.is_alive():
            self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._wake_writer.close()
            if self._thread.ident is None:  # never started: its end of the pair is not closed yet
                self._wake_reader.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    # ---- thread ----

    def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        # ZMQ buffers a whole message before handing it over: refuse absurd frames before that.
        sub.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_message_bytes)
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
            self.stats.socket_error = self.stats.last_error
            logger.error("kv events %s: %s", self.name, self.stats.last_error)
            self._ready.set()
            sub.close(0)
            monitor.close(0)
            self._wake_reader.close()
            return
        self._ready.set()
        self._sub = sub
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake_reader, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(0 if self._queued else None))
                if monitor in ready:
                    self._drain_monitor(monitor)
                if sub in ready or self._queued:
                    self._drain(sub)
        finally:
            self._wake_reader.close()
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)
            if self._dealer is not None:
                self._dealer.close(0)
            self.stats.connected = False

    def _drain(self, sub: zmq.Socket) -> None:
        """Handle the queued live messages (at most `_DRAIN_MAX_MESSAGES`, then the stop flag is
        checked again); consecutive in-order batches reach the index in one `apply` call.

        The cyclic GC is paused for the drain (a few ms at most), as `PrefixIndex.apply` pauses it:
        the held batches keep a few tracked containers per message alive until their apply, and
        the collections they would set off add a fifth or more to the drain's own work per message
        (docs/benchmarks.md, "The KV-event subscriber")."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            queued = self._queued
            for _ in range(_DRAIN_MAX_MESSAGES):
                if queued:  # read while a request waited: older than what the socket holds
                    frames = queued.popleft()
                    self.stats.queued_bytes -= _size(frames)
                else:
                    try:
                        frames = receive_frames(sub)
                    except zmq.Again:
                        break
                self._handle_live(frames)
                if self._held_bytes >= _DRAIN_APPLY_BYTES:
                    self._release_held()
        finally:
            try:
                self._release_held()
            finally:
                if collecting:
                    gc.enable()

    def _release_held(self) -> None:
        """Give the index the payloads held back by the drain, in one call, and count what it read
        of them."""
        if not self._held:
            return
        payloads, first = self._held, self._held_from
        self._held, self._held_bytes, self._held_from = [], 0, None
        assert first is not None  # (set with the first payload held)
        read = self._guarded(self._apply_payloads, payloads, f"seq {first}..{self._stream.newest_seq}")
        self._stream.released(None if read is None else self._count_read(first, read))

    def _count_read(self, first: int, read: list[Any]) -> float | None:
        """Count what the index read of held payloads (`first`: the first one's seq): batches and
        their events by kind, those read undecoded, undecodable events and payloads (a payload
        the decoder refuses is malformed; its seq advanced all the same). Returns the ts of the
        newest batch read (None: none was)."""
        stats = self.stats
        newest_ts = None
        decoded_events: list[KVEvent] = []
        batches = scanned = stored = removed = cleared = 0
        for position, batch in enumerate(read):
            cls = batch.__class__
            if cls is DecodedBatch:
                if batch.skipped_events:
                    self._count_skipped(first + position, batch)
                decoded_events += batch.events
            elif cls is WireBatch:
                scanned += 1
                stored += batch.stored
                removed += batch.removed
                cleared += batch.cleared
            else:  # the decoder's refusal (MalformedBatch)
                self._malformed(f"seq {first + position}: {batch}")
                continue
            batches += 1
            newest_ts = batch.ts
        stats.batches += batches
        if decoded_events:
            _count_kinds(stats.events, decoded_events)
        if scanned:
            stats.scanned_batches += scanned
            kinds = (("BlockStored", stored), ("BlockRemoved", removed), ("AllBlocksCleared", cleared))
            for kind, number in kinds:
                if number:
                    stats.events[kind] = stats.events.get(kind, 0) + number
        return newest_ts

    def _decode_and_apply(self, payloads: list[bytes]) -> list[DecodedBatch | MalformedBatch]:
        """`apply_payloads` for a subscriber given none: each payload decoded, their events given
        to `apply` in one call."""
        read: list[DecodedBatch | MalformedBatch] = []
        events: list[KVEvent] = []
        for payload in payloads:
            try:
                batch = decode_batch(payload)
            except MalformedBatch as refused:
                read.append(refused.with_traceback(None))  # (no cycle through this frame)
                continue
            read.append(batch)
            events += batch.events
        if events:
            self._apply(events)
        return read

    def _drain_monitor(self, monitor: zmq.Socket) -> None:
        stream = self._stream
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = int.from_bytes(frames[0][:2], "little")
            if event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                snapshot_taken = False
                if stream.on_connected(time.monotonic()):
                    snapshot_taken = self._take_snapshot(
                        "connected" if self.stats.last_seq is None else "reconnected"
                    )
                if not snapshot_taken and stream.needs_catch_up():
                    self._catch_up()
            elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                stream.on_disconnected(time.monotonic())

    # ---- messages ----

    def _log_limited(self, kind: str, message: str, *args: object) -> None:
        """Log a warning, at most one of `kind` per `_LOG_INTERVAL_S` (a broken peer must not flood
        the log)."""
        now = time.monotonic()
        if now - self._last_log.get(kind, -_LOG_INTERVAL_S) > _LOG_INTERVAL_S:
            self._last_log[kind] = now
            logger.warning(message, *args)

    def _malformed(self, reason: str) -> None:
        self.stats.malformed += 1
        self.stats.last_error = reason
        self._log_limited("malformed", "kv events %s: malformed message skipped: %s", self.name, reason)

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
        if len(payload) > self.max_message_bytes:
            self._oversized(seq, len(payload))
            return
        # The usual message: the next seq, nothing to check. Held as it came, for one apply per drain
        # (read, and its batch and events counted, then).
        if self._stream.is_next(seq):
            self.stats.last_message_at = time.time()
            self._stream.take_next(seq)
            if self._held_from is None:
                self._held_from = seq
            self._held.append(payload)
            self._held_bytes += len(payload)
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
        """A live batch that is not simply the next one (or an undecodable one): do what the stream says."""
        self.stats.last_message_at = time.time()
        # Anything but the next seq may clear, replay into or replace the backend: the held events go first.
        self._release_held()
        step = self._stream.on_live(seq, None if batch is None else batch.ts)
        if step.verdict is Verdict.ALREADY_HELD:
            return
        if step.verdict is Verdict.DUPLICATE:
            self._log_limited(
                "duplicate",
                "kv events %s: seq %d (last applied %d) published no later than the last batch: "
                "a duplicate or stale message, ignored",
                self.name,
                seq,
                step.last_seq,
            )
            return
        if step.restart:
            logger.warning(
                "kv events %s: seq went back from %d to %d: engine restarted, its cache entries dropped",
                self.name,
                step.last_seq,
                seq,
            )
            if self._replace is not None and self._take_snapshot(f"restart (seq {step.last_seq} -> {seq})"):
                self._continue_after_snapshot(seq, batch)
                self._stream.restarted()
                return
            self._clear()
            self._stream.cleared()
        recovered = step.replay_from is None or self._recover(
            step.replay_from, seq, late_start=step.late_start
        )
        if (
            not recovered
            and self._replace is not None
            and self._take_snapshot(f"unrecovered gap ({self.stats.uncertain_reason})")
        ):
            self._continue_after_snapshot(seq, batch)
        else:
            self._apply_batch(seq, batch)
        if step.restart:
            self._stream.restarted()

    def _oversized(self, seq: int, size: int) -> None:
        """Drop a live message over `max_message_bytes`: its seq advances (no false gap), and the
        backend is uncertain, since the events it carried are lost."""
        self.stats.oversized += 1
        reason = f"seq {seq} dropped: {size} bytes, over max_message_bytes ({self.max_message_bytes})"
        self._log_limited("drop", "kv events %s: dropped %s", self.name, f"the live message of {reason}")
        self._advance(seq, None)
        if self.stats.last_seq == seq:  # (applied as the next seq, not taken for a duplicate)
            self._stream.mark_uncertain(reason)

    def _queue_live(self, sub: zmq.Socket) -> None:
        """Read the live messages queued on the socket into `_queued` (a request is waiting), at
        most `max_queued_bytes` in all: past that, messages are dropped (their seqs become a gap)."""
        stats = self.stats
        for _ in range(_QUEUE_READ_BATCH):
            try:
                frames = receive_frames(sub)
            except zmq.Again:
                return
            size = _size(frames)
            if stats.queued_bytes + size > self.max_queued_bytes:
                stats.dropped_messages += 1
                stats.dropped_bytes += size
                self._log_limited(
                    "drop",
                    "kv events %s: dropped %s",
                    self.name,
                    f"a live message of {size} bytes: {stats.queued_bytes} bytes already queued while "
                    f"the replay endpoint is asked (max_queued_bytes {self.max_queued_bytes})",
                )
                continue
            self._queued.append(frames)
            stats.queued_bytes += size
            stats.queued_bytes_peak = max(stats.queued_bytes_peak, stats.queued_bytes)

    def _continue_after_snapshot(self, seq: int, batch: DecodedBatch | None) -> None:
        """Handle the live batch that led to a snapshot: drop it if the snapshot holds it."""
        step: LiveStep = self._stream.after_snapshot(seq)
        if step.verdict is not Verdict.APPLY:
            return
        if step.replay_from is not None:
            self._recover(step.replay_from, seq, late_start=False)
        self._apply_batch(seq, batch)

    # ---- snapshot ----

    def _take_snapshot(self, why: str) -> bool:
        """Ask for a snapshot and put it in place of the backend's entries; False when it failed."""
        assert self._replace is not None
        try:
            next_seq, batch = self._fetch_snapshot()
        except SnapshotFailed as exc:
            self._stream.snapshot_failed(str(exc))
            logger.warning(
                "kv events %s: snapshot on %s failed, falling back to replay: %s", self.name, why, exc
            )
            return False
        try:
            self._replace(batch.events)
        except Exception:  # a bug here must not end the stream; the entries are as before
            self.stats.apply_errors += 1
            self._stream.snapshot_failed("the index failed to apply the snapshot (see the log)")
            logger.exception("kv events %s: applying the snapshot failed", self.name)
            return False
        blocks = sum(1 for event in batch.events if event_kind(event) == "BlockStored")
        self._stream.snapshot_applied(next_seq, batch.ts, blocks)
        logger.info(
            "kv events %s: snapshot on %s: %d blocks, live from seq %d",
            self.name,
            why,
            blocks,
            next_seq,
        )
        return True

    def _fetch_snapshot(self) -> tuple[int, DecodedBatch]:
        replies, complete = self._request(SNAPSHOT_REQUEST, "snapshot")
        if not complete:
            raise SnapshotFailed(f"no complete answer within {self.replay_timeout_s}s")
        if len(replies) != 1:
            raise SnapshotFailed(
                "the publisher answered without a snapshot (it may not support them: set "
                "kv_events.snapshot: false for it)"
                if not replies
                else f"expected one snapshot batch, got {len(replies)}"
            )
        next_seq, payload = replies[0]
        try:
            return next_seq, decode_batch(payload)
        except MalformedBatch as exc:
            raise SnapshotFailed(f"the snapshot batch could not be decoded: {exc}") from None

    def _apply_batch(self, seq: int, batch: DecodedBatch | None) -> None:
        if batch is None:
            self._stream.applied(seq, None)
            return
        self._count_batch(seq, batch)
        if batch.events:
            self._apply_events(batch.events, f"seq {seq}")
        self._stream.applied(seq, batch.ts)

    def _count_batch(self, seq: int, batch: DecodedBatch) -> None:
        self.stats.batches += 1
        if batch.skipped_events:
            self._count_skipped(seq, batch)
        _count_kinds(self.stats.events, batch.events)

    def _count_skipped(self, seq: int, batch: DecodedBatch) -> None:
        self.stats.skipped_events += batch.skipped_events
        self._malformed(f"seq {seq}: {batch.skipped_events} undecodable events: {batch.skip_reasons[:1]}")

    def _apply_events(self, events: list[KVEvent], where: str) -> None:
        self._guarded(self._apply, events, where)

    def _guarded(self, apply: Callable[[Any], Any], batch: Any, where: str) -> Any:
        """`apply(batch)`'s answer, or None when it raised (counted, logged, the backend uncertain)."""
        try:
            return apply(batch)
        except Exception:  # a bug applying one batch must not end the stream
            self.stats.apply_errors += 1
            self._stream.mark_uncertain(f"{where}: the index failed to apply the batch (see the log)")
            logger.exception("kv events %s: applying %s failed", self.name, where)
            return None

    # ---- replay ----

    def _catch_up(self) -> None:
        """On the first connection: replay what the engine still buffers before traffic needs it."""
        if self.replay_endpoint is None:
            # Nothing to catch up from; a late start shows as uncertain.
            self._stream.caught_up([], None, 0.0, complete=True)
            return
        replies, complete = self._request(encode_seq(0), "catch-up replay from seq 0")
        batches = replies_in_range(replies, 0, None)
        cleared_at, newest_ts = self._apply_replayed(batches)
        reason = self._stream.caught_up(list(batches), cleared_at, newest_ts, complete=complete)
        if reason is not None:
            logger.warning("kv events %s: index uncertain: %s", self.name, reason)

    def _recover(self, start: int, until: int, *, late_start: bool) -> bool:
        """Replay batches start..until-1 and apply them; mark the backend uncertain when that fails."""
        batches: dict[int, bytes] = {}
        if self._stream.begin_gap_replay(time.monotonic()):
            replies, _complete = self._request(encode_seq(start), f"replay from seq {start}")
            batches = replies_in_range(replies, start, until)
        cleared_at, _newest_ts = self._apply_replayed(batches)
        reason = self._stream.gap_outcome(start, until, list(batches), cleared_at, late_start=late_start)
        if reason is None:
            return True
        logger.warning("kv events %s: index uncertain: %s", self.name, reason)
        return False

    def _apply_replayed(self, batches: dict[int, bytes]) -> tuple[int | None, float]:
        """Apply replayed batches (seq -> payload, in seq order) from their last clear on.

        Returns the seq of the batch holding the last AllBlocksCleared (None without one) and the ts
        of the newest batch decoded. Batches before that clear are neither decoded nor applied: the
        clear empties the whole backend, so the result is the same. The rest go to the index in as
        few calls as possible (the index applies a list of events in order, whatever the batches).
        """
        if not batches:
            return None, 0.0
        stats = self.stats
        seqs = list(batches)
        decoded: dict[int, DecodedBatch | None] = {}
        cleared_at = None
        for position in range(len(seqs) - 1, -1, -1):
            seq = seqs[position]
            if _CLEARED_TAG not in batches[seq]:
                continue
            batch = decoded[seq] = self._decode_replayed(seq, batches[seq])
            last_clear = None if batch is None else _last_clear(batch.events)
            if batch is None or last_clear is None:
                continue
            cleared_at = seq
            stats.superseded_batches += position
            stats.superseded_events += last_clear
            batch.events = batch.events[last_clear:]
            seqs = seqs[position:]
            break
        pending: list[KVEvent] = []
        pending_from = seqs[0]
        newest_ts = 0.0
        for seq in seqs:
            batch = decoded[seq] if seq in decoded else self._decode_replayed(seq, batches[seq])
            if batch is None:
                continue
            newest_ts = max(newest_ts, batch.ts)
            self._count_batch(seq, batch)
            pending.extend(batch.events)
            if len(pending) >= _REPLAY_APPLY_CHUNK:
                self._apply_events(pending, f"replayed seq {pending_from}..{seq}")
                pending, pending_from = [], seq + 1
        if pending:
            self._apply_events(pending, f"replayed seq {pending_from}..{seqs[-1]}")
        self._stream.replayed(list(batches), cleared_at, newest_ts)
        return cleared_at, newest_ts

    def _decode_replayed(self, seq: int, payload: bytes) -> DecodedBatch | None:
        try:
            return decode_batch(payload)
        except MalformedBatch as exc:
            self._malformed(f"replay seq {seq}: {exc}")
            return None

    def _request(self, request: bytes, what: str) -> tuple[list[tuple[int, bytes]], bool]:
        """Send one request (a start seq, or the snapshot request) to the engine's ROUTER.

        Returns the (seq, payload) replies that arrived before the wait ended (`ReplayWait`),
        undecoded, and whether the end marker came. Live messages go on being read meanwhile
        (`_queue_live`)."""
        assert self.replay_endpoint is not None
        stream = self._stream
        if not stream.may_replay(time.monotonic()):
            return [], False
        if self._dealer is None:
            self._dealer = self._context.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_message_bytes)
            # The engine's ROUTER drops replies beyond its send high-water mark (1000 by default)
            # when this thread reads more slowly than it sends: let ZMQ's I/O thread queue the
            # whole answer here instead.
            self._dealer.setsockopt(zmq.RCVHWM, _REPLAY_RCVHWM)
            self._dealer.connect(connectable(self.replay_endpoint))
        dealer = self._dealer
        dealer.send_multipart([b"", request])
        wait = ReplayWait(time.monotonic(), self.replay_timeout_s)
        replies: list[tuple[int, bytes]] = []
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        sub = self._sub
        if sub is not None:
            poller.register(sub, zmq.POLLIN)
        answered = False
        while True:
            remaining = wait.remaining(time.monotonic())
            ready = dict(poller.poll(int(remaining * 1000) + 1)) if remaining > 0 else {}
            if sub is not None and sub in ready:
                self._queue_live(sub)
            if dealer not in ready:
                if remaining > 0 and wait.remaining(time.monotonic()) > 0:
                    continue
                # The ROUTER drops at its high-water mark, end marker included. A late answer
                # must not be taken for the next replay's: start that one on a fresh socket.
                logger.warning("kv events %s: %s timed out", self.name, what)
                dealer.close(0)
                self._dealer = None
                if not answered and stream.backoff.unanswered(time.monotonic()):
                    logger.warning(
                        "kv events %s: the replay endpoint answers nothing; not asked again for %.1f s",
                        self.name,
                        stream.backoff.pause_s,
                    )
                return replies, False
            frames = dealer.recv_multipart()
            answered = True
            stream.backoff.answered()
            wait.replied(time.monotonic())
            try:
                reply = parse_replay_reply(frames, self.max_message_bytes)
            except MalformedReply as exc:
                self._malformed(str(exc))
                continue
            if reply is None:
                return replies, True
            replies.append(reply)


def _size(frames: list[bytes]) -> int:
    return sum(map(len, frames))


def _count_kinds(counts: dict[str, int], events: list[KVEvent]) -> None:
    """Add the events to `counts` by kind (one C-level count by class, then a few dict updates)."""
    for cls, number in collections.Counter(map(type, events)).items():
        kind = event_class_kind(cls)
        counts[kind] = counts.get(kind, 0) + number


def _last_clear(events: list[KVEvent]) -> int | None:
    for position in range(len(events) - 1, -1, -1):
        event = events[position]
        # Only a whole clear supersedes what came before it (a one-medium clear leaves the rest).
        if isinstance(event, AllBlocksCleared) and not event.medium:
            return position
    return None
