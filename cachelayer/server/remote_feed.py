"""The shared daemon's remote tier, told to the engines whose stores it wrote through: which chunks
Redis now holds for them, and which of those it has since lost, as numbered events each engine's
connector publishes in its own KV-event stream (medium REMOTE), like an engine-local remote tier.

The daemon has no KV-event stream of its own: the router already subscribes to every engine's, with
sequence numbers and replay, and credits a shared tier to all its members from the union of their
streams. So the daemon keeps one feed per client that asks for one (a random id it sends with its
requests, `remote_feed=True` in the client), and the rules are those of the engine-local remote tier
(cachelayer.storage.remote_truth):
- a chunk is announced by the client whose store put it in L1 and so caused the write-through
  (`attributed`: the CPU tier's BlockStored, emitted in the serving thread before the write is
  queued, names the chunk; the remote writer's BlockStored, later, in its own thread, finds it);
- it is retracted to that same client, and nobody else, when the daemon's `RemoteTruth`
  (reconciliation, optional keyspace notifications) or a quota or the announcement bound removes
  it; a chunk written again for another client is first retracted to the one that had it;
- a retired key space retracts what it announced (nobody could retract it later).

Delivery: each reply to a store, commit, reserve or `feed` request carries the feed's events after
the client's acknowledgement (`feed_ack`, the last number it received), at most
`MAX_EVENTS_PER_REPLY`; the daemon forgets what is acknowledged, so a lost reply is resent and
nothing is lost or duplicated. Bounds: `MAX_EVENTS_PER_FEED` queued per feed and
`MAX_EVENTS_TOTAL` in all (past either, the feed's queue is replaced by one "cleared" event: the
client clears its REMOTE medium, errs towards a miss), `MAX_FEEDS` feeds (`MAX_FEEDS_PER_CREDENTIAL`
per credential; the least recently used goes first), a feed unused for `FEED_IDLE_S` goes, and
`MAX_PENDING` chunks wait for their write-through. A feed belongs to its credential: another
credential naming its id reaches nothing (the events carry token ids).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator

from cachelayer.server.protocol import FeedEvent
from kvwire import AllBlocksCleared, BlockRemoved, BlockStored
from kvwire import KVEvent as Event

MAX_FEEDS = 256
MAX_FEEDS_PER_CREDENTIAL = 64
# Events queued per feed (a stored event is about 1 KB at 256-token chunks) and in all.
MAX_EVENTS_PER_FEED = 8192
MAX_EVENTS_TOTAL = 65536
MAX_EVENTS_PER_REPLY = 512
# A feed no request named for this long is dropped (a live client polls several times a second).
FEED_IDLE_S = 120.0
# Chunks stored in L1 whose write-through has not happened yet, across every key space.
MAX_PENDING = 1 << 16
# Shortest and longest feed id a client may name (16 random bytes from StoreClient).
MIN_FEED_ID_BYTES = 8

_current = threading.local()


class Outbox:
    """One client's feed: numbered events it has not acknowledged yet."""

    __slots__ = ("epoch", "events", "last_used", "name", "next_seq")

    def __init__(self, name: tuple[str, bytes]) -> None:
        self.name = name
        self.events: deque[tuple[int, FeedEvent]] = deque()
        self.next_seq = 1
        # Bumped when the queue overflowed (a "cleared" replaced it): older announcements are void.
        self.epoch = 0
        self.last_used = time.monotonic()


# Who announced a chunk: the feed, and its epoch at the time.
Announcer = tuple[Outbox, int]


