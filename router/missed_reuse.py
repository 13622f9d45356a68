"""Missed reuse: the prompt tokens of a routed request that the fleet held cached but the chosen
engine computed anyway, counted by reason (kvgate_missed_reuse_tokens_total) from what the routing
decision already holds, the policy's frozen Choice, and, for a stale index, the answer's usage.

The reasons split the missed tokens so that none is counted twice (docs/gateway.md, "Missed reuse"):
at routing time, the gap is the best other candidate's credited prefix less the winner's. If the
winner is routed by load only for a contract mismatch, the whole gap is `contract_mismatch`.
Otherwise the part of the gap that the best candidate holds on its GPU (or as predicted; all of it
for a policy whose credit has no tiers, approximate's learned placements) is `load_guard` (only
routing there could reuse it: the policy chose another for its load), and the rest, held only in
a tier (CPU, disk, a shared store) the winner cannot load from, is `tier_unreachable`. When the
answer ends, the winner's own credit less the cached tokens its usage reports is `stale_index`:
tokens below the winner's credit, so disjoint from the gap.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter

# `choice` below is a router.policies.base.Choice, typed loosely: this module sits on the ground
# floor (router/metrics.py holds it), below the policies.
Choice = Any

REASONS = ("load_guard", "stale_index", "tier_unreachable", "contract_mismatch")
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_NO_UNCREDITED: Mapping[str, str] = {}


def routing_gap(choice: Choice, uncredited: Mapping[str, str]) -> tuple[str | None, int, int]:
    """(the reason the whole gap is charged to, or None to split it, the gap's GPU part, the gap)
    for a Choice: tokens the best other candidate is credited beyond the winner's credit."""
    candidates = choice.candidates
    if not candidates:
        return None, 0, 0
    winner = choice.backend.name
    own = candidates.get(winner)
    held = own.get("cached", 0) if own is not None else 0
    best_name, best = None, held
    for name, score in candidates.items():
        cached = score.get("cached", 0)
        if cached > best and name != winner:
            best_name, best = name, cached
    if best_name is None:
        return None, 0, 0
    gap = best - held
    if winner in uncredited:
        return "contract_mismatch", 0, gap
    score = candidates[best_name]
    if "by_tier" in score or "predicted" in score:
        on_gpu = max(score.get("by_tier", {}).get("gpu", 0), score.get("predicted", 0))
    else:
        # A policy with no tier view (approximate: the placements it learned) credits what it
        # believes the engine's GPU holds: none of its gap is a tier's.
        on_gpu = best
    return None, min(gap, max(0, on_gpu - held)), gap


def reported_cached_tokens(tail: bytes) -> int | None:
    """The last `cached_tokens` in the end of an answer (usage.prompt_tokens_details), if any."""
    found = _CACHED_TOKENS.findall(tail)
    return int(found[-1]) if found else None


class MissedReuse:
    """Counts missed reuse per reason (and per chosen backend, bounded by the backend count)."""

    def __init__(self, registry: CollectorRegistry, enabled: bool = True) -> None:
        self.enabled = enabled
        # Backends routed by load only (KVIndexService.uncredited); set by the gateway's wiring.
        self.uncredited: Mapping[str, str] = _NO_UNCREDITED
        self.counter = Counter(
            "kvgate_missed_reuse_tokens",
            "Prompt tokens cached somewhere in the fleet but computed anyway by the chosen engine, by "
            "reason (load_guard, stale_index, tier_unreachable, contract_mismatch)",
            ["reason"],
            registry=registry,
        )
        self.by_backend = Counter(
            "kvgate_missed_reuse_backend_tokens",
            "Missed reuse tokens by the backend that computed them and the reason",
            ["backend", "reason"],
            registry=registry,
        )
        self._children = {reason: self.counter.labels(reason) for reason in REASONS}
        self._backend_children: dict[tuple[str, str], Any] = {}
        self.totals = dict.fromkeys(REASONS, 0)
        self.requests_with_miss = 0

    def _add(self, backend: str, reason: str, tokens: int) -> None:
        self._children[reason].inc(tokens)
        self.totals[reason] += tokens
        key = (backend, reason)
        child = self._backend_children.get(key)
        if child is None:
            child = self._backend_children[key] = self.by_backend.labels(backend, reason)
        child.inc(tokens)

    def routed(self, choice: Choice) -> None:
        """Count the gap of the Choice a request was sent with (the last attempt's)."""
        if not self.enabled or not choice.candidates:
            return
        whole, on_gpu, gap = routing_gap(choice, self.uncredited)
        if gap <= 0:
            return
        self.requests_with_miss += 1
        backend = choice.backend.name
        if whole is not None:
            self._add(backend, whole, gap)
            return
        if on_gpu:
            self._add(backend, "load_guard", on_gpu)
        if gap > on_gpu:
            self._add(backend, "tier_unreachable", gap - on_gpu)

    def wants_tail(self, choice: Choice) -> bool:
        """Whether the answer's end must be kept to check the winner's credit (it had some)."""
        return self.enabled and bool(choice.cached_tokens)

    def finished(self, choice: Choice, status: int, tail: bytes) -> None:
        """Count the winner's credit its answer's usage, read from the answer's end `tail`, says it
        did not have (stale index)."""
        if self.enabled and choice.cached_tokens and status == 200:
            self.answered(choice, status, reported_cached_tokens(tail))

    def answered(self, choice: Choice, status: int, reported: int | None) -> None:
        """`finished` for an answer whose usage was read already: `reported` cached tokens (None:
        the answer reported none, and nothing is counted)."""
        credited = choice.cached_tokens
        if not self.enabled or not credited or status != 200 or reported is None:
            return
        if reported < credited:
            self._add(choice.backend.name, "stale_index", credited - reported)

    def describe(self) -> dict[str, Any]:
        """For /debug/prefix-map: totals per reason, and per backend."""
        per_backend: dict[str, dict[str, int]] = {}
        for (backend, reason), child in self._backend_children.items():
            per_backend.setdefault(backend, {})[reason] = int(child._value.get())
        return {"enabled": self.enabled, "tokens": dict(self.totals), "by_backend": per_backend}
