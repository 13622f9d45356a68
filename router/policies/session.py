"""session: requests of one session (header `x-session-id`, or the OpenAI `user` field) stay on one
backend while it is healthy; a new or orphaned session goes to the least-loaded backend."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from router.backends import BackendState
from router.policies.base import RouteRequest

if TYPE_CHECKING:
    from router.cluster import RoutedNote
from router.policies.least_loaded import fewest_in_flight

# Sessions remembered, least recently used dropped first: bounds memory under unbounded keys.
MAX_SESSIONS = 100_000


class SessionAffinity:
    name = "session"
    needs_tokens = False

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self._pins: OrderedDict[str, str] = OrderedDict()
        self._turn = -1

    def choose(self, request: RouteRequest, candidates: list[BackendState]) -> BackendState:
        key = request.session_key
        if key is not None:
            pinned = self._pins.get(key)
            if pinned is not None:
                for backend in candidates:
                    if backend.name == pinned:
                        self._pins.move_to_end(key)
                        request.decision.session = "pinned"
                        return backend
        self._turn += 1
        backend = fewest_in_flight(candidates, self._turn)
        if key is not None:
            request.decision.session = "repinned" if key in self._pins else "new"
        return backend

    def on_routed(self, request: RouteRequest, backend: BackendState) -> None:
        # Pinned on every attempt: a retry pins again, so a session follows the backend that answered.
        if request.session_key is not None:
            self._pin(request.session_key, backend.name)

    def on_finished(self, request: RouteRequest, backend: BackendState) -> None:
        pass

    def on_peer_routed(self, note: RoutedNote) -> None:
        # A session another replica placed stays there when its next request comes here.
        if note.session is not None:
            self._pin(note.session, note.backend)

    def _pin(self, key: str, backend: str) -> None:
        self._pins[key] = backend
        self._pins.move_to_end(key)
        if len(self._pins) > self.max_sessions:
            self._pins.popitem(last=False)


def create(policy_config: object, context: object) -> SessionAffinity:
    return SessionAffinity()
