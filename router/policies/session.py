"""session: requests of one session (header `x-session-id`, or the OpenAI `user` field) stay on one
backend while it is healthy; a new or orphaned session goes to the least-loaded backend.

A session key is whatever a client sends, so the table never keeps it whole: a key longer than
MAX_SESSION_KEY_CHARS is kept (and sent to peer replicas) as its BLAKE2b digest, and the table is
bounded by the memory its keys take as well as by its entry count."""

from __future__ import annotations

import hashlib
import sys
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from router.backends import BackendState
from router.policies.base import Choice, Policy, RouteRequest

if TYPE_CHECKING:
    from router.cluster import RoutedNote
from router.policies.least_loaded import fewest_in_flight

# Sessions remembered, least recently used dropped first: bounds memory under unbounded keys.
MAX_SESSIONS = 100_000
# Keys longer than this (in characters) are kept as a 128-bit digest ("blake2b:" and 32 hex digits):
# the same session maps to the same pin, and a 1 MiB `user` field costs 40 characters, not 1 MiB.
MAX_SESSION_KEY_CHARS = 128
_DIGEST_PREFIX = "blake2b:"
# What the table's entries may take in all (keys and their bookkeeping), whatever their count.
MAX_SESSION_TABLE_BYTES = 32 << 20
# An entry's bookkeeping besides its key: the ordered dict's slot and node, the pinned name's reference.
_ENTRY_OVERHEAD_BYTES = 104


def session_table_key(key: str) -> str:
    """The key a session is pinned under here and in the replicas' notes: itself when short, its
    digest when longer than MAX_SESSION_KEY_CHARS (a key already in digest form stays as it is)."""
    if len(key) <= MAX_SESSION_KEY_CHARS:
        return key
    # surrogatepass: a JSON string may hold a lone surrogate, which plain UTF-8 refuses to encode.
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return _DIGEST_PREFIX + digest


class SessionAffinity(Policy):
    name = "session"
    needs_tokens = False

    def __init__(
        self, max_sessions: int = MAX_SESSIONS, max_table_bytes: int = MAX_SESSION_TABLE_BYTES
    ) -> None:
        self.max_sessions = max_sessions
        self.max_table_bytes = max_table_bytes
        self._pins: OrderedDict[str, str] = OrderedDict()
        self.table_bytes = 0
        # One string per backend name: a pin from a peer's note refers to it, not to its own copy.
        self._backend_names: dict[str, str] = {}
        self._turn = -1

    def choose(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Choice:
        # The Choice's state: the session's table key, pinned at on_routed (None: no session).
        key = None if request.session_key is None else session_table_key(request.session_key)
        # The request carries the short form on: on_routed and the replica sync do not hash again.
        request.session_key = key
        if key is not None:
            pinned = self._pins.get(key)
            if pinned is not None:
                for backend in candidates:
                    if backend.name == pinned:
                        self._pins.move_to_end(key)
                        return Choice(backend, "session_pinned", state=key)
        self._turn += 1
        backend = fewest_in_flight(candidates, self._turn)
        if key is None:
            return Choice(backend)
        return Choice(backend, "session_repinned" if key in self._pins else "session_new", state=key)

    def on_routed(self, choice: Choice) -> None:
        # Pinned on every attempt: a retry pins again, so a session follows the backend that answered.
        if choice.state is not None:
            self._pin(choice.state, choice.backend.name)

    def on_peer_routed(self, note: RoutedNote) -> None:
        # A session another replica placed stays there when its next request comes here.
        if note.session is not None:
            self._pin(session_table_key(note.session), note.backend)

    @staticmethod
    def _entry_bytes(key: str) -> int:
        return sys.getsizeof(key) + _ENTRY_OVERHEAD_BYTES

    def _pin(self, key: str, backend: str) -> None:
        backend = self._backend_names.setdefault(backend, backend)
        if key not in self._pins:
            self.table_bytes += self._entry_bytes(key)
        self._pins[key] = backend
        self._pins.move_to_end(key)
        while len(self._pins) > self.max_sessions or (
            self.table_bytes > self.max_table_bytes and len(self._pins) > 1
        ):
            dropped, _ = self._pins.popitem(last=False)
            self.table_bytes -= self._entry_bytes(dropped)


def create(policy_config: object, context: object) -> SessionAffinity:
    return SessionAffinity()
