"""approximate: cache-aware routing for engines without KV-event streams.

It learns from its own decisions: every routed prompt's blocks are remembered as held by the
backend that got them, in an LRU bounded to `max_tokens` tokens (the oldest blocks are forgotten
first, much as an engine evicts). Scoring, the hot-spot guard and cold-prefix spreading are those
of kv_aware (router/policies/kv_aware.py), with the learned blocks standing in for the index.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from router.config import ApproximatePolicy
from router.index.keys import ROUTER_BLOCK_TOKENS, prompt_prefix_keys
from router.policies import InvalidPolicyConfig
from router.policies.kv_aware import CacheAwarePolicy, RequestState

if TYPE_CHECKING:
    from router.backends import BackendState
    from router.cluster import RoutedNote
    from router.policies import PolicyContext
    from router.policies.base import CandidateScore, Choice, RouteRequest


class Approximate(CacheAwarePolicy):
    name = "approximate"

    def __init__(self, config: ApproximatePolicy, registry: Any = None) -> None:
        super().__init__(config, registry)
        if config.block_size % ROUTER_BLOCK_TOKENS:
            raise InvalidPolicyConfig(
                f"policy.block_size {config.block_size} must be a multiple of {ROUTER_BLOCK_TOKENS} "
                "(the router's block size)"
            )
        self.block_size = config.block_size
        self._stride = config.block_size // ROUTER_BLOCK_TOKENS
        self.max_blocks = max(1, config.max_tokens // config.block_size)
        # prefix key -> {backend: last routed}; least recently routed first.
        self._blocks: OrderedDict[int, dict[str, float]] = OrderedDict()
        self._held: dict[str, int] = {}

    def _block_keys(self, request: RouteRequest) -> list[int]:
        if request.tokens is None or not len(request.tokens):
            return []
        keys = prompt_prefix_keys(request.tokens, request.namespace)
        return keys[self._stride - 1 :: self._stride]

    def learned_blocks(self, backend: str, keys: list[int]) -> int:
        count = 0
        for key in keys:
            holders = self._blocks.get(key)
            if holders is None or backend not in holders:
                break
            count += 1
        return count

    def choose(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Choice:
        now = time.monotonic()
        keys = self._block_keys(request)
        prompt_tokens = 0 if request.tokens is None else len(request.tokens)
        state = RequestState(request.request_id, request.model, prompt_tokens, keys)
        allowed = self.guarded(candidates, now)
        costs: dict[str, float] = {}
        cached: dict[str, int] = {}
        scores: dict[str, CandidateScore] = {}
        for backend in candidates:
            held = min(prompt_tokens, self.learned_blocks(backend.name, keys) * self.block_size)
            # Same units as kv_aware's defaults: one in-flight request ~ 256 prefill tokens.
            load = 256.0 * backend.in_flight + backend.in_flight_prefill_tokens
            costs[backend.name] = prompt_tokens - held + load
            cached[backend.name] = held
            scores[backend.name] = {
                "cached": held,
                "in_flight": backend.in_flight,
                "cost": costs[backend.name],
            }
        winner = self.pick(candidates, allowed, costs, cached, now)
        if request.tokens is None:
            reason = "no_tokens"
        elif self.is_cold(cached):
            reason = "cold_spread"
        elif cached[winner.name] > 0:
            reason = "learned_hit"
        elif len(allowed) < len(candidates):
            reason = "load_guard"
        else:
            reason = "least_load"
        return self.record(winner, reason, scores, cached[winner.name], state)

    def on_routed(self, choice: Choice) -> None:
        self._learn(choice.backend.name, choice.state.prefix_keys or [], time.monotonic())
        self.remember_routed(choice)

    def on_peer_routed(self, note: RoutedNote) -> None:
        # A peer's note carries this policy's block keys (for_peers: its RequestState's prefix_keys).
        self._learn(note.backend, note.prefix_keys, time.monotonic())
        super().on_peer_routed(note)

    def _learn(self, backend: str, keys: list[int], now: float) -> None:
        blocks = self._blocks
        for key in keys:
            holders = blocks.get(key)
            if holders is None:
                holders = blocks[key] = {}
            else:
                blocks.move_to_end(key)
            if backend not in holders:
                self._held[backend] = self._held.get(backend, 0) + 1
            holders[backend] = now
        while len(blocks) > self.max_blocks:
            _, evicted = blocks.popitem(last=False)
            for name in evicted:
                self._held[name] -= 1

    def cache_size(self, backend: str) -> int:
        return self._held.get(backend, 0)

    @property
    def learned_size(self) -> int:
        return len(self._blocks)


def create(policy_config: ApproximatePolicy, context: PolicyContext) -> Approximate:
    return Approximate(policy_config, context.metrics_registry)
