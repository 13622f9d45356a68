"""round_robin: strict rotation over the healthy backends that serve the model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.backends import BackendState
from router.policies.base import RouteRequest

if TYPE_CHECKING:
    from router.cluster import RoutedNote


class RoundRobin:
    name = "round_robin"
    needs_tokens = False

    def __init__(self) -> None:
        self._turn = -1

    def choose(self, request: RouteRequest, candidates: list[BackendState]) -> BackendState:
        self._turn += 1
        return candidates[self._turn % len(candidates)]

    def on_routed(self, request: RouteRequest, backend: BackendState) -> None:
        pass

    def on_finished(self, request: RouteRequest, backend: BackendState) -> None:
        pass

    def on_peer_routed(self, note: RoutedNote) -> None:
        pass


def create(policy_config: object, context: object) -> RoundRobin:
    return RoundRobin()
