"""kv_aware: route to the backend that would compute the fewest prompt tokens, load included.

Cost of backend B for a prompt of P tokens:
    saved  = gpu_hit_weight * G + cpu_hit_weight * C + disk_hit_weight * D
             (G: leading tokens on B's GPU, or predicted there; C, D: the further tokens B can load
             from CPU, disk; all from the event-driven index)
    cost   = uncached_token_weight * (P - saved)
             + request_load_weight * in_flight + prefill_load_weight * in_flight_prefill_tokens
The cheapest backend wins, with these guards:
- share of recent requests: each backend's count of routed requests decays with share_half_life_s;
  a backend whose count, with this request, would exceed max_share_ratio * the mean, or the
  mean plus share_noise * sqrt(mean) (the chance spread of small counts) when that is more, plus
  share_slack, is skipped while another is under that line (with hot_prefix_requests N > 0, only
  for prompts whose best cached prefix N recent requests matched, same decay; with
  replica_must_pay, only when those requests, at request_load_weight prompt tokens each, outweigh
  the prefill of the cached prefix the move forfeits: a shared system prompt's copy pays, one of a
  document with a few questions does not).
  In-flight counts alone cannot see a hot prefix when requests finish fast (about one in flight per
  engine); the decayed share can, and the request then goes to the cheapest under-share backend,
  which pays the prefill once and caches the hot prefix too (a second replica, which later requests
  for it share), as a perfect-knowledge placement would. With N > 0 a prefix only one
  conversation uses is not moved (moving it costs its whole prefill and replicates nothing);
- in-flight hot spots: a backend whose in-flight count is over max_load_ratio * mean + load_slack
  is skipped while another candidate is under that line (with hot_prefix_requests N > 0, like the
  share guard, only for a hot prefix: a conversation's or a document's own prefix is not moved for
  the instant's in-flight count, the cost's load terms weigh it);
- nothing cached: when no candidate holds (or is predicted to hold) any of the prompt, among the
  candidates under the in-flight line (max_load_ratio * mean + load_slack), those with the fewest
  prompt tokens still to prefill, then the fewest prompt tokens placed to compute lately
  (`cold_spread_by: prefill_tokens`; `new_prefixes`: the fewest recent cold placements), then
  the fewest in flight, ties taken in turn. Different cold
  prefixes therefore spread over the engines by what they fill instead of piling onto the first one
  (docs/index.md, "kv_aware", has why); between equal costs otherwise, the
  backend with the fewest recently placed prompt tokens wins, then the one whose cache holds least.
With measure_load_costs (off by default), the TTFTs of streamed requests measure what a request in
flight and a queued prompt token cost on these engines, in prompt tokens, and the larger of
measured and configured weight applies (router/policies/load_costs.py, docs/index.md).
With `shared_tiers` configured, a prefix held in a store several backends read (a shared cache
daemon, a Redis tier) counts for every backend attached to it, at that tier's hit weight
(router/policies/shared_tiers.py), so the load terms choose among them.
After routing, the prompt is credited to the chosen backend for prediction_ttl_s (its events arrive
only after the prefill); predictions steer routing but never appear in the index or /lookup.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Counter

from router.config import CacheAwareGuards, KVAwarePolicy
from router.index.keys import ROUTER_BLOCK_TOKENS, prompt_prefix_keys
from router.index.store import BackendMatch
from router.policies.base import Choice, PeerPlacement, Policy
from router.policies.capacity import CapacityModel
from router.policies.least_loaded import fewest_in_flight
from router.policies.load_costs import MeasuredLoadCosts
from router.policies.shared_tiers import SharedTiers

if TYPE_CHECKING:
    from router.backends import BackendState
    from router.cluster import RoutedNote
    from router.policies import PolicyContext
    from router.policies.base import CandidateScore, RecentDecision, RouteRequest

logger = logging.getLogger("kvgate.policy")


class KVIndex(Protocol):
    """What kv_aware reads from the KV index: router/index/service.py's KVIndexService in the gateway
    (a bare PrefixIndex in unit tests)."""

    def longest_cached_prefix(
        self, tokens: Any, namespace: Any, backends: Sequence[str] | None = None, *, keys: Any = None
    ) -> dict[str, BackendMatch]: ...

    def namespace_for(self, model: str, cache_salt: str | None) -> Any: ...

    def held_tokens(self, backend: str) -> int: ...

    def stats(self, backend: str) -> Any: ...

    # Backends routed by load only, and why (a contract mismatch): they get no shared-tier credit.
    uncredited: Mapping[str, str]


# Recent placements decay with this half-life (seconds): long enough to spread a burst of cold
# prefixes, short enough that yesterday's traffic does not steer today's.
PLACEMENT_HALF_LIFE_S = 30.0
DECISIONS_KEPT = 200


@dataclass(slots=True)
class RequestState:
    """What a cache-aware policy keeps of one request from choose() to on_routed() and
    on_finished(): the Choice's `state`, read by no one else."""

    request_id: str
    model: str
    prompt_tokens: int
    # The prompt's router keys (kv_aware: router/index keys; approximate: its block keys); None:
    # the prompt had no tokens.
    prefix_keys: list[int] | None = None
    # kv_aware: the first of prefix_keys that routing the prompt to the chosen backend credits as
    # predicted there: past the blocks its KV events show (the index's contiguous prefix, any tier)
    # and those credited there lately.
    predicted_from: int = 0
    # kv_aware: the router key where the best cached prefix ends.
    hot_prefix_key: int | None = None
    # kv_aware with measure_load_costs: (prefill tokens, requests in flight, prompt tokens queued)
    # at the backend when the request was sent (on_routed); on_finished() fits the load costs from
    # them and the answer's TTFT.
    load_at_send: tuple[int, int, int] | None = None

    def predicted_keys(self) -> list[int]:
        """The prompt's router keys that routing it to the chosen backend credits there as
        predicted: those its KV events do not show yet and that are not freshly credited."""
        keys = self.prefix_keys or []
        start = self.predicted_from
        return keys[start:] if start else keys


