"""round_robin: strict rotation over the healthy backends that serve the model."""

from __future__ import annotations

from collections.abc import Sequence

from router.backends import BackendState
from router.policies.base import Choice, Policy, RouteRequest


class RoundRobin(Policy):
    name = "round_robin"
    needs_tokens = False

    def __init__(self) -> None:
        self._turn = -1

    def choose(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Choice:
        self._turn += 1
        return Choice(candidates[self._turn % len(candidates)])


def create(policy_config: object, context: object) -> RoundRobin:
    return RoundRobin()
