"""The routing call of the endpoint picker: one request body in, one engine endpoint (`ip:port`) out,
over the very core `kvgate serve` routes with (router/request_routing.py parses, the gateway's
request preparers tokenize, its policy chooses), and the accounting of that pick (`Pick`) until the
answer ends: in-flight load, prefill tokens, the policy's feedback, the replica sync.

A refusal is a `PickRefused`: the status and error body the client gets, and a reason for the metrics.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Sequence
from time import perf_counter
from typing import TYPE_CHECKING

import msgspec

from router.auth import UNAUTHORIZED_MESSAGE
from router.errors import GatewayError, KvgateError, error_body, gateway_error_body
from router.forward import FORWARDED_ROUTES, ForwardedRoute
from router.policies.base import Choice, RouteRequest
from router.policies.least_loaded import LeastLoaded
from router.request_routing import engine_body, parse_route_request, prefill_tokens_of, release_backend

if TYPE_CHECKING:
    from router.backends import BackendState
    from router.config import Epp
    from router.epp.metrics import EppMetrics
    from router.policies.base import Policy
    from router.wiring import Gateway

log = logging.getLogger("kvgate.epp")


class PickRefused(KvgateError):
    """The picker answers the client itself: `status`, vLLM's error `body`, and `reason` (metrics)."""

    def __init__(self, status: int, body: bytes, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.body = body
        self.reason = reason

    @classmethod
    def of(cls, error: GatewayError, reason: str) -> PickRefused:
        return cls(error.status, gateway_error_body(error), reason)


def body_too_large(limit: int) -> PickRefused:
    message = f"request body is over the limit of {limit} bytes (epp.max_body_bytes)"
    return PickRefused(413, error_body(413, message, "body"), "body_too_large")


def format_endpoint(host: str, port: int) -> str:
    """`ip:port`, an IPv6 address in brackets (what Envoy's ORIGINAL_DST reads)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class EndpointPicker:
    """Picks for the ext_proc streams (router/epp/stream.py); one per `kvgate epp` process."""

    def __init__(self, gateway: Gateway, config: Epp, metrics: EppMetrics | None = None) -> None:
        self.gateway = gateway
        self.context = gateway.forwarding
        self.config = config
        self.metrics = metrics
        self.routes = {route.path: route for route in FORWARDED_ROUTES}
        # Paths with no prompt to route by (and unknown paths) go to the least-loaded engine.
        self.least_loaded = LeastLoaded()
        # Picked requests whose accounting is still open (Pick.finish closes it).
        self.in_flight = 0
        # (host, port) of a backend URL -> its `ip:port`; host names are resolved once.
        self._endpoints: dict[tuple[str, int], str] = {}
        # Open picks by their request's x-request-id (router/epp/access_log.py ends them); a list, as
        # a client may send the same id twice.
        self._by_request_id: dict[bytes, list[Pick]] = {}
        # Envoy's access-log streams connected now: while there is one (or, with
        # epp.envoy_access_log, before Envoy opens the first), a pick whose ext_proc stream ended
        # before its answer did waits for the answer's log entry.
        self.access_log_streams = 0
        # How many times the last access-log stream closed (Pick.wait_for_access_log).
        self.access_log_closes = 0
        self._told_no_access_log = False

    def route_for(self, path: bytes) -> ForwardedRoute | None:
        return self.routes.get(path.split(b"?", 1)[0].decode("latin-1"))

    async def endpoint_of(self, backend: BackendState) -> str:
        """The backend's `ip:port`, as Envoy must connect to it (a host name resolved, IPv4 first)."""
        endpoint = self._endpoints.get(backend.origin)
        if endpoint is not None:
            return endpoint
        host, port = backend.origin
        try:
            ipaddress.ip_address(host)
        except ValueError:
            found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            found.sort(key=lambda entry: entry[0] != socket.AF_INET)
            host = found[0][4][0]
        endpoint = self._endpoints[backend.origin] = format_endpoint(host, port)
        return endpoint

    async def backend_at(self, endpoint: str) -> BackendState | None:
        for backend in self.context.backends.values():
            if await self.endpoint_of(backend) == endpoint:
                return backend
        return None

    def check_admission(self, headers: Sequence[tuple[bytes, bytes]]) -> str | None:
        """Refuse before reading the body: a client without an API key (when keys are configured),
        or any request while the picker sheds load (`epp.max_in_flight`). Returns the tenant the
        client's key speaks for (auth.tenants), None for a key without one or no keys configured."""
        keys = self.context.client_keys
        tenant = None
        if keys is not None:
            allowed, tenant = keys.tenant_of_headers(headers)
            if not allowed:
                raise PickRefused(401, error_body(401, UNAUTHORIZED_MESSAGE), "unauthorized")
        limit = self.config.max_in_flight
        if limit is not None and self.in_flight >= limit:
            message = (
                f"the gateway is at its limit of {limit} requests in flight (epp.max_in_flight); retry later"
            )
            raise PickRefused(429, error_body(429, message), "shed")
        return tenant

    async def pick(
        self,
        route: ForwardedRoute,
        body: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        subset: frozenset[str] | None,
        tenant: str | None = None,
    ) -> tuple[Pick, bytes | None]:
        """Parse, prepare and route one request body; raises PickRefused. Returns the pick and the
        body to send on in place of the client's, as serve sends it (router/request_routing.py,
        engine_body): `tenant`'s salted one on a salted path (routed by it), `model` set to the
        engines' name for it (models[].served_name); else None (the client's, unchanged)."""
        started = perf_counter()
        request_id, session_value = b"", None
        session_header = self.context.session_header
        for name, value in headers:
            if name == b"x-request-id":
                request_id = value
            elif name == session_header:
                session_value = value
        try:
            route_request, data, by_policy = parse_route_request(
                self.context, route, body, request_id, session_value, tenant
            )
            rewritten = engine_body(route, data, tenant, self.context.served_names.get(route_request.model))
        except GatewayError as exc:
            raise PickRefused.of(exc, "unknown_model" if exc.status == 404 else "bad_request") from None
        if by_policy:
            for prepare in self.context.request_preparers:
                await prepare(route_request)
        policy = self.context.policy if by_policy else self.least_loaded
        candidates = await self._candidates(route_request.model, subset)
        pick = self._choose(policy, route_request, candidates, request_id)
        if self.metrics is not None:
            self.metrics.pick_seconds.observe(perf_counter() - started)
        return pick, rewritten

    async def pick_by_load(self, subset: frozenset[str] | None, request_id: bytes = b"") -> Pick:
        """A request with no model to route by (GET /v1/models, an unknown path): the least-loaded
        accepting engine of any model."""
        backends = self.context.backends
        candidates = [backend for backend in backends.values() if backend.accepting]
        if subset is not None:
            candidates = [backend for backend in candidates if await self.endpoint_of(backend) in subset]
            if not candidates:
                raise self._subset_refusal(subset)
        if not candidates:
            raise PickRefused(503, error_body(503, "no healthy backend"), "no_endpoint")
        return self._choose(self.least_loaded, RouteRequest("", "", {}), candidates, request_id)

    async def _candidates(self, model: str, subset: frozenset[str] | None) -> list[BackendState]:
        """As the proxy's: the healthy backends serving `model`, else the one marked down longest ago
        (panic routing); all inside the subset hint when the gateway sends one."""
        backends = self.context.backends
        healthy = backends.candidates(model)
        down = backends.panic_candidates(model)
        if subset is not None:
            healthy = [backend for backend in healthy if await self.endpoint_of(backend) in subset]
            down = [backend for backend in down if await self.endpoint_of(backend) in subset]
            if not healthy and not down:
                raise self._subset_refusal(subset)
        candidates = healthy or down[:1]
        if not candidates:
            message = f"no healthy backend serves the model `{model}`"
            raise PickRefused(503, error_body(503, message), "no_endpoint")
        return candidates

    def _subset_refusal(self, subset: frozenset[str]) -> PickRefused:
        named = ", ".join(sorted(subset)) or "none"
        message = (
            f"the gateway's subset hint allows endpoints ({named}) that name no healthy backend of this "
            "picker that serves the request"
        )
        return PickRefused(503, error_body(503, message), "subset_no_endpoint")

    def _choose(
        self, policy: Policy, route_request: RouteRequest, candidates: list[BackendState], request_id: bytes
    ) -> Pick:
        choice = policy.choose(route_request, candidates)
        backend = choice.backend
        if not backend.healthy:
            self.context.metrics.panic_routed.labels(backend.name).inc()
        prefill_tokens = prefill_tokens_of(route_request, choice)
        # Counted from the pick: Envoy sends the request on at once.
        backend.in_flight += 1
        backend.in_flight_prefill_tokens += prefill_tokens
        cluster = self.context.cluster
        if cluster is not None:
            cluster.routed(route_request, choice, prefill_tokens)
        policy.on_routed(choice)
        self.in_flight += 1
        if self.metrics is not None:
            self.metrics.picks.labels(choice.reason or "load").inc()
        pick = Pick(self, policy, choice, prefill_tokens, self._endpoints.get(backend.origin, ""), request_id)
        pick.fallback = _next_best(choice, candidates)
        pick.tenant = route_request.tenant
        if request_id:
            self._by_request_id.setdefault(request_id, []).append(pick)
        return pick

    def _forget(self, pick: Pick) -> None:
        picks = self._by_request_id.get(pick.request_id)
        if picks is None:
            return
        if pick in picks:
            picks.remove(pick)
        if not picks:
            del self._by_request_id[pick.request_id]

    async def answer_ended(
        self, request_id: bytes, status: int, served: str | None, ttft_s: float | None
    ) -> None:
        """Envoy's access log says the request `request_id` ended with `status` (0: no response, the
        stream was reset), served by `served`: close the oldest open pick of that id."""
        picks = self._by_request_id.get(request_id)
        if not picks:
            return
        pick = picks[0]
        if pick.status is None and status:
            # The response headers were not seen (response_header_mode SKIP): the entry tells all.
            await pick.response_started(status, served, False)
            pick.ttft_s = ttft_s if status == 200 else None
        pick.finish(status or None, "access_log")

    def access_log_closed(self) -> None:
        """The last access-log stream closed. Envoy going away (a restart, a crash) closes it, and no
        entry will come for the requests it had: the picks left waiting close now, and so will those
        made before this close whose ext_proc stream ends later while no stream is connected (their
        Envoy may be the one gone). An Envoy still running opens a stream again with its next entry;
        the picks made from now on wait for theirs. The entries that do come for the picks closed
        here are ignored: a dropped stream costs their load, released before their answers end, not
        a load held for a request gone."""
        self.access_log_closes += 1
        for picks in list(self._by_request_id.values()):
            for pick in list(picks):
                if pick.waiting:
                    pick.finish(None, "access_log_closed")

    def access_log_timed_out(self, pick: Pick) -> None:
        """`pick` waited epp.stream_timeout_s for its entry in vain; said once when no log stream is
        connected, as an Envoy that sends no access log here holds every such pick's load that long."""
        if self.access_log_streams == 0 and not self._told_no_access_log:
            self._told_no_access_log = True
            log.warning(
                "a pick waited epp.stream_timeout_s (%g s) for Envoy's access-log entry of its request "
                "and no access-log stream from Envoy is connected: point Envoy's http_grpc access log "
                "at the picker (deploy/envoy/envoy-epp.yaml) or set epp.envoy_access_log: false",
                self.config.stream_timeout_s,
            )
        pick.finish(None, "access_log_timeout")


def _next_best(choice: Choice, candidates: list[BackendState]) -> BackendState | None:
    """The candidate the policy would have taken had the winner been absent: lowest cost where the
    policy scored them, else fewest requests in flight (the protocol's fallback endpoint)."""
    others = [backend for backend in candidates if backend is not choice.backend]
    if not others:
        return None
    scores = choice.candidates
    infinity = float("inf")

    def rank(backend: BackendState) -> tuple[float, int]:
        score = scores.get(backend.name)
        cost = score.get("cost", infinity) if score is not None else infinity
        return cost, backend.in_flight

    return min(others, key=rank)


class Pick:
    """One picked request's accounting, open from the pick until `finish` (once)."""

    __slots__ = (
        "_timer",
        "choice",
        "endpoint",
        "fallback",
        "finished",
        "log_closes_before",
        "picked_at",
        "picker",
        "policy",
        "prefill_tokens",
        "reported_cached_tokens",
        "request_id",
        "status",
        "tenant",
        "ttft_s",
        "waiting",
    )

    def __init__(
        self,
        picker: EndpointPicker,
        policy: Policy,
        choice: Choice,
        prefill_tokens: int,
        endpoint: str,
        request_id: bytes = b"",
    ) -> None:
        self.picker = picker
        self.policy = policy
        self.choice = choice
        self.prefill_tokens = prefill_tokens
        self.endpoint = endpoint
        self.picked_at = perf_counter()
        self.status: int | None = None
        self.ttft_s: float | None = None
        self.finished = False
        self.request_id = request_id
        # The next best engine, listed after the pick in the `envoy.lb` metadata (Envoy's retry).
        self.fallback: BackendState | None = None
        # Left for its access-log entry (its ext_proc stream ended before the answer).
        self.waiting = False
        # The access-log closes before this pick: one after it may have been its Envoy going away.
        self.log_closes_before = picker.access_log_closes
        self._timer: asyncio.TimerHandle | None = None
        # The tenant of the client's key (auth.tenants), for kvgate_tenant_requests_total.
        self.tenant: str | None = None
        # The cached tokens the answer's usage reports (stream.py reads it), for stale_index.
        self.reported_cached_tokens: int | None = None

    @property
    def backend(self) -> BackendState:
        return self.choice.backend

    async def resolve(self) -> str:
        """The picked endpoint (`ip:port`), resolving the backend's host name on its first pick."""
        if not self.endpoint:
            self.endpoint = await self.picker.endpoint_of(self.backend)
        return self.endpoint

    async def endpoints(self) -> str:
        """The pick then its fallback, comma-separated, as the `envoy.lb` metadata lists them (the
        pick alone when there is no other candidate, or its address cannot be resolved)."""
        endpoint = await self.resolve()
        if self.fallback is None:
            return endpoint
        try:
            return f"{endpoint},{await self.picker.endpoint_of(self.fallback)}"
        except OSError:
            return endpoint

    def start_response_timer(self) -> None:
        """Close the accounting if no response headers come within epp.response_timeout_s."""
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.picker.config.response_timeout_s, self._response_timed_out)

    def _response_timed_out(self) -> None:
        self.finish(504, "response_timeout")

    def wait_for_access_log(self) -> bool:
        """The ext_proc stream ended (closed or reset) with the accounting open: leave it for the
        request's access-log entry, at most epp.stream_timeout_s (the longest exchange). False (close
        it now) when the request has no id to find it by, or no entry is to be expected: no access-log
        stream is connected, and Envoy is not said to send one (epp.envoy_access_log) or the last
        one closed since the pick (EndpointPicker.access_log_closed)."""
        picker = self.picker
        if self.finished or not self.request_id:
            return False
        if picker.access_log_streams == 0 and not (
            picker.config.envoy_access_log and self.log_closes_before == picker.access_log_closes
        ):
            return False
        self.waiting = True
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(picker.config.stream_timeout_s, self._log_timed_out)
        return True

    def _log_timed_out(self) -> None:
        self.picker.access_log_timed_out(self)

    async def response_started(self, status: int, served: str | None, event_stream: bool) -> None:
        """The response headers arrived: the prefill is over; the time to them is a streamed answer's
        time to its first token; the endpoint Envoy says served it takes the credit."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.finished:
            return
        self.status = status
        if status == 200 and event_stream:
            self.ttft_s = perf_counter() - self.picked_at
        picker = self.picker
        if served is not None and served != self.endpoint:
            other = await picker.backend_at(served)
            if other is not None and other is not self.backend and not self.finished:
                release_backend(self.backend, self.prefill_tokens)
                other.in_flight += 1
                other.in_flight_prefill_tokens += self.prefill_tokens
                self.choice = msgspec.structs.replace(self.choice, backend=other)
                self.endpoint = served
                if picker.metrics is not None:
                    picker.metrics.served_elsewhere.inc()
        if self.prefill_tokens and not self.finished:
            self.backend.in_flight_prefill_tokens -= self.prefill_tokens
            self.prefill_tokens = 0
            if picker.context.cluster is not None:
                picker.context.cluster.loads_changed()

    def finish(self, status: int | None, how: str) -> None:
        """The answer ended (or will never be seen): release the load and tell the policy, once."""
        if self.finished:
            return
        self.finished = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        picker = self.picker
        if self.request_id:
            picker._forget(self)
        context = picker.context
        backend = self.backend
        # No status seen: Envoy closed the stream before any response (the client left, or the
        # engine never answered); 499 as nginx logs a client that went away.
        outcome = status if status is not None else (self.status if self.status is not None else 499)
        release_backend(backend, self.prefill_tokens)
        self.prefill_tokens = 0
        if context.cluster is not None:
            context.cluster.loads_changed()
        backend.requests_total += 1
        context.metrics.count_request(backend.name, outcome)
        if self.tenant is not None:
            context.metrics.count_tenant_request(self.tenant, outcome)
        context.metrics.observe_upstream(backend.name, perf_counter() - self.picked_at)
        self.policy.on_finished(self.choice, outcome, self.ttft_s)
        missed_reuse = context.metrics.missed_reuse
        if missed_reuse.enabled:
            missed_reuse.routed(self.choice)
            # Where Envoy sends the answer's body, its usage tells a stale index (else none is counted).
            missed_reuse.answered(self.choice, outcome, self.reported_cached_tokens)
        picker.in_flight -= 1
        if picker.metrics is not None:
            picker.metrics.finished.labels(how).inc()
