"""A shared tier's removals reach every member: a chunk that left a store several backends read
(the cache layer's daemon) has left it for all of them, whichever member's stream says so.

The daemon's pool is one store, but its events travel in the engines' streams: a chunk evicted by
engine B's store is reported by B, while engine A, which stored it, announced it. Applied to B's
index alone, that removal finds nothing there, and A keeps a credit for a chunk that is gone
(shared tiers credit the longest prefix any member holds to all of them). `SharedRemovals` wraps a
member's apply callables (`wrap`, `wrap_payloads`): every `BlockRemoved` of a shared tier's medium
it sees is applied to the other members' indexes too (where they never held the chunk it is an
unknown removal, a no-op).

Streams are not ordered with each other, so a removal can reach A after A announced the chunk
again (stored anew after the eviction): A then loses a credit it had, a missed hit, never a false
one. A payload the frame reader scanned is decoded again only when it holds removals.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvwire import BlockRemoved, DecodedBatch, KVEvent, decode_batch, tier_of
from router.config import SharedTier

ApplyTo = Callable[[str, list[KVEvent]], None]


class SharedRemovals:
    def __init__(self, apply_to: ApplyTo, index_names: Callable[[str], list[str]]) -> None:
        """`apply_to(index_name, events)`: the writer's apply; `index_names(backend)`: the indexes
        (one per DP rank) of a backend now."""
        self._apply_to = apply_to
        self._index_names = index_names
        # backend -> {tier as the index names it: the other members}
        self._peers: dict[str, dict[str, tuple[str, ...]]] = {}

    def configure(self, tiers: Sequence[SharedTier]) -> None:
        self._peers = {}
        for tier in tiers:
            for member in tier.backends:
                others = tuple(name for name in tier.backends if name != member)
                self._peers.setdefault(member, {})[tier_of(tier.name)] = others

    def wrap(self, backend: str, apply: Callable[[list[KVEvent]], None]) -> Callable[[list[KVEvent]], None]:
        """`apply` for one of `backend`'s streams, fanning its shared removals out (`apply` itself
        when the backend shares no tier)."""
        peers = self._peers.get(backend)
        if not peers:
            return apply

        def apply_and_share(events: list[KVEvent]) -> None:
            apply(events)
            self._share(peers, events)

        return apply_and_share

    def wrap_payloads(
        self, backend: str, apply_payloads: Callable[[list[bytes]], list[Any]]
    ) -> Callable[[list[bytes]], list[Any]]:
        """`apply_payloads` (the writer's, for one of `backend`'s streams) fanning its shared removals
        out: a payload the frame reader scanned is decoded again only when it holds removals."""
        peers = self._peers.get(backend)
        if not peers:
            return apply_payloads

        def apply_and_share(payloads: list[bytes]) -> list[Any]:
            read = apply_payloads(payloads)
            for payload, batch in zip(payloads, read, strict=True):
                if isinstance(batch, DecodedBatch):
                    self._share(peers, batch.events)
                elif getattr(batch, "removed", 0):  # a scanned WireBatch holding removals
                    self._share(peers, decode_batch(payload).events)
            return read

        return apply_and_share

    def _share(self, peers: dict[str, tuple[str, ...]], events: list[KVEvent]) -> None:
        shared: dict[str, list[KVEvent]] = {}
        for event in events:
            if isinstance(event, BlockRemoved) and event.block_hashes:
                others = peers.get(tier_of(event.medium))
                for other in others or ():
                    shared.setdefault(other, []).append(event)
        for other, removals in shared.items():
            for index_name in self._index_names(other):
                self._apply_to(index_name, removals)
