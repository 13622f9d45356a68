"""The remote tier's removals: which of the chunks this engine announced in Redis are gone, told as
KV events (`BlockRemoved`, medium "remote"), so that a router never credits a prefix Redis lost.

Redis evicts (maxmemory), expires and deletes keys without telling the engines that wrote them.
`RemoteTruth` remembers the chunks this engine announced stored in the remote tier (it announces
only those its own writer SET; a chunk another engine had already written is that engine's to
announce) and retracts each one when it learns the key is gone, by two means:
- reconciliation, every `remote_reconcile_interval_s`: one pipelined EXISTS per announced chunk
  (slices of `RECONCILE_SLICE` keys, one round trip each); it needs nothing of the server and
  repairs whatever a notification missed;
- optionally (`remote_eviction_notifications`) the server's keyevent notifications of evicted,
  expired and deleted keys, for a removal within milliseconds. Pub/sub is fire-and-forget: a
  message sent while the subscription is down is lost, so every (re)subscription is followed by a
  reconciliation. It needs the operator to turn `notify-keyspace-events` on (`Exge`); the engine
  never changes the server's configuration and warns when they are off.

Whoever announced a chunk retracts it, and nobody else: each engine's stream stays consistent with
itself (a removal only for a chunk that stream announced, sequence-numbered and replayed with the
rest), and a router that credits a shared tier to all its members from the union of their streams
sees a chunk credited exactly while some announcer still believes it held. Two engines that both
wrote one chunk (a race between their EXISTS and SET) both announced it and both retract it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import redis

from cachelayer.storage.chunk_write import TierState
from cachelayer.storage.remote import CorruptValue, RemoteTier
from kvwire import BlockRemoved

log = logging.getLogger(__name__)

# Keys asked about in one round trip of a reconciliation (about 70 bytes each way per key).
RECONCILE_SLICE = 1024
# Seconds between attempts to subscribe again after the notification connection failed.
RESUBSCRIBE_AFTER_S = 1.0
# The keyevent classes a removal needs: E (keyevent channel), x (expired), e (evicted), g (DEL).
NEEDED_KEYEVENT_FLAGS = "Exeg"


@dataclass(slots=True)
class TruthCounters:
    """What the remote tier's removals did, for stats()."""

    reconciliations: int = 0
    reconciled_chunks: int = 0  # keys asked about
    retracted_by_reconciliation: int = 0
    retracted_by_notification: int = 0
    retracted_by_read: int = 0  # values a retrieve found corrupt and deleted
    retracted_by_bound: int = 0  # forgotten past remote_max_announced_chunks
    retracted_by_quota: int = 0  # removed by this engine's write to keep a tenant within its share
    notifications: int = 0
    subscriptions: int = 0


