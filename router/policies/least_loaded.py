"""least_loaded: the backend with the fewest in-flight requests; ties rotate so none is favoured."""

from __future__ import annotations

from collections.abc import Sequence

from router.backends import BackendState
from router.policies.base import Choice, Policy, RouteRequest


def fewest_in_flight(candidates: Sequence[BackendState], turn: int) -> BackendState:
    """The least-loaded candidate; among equals, the `turn`-th (mod their count)."""
    lowest = min(backend.in_flight for backend in candidates)
    tied = [backend for backend in candidates if backend.in_flight == lowest]
    return tied[turn % len(tied)]


class LeastLoaded(Policy):
    name = "least_loaded"
    needs_tokens = False

    def __init__(self) -> None:
        self._turn = -1

    def choose(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Choice:
        self._turn += 1
        return Choice(fewest_in_flight(candidates, self._turn))


def create(policy_config: object, context: object) -> LeastLoaded:
    return LeastLoaded()
