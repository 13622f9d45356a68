"""The bookkeeping every storage tier shares: index, eviction order, pins and reference counts.

Invariants (callers hold the engine's lock around every method here):
- a new entry is visible to lookups only once committed; committing replaces any entry of the
  same key atomically (a recompressed chunk never disappears in between);
- an entry with refcount > 0 (being written or read) or pins > 0 is never evicted;
- a removed entry's space is released exactly once, when its last reference goes;
- with a `TenantLedger`, a tenant's bytes count from its chunk's reservation until its space is
  released (the sum over tenants is the tier's allocated bytes), and a reservation that would take
  a tenant past its cap first evicts that tenant's own chunks, in the tier's eviction order, never
  another tenant's; when they cannot make room (pinned, in use) the reservation is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cachelayer.keys import ChunkSpan
from cachelayer.storage.eviction import EvictionPolicy, make_policy
from cachelayer.storage.quotas import SHARED_TENANT, TenantLedger, tenant_of


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
    # Whose quota the chunk counts against (cachelayer.storage.quotas.tenant_of its chain's salt).
    tenant: str = SHARED_TENANT

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def of_span(
        cls, span: ChunkSpan, token_ids: Sequence[int], fmt: str = "raw", cache_salt: str | None = None
    ) -> ChunkMeta:
        """The chunk `span` of a chain stored under `cache_salt`: the salt on its first chunk only
        (for its event), the tenant on every chunk (for its quota)."""
        first = span.parent_key is None
        salt = cache_salt if first else None
        return cls(span.key, span.parent_key, token_ids, fmt, salt, tenant_of(cache_salt))


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

    def __init__(self, cache_policy: str, ledger: TenantLedger | None = None) -> None:
        self._entries: dict[int, TierEntry] = {}  # committed entries
        self._pending: dict[int, TierEntry] = {}  # reserved, being written
        self._cache_policy = cache_policy
        self._policy: EvictionPolicy = make_policy(cache_policy)
        self.evicted_chunks = 0
        # Per-tenant caps (None: one budget for all). Each tenant then has an eviction order of its
        # own, so a tenant at its cap finds its own oldest chunks without walking everyone's.
        self.ledger = ledger
        self._tenant_policies: dict[str, EvictionPolicy] = {}

    # ---- subclass hooks ----
    def _allocate(self, nbytes: int) -> int | None:
        raise NotImplementedError

    def _release_space(self, entry: TierEntry) -> None:
        raise NotImplementedError

    def _charged_bytes(self, nbytes: int) -> int:
        """What a chunk of `nbytes` costs the tier's space (and its tenant's quota)."""
        return nbytes

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
        if self.ledger is not None:
            entry = self._entries.get(key)
            if entry is not None:
                self._tenant_policies[entry.meta.tenant].on_access(key)

    # ---- space ----
    def reserve(self, meta: ChunkMeta, nbytes: int) -> tuple[TierEntry | None, list[ChunkMeta]]:
        """A new uncommitted entry holding one reference (the writer's), evicting as needed.

        Returns (None, evicted) when even evicting every evictable chunk does not make room.
        """
        evicted: list[ChunkMeta] = []
        ledger = self.ledger
        if ledger is not None and not self._within_cap(
            ledger, meta.tenant, self._charged_bytes(nbytes), evicted
        ):
            ledger.note(meta.tenant, refused=1)
            return None, evicted
        location = self._allocate(nbytes)
        # The pool itself is full: its eviction order decides, over every tenant (each of them
        # within its cap; docs/cachelayer.md, "Tenant quotas"). One victim at a time, read lazily
        # from the front of the order: a snapshot of the whole order per eviction cost O(chunks).
        while location is None:
            victim = self._first_evictable()
            if victim is None:
                break
            self._evict(victim, evicted)
            location = self._allocate(nbytes)
        if location is None:
            return None, evicted
        entry = TierEntry(meta=meta, nbytes=nbytes, location=location, refcount=1)
        if ledger is not None:
            ledger.add(meta.tenant, self._charged_bytes(nbytes))
        self._pending[meta.key] = entry
        return entry, evicted

    def _within_cap(self, ledger: TenantLedger, tenant: str, nbytes: int, evicted: list[ChunkMeta]) -> bool:
        """Whether `nbytes` more fit `tenant`'s cap, after evicting its own chunks (oldest first in
        the tier's order) as far as needed; never another tenant's."""
        cap = ledger.cap(tenant)
        if nbytes > cap:
            return False
        if ledger.used(tenant) + nbytes <= cap:
            return True
        # Chosen first, removed after: the walk reads the tenant's order lazily (a tenant at its cap
        # evicts on every store; copying its whole order each time would cost O(its chunks)).
        needed = ledger.used(tenant) + nbytes - cap
        victims: list[TierEntry] = []
        own = self._tenant_policies.get(tenant)
        for key in own.in_order() if own is not None else ():
            victim = self._entries[key]
            if victim.refcount or victim.pins:
                continue
            victims.append(victim)
            needed -= self._charged_bytes(victim.nbytes)
            if needed <= 0:
                break
        if needed > 0:
            return False  # pinned or in use: nothing is evicted for a store that cannot fit anyway
        for victim in victims:
            self._evict(victim, evicted)
        ledger.note(tenant, evicted=len(victims))
        return True

    def _first_evictable(self) -> TierEntry | None:
        """The first chunk in the eviction order that no one holds or pinned (None: there is none)."""
        for key in self._policy.in_order():
            entry = self._entries.get(key)
            if entry is not None and not entry.refcount and not entry.pins:
                return entry
        return None

    def _evict(self, victim: TierEntry, evicted: list[ChunkMeta]) -> None:
        self.remove(victim.meta.key)
        self.evicted_chunks += 1
        evicted.append(victim.meta)

    def _give_back(self, entry: TierEntry) -> None:
        """Release a removed entry's space, and its bytes from its tenant's count."""
        self._release_space(entry)
        if self.ledger is not None:
            self.ledger.subtract(entry.meta.tenant, self._charged_bytes(entry.nbytes))

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
        if self.ledger is not None:
            tenant = entry.meta.tenant
            policy = self._tenant_policies.get(tenant)
            if policy is None:
                policy = self._tenant_policies[tenant] = make_policy(self._cache_policy)
            policy.on_insert(key)
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
            self._give_back(entry)

    def remove(self, key: int) -> TierEntry | None:
        """Take a chunk out of the index; its space goes back once no reader holds it."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._policy.on_remove(key)
        if self.ledger is not None:
            tenant = entry.meta.tenant
            policy = self._tenant_policies[tenant]
            policy.on_remove(key)
            if not len(policy):
                del self._tenant_policies[tenant]
        entry.removed = True
        if entry.refcount == 0:
            self._give_back(entry)
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

    def tenant_usage(self) -> dict[str, dict[str, int]] | None:
        """Bytes, chunks and cap per tenant label (cachelayer.storage.quotas.TenantLedger.report);
        None without quotas."""
        return self.ledger.report() if self.ledger is not None else None