class RemoteTruth:
    """The chunks this engine announced in the remote tier, and the threads that retract those the
    tier lost. Its events go to the engine's listeners, under the engine's lock, as every change."""

    def __init__(
        self,
        remote: RemoteTier,
        state: TierState,
        *,
        reconcile_interval_s: float,
        notifications: bool,
        max_chunks: int,
    ) -> None:
        self.remote = remote
        self._state = state
        self._max_chunks = max_chunks
        # chunk key -> the announcement's number, oldest first (under the state's lock): a
        # reconciliation retracts a chunk only if it was not announced again since it looked.
        self._announced: dict[int, int] = {}
        self._announcements = 0
        self.counters = TruthCounters()
        self._stopped = threading.Event()
        self._wake = threading.Event()
        self._interval_s = reconcile_interval_s
        self._threads: list[threading.Thread] = []
        if reconcile_interval_s > 0 or notifications:
            self._start(self._reconcile_loop, "cachelayer-remote-reconcile")
        if notifications:
            self._start(self._listen_loop, "cachelayer-remote-notifications")

    def _start(self, target: object, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # ---- what the engine tells it ----

    def announced(self, keys: Iterable[int]) -> None:
        """The engine announced these chunks stored in the remote tier. Under the state's lock."""
        announced = self._announced
        for key in keys:
            self._announcements += 1
            announced.pop(key, None)  # the newest announcement moves to the end
            announced[key] = self._announcements
        excess = len(announced) - self._max_chunks
        if excess > 0:
            oldest = [key for key, _ in zip(announced, range(excess), strict=False)]
            self.counters.retracted_by_bound += len(oldest)
            self._retract(oldest)

    def lost(self, keys: Iterable[int], *, by: str = "read") -> int:
        """The remote tier no longer holds these chunks: retract those this engine announced."""
        with self._state.lock:
            gone = [key for key in keys if key in self._announced]
            if gone:
                field = f"retracted_by_{by}"
                setattr(self.counters, field, getattr(self.counters, field) + len(gone))
                self._retract(gone)
            return len(gone)

    def _retract(self, keys: list[int]) -> None:
        for key in keys:
            del self._announced[key]
        self._state.emit([BlockRemoved(block_hashes=keys, medium=self.remote.medium)])

    @property
    def announced_chunks(self) -> int:
        with self._state.lock:
            return len(self._announced)

    # ---- reconciliation ----

    def reconcile(self) -> int | None:
        """Ask the remote tier about every announced chunk and retract those it lost; the number
        retracted, None when Redis could not answer (nothing is retracted on a failure)."""
        with self._state.lock:
            looked = dict(self._announced)
        keys = list(looked)
        retracted = 0
        for start in range(0, len(keys), RECONCILE_SLICE):
            part = keys[start : start + RECONCILE_SLICE]
            missing = self.remote.missing(part)
            if missing is None:
                return None
            self.counters.reconciled_chunks += len(part)
            if missing:
                with self._state.lock:
                    # Announced again since we looked (written back after an eviction): keep it.
                    gone = [key for key in missing if self._announced.get(key) == looked[key]]
                    if gone:
                        self.counters.retracted_by_reconciliation += len(gone)
                        self._retract(gone)
                        retracted += len(gone)
        self.counters.reconciliations += 1
        return retracted

    def reconcile_soon(self) -> None:
        """Run a reconciliation now, in the reconciling thread (after a subscription came back)."""
        self._wake.set()

    def _reconcile_loop(self) -> None:
        while not self._stopped.is_set():
            # Without a period, reconciliations run only when a (re)subscription asks for one.
            self._wake.wait(self._interval_s if self._interval_s > 0 else None)
            self._wake.clear()
            if self._stopped.is_set():
                return
            try:
                self.reconcile()
            except Exception:  # a bug here must not end the thread silently
                log.exception("cachelayer: remote tier reconciliation failed")

    # ---- keyspace notifications ----

    def _listen_loop(self) -> None:
        warned = False
        while not self._stopped.is_set():
            flags = self.remote.keyevent_flags()
            if not warned and (flags is None or not _covers(flags)):
                warned = True
                log.warning(
                    "cachelayer: remote_eviction_notifications is on but the Redis at %s %s; "
                    "removals are found by reconciliation only until it is set "
                    "(CONFIG SET notify-keyspace-events %s)",
                    self.remote.url,
                    "does not let its notify-keyspace-events be read"
                    if flags is None
                    else f"has notify-keyspace-events {flags!r}",
                    NEEDED_KEYEVENT_FLAGS,
                )
            try:
                self.remote.watch_removals(
                    self._notified,
                    self._stopped,
                    database=self.remote.database,
                    on_subscribed=self._subscribed,
                )
            except (redis.RedisError, OSError, CorruptValue) as exc:
                log.warning("cachelayer: remote tier notifications lost (%s); subscribing again", exc)
            self._stopped.wait(RESUBSCRIBE_AFTER_S)

    def _subscribed(self) -> None:
        self.counters.subscriptions += 1
        self.reconcile_soon()  # what was evicted while nobody listened

    def _notified(self, keys: list[int]) -> None:
        self.counters.notifications += len(keys)
        self.lost(keys, by="notification")

    def close(self) -> None:
        self._stopped.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=5)

    def stats(self) -> dict[str, int]:
        counters = self.counters
        return {
            "remote_announced_chunks": self.announced_chunks,
            "remote_reconciliations": counters.reconciliations,
            "remote_reconciled_chunks": counters.reconciled_chunks,
            "remote_retracted_chunks": (
                counters.retracted_by_reconciliation
                + counters.retracted_by_notification
                + counters.retracted_by_read
                + counters.retracted_by_bound
                + counters.retracted_by_quota
            ),
            "remote_retracted_by_notification": counters.retracted_by_notification,
            "remote_notifications": counters.notifications,
        }


def _covers(flags: str) -> bool:
    """Whether `notify-keyspace-events` sends the keyevent notifications a removal needs ("A" is
    every class but key-miss and new-key)."""
    classes = set(flags.replace("A", "g$lshzxetd"))
    return "E" in classes and all(flag in classes for flag in "xeg")
