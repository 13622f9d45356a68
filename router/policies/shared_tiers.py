"""Shared KV tiers: a prefix in a store several backends read is a hit for every one of them.

The engines report what they hold per tier (KV events' `medium`). A tier that several engines
share (the cache layer's daemon, its Redis tier) is reported by whichever engine put a chunk
there, but every engine attached to that store can load it. Given the `shared_tiers` of the
configuration, `SharedTiers.credit` takes the longest prefix any member holds in a shared tier and
credits it, in that tier, to every member: the prefix then no longer pins traffic to the engine
that stored it, and kv_aware chooses among the members by load. The tier keeps its own hit weight
(a load from that store, not a GPU hit), and a member's own GPU or CPU prefix still counts first.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvwire import tier_of
from router.config import SharedTier
from router.index.store import BackendMatch


class SharedTiers:
    def __init__(self, tiers: Sequence[SharedTier]) -> None:
        # (tier as the index names it, its members)
        self._tiers = [(tier_of(tier.name), tuple(tier.backends)) for tier in tiers]
        self.hit_weights = {tier_of(tier.name): tier.hit_weight for tier in tiers}
        self.members = sorted({backend for _, backends in self._tiers for backend in backends})

    def __bool__(self) -> bool:
        return bool(self._tiers)

    def credit(
        self, matches: dict[str, BackendMatch], uncredited: Collection[str] = ()
    ) -> dict[str, BackendMatch]:
        """`matches` (index lookups, members of the shared tiers included) with each shared tier's
        longest prefix credited to all its members but the `uncredited` (a contract mismatch: the
        member may key the store otherwise, so what the others wrote may be no hit for it)."""
        credited = dict(matches)
        for tier, backends in self._tiers:
            held = max(
                (matches[name].by_tier.get(tier, 0) for name in backends if name in matches), default=0
            )
            if not held:
                continue
            for name in backends:
                if name not in uncredited:
                    credited[name] = with_tier_prefix(credited.get(name), tier, held)
        return credited


def with_tier_prefix(match: BackendMatch | None, tier: str, held: int) -> BackendMatch:
    """`match` with `held` leading tokens loadable from `tier` (faster tiers keep their prefix)."""
    by_tier = dict(match.by_tier) if match else {}
    by_tier[tier] = max(by_tier.get(tier, 0), held)
    cumulative = [(name, through) for name, through in (match.cumulative if match else []) if name != tier]
    reached = cumulative[-1][1] if cumulative else 0
    if by_tier[tier] > reached:
        cumulative.append((tier, by_tier[tier]))
    return BackendMatch(by_tier, cumulative)
