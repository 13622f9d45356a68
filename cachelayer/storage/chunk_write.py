"""ChunkWrite: chunks written into one tier as a unit, the one transaction behind every store,
promotion, write-through, move, import and re-encode; and the KV events a tier's changes make.

What every write shares with the tiers' owner (the engine) is its `TierState`: the one lock over
every tier's index, the clear() generation (bumped by each clear: work begun before a clear is
dropped, never committed after it, so a cleared cache never refills from it), and the event
listeners, which hear every change in order, under the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

from cachelayer.storage.tier import ChunkMeta, Tier, TierEntry
from kvwire import BlockRemoved, BlockStored, KVEvent


class TierState:
    """The lock, clear() generation and event listeners of one engine's tiers."""

    __slots__ = ("generation", "listeners", "lock")

    def __init__(self, lock: threading.RLock | None = None) -> None:
        """`lock`: one shared with other engines (the daemon's one pool); by default a new one."""
        self.lock = lock if lock is not None else threading.RLock()
        self.generation = 0  # bumped by clear(), under the lock
        self.listeners: list[Callable[[list[KVEvent]], None]] = []

    def emit(self, events: list[KVEvent]) -> None:
        """Announce state changes to every listener, in order. Under the lock."""
        if events:
            for listener in self.listeners:
                listener(events)


class _Medium(Protocol):
    medium: str  # the KV-event medium of a tier: "cpu", "disk", the remote tier's


def stored_event(tier: _Medium, meta: ChunkMeta) -> BlockStored:
    """The BlockStored that announces one chunk in `tier`."""
    return BlockStored(
        block_hashes=[meta.key],
        parent_block_hash=meta.parent_key,
        token_ids=list(meta.token_ids),
        block_size=meta.num_tokens,
        medium=tier.medium,
        extra_keys=[(meta.cache_salt,)] if meta.cache_salt is not None else None,
    )


def removal_events(tier: _Medium, metas: list[ChunkMeta]) -> list[KVEvent]:
    """One BlockRemoved for the chunks `tier` lost (none when it lost none)."""
    return [BlockRemoved(block_hashes=[meta.key for meta in metas], medium=tier.medium)] if metas else []


def snapshot_events(tiers: Iterable[Tier]) -> list[KVEvent]:
    """A BlockStored for every chunk the tiers hold, tier by tier, parents before children (what a
    subscriber that starts late replays). Under the lock."""
    events: list[KVEvent] = []
    for tier in tiers:
        entries = {entry.meta.key: entry for entry in tier.committed_entries()}
        depth: dict[int, int] = {}  # a chunk's place in its chain: 1 for a chain's first held chunk
        for key in entries:
            chain: list[int] = []
            current: int | None = key
            while current in entries and current not in depth:
                chain.append(current)
                current = entries[current].meta.parent_key
            level = depth.get(current, 0) if current is not None else 0
            for member in reversed(chain):
                level += 1
                depth[member] = level
        for key in sorted(entries, key=lambda item: depth.get(item, 0)):
            events.append(stored_event(tier, entries[key].meta))
    return events


class ChunkWrite:
    """Chunks written into one tier as a unit.

    Under the tiers' lock the chunks are reserved (invisible to lookups, never evicted); their
    bytes are copied outside it (`copying`); then, under the lock again, `commit` makes them
    visible together. A copy that raises aborts them all (their space goes back, nothing becomes
    visible). With `dropped_by_clear`, a clear() since the reservation aborts them at commit: a
    cleared cache never refills from work begun before the clear.
    """

    __slots__ = ("_dropped_by_clear", "_evicted", "_generation", "_state", "entries", "tier")

    def __init__(self, state: TierState, tier: Tier, *, dropped_by_clear: bool = True) -> None:
        """Begin a write into `tier`; the caller holds the lock."""
        self._state = state
        self.tier = tier
        self.entries: list[TierEntry] = []
        self._evicted: list[ChunkMeta] = []
        self._generation = state.generation
        self._dropped_by_clear = dropped_by_clear

    def reserve(self, meta: ChunkMeta, nbytes: int) -> TierEntry | None:
        """Space for one more chunk, evicting as needed; None when even eviction makes no room.
        Under the lock."""
        entry, evicted = self.tier.reserve(meta, nbytes)
        self._evicted.extend(evicted)
        if entry is not None:
            self.entries.append(entry)
        return entry

    def announce_evictions(self) -> None:
        """One BlockRemoved for the chunks the reservations evicted so far. Under the lock."""
        self._state.emit(removal_events(self.tier, self._evicted))
        self._evicted = []

    @contextmanager
    def copying(self, *, on_failure: Callable[[], None] | None = None) -> Iterator[None]:
        """Wrap the copy into the reserved chunks (run without the lock): when it raises, every
        reserved chunk is aborted, and `on_failure` runs, under the lock, before the error goes on."""
        try:
            yield
        except BaseException:
            with self._state.lock:
                self.abort()
                if on_failure is not None:
                    on_failure()
            raise

    def abort(self) -> None:
        """Give back the space of every reserved chunk; nothing becomes visible. Under the lock."""
        for entry in self.entries:
            self.tier.abort(entry)

    def commit(self, written: Collection[TierEntry] | None = None) -> list[KVEvent]:
        """Make the written chunks (`written`, by default all) visible and return their BlockStored
        events, for the caller to emit; the others are aborted, and all of them when a clear()
        came since the reservation (`dropped_by_clear`). Under the lock."""
        if self._dropped_by_clear and self.cleared:
            self.abort()
            return []
        events: list[KVEvent] = []
        for entry in self.entries:
            if written is None or entry in written:
                self.tier.commit(entry)
                events.append(stored_event(self.tier, entry.meta))
            else:
                self.tier.abort(entry)
        return events

    @property
    def cleared(self) -> bool:
        """Whether a clear() came since the write began. Under the lock."""
        return self._generation != self._state.generation
