"""The one small interface every routing policy implements, and the result it hands its callers.

A caller (router/forward.py, which relays the answer; an endpoint picker that only chooses; a
prefill/decode split that chooses twice for one request) builds a RouteRequest and asks the policy
to `choose` among the candidates. The answer is a Choice, an immutable result: the backend, why,
and how each candidate scored. The caller hands that Choice back when the request is sent
(`on_routed`) and when its answer has ended (`on_finished`, with the status and the time to the
first streamed piece). What the policy must remember of a request between those calls it keeps in
the Choice's `state`, its own object, which callers never read. Policies never do I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict

import msgspec

from router.route_request import RouteRequest

if TYPE_CHECKING:
    from router.backends import BackendState
    from router.cluster import RoutedNote


class CandidateScore(TypedDict, total=False):
    """How a cache-aware policy scored one candidate backend (Choice.candidates)."""

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


class RecentDecision(TypedDict):
    """One routed request as /debug/prefix-map and the routing warnings read it (Policy.recent_decisions)."""

    at: float  # time.time() when it was routed
    request_id: str
    model: str
    backend: str
    reason: str | None  # Choice.reason
    prompt_tokens: int
    cached_tokens: int
    # Per candidate: the tokens it held and its cost (CandidateScore's `cached` and `cost`).
    candidates: dict[str, dict[str, Any]]


# Frozen msgspec structs: immutable, and a tenth of a frozen dataclass's construction time (one
# Choice per request and attempt).
class Choice(msgspec.Struct, frozen=True):
    """What a policy chose for one request, and why: returned by `choose`, handed back unchanged to
    the same policy's `on_routed` and `on_finished`."""

    backend: BackendState
    # Why it won: a key of router/debug_page.py DECISION_REASONS for the cache-aware policies
    # ("cache_hit", "cold_spread"...); "session_pinned", "session_repinned" or "session_new" for
    # session; None where the policy has no reason to give (round_robin, least_loaded).
    reason: str | None = None
    # Leading prompt tokens the backend holds (cached or predicted); None: the policy did not look.
    cached_tokens: int | None = None
    # Prompt tokens the backend still has to prefill; None: the policy did not count them
    # (router/forward.py then counts the prompt's tokens less RouteRequest.known_cached_tokens).
    prefill_tokens: int | None = None
    # Per candidate backend, how the policy scored it (empty: it scores none).
    candidates: Mapping[str, CandidateScore] = {}
    # The policy's own record of the request, for its on_routed and on_finished; callers never read it.
    state: Any = None


class PeerPlacement(msgspec.Struct, frozen=True):
    """What the other replicas of the gateway should learn of a request this one routed
    (router/cluster.py sends it in a RoutedNote; their policies take it in `on_peer_routed`)."""

    # Router keys of the prompt to credit to the backend as predicted there, for ttl_s seconds.
    prefix_keys: list[int]
    ttl_s: float = 0.0
    # The router key where the prompt's best cached prefix ends (the hot-prefix guard counts it).
    hot_prefix_key: int | None = None


NO_PEER_PLACEMENT = PeerPlacement([])


class Policy:
    """A routing policy. Only `choose` is required; the rest have defaults for a policy that keeps
    no state about requests and has nothing to tell anyone else."""

    name: ClassVar[str]
    # True when choose() needs RouteRequest.tokens (the app tokenizes off the event loop first).
    needs_tokens: ClassVar[bool] = False

    def choose(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Choice:
        """Pick one of the candidates (never empty, all healthy and accepting; or, when none is,
        the one marked-down backend that router/forward.py tries before answering 503)."""
        raise NotImplementedError(f"{type(self).__name__} must implement choose()")

    def on_routed(self, choice: Choice) -> None:
        """The request was sent to choice.backend, before any answer: once per attempt (a retry on
        another backend comes with a new choose(), so the last attempt's Choice wins)."""

    def on_finished(self, choice: Choice, status: int, ttft_s: float | None) -> None:
        """The answer to a routed request has ended with HTTP `status` (502/504 when the backend
        failed mid-answer); `ttft_s`: seconds from sending it to the first piece of a streamed 200
        answer, else None. At most once per Choice; an attempt left for a retry never gets it."""

    def on_peer_routed(self, note: RoutedNote) -> None:
        """Another replica of the gateway routed a request (router/cluster.py): take it into the
        state that steers routing as if this one had (its in-flight count arrives separately)."""

    def for_peers(self, choice: Choice) -> PeerPlacement:
        """What the other replicas' policies should learn of this routed Choice (their on_peer_routed)."""
        return NO_PEER_PLACEMENT

    def recent_decisions(self) -> Sequence[RecentDecision]:
        """The last requests routed, oldest first (for /debug/prefix-map and the routing warnings)."""
        return ()

    def measured_load_costs(self) -> dict[str, Any] | None:
        """What the policy has measured of the engines' load costs (router/policies/load_costs.py
        describe()), for /debug/prefix-map; None: it measures none."""
        return None
