"""The bookkeeping every storage tier shares: index, eviction order, pins and reference counts.

Invariants (callers hold the engine's lock around every method here):
- a new entry is visible to lookups only once committed; committing replaces any entry of the
  same key atomically (a recompressed chunk never disappears in between);
- an entry with refcount > 0 (being written or read) or pins > 0 is never evicted;
- a removed entry's space is released exactly once, when its last reference goes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cachelayer.storage.eviction import EvictionPolicy, make_policy


@dataclass(slots=True)
class ChunkMeta:
    """What identifies and describes one stored chunk, independent of the tier that holds it."""

    key: int
    parent_key: int | None
    # array("q"): 8 bytes a token (a list of Python ints costs ~36), since small models keep
    # tens of thousands of chunks in the pool. Events and disk headers turn it into a list.
    token_ids: Sequence[int]
    # "raw": the KV as [num_layers, 2, num_tokens, channels] in the engine's dtype; otherwise the
    # name of the codec whose blob is stored.
    fmt: str = "raw"
    # The cache_salt of a chain's first chunk, for its KV event (vLLM carries it in extra_keys so a
    # router keeps salted prefixes apart); None for later chunks (their keys chain from it).
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True, eq=False)
class TierEntry:
    meta: ChunkMeta
    nbytes: int
    location: int = 0  # the pool offset (CPU tier); unused on disk
    refcount: int = 0
    pins: int = 0
    committed: bool = False
    removed: bool = False
    extra: dict = field(default_factory=dict)


class Tier:
    """Index + eviction + refcounts; subclasses supply the space (`_allocate`, `_release_space`)."""

    name = "tier"  # the controller's location name, e.g. "LocalCPUBackend"
    medium = "tier"  # the KV-event medium, e.g. "cpu"

    def __init__(self, cache_policy: str) -> None:
        self._entries: dict[int, TierEntry] = {}  # committed entries
        self._pending: dict[int, TierEntry] = {}  # reserved, being written
        self._policy: EvictionPolicy = make_policy(cache_policy)
        self.evicted_chunks = 0

    # ---- subclass hooks ----
    def _allocate(self, nbytes: int) -> int | None:
        raise NotImplementedError

    def _release_space(self, entry: TierEntry) -> None:
        raise NotImplementedError

    # ---- lookups ----
    def get(self, key: int) -> TierEntry | None:
        return self._entries.get(key)

    def __contains__(self, key: int) -> bool:
        return self.get(key) is not None

    def has_key(self, key: int) -> bool:
        """Held, or reserved by a writer that has not committed yet."""
        return key in self._entries or key in self._pending

    def committed_entries(self) -> list[TierEntry]:
        return list(self._entries.values())

    def touch(self, key: int) -> None:
        self._policy.on_access(key)

    # ---- space ----
    def reserve(self, meta: ChunkMeta, nbytes: int) -> tuple[TierEntry | None, list[ChunkMeta]]:
        """A new uncommitted entry holding one reference (the writer's), evicting as needed.

        Returns (None, evicted) when even evicting every evictable chunk does not make room.
        """
        evicted: list[ChunkMeta] = []
        location = self._allocate(nbytes)
        if location is None:
            for key in self._policy.candidates():
                victim = self._entries.get(key)
                if victim is None or victim.refcount or victim.pins:
                    continue
                self.remove(key)
                self.evicted_chunks += 1
                evicted.append(victim.meta)
                location = self._allocate(nbytes)
                if location is not None:
                    break
        if location is None:
            return None, evicted
        entry = TierEntry(meta=meta, nbytes=nbytes, location=location, refcount=1)
        self._pending[meta.key] = entry
        return entry, evicted

    def commit(self, entry: TierEntry) -> None:
        """Make a written entry visible, replacing any entry of the same key; drops the writer's reference."""
        key = entry.meta.key
        if self._pending.get(key) is entry:
            del self._pending[key]
        replaced = self.remove(key)
        if replaced is not None:
            entry.pins = replaced.pins  # a re-encoded chunk stays pinned
        entry.committed = True
        self._entries[key] = entry
        self._policy.on_insert(key)
        self.release(entry)

    def abort(self, entry: TierEntry) -> None:
        """Drop an entry whose write failed."""
        if self._pending.get(entry.meta.key) is entry:
            del self._pending[entry.meta.key]
        entry.removed = True
        self.release(entry)

    def withdraw(self, entry: TierEntry) -> None:
        """Drop an uncommitted entry from the index but keep the writer's reference (and so its
        space) until the writer is known to have stopped: then `release` frees it."""
        if self._pending.get(entry.meta.key) is entry:
            del self._pending[entry.meta.key]
        entry.removed = True

    def acquire(self, entry: TierEntry) -> None:
        entry.refcount += 1

    def release(self, entry: TierEntry) -> None:
        if entry.refcount <= 0:
            raise RuntimeError(f"chunk {entry.meta.key:#x} released more often than acquired")
        entry.refcount -= 1
        if entry.refcount == 0 and entry.removed:
            self._release_space(entry)

    def remove(self, key: int) -> TierEntry | None:
        """Take a chunk out of the index; its space goes back once no reader holds it."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._policy.on_remove(key)
        entry.removed = True
        if entry.refcount == 0:
            self._release_space(entry)
        return entry

    # ---- pins ----
    def pin(self, key: int) -> bool:
        entry = self.get(key)
        if entry is None:
            return False
        entry.pins += 1
        return True

    def unpin(self, key: int) -> bool:
        entry = self.get(key)
        if entry is None or entry.pins == 0:
            return False
        entry.pins -= 1
        return True

    @property
    def num_chunks(self) -> int:
        return len(self._entries)
