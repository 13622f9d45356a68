"""The one small interface every routing policy implements.

The app builds a RouteRequest per incoming request, hands the policy the healthy candidates, and
tells it when the request has been routed and when it has finished. Policies never do I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypedDict

from router.index.keys import DEFAULT_NAMESPACE, Namespace

if TYPE_CHECKING:
    import numpy as np

    from router.backends import BackendState
    from router.cluster import RoutedNote


class CandidateScore(TypedDict, total=False):
    """How a cache-aware policy scored one candidate backend (RouteDecision.candidates)."""

    # Leading prompt tokens the backend holds (cached or predicted), in one contiguous prefix.
    cached: int
    # kv_aware: tokens held per tier, from the index ({"gpu": 256, "cpu": 512}).
    by_tier: dict[str, int]
    # kv_aware: leading tokens credited to the backend because a prompt sharing them was just routed there.
    predicted: int
    in_flight: int
    # kv_aware: the load part of the cost (prompt-token units).
    load: float
    # The cost the policy minimised (prompt-token units): lowest wins.
    cost: float


@dataclass(slots=True)
class RouteDecision:
    """What the policy decided for one request and why, handed between the policy, router/forward.py,
    the replica sync (router/cluster.py) and /debug/prefix-map. Only the cache-aware policies
    (kv_aware, approximate) fill the scoring fields; the others leave their defaults."""

    # The policy that scored the candidates, and the backend it chose (None until one did).
    policy: str | None = None
    winner: str | None = None
    # Why the winner won: a key of router/debug_page.py DECISION_REASONS ("cache_hit", "cold_spread"...).
    reason: str | None = None
    # Prompt tokens, and how many of them the winner holds (cached or predicted).
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Prompt tokens the winner still has to prefill; None: router/forward.py counts tokens - cached_tokens.
    prefill_tokens: int | None = None
    # Per candidate backend, how the policy scored it.
    candidates: dict[str, CandidateScore] = field(default_factory=dict)
    # The prompt's router keys (router/index keys), from choose() until on_routed() consumes them
    # (the replica sync reads them in between).
    prefix_keys: list[int] | None = None
    # kv_aware: for the backend it chose, the first of prefix_keys that routing the prompt there
    # credits as predicted: past the blocks its KV events show (the index's contiguous prefix, any
    # tier) and those credited there lately; until on_routed() consumes it.
    predicted_from: dict[str, int] | None = None
    # kv_aware: the router key where the best cached prefix ends, until on_routed() consumes it.
    hot_prefix_key: int | None = None
    # session: "pinned" (its backend took it), "repinned" (its backend was gone) or "new".
    session: str | None = None
    # kv_aware with measure_load_costs: (prefill tokens, requests in flight, prompt tokens queued) at
    # the backend when the request was sent, and the time from sending it to the answer's first
    # streamed piece (router/forward.py); on_finished() fits the load costs from both.
    load_at_send: tuple[int, int, int] | None = None
    upstream_ttft_s: float | None = None

    def predicted_keys(self, backend: str) -> list[int]:
        """The prompt's router keys that routing it to `backend` credits there as predicted: those
        its KV events do not show yet and that are not freshly credited (all of them for a backend
        the policy did not choose)."""
        keys = self.prefix_keys or []
        start = (self.predicted_from or {}).get(backend, 0)
        return keys[start:] if start else keys


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
    # Filled by the policy: what it chose and why (forward.py's accounting, metrics, /debug/prefix-map).
    decision: RouteDecision = field(default_factory=RouteDecision)
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


class WithoutFeedback:
    """The hooks of a policy that keeps no state about requests (round_robin, least_loaded): what a
    request did after choose() changes nothing it decides, its own or a peer replica's."""

    def on_routed(self, request: RouteRequest, backend: BackendState) -> None:
        pass

    def on_finished(self, request: RouteRequest, backend: BackendState) -> None:
        pass

    def on_peer_routed(self, note: RoutedNote) -> None:
        pass
