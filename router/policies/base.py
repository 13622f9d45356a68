"""The one small interface every routing policy implements.

The app builds a RouteRequest per incoming request, hands the policy the healthy candidates, and
tells it when the request has been routed and when it has finished. Policies never do I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from router.index.keys import DEFAULT_NAMESPACE, Namespace

if TYPE_CHECKING:
    import numpy as np

    from router.backends import BackendState
    from router.cluster import RoutedNote


@dataclass(slots=True)
class RouteRequest:
    request_id: str
    model: str
    # The parsed JSON body (never modified: the original bytes are forwarded).
    body: dict
    # Session key from `x-session-id` or the OpenAI `user` field, if any.
    session_key: str | None = None
    # Prompt tokens as the engine will see them (uint32 array); only filled when the policy
    # asks for them through `needs_tokens`.
    tokens: np.ndarray | None = None
    # Cache namespace (LoRA adapter, cache salt) as the request names it: salted prompts never match
    # unsalted entries. kv_aware looks an unnamed adapter up by `model` (`PrefixIndex.namespace_for`).
    namespace: Namespace = DEFAULT_NAMESPACE
    # Filled by the policy: why it chose what it chose (for metrics and /debug/prefix-map).
    decision: dict = field(default_factory=dict)
    # Bytes of the request body as received: how much parsing it further may cost (the tokenizer
    # moves large bodies off the event loop).
    body_size: int = 0


class Policy(Protocol):
    name: str
    # True when choose() needs RouteRequest.tokens (the app tokenizes off the event loop first).
    needs_tokens: bool

    def choose(self, request: RouteRequest, candidates: list[BackendState]) -> BackendState:
        """Pick one of the candidates (never empty, all healthy and accepting; or, when none is,
        the one marked-down backend that router/forward.py tries before answering 503)."""
        ...

    def on_routed(self, request: RouteRequest, backend: BackendState) -> None:
        """Called when the request is sent to `backend`, before any answer: once per attempt (a
        retry on another backend calls choose() and on_routed() again, so the last call wins)."""
        ...

    def on_finished(self, request: RouteRequest, backend: BackendState) -> None:
        """Called when the response to the request has ended, successfully or not."""
        ...

    def on_peer_routed(self, note: RoutedNote) -> None:
        """Another replica of the gateway routed a request (router/cluster.py): take it into the
        state that steers routing as if this one had (its in-flight count arrives separately)."""
        ...
