"""One engine's KV-event stream: ZMQ SUB, sequence checks, replay over DEALER, restarts.

Each subscriber runs in its own thread (blocking zmq polls release the GIL), decodes every batch
with `kvwire` and hands the events to a callback (the index). The request path never
waits on it.

Sequence rules (vLLM's publisher; docs/index.md, "Subscriber"):
- seq == last + 1: apply.
- seq > last + 1: a gap. Replay from last + 1 over a DEALER socket (`[b"", start_seq]`), accept
  replies of 2 or 3 frames after the empty delimiter, stop at the end marker (seq -1) or a timeout,
  drop duplicates. A gap the replay cannot fill marks the backend uncertain (shown and counted).
- seq <= last, in a batch published after the newest batch applied (its `ts` is later): the
  engine restarted (every engine process publishes from seq 0, so only a new stream steps back
  while time goes forward): clear the backend and continue from this message. An undecodable
  message says nothing of when it was published: it counts as a restart only at seq 0.
- seq <= last otherwise: a duplicate or stale message (delivered twice, resent by a peer, an old
  replay): ignored and counted in `duplicates`; the index is left as it is.
- Catch-up: on its first connection the subscriber asks for a replay from seq 0 at once, without
  waiting for a live message, so what the engine still buffers is in the index before traffic
  arrives; `stats.synced` turns true when that answer is in (or at once when there is no replay
  endpoint). Live batches it already holds (published before the answer) are dropped by seq and
  ts. A partial answer leaves a gap the next message replays; with no answer at all, the first
  message with seq > 0 (a late start) replays from 0 as before. If a late start's replay does not
  reach back to seq 0, the backend is uncertain.
- A replay never redoes dead work: AllBlocksCleared empties the whole backend (every tier), so
  replayed batches before the last one holding a clear are not decoded nor applied (counted in
  `superseded_batches`, and events before the clear in its own batch in `superseded_events`);
  the rest goes to the index in one call (per 8192 events). Seqs missing before that clear do
  not make the backend uncertain: nothing they held survived it.
- Live messages are drained, not read one per wakeup: every message queued when the socket turns
  readable is handled in that wakeup, and the events of consecutive in-order batches go to the
  index in one call (`_drain`), flushed before anything else touches the index (a gap's replay, a
  restart, a snapshot) and at the end of the drain, so the index sees the same events in the same
  order and a burst of one-block messages pays one index call, not one per message.
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
- A replay endpoint that answered nothing to two requests in a row (one lost answer is a
  ROUTER at its high-water mark; two, an endpoint that does not answer) is not asked again for a
  while (`replay_timeout_s` at first, doubling up to `_REPLAY_BACKOFF_MAX_S`; any answer resets
  it): meanwhile a gap is unrecovered at once (`skipped_replays`), not one timeout per gap.
Each subscriber has its own thread and sockets, so these waits never hold up another backend's
stream.

Snapshots (`kv_events.snapshot: true`, cache-layer publishers only: vLLM's has no such request):
the request `[b"", b"KVSNAPSHOT"]` on the replay socket is answered with one batch holding
everything the engine holds (AllBlocksCleared, then a BlockStored per block and tier) under seq =
the first live batch it does not include, then the end marker. It is asked for when the state is
unknown: the stream connects for the first time or again after an outage of at least
`snapshot_after_outage_s` (default 0: every reconnect, since an engine that restarted meanwhile is
otherwise noticed only at its next event, and what it published before the reconnect is lost),
the engine restarted (seq went back), or a gap the replay could not fill (a late start included).
The snapshot replaces the backend's entries at once (`replace`), last_seq becomes seq - 1, live
batches older than seq and published before it are dropped, and the uncertain mark is cleared. A
snapshot on the first connection is the catch-up (synced once it is in; if it fails, the catch-up
replay runs instead).
A snapshot that fails (timeout, no snapshot in the answer, garbage) is counted and logged, and
the rules above apply as without snapshots.
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
from router.config import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_QUEUED_BYTES

if TYPE_CHECKING:
    from router.index.ingest import WireIngest

logger = logging.getLogger("kvgate.index")

# Callbacks: apply(events), clear() on a restart, replace(events) with a snapshot. All run in the
# subscriber's thread.
ApplyEvents = Callable[[list[KVEvent]], None]
ClearBackend = Callable[[], None]
ReplaceBackend = Callable[[list[KVEvent]], None]

# The event tag as msgpack spells it in either encoding: a payload without these bytes holds no
# clear, so replayed batches are searched for the last clear without decoding them.
_CLEARED_TAG = b"AllBlocksCleared"
# Replayed events go to the index in calls of at most this many (one lock hold stays short).
_REPLAY_APPLY_CHUNK = 8192
# One wakeup handles at most this many queued live messages (then the stop flag is checked), and
# the in-order events it holds back go to the index whenever they reach `_DRAIN_APPLY_EVENTS`, so a
# long burst is applied in steps (a lookup meanwhile sees the stream a few ms behind, not more).
_DRAIN_MAX_MESSAGES = 1000
_DRAIN_APPLY_EVENTS = 512
# A replay answer still flowing gets this many replay timeouts in all; replies queued per DEALER.
_REPLAY_MAX_TIMEOUTS = 10
_REPLAY_RCVHWM = 200_000
# The longest pause between requests to a replay endpoint that answered nothing.
_REPLAY_BACKOFF_MAX_S = 30.0
# Live messages read into the queue per wakeup of a request's wait (then the wait goes on).
_QUEUE_READ_BATCH = 1000


def receive_frames(socket: zmq.Socket) -> list[bytes]:
    """The frames of the next queued message (zmq.Again when none is queued).

    `recv_multipart` asks the socket for RCVMORE after every frame, a getsockopt that costs pyzmq
    about 2 us; a frame received without copying carries the same flag (`Frame.more`), so a
    3-frame message costs about half. Parts after the first are there already (ZMQ delivers a
    multipart message whole)."""
    frame = socket.recv(zmq.NOBLOCK, copy=False)
    frames = [frame.bytes]
    while frame.more:
        frame = socket.recv(copy=False)
        frames.append(frame.bytes)
    return frames


class SnapshotFailed(Exception):
    """The publisher gave no usable snapshot (timeout, only an end marker, or garbage)."""


@dataclass
class SubscriberStats:
    connected: bool = False
    last_seq: int | None = None
    batches: int = 0
    # Of those, batches the index took undecoded (the wire scan accepted their payload).
    scanned_batches: int = 0
    events: dict[str, int] = field(default_factory=dict)
    skipped_events: int = 0
    malformed: int = 0
    replays: int = 0
    replayed_batches: int = 0
    # Replayed batches skipped because a later AllBlocksCleared in the same replay undoes them, and
    # events before the clear inside the batch holding it.
    superseded_batches: int = 0
    superseded_events: int = 0
    # True once the first catch-up is done (replay from seq 0 answered, snapshot applied, or
    # nothing to replay from): the index holds what the engine still buffers.
    synced: bool = False
    unrecovered_gaps: int = 0
    restarts: int = 0
    # Messages whose seq was not past the last one applied, and not from a restarted engine.
    duplicates: int = 0
    # Live messages over `max_message_bytes` (dropped), and live messages dropped because the
    # queue read during a replay wait was full (`max_queued_bytes`), with their bytes.
    oversized: int = 0
    dropped_messages: int = 0
    dropped_bytes: int = 0
    # Bytes in that queue now, and the most it held.
    queued_bytes: int = 0
    queued_bytes_peak: int = 0
    # Replays and snapshots not asked because the endpoint answered nothing lately.
    skipped_replays: int = 0
    # Set when a gap could not be filled or a late start found the engine's history gone: the
    # index may hold blocks the engine already dropped (or lack some it holds).
    uncertain: bool = False
    uncertain_reason: str | None = None
    last_message_at: float | None = None
    # Set when the socket could not be bound or connected at all: nothing will ever arrive.
    socket_error: str | None = None
    apply_errors: int = 0
    last_error: str | None = None
    snapshots: int = 0
    snapshot_failures: int = 0
    # Blocks in the last snapshot applied, and why the last one failed.
    snapshot_blocks: int = 0
    last_snapshot_error: str | None = None


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
        replace: ReplaceBackend | None = None,
        snapshot_after_outage_s: float = 0.0,
        wire: WireIngest | None = None,
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
        self.stats = SubscriberStats()
        self._apply = apply
        self._clear = clear
        self._on_batch = on_batch
        # In-order live payloads the index's scan accepts go to it undecoded (`on_batch` needs
        # decoded batches, so it turns this off).
        self._wire = wire if on_batch is None else None
        self._context = context or zmq.Context.instance()
        self._stop = threading.Event()
        # stop() writes a byte here to wake the thread's poll, which otherwise waits for messages
        # without a timeout: polling on a timer to notice the stop flag cost an idle gateway
        # about 0.12 ms of CPU per wake-up and subscriber (10 a second each at 0.1 s).
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_writer.setblocking(False)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{name}", daemon=True)
        self._dealer: zmq.Socket | None = None
        self._sub: zmq.Socket | None = None
        # Live messages read while a request waited, in order, handled before the socket's next.
        self._queued: collections.deque[list[bytes]] = collections.deque()
        # A silent replay endpoint is not asked again before this time (monotonic).
        self._replay_quiet_until = 0.0
        self._replay_backoff_s = 0.0
        self._unanswered_requests = 0
        self._last_malformed_log = 0.0
        self._last_drop_log = 0.0
        self._last_duplicate_log = 0.0
        # The `ts` of the newest batch applied (its publisher's clock): a message whose seq steps
        # back comes from a restarted engine only when it was published later than that.
        self._last_ts = 0.0
        # Snapshots need the replay socket and somewhere to put them.
        self._replace = replace if replay_endpoint is not None else None
        self.snapshot_after_outage_s = snapshot_after_outage_s
        self._disconnected_at: float | None = None
        # After a snapshot or a catch-up replay: (the first seq it does not hold, the ts of the
        # newest batch it holds). Live batches below that seq published no later are already
        # applied; the mark goes once a batch at or past that seq arrives.
        self._live_floor: tuple[int, float] | None = None
        # While a drain runs: events of in-order live batches not yet given to the index, their
        # batches (for `on_batch`, after the apply) and the seq of the first one; or, for payloads
        # the wire scan accepted, the scanned batches and their events' count (one kind at a time:
        # a batch of the other kind releases what is held first, so the order holds).
        self._draining = False
        self._held_events: list[KVEvent] = []
        self._held_batches: list[DecodedBatch] = []
        self._held_scanned: list[Any] = []
        self._held_scanned_events = 0
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
        the collections they set off cost about 1.5 us a message (5.1-6.1 vs 6.3-7.4 us for the
        drain's own work on 30k one-block messages, the index call left out)."""
        self._draining = True
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
                if len(self._held_events) + self._held_scanned_events >= _DRAIN_APPLY_EVENTS:
                    self._release_held()
        finally:
            self._draining = False
            try:
                self._release_held()
            finally:
                if collecting:
                    gc.enable()

    def _release_held(self) -> None:
        """Give the index the events (or scanned batches) held back by the drain, in one call,
        then run `on_batch`."""
        if self._held_scanned:
            self._release_scanned()
            return
        if not self._held_batches:
            return
        events, batches, first = self._held_events, self._held_batches, self._held_from
        self._held_events, self._held_batches, self._held_from = [], [], None
        self._last_ts = batches[-1].ts
        self.stats.batches += len(batches)
        _count_kinds(self.stats.events, events)
        if events:
            self._apply_events(events, f"seq {first}..{self.stats.last_seq}")
        if self._on_batch is not None:
            for batch in batches:
                self._on_batch(self.name, batch)

    def _release_scanned(self) -> None:
        scanned, first = self._held_scanned, self._held_from
        self._held_scanned, self._held_scanned_events, self._held_from = [], 0, None
        self._last_ts = scanned[-1].ts
        stats = self.stats
        stats.batches += len(scanned)
        stats.scanned_batches += len(scanned)
        stored = removed = cleared = 0
        for batch in scanned:
            stored += batch.stored
            removed += batch.removed
            cleared += batch.cleared
        kinds = (("BlockStored", stored), ("BlockRemoved", removed), ("AllBlocksCleared", cleared))
        for kind, number in kinds:
            if number:
                stats.events[kind] = stats.events.get(kind, 0) + number
        assert self._wire is not None  # (only a wire scan fills `_held_scanned`)
        self._guarded(self._wire.apply, scanned, f"seq {first}..{stats.last_seq}")

    def _drain_monitor(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = int.from_bytes(frames[0][:2], "little")
            if event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                was_connected = self.stats.connected
                self.stats.connected = True
                snapshot_taken = False
                if not was_connected and self._replace is not None and self._needs_snapshot_on_connect():
                    snapshot_taken = self._take_snapshot(
                        "connected" if self.stats.last_seq is None else "reconnected"
                    )
                if not snapshot_taken and not self.stats.synced and self.stats.last_seq is None:
                    self._catch_up()
                self._disconnected_at = None
            elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                if self.stats.connected:
                    self._disconnected_at = time.monotonic()
                self.stats.connected = False

    def _needs_snapshot_on_connect(self) -> bool:
        if self.stats.last_seq is None:
            return True
        outage_since = self._disconnected_at
        return outage_since is not None and time.monotonic() - outage_since >= self.snapshot_after_outage_s

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
        if len(payload) > self.max_message_bytes:
            self._oversized(seq, len(payload))
            return
        stats = self.stats
        # The usual message: the next seq while draining, nothing to check.
        in_order = self._draining and stats.last_seq == seq - 1 and self._live_floor is None
        if in_order and self._wire is not None:
            scanned = self._wire.scan(payload)
            if scanned is not None:  # held undecoded for one apply per drain
                self._hold(seq, scanned=True)
                self._held_scanned.append(scanned)
                self._held_scanned_events += len(scanned)
                return
        try:
            batch = decode_batch(payload)
        except MalformedBatch as exc:
            self._malformed(f"seq {seq}: {exc}")
            # The seq itself is good: advance it so the next message is not taken for a gap.
            self._advance(seq, None)
            return
        if in_order:
            # Held for one apply per drain (batches and event kinds are counted then).
            self._hold(seq, scanned=False)
            if batch.skipped_events:
                self._count_skipped(seq, batch)
            self._held_events += batch.events
            self._held_batches.append(batch)
            return
        self._advance(seq, batch)

    def _hold(self, seq: int, *, scanned: bool) -> None:
        """Take the in-order message `seq` as held, of one kind (`scanned`, or decoded): held
        messages of the other kind go to the index first, so the order holds."""
        other_kind_held = self._held_batches if scanned else self._held_scanned
        if other_kind_held:
            self._release_held()
        stats = self.stats
        stats.last_message_at = time.time()
        stats.last_seq = seq
        if self._held_from is None:
            self._held_from = seq

    def _advance(self, seq: int, batch: DecodedBatch | None) -> None:
        stats = self.stats
        stats.last_message_at = time.time()
        # Anything but the next seq while draining may clear, replay into or replace the backend:
        # the held events go first.
        self._release_held()
        floor = self._live_floor
        if floor is not None:
            floor_seq, floor_ts = floor
            if seq >= floor_seq:
                self._live_floor = None
            elif batch is None or batch.ts <= floor_ts:
                return  # published before the snapshot or catch-up, which already holds it
        last = stats.last_seq
        recovered = True
        if last is None:
            if seq > 0:
                recovered = self._recover(0, seq, late_start=True)
            stats.synced = True
        elif seq <= last:
            if not self._from_new_stream(seq, batch):
                self._duplicate(seq, last)
                return
            stats.restarts += 1
            logger.warning(
                "kv events %s: seq went back from %d to %d: engine restarted, its cache entries dropped",
                self.name,
                last,
                seq,
            )
            if self._replace is not None and self._take_snapshot(f"restart (seq {last} -> {seq})"):
                self._continue_after_snapshot(seq, batch)
                return
            self._clear()
            stats.uncertain = False
            stats.uncertain_reason = None
            if seq > 0:
                recovered = self._recover(0, seq, late_start=True)
        elif seq > last + 1:
            recovered = self._recover(last + 1, seq, late_start=False)
        if (
            not recovered
            and self._replace is not None
            and self._take_snapshot(f"unrecovered gap ({stats.uncertain_reason})")
        ):
            self._continue_after_snapshot(seq, batch)
            return
        self._apply_batch(seq, batch)

    def _oversized(self, seq: int, size: int) -> None:
        """Drop a live message over `max_message_bytes`: its seq advances (no false gap), and the
        backend is uncertain, since the events it carried are lost."""
        self.stats.oversized += 1
        reason = f"seq {seq} dropped: {size} bytes, over max_message_bytes ({self.max_message_bytes})"
        self._log_drop(f"the live message of {reason}")
        self._advance(seq, None)
        if self.stats.last_seq == seq:  # (applied as the next seq, not taken for a duplicate)
            self.stats.uncertain = True
            self.stats.uncertain_reason = reason

    def _log_drop(self, what: str) -> None:
        now = time.monotonic()
        if now - self._last_drop_log > 5.0:  # rate-limited: a flooding peer must not flood the log
            self._last_drop_log = now
            logger.warning("kv events %s: dropped %s", self.name, what)

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
                self._log_drop(
                    f"a live message of {size} bytes: {stats.queued_bytes} bytes already queued while "
                    f"the replay endpoint is asked (max_queued_bytes {self.max_queued_bytes})"
                )
                continue
            self._queued.append(frames)
            stats.queued_bytes += size
            stats.queued_bytes_peak = max(stats.queued_bytes_peak, stats.queued_bytes)

    def _from_new_stream(self, seq: int, batch: DecodedBatch | None) -> bool:
        """Whether a message whose seq is not past the last one comes from a restarted engine."""
        if batch is None:
            return seq == 0
        return batch.ts > self._last_ts

    def _duplicate(self, seq: int, last: int) -> None:
        self.stats.duplicates += 1
        now = time.monotonic()
        if now - self._last_duplicate_log > 5.0:  # rate-limited: a looping peer must not flood the log
            self._last_duplicate_log = now
            logger.warning(
                "kv events %s: seq %d (last applied %d) published no later than the last batch: "
                "a duplicate or stale message, ignored",
                self.name,
                seq,
                last,
            )

    def _continue_after_snapshot(self, seq: int, batch: DecodedBatch | None) -> None:
        """Handle the live batch that led to a snapshot: drop it if the snapshot holds it."""
        last = -1 if self.stats.last_seq is None else self.stats.last_seq
        if seq <= last:
            return
        if seq > last + 1:
            self._recover(last + 1, seq, late_start=False)
        self._live_floor = None
        self._apply_batch(seq, batch)

    # ---- snapshot ----

    def _take_snapshot(self, why: str) -> bool:
        """Ask for a snapshot and put it in place of the backend's entries; False when it failed."""
        assert self._replace is not None
        stats = self.stats
        try:
            next_seq, batch = self._fetch_snapshot()
        except SnapshotFailed as exc:
            stats.snapshot_failures += 1
            stats.last_snapshot_error = str(exc)
            logger.warning(
                "kv events %s: snapshot on %s failed, falling back to replay: %s", self.name, why, exc
            )
            return False
        try:
            self._replace(batch.events)
        except Exception:  # a bug here must not end the stream; the entries are as before
            stats.snapshot_failures += 1
            stats.apply_errors += 1
            stats.last_snapshot_error = "the index failed to apply the snapshot (see the log)"
            logger.exception("kv events %s: applying the snapshot failed", self.name)
            return False
        stats.snapshots += 1
        stats.synced = True
        stats.snapshot_blocks = sum(1 for event in batch.events if event_kind(event) == "BlockStored")
        stats.last_seq = next_seq - 1 if next_seq > 0 else None
        stats.uncertain = False
        stats.uncertain_reason = None
        stats.last_snapshot_error = None
        self._live_floor = (next_seq, batch.ts)
        self._last_ts = batch.ts
        logger.info(
            "kv events %s: snapshot on %s: %d blocks, live from seq %d",
            self.name,
            why,
            stats.snapshot_blocks,
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
        self.stats.last_seq = seq
        if batch is None:
            return
        self._last_ts = batch.ts
        self._count_batch(seq, batch)
        if batch.events:
            self._apply_events(batch.events, f"seq {seq}")
        if self._on_batch is not None:
            self._on_batch(self.name, batch)

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

    def _guarded(self, apply: Callable[[Any], None], batch: Any, where: str) -> None:
        try:
            apply(batch)
        except Exception:  # a bug applying one batch must not end the stream
            self.stats.apply_errors += 1
            self.stats.uncertain = True
            self.stats.uncertain_reason = f"{where}: the index failed to apply the batch (see the log)"
            logger.exception("kv events %s: applying %s failed", self.name, where)

    # ---- replay ----

    def _catch_up(self) -> None:
        """On the first connection: replay what the engine still buffers before traffic needs it."""
        if self.replay_endpoint is None:
            self.stats.synced = True  # nothing to catch up from; a late start shows as uncertain
            return
        replies, complete = self._request(encode_seq(0), "catch-up replay from seq 0")
        batches = _in_range(replies, 0, None)
        if batches:
            self.stats.replays += 1
            cleared_at, newest_ts = self._apply_replayed(batches)
            newest = next(reversed(batches))
            first_needed = 0 if cleared_at is None else cleared_at + 1
            if _count_from(batches, first_needed) != newest + 1 - first_needed:
                self._mark_uncertain(
                    f"subscribed late (engine at seq {newest}); the engine no longer buffers seq 0.."
                )
            self._live_floor = (newest + 1, newest_ts)
        # A partial answer is enough: the batches it lacks come back as a gap at the next message.
        # With no answer at all, the first message's late-start replay does the catch-up.
        if complete or batches:
            self.stats.synced = True

    def _recover(self, start: int, until: int, *, late_start: bool) -> bool:
        """Replay batches start..until-1 and apply them; mark the backend uncertain when that fails."""
        batches: dict[int, bytes] = {}
        if self.replay_endpoint is not None and not self._replay_paused():
            self.stats.replays += 1
            replies, _complete = self._request(encode_seq(start), f"replay from seq {start}")
            batches = _in_range(replies, start, until)
        cleared_at, _newest_ts = self._apply_replayed(batches)
        # Seqs before the last clear need not be found: nothing they stored survived it.
        first_needed = start if cleared_at is None else cleared_at + 1
        if _count_from(batches, first_needed) == until - first_needed:
            return True
        if late_start:
            reason = f"subscribed late (first seq {until}); the engine no longer buffers seq {start}.."
        else:
            self.stats.unrecovered_gaps += 1
            reason = f"lost seq {start}..{until - 1}; replay recovered {len(batches)} of {until - start}"
        self._mark_uncertain(reason)
        return False

    def _mark_uncertain(self, reason: str) -> None:
        self.stats.uncertain = True
        self.stats.uncertain_reason = reason
        logger.warning("kv events %s: index uncertain: %s", self.name, reason)

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
        stats.replayed_batches += len(batches)
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
        applied: list[DecodedBatch] = []
        newest_ts = 0.0
        for seq in seqs:
            batch = decoded[seq] if seq in decoded else self._decode_replayed(seq, batches[seq])
            stats.last_seq = seq
            if batch is None:
                continue
            newest_ts = max(newest_ts, batch.ts)
            self._count_batch(seq, batch)
            applied.append(batch)
            pending.extend(batch.events)
            if len(pending) >= _REPLAY_APPLY_CHUNK:
                self._apply_events(pending, f"replayed seq {pending_from}..{seq}")
                pending, pending_from = [], seq + 1
        if pending:
            self._apply_events(pending, f"replayed seq {pending_from}..{seqs[-1]}")
        if self._on_batch is not None:
            for batch in applied:
                self._on_batch(self.name, batch)
        self._last_ts = max(self._last_ts, newest_ts)
        return cleared_at, newest_ts

    def _decode_replayed(self, seq: int, payload: bytes) -> DecodedBatch | None:
        try:
            return decode_batch(payload)
        except MalformedBatch as exc:
            self._malformed(f"replay seq {seq}: {exc}")
            return None

    def _request(self, request: bytes, what: str) -> tuple[list[tuple[int, bytes]], bool]:
        """Send one request (a start seq, or the snapshot request) to the engine's ROUTER.

        Returns the (seq, payload) replies that arrived before the deadline, undecoded, and whether
        the end marker came. The deadline is `replay_timeout_s` after the request or the latest
        reply (a long buffer replayed while the CPU is busy is not cut short while it flows), and
        never later than `_REPLAY_MAX_TIMEOUTS` times that after the request.
        """
        assert self.replay_endpoint is not None
        if self._replay_paused():
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
        started = time.monotonic()
        cap = started + self.replay_timeout_s * _REPLAY_MAX_TIMEOUTS
        deadline = started + self.replay_timeout_s
        replies: list[tuple[int, bytes]] = []
        # Live messages go on being read meanwhile (`_queue_live`).
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        sub = self._sub
        if sub is not None:
            poller.register(sub, zmq.POLLIN)
        answered = False
        while True:
            remaining = min(deadline, cap) - time.monotonic()
            ready = dict(poller.poll(int(remaining * 1000) + 1)) if remaining > 0 else {}
            if sub is not None and sub in ready:
                self._queue_live(sub)
            if dealer not in ready:
                if remaining > 0 and time.monotonic() < min(deadline, cap):
                    continue
                # The ROUTER drops at its high-water mark, end marker included. A late answer
                # must not be taken for the next replay's: start that one on a fresh socket.
                logger.warning("kv events %s: %s timed out", self.name, what)
                dealer.close(0)
                self._dealer = None
                if not answered:
                    self._back_off_replays()
                return replies, False
            frames = dealer.recv_multipart()
            answered = True
            self._unanswered_requests = 0
            self._replay_backoff_s = 0.0
            deadline = time.monotonic() + self.replay_timeout_s
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
                return replies, True
            if len(frames[1]) > self.max_message_bytes:
                self._malformed(f"replay seq {seq}: {len(frames[1])} bytes, over max_message_bytes")
                continue
            replies.append((seq, frames[1]))

    def _replay_paused(self) -> bool:
        """True (and counted) while the replay endpoint is not asked, having answered nothing."""
        if time.monotonic() < self._replay_quiet_until:
            self.stats.skipped_replays += 1
            return True
        return False

    def _back_off_replays(self) -> None:
        """The replay endpoint answered nothing: after the second time in a row, do not ask it
        again for a while, twice as long each time."""
        self._unanswered_requests += 1
        if self._unanswered_requests < 2:
            return
        backoff = max(self.replay_timeout_s, 2 * self._replay_backoff_s)
        self._replay_backoff_s = min(_REPLAY_BACKOFF_MAX_S, backoff)
        self._replay_quiet_until = time.monotonic() + self._replay_backoff_s
        logger.warning(
            "kv events %s: the replay endpoint answers nothing; not asked again for %.1f s",
            self.name,
            self._replay_backoff_s,
        )


def _size(frames: list[bytes]) -> int:
    return sum(map(len, frames))


def _in_range(replies: list[tuple[int, bytes]], start: int, until: int | None) -> dict[int, bytes]:
    """Replies with start <= seq < until (the live stream delivers the rest), first copy of each, by seq."""
    batches: dict[int, bytes] = {}
    for seq, payload in replies:
        if seq >= start and (until is None or seq < until):
            batches.setdefault(seq, payload)
    return dict(sorted(batches.items()))


def _count_from(batches: dict[int, bytes], first: int) -> int:
    return sum(1 for seq in batches if seq >= first)


def _count_kinds(counts: dict[str, int], events: list[KVEvent]) -> None:
    """Add the events to `counts` by kind (one C-level count by class, then a few dict updates)."""
    for cls, number in collections.Counter(map(type, events)).items():
        kind = event_class_kind(cls)
        counts[kind] = counts.get(kind, 0) + number


def _last_clear(events: list[KVEvent]) -> int | None:
    for position in range(len(events) - 1, -1, -1):
        if isinstance(events[position], AllBlocksCleared):
            return position
    return None
