"""Leases on L1 chunks that same-host clients read or write in the shared pool themselves.

A shared-memory client copies KV between its memory and the daemon's pool between two control
messages. In between, the chunks it touches are held by a lease, so that neither eviction nor a
concurrent store can hand their space to another chunk:
- a read lease holds a reference on each chunk it covers; `release` drops them. A read lease that
  outlives `ttl_s` is ended by the daemon (the chunks may then be evicted) and its release is
  answered "expired": the client discards what it copied, so a reader never uses reused memory.
- a write lease holds the reserved chunks until `commit` makes them visible. One that outlives
  `ttl_s` is withdrawn (its keys may be stored by others) but its space stays allocated for one
  more `ttl_s`, because its owner may still be copying into it; then it is freed, whether or not
  the owner lives (a commit after that is answered "expired").
- every lease belongs to the connection that opened it (`Owner`: the credential and the ZMQ
  routing id the daemon saw, never anything the client claims), and its id is 128 random bits:
  no other client can commit, release or even name it. An expired lease no longer counts
  against its owner's cap.
- a client may also name its process (pid and start time, checked in /proc): when that process
  is gone, the leases of that connection end at once, so a client killed mid-transfer leaks
  nothing until the TTL. The pid only ever shortens the naming connection's own leases.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Literal

from cachelayer.engine import CacheEngine, StoreReservation
from cachelayer.errors import CacheLayerError
from cachelayer.server.protocol import ChunkEvent
from cachelayer.storage.tier import TierEntry

# How often owners' liveness is checked (a /proc read per client process).
LIVENESS_INTERVAL_S = 0.2


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat), or None
    when no such process is visible: with the pid, an identity that survives pid reuse."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            data = stat.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class ClientProcess:
    pid: int
    start_time: int

    def alive(self) -> bool:
        return process_start_time(self.pid) == self.start_time


@dataclass(frozen=True, slots=True)
class Owner:
    """The connection a lease belongs to: its credential's name and its ZMQ routing id."""

    credential: str
    connection: bytes


LEASE_ID_BYTES = 16


@dataclass(slots=True)
class Lease:
    lease_id: bytes
    owner: Owner
    # The process the owner named, when the daemon can see it: its death ends the lease early.
    process: ClientProcess | None
    engine: CacheEngine
    kind: Literal["read", "write"]
    deadline: float
    # read: the chunks referenced; write: the reservation being filled.
    entries: list[TierEntry] = field(default_factory=list)
    reservation: StoreReservation | None = None
    # write: chunks evicted while reserving, reported with the commit.
    events: list[ChunkEvent] = field(default_factory=list)
    expired: bool = False


class LeaseLimitError(CacheLayerError, RuntimeError):
    """A client holds too many leases at once."""


class LeaseTable:
    """Every open lease of one daemon. Not thread-safe: the daemon's serving thread owns it.

    Caps count live (unexpired) leases: `max_per_client` a connection, `max_per_credential` every
    connection of one credential together (one client opening many connections)."""

    def __init__(self, *, ttl_s: float, max_per_client: int = 64, max_per_credential: int = 1024) -> None:
        self.ttl_s = ttl_s
        self.max_per_client = max_per_client
        self.max_per_credential = max_per_credential
        self._leases: dict[bytes, Lease] = {}
        self._next_liveness_check = 0.0
        self.opened_total = 0
        self.expired_total = 0
        self.reclaimed_total = 0  # leases ended because their owner died

    def __len__(self) -> int:
        return len(self._leases)

    def check_room(self, owner: Owner) -> None:
        """LeaseLimitError when `owner` may open no more lease now (checked before reserving)."""
        live = [lease for lease in self._leases.values() if not lease.expired]
        held = sum(1 for lease in live if lease.owner == owner)
        if held >= self.max_per_client:
            raise LeaseLimitError(
                f"this connection already holds {held} leases: release or commit them first"
            )
        held_by_credential = sum(1 for lease in live if lease.owner.credential == owner.credential)
        if held_by_credential >= self.max_per_credential:
            raise LeaseLimitError(
                f"the clients of credential {owner.credential!r} already hold {held_by_credential} "
                "leases: release or commit them first"
            )

    def _open(self, lease: Lease) -> Lease:
        try:
            self.check_room(lease.owner)
        except LeaseLimitError:
            self._end(lease)
            raise
        self._leases[lease.lease_id] = lease
        self.opened_total += 1
        return lease

    def open_read(
        self, owner: Owner, process: ClientProcess | None, engine: CacheEngine, entries: list[TierEntry]
    ) -> Lease:
        deadline = time.monotonic() + self.ttl_s
        return self._open(Lease(_new_id(), owner, process, engine, "read", deadline, entries=entries))

    def open_write(
        self,
        owner: Owner,
        process: ClientProcess | None,
        engine: CacheEngine,
        reservation: StoreReservation,
        events: list[ChunkEvent],
    ) -> Lease:
        lease = Lease(
            _new_id(),
            owner,
            process,
            engine,
            "write",
            time.monotonic() + self.ttl_s,
            reservation=reservation,
            events=events,
        )
        return self._open(lease)

    def holds(self, engine: CacheEngine) -> bool:
        """Whether some lease still references `engine` (its key space must not be retired)."""
        return any(lease.engine is engine for lease in self._leases.values())

    def take(self, lease_id: bytes, owner: Owner) -> Lease | None:
        """Remove and return the owner's lease (expired ones included); None if it has none of that id."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.owner != owner:
            return None
        return self._leases.pop(lease_id)

    def finish(self, lease: Lease) -> None:
        """End a taken lease without committing: release what it holds."""
        self._end(lease)

    def reap(self, now: float | None = None) -> None:
        """Expire overdue leases; free expired ones one TTL later; end the leases whose named
        client process is gone."""
        now = time.monotonic() if now is None else now
        for lease_id, lease in list(self._leases.items()):
            if not lease.expired and now > lease.deadline:
                self._expire(lease)
            if lease.expired and now > lease.deadline + self.ttl_s:
                # Past its grace: an owner still writing now is broken; its space goes back.
                del self._leases[lease_id]
                self._end(lease)
        if now < self._next_liveness_check:
            return
        self._next_liveness_check = now + LIVENESS_INTERVAL_S
        processes = {lease.process for lease in self._leases.values() if lease.process is not None}
        dead = {process for process in processes if not process.alive()}
        for lease_id, lease in list(self._leases.items()):
            if lease.process in dead:
                del self._leases[lease_id]
                self._end(lease)
                self.reclaimed_total += 1

    def close(self) -> None:
        for lease in list(self._leases.values()):
            self._end(lease)
        self._leases.clear()

    def _expire(self, lease: Lease) -> None:
        lease.expired = True
        self.expired_total += 1
        if lease.kind == "read":
            lease.engine.release_chunks(lease.entries)
            lease.entries = []
        elif lease.reservation is not None:
            lease.engine.withdraw_chunks(lease.reservation)

    def _end(self, lease: Lease) -> None:
        """Release what the lease holds (idempotent: a second call finds nothing left)."""
        if lease.kind == "read":
            lease.engine.release_chunks(lease.entries)
            lease.entries = []
        elif lease.reservation is not None:
            if lease.expired:  # withdrawn already: only the space is left to free
                lease.engine.release_chunks([entry for _, entry in lease.reservation.chunks])
            else:
                lease.engine.abort_chunks(lease.reservation)
            lease.reservation = None


def _new_id() -> bytes:
    return secrets.token_bytes(LEASE_ID_BYTES)