class RemoteFeeds:
    """Every client's feed, and the delivery of their events. Thread-safe (its own lock, taken
    after the engines' lock, never before it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outboxes: OrderedDict[tuple[str, bytes], Outbox] = OrderedDict()
        self.queued_events = 0
        self.resets = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._outboxes)

    def outbox(self, credential: str, feed_id: bytes, *, create: bool) -> Outbox | None:
        """The feed `feed_id` of `credential`; made with `create` (after dropping idle feeds, and the
        least recently used past a cap). ValueError for an id too short to be a random one."""
        if len(feed_id) < MIN_FEED_ID_BYTES:
            raise ValueError(f"a feed id has {MIN_FEED_ID_BYTES} to 32 bytes, got {len(feed_id)}")
        name = (credential, feed_id)
        now = time.monotonic()
        with self._lock:
            outbox = self._outboxes.get(name)
            if outbox is None and create:
                self._reap(now)
                own = [key for key in self._outboxes if key[0] == credential]
                if len(own) >= MAX_FEEDS_PER_CREDENTIAL:
                    self._drop(own[0])
                if len(self._outboxes) >= MAX_FEEDS:
                    self._drop(next(iter(self._outboxes)))
                outbox = self._outboxes[name] = Outbox(name)
            if outbox is not None:
                outbox.last_used = now
                self._outboxes.move_to_end(name)
            return outbox

    def _reap(self, now: float) -> None:
        for name in [name for name, box in self._outboxes.items() if now - box.last_used > FEED_IDLE_S]:
            self._drop(name)

    def _drop(self, name: tuple[str, bytes]) -> None:
        outbox = self._outboxes.pop(name)
        self.queued_events -= len(outbox.events)
        outbox.events.clear()
        outbox.epoch += 1  # what it announced is nobody's now: no removal goes anywhere

    def live(self, announcer: Announcer) -> bool:
        """Whether the feed that made an announcement still stands for it. Under the lock."""
        outbox, epoch = announcer
        return outbox.epoch == epoch and self._outboxes.get(outbox.name) is outbox

    def push(self, announcer: Announcer, events: list[FeedEvent]) -> bool:
        """Queue events for the feed that made an announcement; False (nothing queued) when that
        feed is gone or has been cleared since."""
        outbox = announcer[0]
        with self._lock:
            if not self.live(announcer):
                return False
            for event in events:
                outbox.events.append((outbox.next_seq, event))
                outbox.next_seq += 1
            self.queued_events += len(events)
            if len(outbox.events) > MAX_EVENTS_PER_FEED or self.queued_events > MAX_EVENTS_TOTAL:
                self._reset(max(self._outboxes.values(), key=lambda box: len(box.events)))
            return True

    def _reset(self, outbox: Outbox) -> None:
        """Replace the feed's queue by one "cleared": its client forgets its REMOTE announcements."""
        self.resets += 1
        self.queued_events -= len(outbox.events) - 1
        outbox.events.clear()
        outbox.epoch += 1
        outbox.events.append((outbox.next_seq, FeedEvent("cleared")))
        outbox.next_seq += 1

    def deliver(self, outbox: Outbox, ack: int) -> tuple[list[FeedEvent], int]:
        """Forget the events up to `ack`, and answer the next ones (at most MAX_EVENTS_PER_REPLY)
        with the number of the last; an `ack` beyond what the feed numbered (a client of an earlier
        daemon) acknowledges nothing."""
        with self._lock:
            if ack >= outbox.next_seq:
                ack = 0
            events = outbox.events
            while events and events[0][0] <= ack:
                events.popleft()
                self.queued_events -= 1
            sent = [event for _, event in list(events)[:MAX_EVENTS_PER_REPLY]]
            last = events[len(sent) - 1][0] if sent else 0
            return sent, last

    @contextlib.contextmanager
    def attributing(self, outbox: Outbox | None) -> Iterator[None]:
        """Chunks stored in L1 inside the block, in this thread, are announced to `outbox` once
        written through."""
        _current.announcer = (outbox, outbox.epoch) if outbox is not None else None
        try:
            yield
        finally:
            _current.announcer = None


class EngineFeed:
    """The listener of one key space's engine that turns its remote tier's events into feed
    events for the clients that caused them. Called under the engine's lock, in order."""

    def __init__(self, feeds: RemoteFeeds, cpu_medium: str, remote_medium: str) -> None:
        self.feeds = feeds
        self._cpu = cpu_medium
        self._remote = remote_medium
        # Stored in L1, not written through yet; and announced in the remote tier.
        self._pending: OrderedDict[int, Announcer] = OrderedDict()
        self._announcer: dict[int, Announcer] = {}
        self.unattributed_writes = 0

    def __call__(self, events: list[Event]) -> None:
        for event in events:
            medium = getattr(event, "medium", None)
            if isinstance(event, BlockStored) and medium == self._cpu:
                self._note_pending(event.block_hashes)
            elif isinstance(event, BlockRemoved) and medium == self._cpu:
                for key in event.block_hashes:  # left L1 first: the writer skips it
                    self._pending.pop(key, None)
            elif isinstance(event, BlockStored) and medium == self._remote:
                self._written(event)
            elif isinstance(event, BlockRemoved) and medium == self._remote:
                self._lost(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._pending.clear()
                if medium in (None, self._remote):
                    self.retract_all()

    def _note_pending(self, keys: list[int]) -> None:
        announcer = getattr(_current, "announcer", None)
        if announcer is None:
            return
        for key in keys:
            self._pending.pop(key, None)
            self._pending[key] = announcer
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)

    def _written(self, event: BlockStored) -> None:
        salt = event.extra_keys[0][0] if event.extra_keys and event.extra_keys[0] else None
        for index, key in enumerate(event.block_hashes):
            announcer = self._pending.pop(key, None)
            if announcer is None:
                self.unattributed_writes += 1
                continue
            previous = self._announcer.get(key)
            if previous is not None and previous[0] is not announcer[0]:
                self.feeds.push(previous, [FeedEvent("removed", key)])
            stored = FeedEvent(
                "stored",
                key,
                event.parent_block_hash if index == 0 else event.block_hashes[index - 1],
                list(event.token_ids),
                salt if index == 0 else None,
            )
            if self.feeds.push(announcer, [stored]):
                self._announcer[key] = announcer
            else:  # its client's feed went (or was cleared) since the store
                self._announcer.pop(key, None)
                self.unattributed_writes += 1

    def _lost(self, keys: list[int]) -> None:
        for key in keys:
            announcer = self._announcer.pop(key, None)
            if announcer is not None:
                self.feeds.push(announcer, [FeedEvent("removed", key)])

    def retract_all(self) -> None:
        """Retract every chunk this key space announced (it is retired: nobody could later)."""
        self._lost(list(self._announcer))

    @property
    def announced_chunks(self) -> int:
        return len(self._announcer)