class RoutingMetrics:
    """Decision reasons and cached tokens of routed requests (kvgate_route_*)."""

    def __init__(self, registry: Any) -> None:
        self.decisions = Counter(
            "kvgate_route_decisions",
            "Routing decisions of the cache-aware policies, by reason",
            ["policy", "reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvgate_routed_prompt_tokens",
            "Prompt tokens of routed requests, and how many of them the chosen backend had cached",
            ["policy", "kind"],
            registry=registry,
        )
        # Labelled children, looked up once each: `labels()` costs microseconds on every request.
        self._decision_counters: dict[tuple[str, str], Any] = {}
        self._token_counters: dict[str, tuple[Any, Any]] = {}

    def count_decision(self, policy: str, reason: str) -> None:
        counter = self._decision_counters.get((policy, reason))
        if counter is None:
            counter = self._decision_counters[(policy, reason)] = self.decisions.labels(policy, reason)
        counter.inc()

    def count_prompt_tokens(self, policy: str, prompt_tokens: int, cached_tokens: int) -> None:
        counters = self._token_counters.get(policy)
        if counters is None:
            counters = self._token_counters[policy] = (
                self.prompt_tokens.labels(policy, "prompt"),
                self.prompt_tokens.labels(policy, "cached"),
            )
        counters[0].inc(prompt_tokens)
        counters[1].inc(cached_tokens)


class PlacementTracker:
    """Exponentially decayed amounts (prompt tokens, or requests) recently placed on each backend."""

    def __init__(self, half_life_s: float = PLACEMENT_HALF_LIFE_S) -> None:
        self._rate = math.log(2) / half_life_s
        self._values: dict[str, tuple[float, float]] = {}

    def value(self, backend: str, now: float) -> float:
        amount, at = self._values.get(backend, (0.0, now))
        return amount * math.exp(-self._rate * (now - at))

    def add(self, backend: str, tokens: float, now: float) -> None:
        self._values[backend] = (self.value(backend, now) + tokens, now)


class RecentPrefixUses:
    """Decayed count of recent requests whose best cached prefix ended at each prefix key (bounded LRU)."""

    def __init__(self, half_life_s: float, max_keys: int = 65_536) -> None:
        self._rate = math.log(2) / half_life_s
        self._max_keys = max_keys
        self._values: OrderedDict[int, tuple[float, float]] = OrderedDict()

    def value(self, key: int, now: float) -> float:
        amount, at = self._values.get(key, (0.0, now))
        return amount * math.exp(-self._rate * (now - at))

    def add(self, key: int, now: float) -> None:
        self._values[key] = (self.value(key, now) + 1.0, now)
        self._values.move_to_end(key)
        if len(self._values) > self._max_keys:
            self._values.popitem(last=False)


# Keys a backend's newer generation of predictions holds before it is rotated early: 2^19 router
# blocks are 8M tokens, more than an engine's GPU cache holds (so more than it can be predicted to
# hold); the two generations then hold at most ~80 MB a backend (~78 bytes a key).
MAX_PREDICTED_KEYS_PER_BACKEND = 1 << 19


class Predictions:
    """Prompts routed recently, credited to their backend until prediction_ttl_s has passed.

    Each backend's credited keys map to their expiry in two generations: keys are written to the
    newer, and every ttl_s the older one is dropped whole (each of its entries was written at least
    ttl_s before, so it has expired). Expiry costs a dict swap instead of a deletion per key; an
    entry outlives its expiry by up to ttl_s in memory, and lookups compare expiries regardless.
    A backend's newer generation that reaches max_keys_per_backend becomes its older one at once
    (the older dropped early): distinct long prompts sent fast (or a peer's notes) would otherwise
    hold memory for every key they credit within ttl_s. Dropping credit early only predicts less.
    """

    def __init__(self, ttl_s: float, max_keys_per_backend: int = MAX_PREDICTED_KEYS_PER_BACKEND) -> None:
        self.ttl_s = ttl_s
        self.max_keys_per_backend = max_keys_per_backend
        self._newer: dict[str, dict[int, float]] = {}
        self._older: dict[str, dict[int, float]] = {}
        self._rotated_at = -math.inf

    def add(self, backend: str, keys: list[int], now: float, ttl_s: float | None = None) -> None:
        """Credit `keys` to `backend` for prediction_ttl_s (or `ttl_s`, a peer's, when shorter)."""
        ttl_s = self.ttl_s if ttl_s is None else min(ttl_s, self.ttl_s)
        if not keys or ttl_s <= 0:
            return
        self.expire(now)
        table = self._newer.get(backend)
        if table is None:
            table = self._newer[backend] = {}
        expiry = now + ttl_s
        # A plain loop: half the time of update(dict.fromkeys(...)), which builds a second dict first.
        for key in keys:
            table[key] = expiry
        if len(table) >= self.max_keys_per_backend:
            self._older[backend], self._newer[backend] = table, {}

    def expire(self, now: float) -> None:
        if now - self._rotated_at >= self.ttl_s:
            self._older, self._newer = self._newer, {}
            self._rotated_at = now

    def leading_blocks(self, backend: str, keys: list[int], now: float, held: int = 0) -> int:
        """How many leading router blocks of the prompt `backend` holds, counting predictions: when
        its KV events show the first `held` blocks, those and the predicted blocks right after them;
        0 when no prediction continues them.

        A routed prompt is credited at once from where its engine's events showed it held, or
        from where an earlier credit it keeps ends (`RequestState.predicted_keys`), to its end;
        the kept credit lapses first. So once the block after `held` is credited, credit runs on
        without a gap to where it ends (unless the engine has since evicted blocks inside a
        credited run, which the index then reports for itself): one lookup when that block is not
        credited (the usual answer), else a binary search, a handful of lookups whatever the
        prompt length.
        """
        if held >= len(keys):
            return 0
        newer = self._newer.get(backend)
        older = self._older.get(backend)
        if not newer and not older:
            return 0
        newer = newer or {}
        older = older or {}

        def credited(key: int) -> bool:
            expiry = newer.get(key)
            return (older.get(key, 0.0) if expiry is None else expiry) > now

        if not credited(keys[held]):
            return 0
        return bisect.bisect_left(keys, True, lo=held + 1, key=lambda key: not credited(key))

    def forget(self, backend: str) -> None:
        self._newer.pop(backend, None)
        self._older.pop(backend, None)


class CacheAwarePolicy(Policy):
    """What kv_aware and approximate share: load guard, spreading, decisions, metrics."""

    name = "cache_aware"
    needs_tokens = True

    def __init__(self, config: CacheAwareGuards, registry: Any = None) -> None:
        self.max_load_ratio = config.max_load_ratio
        self.load_slack = config.load_slack
        self.max_share_ratio = config.max_share_ratio
        self.share_slack = config.share_slack
        self.share_noise = config.share_noise
        self.affinity_min_tokens = config.affinity_min_tokens
        self.placements = PlacementTracker()
        self.request_shares = PlacementTracker(config.share_half_life_s)
        self.cold_placements = PlacementTracker(config.share_half_life_s)
        # What spreads cold prompts (`cold_spread_by`): recent cold placements, or recent prefill tokens.
        by_tokens = config.cold_spread_by == "prefill_tokens"
        self.cold_spread = self.placements if by_tokens else self.cold_placements
        self._turn = -1
        self._recent_decisions: deque[RecentDecision] = deque(maxlen=DECISIONS_KEPT)
        self.metrics = RoutingMetrics(registry) if registry is not None else None

    def guarded(self, candidates: list[BackendState], now: float) -> list[BackendState]:
        """Candidates under the share line and the in-flight line (see the module docstring).

        The share line always lets through the backend with the smallest share (it is at most the
        mean), so the result is never empty.
        """
        if len(candidates) < 2:
            return candidates
        shares = [self.request_shares.value(b.name, now) for b in candidates]
        mean_share = (sum(shares) + 1) / len(candidates)
        # The larger of a proportional tolerance and the chance spread of small counts: the
        # latter wins below (share_noise / (max_share_ratio - 1))^2 requests per backend.
        share_line = self.share_slack + max(
            self.max_share_ratio * mean_share, mean_share + self.share_noise * math.sqrt(mean_share)
        )
        allowed = [b for b, share in zip(candidates, shares, strict=True) if share + 1 <= share_line]
        allowed = allowed or candidates
        return self.under_in_flight_line(allowed)

    def under_in_flight_line(self, backends: list[BackendState]) -> list[BackendState]:
        """The backends whose in-flight count is at most max_load_ratio * their mean + load_slack;
        all of them when none is (only possible with max_load_ratio < 1)."""
        mean = sum(b.in_flight for b in backends) / len(backends)
        line = self.max_load_ratio * mean + self.load_slack
        return [b for b in backends if b.in_flight <= line] or backends

    def record(self, winner: BackendState, reason: str, scores: dict[str, CandidateScore],
               cached_tokens: int, state: RequestState) -> Choice:  # fmt: skip
        """The Choice of `winner` (counted in the metrics, logged at debug level)."""
        if self.metrics is not None:
            self.metrics.count_decision(self.name, reason)
        logger.debug(
            "route %s -> %s (%s): %d of %d prompt tokens cached; candidates %s",
            state.request_id,
            winner.name,
            reason,
            cached_tokens,
            state.prompt_tokens,
            scores,
        )
        prefill_tokens = max(0, state.prompt_tokens - cached_tokens)
        return Choice(winner, reason, cached_tokens, prefill_tokens, scores, state)

    def remember_routed(self, choice: Choice) -> None:
        state: RequestState = choice.state
        prompt_tokens = state.prompt_tokens
        cached_tokens = choice.cached_tokens or 0
        backend = choice.backend
        now = time.monotonic()
        self._count_placement(
            backend.name, max(0, prompt_tokens - cached_tokens), choice.reason == "cold_spread", now
        )
        if self.metrics is not None and prompt_tokens:
            self.metrics.count_prompt_tokens(self.name, prompt_tokens, cached_tokens)
        self._recent_decisions.append(
            {
                "at": time.time(),
                "request_id": state.request_id,
                "model": state.model,
                "backend": backend.name,
                "reason": choice.reason,
                "prompt_tokens": prompt_tokens,
                "cached_tokens": cached_tokens,
                "candidates": {
                    name: {"cached": score.get("cached", 0), "cost": score.get("cost")}
                    for name, score in choice.candidates.items()
                },
            }
        )

    def recent_decisions(self) -> Sequence[RecentDecision]:
        return self._recent_decisions

    def for_peers(self, choice: Choice) -> PeerPlacement:
        # The peers learn the prompt's keys as held where it went (approximate's blocks).
        return PeerPlacement(choice.state.prefix_keys or [])

    def _count_placement(self, backend: str, prefill_tokens: int, cold: bool, now: float) -> None:
        self.placements.add(backend, prefill_tokens, now)
        self.request_shares.add(backend, 1.0, now)
        if cold:
            self.cold_placements.add(backend, 1.0, now)

    def on_peer_routed(self, note: RoutedNote) -> None:
        # The guards and the cold spread count the fleet's recent placements, not this replica's only.
        self._count_placement(note.backend, note.prefill_tokens, note.cold, time.monotonic())

    def pick(
        self,
        candidates: list[BackendState],
        allowed: list[BackendState],
        costs: dict[str, float],
        cached: dict[str, int],
        now: float,
        keys: list[int] | None = None,
    ) -> BackendState:
        """The allowed candidate with the lowest cost; among equal costs, fewest recent placements,
        then the emptiest cache.

        When no candidate holds any of the prompt (the cost would only restate the loads): among
        the candidates under the in-flight line (the in-flight guard's), those with the fewest
        prompt tokens still to prefill, then those with the least recent cold spread
        (`cold_spread_by`: prompt tokens placed to compute, or cold placements), then
        least_loaded's choice (fewest in flight, its rotation between equals).
        The rotation advances on cold requests only, so cold prefixes (first turns, new documents)
        are dealt out evenly and need no guard.
        """
        if self.is_cold(cached):
            self._turn += 1
            # A new prefix brings its follow-ups to the engine it lands on (a conversation's next
            # turns, a document's next questions), so what each engine was given lately decides
            # the load and the cache pressure of minutes to come; the instant's in-flight count
            # mostly counts requests past their prefill, which delay a new prefill little. So every
            # engine under the in-flight guard's line is a candidate: spreading by the instant's
            # in-flight count dealt new conversations unevenly, and the engine that got more outgrew
            # its cache (docs/index.md, "kv_aware").
            near = self.under_in_flight_line(candidates)
            # A new prompt behind a prefill still running waits for all of it: among those, the
            # engines with the fewest prompt tokens still to prefill (a workload without reuse,
            # every prompt cold, otherwise waits longer for first tokens than under least_loaded).
            least_queued = min(b.in_flight_prefill_tokens for b in near)
            near = [b for b in near if b.in_flight_prefill_tokens <= least_queued]
            placed = self.cold_spread_values(near, now, keys or [])
            fewest = min(placed.values())
            return fewest_in_flight([b for b in near if placed[b.name] < fewest + 0.5], self._turn)
        # Tie-breaks (a decay and the index's held tokens each) only for the candidates tied on cost.
        lowest = min(round(costs[b.name], 6) for b in allowed)
        tied = [b for b in allowed if round(costs[b.name], 6) == lowest]
        best = tied[0]
        if len(tied) > 1:
            best = min(
                tied,
                key=lambda b: (round(self.placements.value(b.name, now), 3), self.cache_size(b.name), b.name),
            )
        if len(allowed) < len(candidates) and not cached[best.name]:
            # A spill off a guarded backend to one that must prefill the prefix anyway: take the one
            # with the most headroom under the share line (recent requests plus those in flight), so
            # the spills of this prefix that follow find it there; by cost alone an engine busy with
            # another hot prefix's cache hits (little prefill placed, none in flight at this instant)
            # would take it, cross the line in turn, and the next spill would pay the prefill again.
            return min(
                (b for b in allowed if not cached[b.name]),
                key=lambda b: (self.request_shares.value(b.name, now) + b.in_flight, costs[b.name], b.name),
            )
        return best

    def cold_spread_values(self, near: list[BackendState], now: float, keys: list[int]) -> dict[str, float]:
        """What spreads a cold prompt (router keys `keys`) over `near` (`cold_spread_by`), lowest first."""
        return {b.name: self.cold_spread.value(b.name, now) for b in near}

    def is_cold(self, cached: dict[str, int]) -> bool:
        """No candidate holds enough of the prompt to tie it to an engine (affinity_min_tokens)."""
        return max(cached.values(), default=0) < max(1, self.affinity_min_tokens)

    def cache_size(self, backend: str) -> int:
        return 0


class KVAware(CacheAwarePolicy):
    name = "kv_aware"

    def __init__(
        self,
        config: KVAwarePolicy,
        kv_index: KVIndex | None = None,
        registry: Any = None,
        shared_tiers: SharedTiers | None = None,
    ) -> None:
        super().__init__(config, registry)
        self.config = config
        self.kv_index = kv_index
        self.shared_tiers = shared_tiers or SharedTiers([])
        self.predictions = Predictions(config.prediction_ttl_s)
        self.prefix_uses = RecentPrefixUses(config.share_half_life_s)
        self.load_costs = (
            MeasuredLoadCosts(config.load_fit_half_life_requests, config.load_fit_min_requests)
            if config.measure_load_costs
            else None
        )
        # Each engine's capacity and survival time (router/policies/capacity.py): predictions and
        # cold prompts under cache pressure.
        self.capacity = CapacityModel(kv_index) if config.place_by_eviction else None
        self._weights = {
            "gpu": config.gpu_hit_weight,
            "cpu": config.cpu_hit_weight,
            "disk": config.disk_hit_weight,
            **self.shared_tiers.hit_weights,
        }

    def choose(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Choice:
        now = time.monotonic()
        self.predictions.expire(now)
        tokens = request.tokens
        prompt_tokens = 0 if tokens is None else len(tokens)
        state = RequestState(request.request_id, request.model, prompt_tokens)
        namespace = request.namespace
        if namespace.lora_name is None and self.kv_index is not None:
            namespace = self.kv_index.namespace_for(request.model, namespace.cache_salt)
        matches: dict[str, BackendMatch] = {}
        keys: list[int] = []
        if tokens is not None and prompt_tokens:
            # Computed once: the index lookup and the predictions share them.
            keys = prompt_prefix_keys(tokens, namespace)
            if self.kv_index is not None:
                backends = [b.name for b in candidates]
                if self.shared_tiers:
                    # A member that is no candidate now (unhealthy, another model) may have stored it.
                    backends += [name for name in self.shared_tiers.members if name not in backends]
                matches = self.kv_index.longest_cached_prefix(tokens, namespace, backends, keys=keys)
                if self.shared_tiers:
                    # A backend the contract check found disagreeing gets no shared credit either.
                    matches = self.shared_tiers.credit(matches, self.kv_index.uncredited)
            state.prefix_keys = keys
        costs: dict[str, float] = {}
        cached: dict[str, int] = {}
        scores: dict[str, CandidateScore] = {}
        request_weight, prefill_weight = self.load_weights()
        indexed_blocks: dict[str, int] = {}
        credited_now: set[str] = set()  # candidates with predicted blocks past their indexed ones
        for backend in candidates:
            match = matches.get(backend.name)
            indexed = indexed_blocks[backend.name] = match.tokens // ROUTER_BLOCK_TOKENS if match else 0
            name = backend.name
            predicted_blocks = self.predictions.leading_blocks(name, keys, now, indexed)
            if predicted_blocks:
                credited_now.add(name)
            if predicted_blocks and self.capacity is not None:
                cut_s = self.prediction_cut_s(name, now)
                if cut_s > 0:
                    predicted_blocks = self.predictions.leading_blocks(name, keys, now + cut_s, indexed)
            predicted = predicted_blocks * ROUTER_BLOCK_TOKENS
            saved, held = self._saved_tokens(match, predicted)
            load = request_weight * backend.in_flight + prefill_weight * backend.in_flight_prefill_tokens
            costs[backend.name] = self.config.uncached_token_weight * (prompt_tokens - saved) + load
            cached[backend.name] = held
            scores[backend.name] = {
                "cached": held,
                "by_tier": dict(match.by_tier) if match else {},
                "predicted": predicted,
                "in_flight": backend.in_flight,
                "load": load,
                "cost": costs[backend.name],
            }
        hot_key = None
        best_held = max(cached.values(), default=0)
        best_blocks = min(len(keys), best_held // ROUTER_BLOCK_TOKENS)
        if best_blocks:
            hot_key = state.hot_prefix_key = keys[best_blocks - 1]
        uses = self.prefix_uses.value(hot_key, now) if hot_key is not None else 0.0
        # A copy made for a hot prefix pays when its recent requests, each worth a request in
        # flight, outweigh the prefill of the tokens the move forfeits (replica_must_pay).
        replica_pays = not self.config.replica_must_pay or uses * request_weight >= best_held
        hot = self.config.hot_prefix_requests == 0 or (
            hot_key is not None and uses >= self.config.hot_prefix_requests - 1e-9 and replica_pays
        )
        # The guards move a request off the engine that holds its prefix. For a hot prefix that makes
        # a replica the prefix's next requests share. A prefix of one conversation or one document
        # moved pays its whole prefill again and leaves the conversation split over two engines, for
        # an in-flight count that is mostly requests past their prefill, which delay a new one little:
        # such a request stays home unless its cost says otherwise (docs/index.md, "kv_aware", has
        # the runs where the guard moved chat turns and each move was a whole-conversation miss).
        allowed = self.guarded(candidates, now) if hot else candidates
        winner = self.pick(candidates, allowed, costs, cached, now, keys)
        if keys:
            # Where the winner's new credit starts: past what its events show, and past the blocks
            # credited there lately (over half of their ttl left), which are left as they are.
            # (Nothing credited there now: nothing with half its ttl left either, no second search.)
            indexed = indexed_blocks[winner.name]
            fresh = 0
            if winner.name in credited_now:
                fresh = self.predictions.leading_blocks(
                    winner.name, keys, now + self.predictions.ttl_s / 2, indexed
                )
            state.predicted_from = max(indexed, fresh)
        reason = self._reason(tokens, candidates, allowed, winner, cached)
        return self.record(winner, reason, scores, cached[winner.name], state)

    def load_weights(self) -> tuple[float, float]:
        """Prompt tokens one request in flight, and one queued prompt token, are worth: the
        configured weights, or what the engines' TTFTs measure when that is more."""
        request_weight, prefill_weight = self.config.request_load_weight, self.config.prefill_load_weight
        measured = self.load_costs
        if measured is not None and measured.request_weight is not None:
            request_weight = max(request_weight, measured.request_weight)
            prefill_weight = max(prefill_weight, measured.prefill_weight or 0.0)
        return request_weight, prefill_weight

    def _saved_tokens(self, match: BackendMatch | None, predicted: int) -> tuple[float, int]:
        """Weighted tokens the backend would not compute, and the contiguous prefix it holds."""
        gpu = predicted
        cumulative = match.cumulative if match else []
        saved = 0.0
        held = gpu
        for tier, through in cumulative:
            if tier == "gpu":
                gpu = max(gpu, through)
                held = gpu
                continue
            if through > held:
                saved += self._weights.get(tier, self.config.disk_hit_weight) * (through - held)
                held = through
        return saved + self.config.gpu_hit_weight * gpu, held

    def _reason(self, tokens: Any, candidates: list, allowed: list, winner: Any, cached: dict) -> str:
        if tokens is None:
            return "no_tokens"
        if self.is_cold(cached):
            return "cold_spread"
        if len(allowed) < len(candidates) and max(cached.values(), default=0) > cached[winner.name]:
            return "load_guard"
        if cached[winner.name] > 0:
            best_cache = max(cached.values())
            return "cache_hit" if cached[winner.name] == best_cache else "cache_vs_load"
        return "least_load"

    def cache_size(self, backend: str) -> int:
        return 0 if self.kv_index is None else self.kv_index.held_tokens(backend)

    def prediction_cut_s(self, backend: str, now: float) -> float:
        """How much sooner than prediction_ttl_s a prediction on `backend` lapses: past the time
        the predicted prompt surely survives there (capacity.earliest_survival_s: the engine may
        have touched its whole capacity since), the index's events, which have come meanwhile, say
        whether it is still there; crediting it regardless steered the prefix's next request,
        cold in truth, to the engine that churns fastest."""
        if self.capacity is None:
            return 0.0
        return max(0.0, self.predictions.ttl_s - self.capacity.earliest_survival_s(backend, now))

    def cold_spread_values(self, near: list[BackendState], now: float, keys: list[int]) -> dict[str, float]:
        """Once every engine in `near` has had to evict (router/policies/capacity.py), per token of
        capacity (scaled to the mean capacity): for a prompt whose prefix was routed before (it is
        reused, and was evicted since), the prompt tokens each engine touched lately, i.e. the
        shortest time a block surely survives there; for a new one, `cold_spread_by`.

        A reused prefix that was evicted comes back at intervals longer than its engine kept it:
        it goes where it surely lasts longest. An engine serving hits on hot prefixes computes little
        but touches much; spread by prefill tokens it drew the evicted prefixes, whose prefills then
        pushed its hot ones out. A new prompt (a conversation's first turn) brings follow-ups that
        are stored where it lands: the new tokens placed there (`prefill_tokens`) weigh that."""
        capacity = self.capacity
        if capacity is None:
            return super().cold_spread_values(near, now, keys)
        sizes = {b.name: capacity.capacity_tokens(b.name) for b in near}
        if min(sizes.values(), default=0) <= 0:
            return super().cold_spread_values(near, now, keys)
        mean = sum(sizes.values()) / len(sizes)
        if capacity.seen_before(keys):
            # Under the share line too, as a hot prefix's spill: touched tokens alone would pile
            # the evicted prefixes of many conversations onto the engine with the fewest hits.
            fair = {b.name for b in self.guarded(near, now)}
            values = {
                name: capacity.touched_per_s(name, now) / capacity.rate if name in fair else math.inf
                for name in sizes
            }
        else:
            values = super().cold_spread_values(near, now, keys)
        return {name: value * mean / sizes[name] for name, value in values.items()}

    def on_routed(self, choice: Choice) -> None:
        state: RequestState = choice.state
        backend = choice.backend
        predicted_keys = state.predicted_keys()
        hot_key = state.hot_prefix_key
        now = time.monotonic()
        if predicted_keys:
            self.predictions.add(backend.name, predicted_keys, now)
        if hot_key is not None:
            self.prefix_uses.add(hot_key, now)
        if self.capacity is not None:
            self.capacity.on_routed(backend.name, state.prompt_tokens, now, state.prefix_keys)
        if self.load_costs is not None:
            # The load the request met: on_routed comes after the gateway counted it in.
            prefill_tokens = choice.prefill_tokens or 0
            state.load_at_send = (
                prefill_tokens,
                backend.in_flight - 1,
                backend.in_flight_prefill_tokens - prefill_tokens,
            )
        self.remember_routed(choice)

    def for_peers(self, choice: Choice) -> PeerPlacement:
        # Past what the backend's events show: the peers credit it as predicted, as on_routed does here.
        state: RequestState = choice.state
        keys = state.predicted_keys()
        return PeerPlacement(keys, self.predictions.ttl_s if keys else 0.0, state.hot_prefix_key)

    def on_peer_routed(self, note: RoutedNote) -> None:
        now = time.monotonic()
        # A prompt a peer just sent is predicted where it went, as one of ours would be: its
        # events arrive only after the prefill.
        self.predictions.add(note.backend, note.prefix_keys, now, note.ttl_s)
        if note.hot_prefix_key is not None:
            self.prefix_uses.add(note.hot_prefix_key, now)
        super().on_peer_routed(note)

    def on_finished(self, choice: Choice, status: int, ttft_s: float | None) -> None:
        load = choice.state.load_at_send
        if ttft_s is not None and load is not None and self.load_costs is not None:
            self.load_costs.observe(*load, ttft_s)

    def measured_load_costs(self) -> dict[str, Any] | None:
        return None if self.load_costs is None else self.load_costs.describe()


def create(policy_config: KVAwarePolicy, context: PolicyContext) -> KVAware:
    return KVAware(
        policy_config, context.kv_index, context.metrics_registry, SharedTiers(context.shared_tiers)
    )
