"""The sequence rules of one engine's KV-event stream, as a state machine without sockets or clocks.

`EventStream` is told what arrived (a live batch's seq and publish time, a replay's seqs, a
snapshot, a connection coming or going, with the time when it matters) and answers what to do with
it; `transport.EventSubscriber` carries the answers out over ZMQ and into the index. The rules
follow vLLM's publisher (docs/index.md, "Subscriber"):
- seq == last + 1: apply.
- seq > last + 1: a gap; replay last + 1..seq - 1 first. A gap the replay cannot fill marks the
  backend uncertain, or is filled by a snapshot where the publisher offers them.
- seq <= last in a batch published later than the newest one applied: the engine restarted (a new
  engine process publishes from seq 0, so only a new stream steps back while time goes forward):
  replace the backend with a snapshot, or clear it and replay what the new engine buffered. An
  undecodable batch says nothing of when it was published: it counts as a restart only at seq 0.
- seq <= last otherwise: a duplicate or stale message; ignored and counted.
- The first connection catches up (a replay from seq 0, or a snapshot) before any live message;
  live batches the catch-up or a snapshot already holds are dropped by seq and publish time.
- A replay endpoint that answered nothing to two requests in a row is not asked again for a
  while, twice as long each time (`ReplayBackoff`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvwire import decode_seq
from router.errors import KvgateError

# A replay reply with this seq ends the answer.
REPLAY_END_SEQ = -1
# A replay answer still flowing gets this many replay timeouts in all.
_REPLAY_MAX_TIMEOUTS = 10
# The longest pause between requests to a replay endpoint that answered nothing.
_REPLAY_BACKOFF_MAX_S = 30.0


@dataclass
class StreamStats:
    """What one stream (one backend and DP rank) has seen, as the debug page and metrics show it."""

    connected: bool = False
    # The newest seq whose events are in the index (None before the first).
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


class Verdict(enum.Enum):
    """What becomes of a live batch."""

    APPLY = "apply"
    # Published before the snapshot or catch-up that already holds it.
    ALREADY_HELD = "already held"
    # Not past the last seq applied and not from a restarted engine.
    DUPLICATE = "duplicate"


@dataclass(frozen=True, slots=True)
class LiveStep:
    """The steps for one live batch, in order: `restart` (replace the backend by a snapshot, or
    clear it), then a replay of `replay_from`..seq - 1 when set, then the verdict."""

    verdict: Verdict
    # The last seq applied before this batch (None before the first).
    last_seq: int | None = None
    restart: bool = False
    replay_from: int | None = None
    # The replay is of a history the stream never saw (a late start or a restarted engine), not a gap.
    late_start: bool = False


_ALREADY_HELD = LiveStep(Verdict.ALREADY_HELD)


class MalformedReply(KvgateError, ValueError):
    """A replay reply that is not `[b"", (topic,) seq, payload]` or whose payload is too large."""


def parse_replay_reply(frames: list[bytes], max_message_bytes: int) -> tuple[int, bytes] | None:
    """A replay reply's (seq, payload), or None for the end marker.

    Replies are `[b"", seq, payload]` (vLLM < 0.26) or `[b"", topic, seq, payload]` (later); the
    empty delimiter may be gone already. Raises MalformedReply for anything else, and for a payload
    over `max_message_bytes` (dropped like a lost reply)."""
    if frames and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 3:
        frames = frames[1:]
    if len(frames) != 2:
        raise MalformedReply(f"replay reply with {len(frames)} frames")
    try:
        seq = decode_seq(frames[0])
    except ValueError as exc:
        raise MalformedReply(f"replay: {exc}") from None
    if seq == REPLAY_END_SEQ:
        return None
    if len(frames[1]) > max_message_bytes:
        raise MalformedReply(f"replay seq {seq}: {len(frames[1])} bytes, over max_message_bytes")
    return seq, frames[1]


def replies_in_range(replies: Iterable[tuple[int, bytes]], start: int, until: int | None) -> dict[int, bytes]:
    """Replies with start <= seq < until (the live stream delivers the rest), first copy of each, by seq."""
    batches: dict[int, bytes] = {}
    for seq, payload in replies:
        if seq >= start and (until is None or seq < until):
            batches.setdefault(seq, payload)
    return dict(sorted(batches.items()))


class ReplayWait:
    """When a request to the replay endpoint stops waiting: `timeout_s` after the request or the
    latest reply (a long answer read while the CPU is busy is not cut short while it flows), and
    never later than `_REPLAY_MAX_TIMEOUTS` times that after the request."""

    def __init__(self, started: float, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._cap = started + timeout_s * _REPLAY_MAX_TIMEOUTS
        self._deadline = started + timeout_s

    def remaining(self, now: float) -> float:
        """Seconds left to wait (0 or less: the request timed out)."""
        return min(self._deadline, self._cap) - now

    def replied(self, now: float) -> None:
        self._deadline = now + self.timeout_s


class ReplayBackoff:
    """A replay endpoint that answered nothing to two requests in a row (one lost answer is a
    ROUTER at its high-water mark; two, an endpoint that does not answer) is not asked again for
    `timeout_s`, then twice as long each time it stays silent, up to `_REPLAY_BACKOFF_MAX_S`; any
    answer resets it. Meanwhile a gap is unrecovered at once, not one timeout per gap."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.pause_s = 0.0
        self._quiet_until = 0.0
        self._unanswered = 0

    def paused(self, now: float) -> bool:
        return now < self._quiet_until

    def answered(self) -> None:
        self._unanswered = 0
        self.pause_s = 0.0

    def unanswered(self, now: float) -> bool:
        """Count a request that got no answer; True when that starts (or lengthens) a pause."""
        self._unanswered += 1
        if self._unanswered < 2:
            return False
        self.pause_s = min(_REPLAY_BACKOFF_MAX_S, max(self.timeout_s, 2 * self.pause_s))
        self._quiet_until = now + self.pause_s
        return True


