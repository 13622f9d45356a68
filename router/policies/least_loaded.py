"""least_loaded: the backend with the fewest in-flight requests; ties rotate so none is favoured."""

from __future__ import annotations

from router.backends import BackendState
from router.policies.base import RouteRequest, WithoutFeedback


def fewest_in_flight(candidates: list[BackendState], turn: int) -> BackendState:
    """The least-loaded candidate; among equals, the `turn`-th (mod their count)."""
    lowest = min(backend.in_flight for backend in candidates)
    tied = [backend for backend in candidates if backend.in_flight == lowest]
    return tied[turn % len(tied)]


class LeastLoaded(WithoutFeedback):
    name = "least_loaded"
    needs_tokens = False

    def __init__(self) -> None:
        self._turn = -1

    def choose(self, request: RouteRequest, candidates: list[BackendState]) -> BackendState:
        self._turn += 1
        return fewest_in_flight(candidates, self._turn)


def create(policy_config: object, context: object) -> LeastLoaded:
    return LeastLoaded()