class EventStream:
    """The sequence state of one engine stream (one backend and DP rank) and its rules.

    `replay`: the engine has a replay endpoint; `snapshot`: it answers snapshot requests (cache-layer
    publishers). Counters and the visible state are kept in `stats`."""

    def __init__(
        self,
        *,
        replay: bool,
        snapshot: bool = False,
        replay_timeout_s: float = 1.0,
        snapshot_after_outage_s: float = 0.0,
        stats: StreamStats | None = None,
    ) -> None:
        self.replay = replay
        self.snapshot = snapshot and replay
        self.snapshot_after_outage_s = snapshot_after_outage_s
        self.stats = stats if stats is not None else StreamStats()
        self.backoff = ReplayBackoff(replay_timeout_s)
        # The publish time (`ts`, the publisher's clock) of the newest batch applied: a batch whose
        # seq steps back comes from a restarted engine only when it was published later than that.
        self.last_ts = 0.0
        # After a snapshot or a catch-up replay: (the first seq it does not hold, the ts of the
        # newest batch it holds). Live batches below that seq published no later are already
        # applied; the mark goes once a batch at or past that seq arrives.
        self.live_floor: tuple[int, float] | None = None
        # The newest seq taken: `stats.last_seq`, or past it while batches taken by `take_next`
        # wait for the index (`released`), so a reader of the stats never sees a seq whose events
        # are not in the index yet.
        self.newest_seq: int | None = None
        self._disconnected_at: float | None = None

    # ---- live batches ----

    def is_next(self, seq: int) -> bool:
        """The usual batch: the next seq with no catch-up mark pending (apply it, nothing to check)."""
        return self.newest_seq == seq - 1 and self.live_floor is None

    def take_next(self, seq: int) -> None:
        """A batch `is_next` accepted is taken (its events reach the index later, in order: `released`)."""
        self.newest_seq = seq

    def on_live(self, seq: int, ts: float | None) -> LiveStep:
        """What to do with live batch `seq` published at `ts` (None: its payload is undecodable)."""
        floor = self.live_floor
        if floor is not None:
            floor_seq, floor_ts = floor
            if seq >= floor_seq:
                self.live_floor = None
            elif ts is None or ts <= floor_ts:
                return _ALREADY_HELD
        stats = self.stats
        last = self.newest_seq
        if last is None:
            return LiveStep(Verdict.APPLY, last, replay_from=0 if seq > 0 else None, late_start=True)
        if seq <= last:
            published_later = seq == 0 if ts is None else ts > self.last_ts
            if not published_later:
                stats.duplicates += 1
                return LiveStep(Verdict.DUPLICATE, last)
            replay_from = 0 if seq > 0 else None
            return LiveStep(Verdict.APPLY, last, restart=True, replay_from=replay_from, late_start=True)
        if seq > last + 1:
            return LiveStep(Verdict.APPLY, last, replay_from=last + 1)
        return LiveStep(Verdict.APPLY, last)

    def after_snapshot(self, seq: int) -> LiveStep:
        """What to do with the live batch that led to a snapshot: drop it if the snapshot holds it."""
        last = -1 if self.newest_seq is None else self.newest_seq
        if seq <= last:
            return _ALREADY_HELD
        self.live_floor = None
        return LiveStep(Verdict.APPLY, last, replay_from=last + 1 if seq > last + 1 else None)

    def applied(self, seq: int, ts: float | None) -> None:
        """Live batch `seq` is in the index (`ts` None: undecodable, its seq advances all the same).

        The stream is synced from then on: a first batch that arrives before any catch-up answer
        replayed from seq 0 first, which is the catch-up."""
        self.stats.synced = True
        self.stats.last_seq = self.newest_seq = seq
        if ts is not None:
            self.last_ts = ts

    def released(self, ts: float | None) -> None:
        """The batches taken by `take_next` are in the index; the newest was published at `ts`
        (None: none of them could be read, their seqs advance all the same)."""
        self.stats.last_seq = self.newest_seq
        if ts is not None:
            self.last_ts = ts

    def restarted(self) -> None:
        """The restart `on_live` announced is handled (the backend replaced or cleared, the batch
        applied): counted now, so a reader of `restarts` finds the new engine's batch in the index."""
        self.stats.restarts += 1

    def cleared(self) -> None:
        """The backend was cleared after a restart: what was uncertain about it is gone."""
        self.stats.uncertain = False
        self.stats.uncertain_reason = None

    def mark_uncertain(self, reason: str) -> None:
        self.stats.uncertain = True
        self.stats.uncertain_reason = reason

    # ---- replays ----

    def may_replay(self, now: float) -> bool:
        """Whether the replay endpoint may be asked now (a request skipped for the backoff is counted)."""
        if not self.replay:
            return False
        if self.backoff.paused(now):
            self.stats.skipped_replays += 1
            return False
        return True

    def begin_gap_replay(self, now: float) -> bool:
        """Whether to ask for a replay of a gap or a late start now (counted in `replays` if so)."""
        if not self.may_replay(now):
            return False
        self.stats.replays += 1
        return True

    def replayed(self, seqs: list[int], cleared_at: int | None, newest_ts: float) -> None:
        """Replayed batches `seqs` (in order) reached the index from the one holding the last
        AllBlocksCleared (`cleared_at`) on; the newest decoded was published at `newest_ts`."""
        if seqs:
            self.stats.replayed_batches += len(seqs)
            self.stats.last_seq = self.newest_seq = seqs[-1]
        self.last_ts = max(self.last_ts, newest_ts)

    def gap_outcome(
        self, start: int, until: int, seqs: list[int], cleared_at: int | None, *, late_start: bool
    ) -> str | None:
        """After replaying start..until - 1 (`seqs` came back): None when the replay filled it,
        else the reason the backend is now uncertain. Seqs before the last clear need not come
        back: nothing they stored survived it."""
        first_needed = start if cleared_at is None else cleared_at + 1
        if sum(1 for seq in seqs if seq >= first_needed) == until - first_needed:
            return None
        if late_start:
            reason = f"subscribed late (first seq {until}); the engine no longer buffers seq {start}.."
        else:
            self.stats.unrecovered_gaps += 1
            reason = f"lost seq {start}..{until - 1}; replay recovered {len(seqs)} of {until - start}"
        self.mark_uncertain(reason)
        return reason

    def caught_up(
        self, seqs: list[int], cleared_at: int | None, newest_ts: float, *, complete: bool
    ) -> str | None:
        """After the first connection's replay from seq 0 (`seqs` came back, `complete`: its end
        marker too). A partial answer is enough: the batches it lacks come back as a gap at the
        next message; with no answer at all, the first live batch's late-start replay catches up.
        Returns the reason the backend is uncertain when the engine no longer buffers seq 0."""
        reason = None
        if seqs:
            self.stats.replays += 1
            newest = seqs[-1]
            first_needed = 0 if cleared_at is None else cleared_at + 1
            if sum(1 for seq in seqs if seq >= first_needed) != newest + 1 - first_needed:
                reason = f"subscribed late (engine at seq {newest}); the engine no longer buffers seq 0.."
                self.mark_uncertain(reason)
            self.live_floor = (newest + 1, newest_ts)
        if complete or seqs:
            self.stats.synced = True
        return reason

    # ---- snapshots ----

    def snapshot_applied(self, next_seq: int, ts: float, blocks: int) -> None:
        """A snapshot replaced the backend: it holds every batch before `next_seq`, published by `ts`."""
        stats = self.stats
        stats.snapshots += 1
        stats.synced = True
        stats.snapshot_blocks = blocks
        stats.last_seq = self.newest_seq = next_seq - 1 if next_seq > 0 else None
        stats.uncertain = False
        stats.uncertain_reason = None
        stats.last_snapshot_error = None
        self.live_floor = (next_seq, ts)
        self.last_ts = ts

    def snapshot_failed(self, reason: str) -> None:
        self.stats.snapshot_failures += 1
        self.stats.last_snapshot_error = reason

    # ---- connection ----

    def on_connected(self, now: float) -> bool:
        """The stream (re)connected; True when a snapshot should be asked for first: on the first
        connection, or after an outage of at least `snapshot_after_outage_s` (an engine that
        restarted meanwhile is otherwise noticed only at its next event)."""
        was_connected = self.stats.connected
        self.stats.connected = True
        outage_since, self._disconnected_at = self._disconnected_at, None
        if was_connected or not self.snapshot:
            return False
        if self.newest_seq is None:
            return True
        return outage_since is not None and now - outage_since >= self.snapshot_after_outage_s

    def needs_catch_up(self) -> bool:
        """Connected for the first time and not caught up yet (no snapshot): replay from seq 0."""
        return not self.stats.synced and self.newest_seq is None

    def on_disconnected(self, now: float) -> None:
        if self.stats.connected:
            self._disconnected_at = now
        self.stats.connected = False
