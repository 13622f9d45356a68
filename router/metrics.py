"""Prometheus metrics of the gateway (all named kvgate_*), with per-backend children cached so the
request path pays one dict lookup, not a label resolution."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.missed_reuse import MissedReuse

if TYPE_CHECKING:
    from router.backends import BackendState

# Gateway overhead is tens of microseconds; upstream time is milliseconds to minutes.
_OVERHEAD_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 6.4e-3, 12.8e-3, 0.1)
_STALL_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_UPSTREAM_BUCKETS = (1e-3, 5e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class GatewayMetrics:
    """One registry per gateway (tests may build several in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvgate_requests",
            "Forwarded requests by the backend that answered and the HTTP status the client got",
            ["backend", "status"],
            registry=self.registry,
        )
        # Labelled by tenant names from the configuration only (auth.tenants): bounded cardinality.
        self.tenant_requests = Counter(
            "kvgate_tenant_requests",
            "Requests of each tenant (auth.tenants) by the HTTP status the client got, whether a backend "
            "or the gateway answered",
            ["tenant", "status"],
            registry=self.registry,
        )
        self.gateway_errors = Counter(
            "kvgate_gateway_errors",
            "Requests the gateway answered itself with an error (no backend answered), by status",
            ["status"],
            registry=self.registry,
        )
        self.overhead = Histogram(
            "kvgate_gateway_overhead_seconds",
            "Time spent in the gateway per request, upstream time excluded",
            buckets=_OVERHEAD_BUCKETS,
            registry=self.registry,
        )
        self.upstream = Histogram(
            "kvgate_upstream_seconds",
            "Time from sending a request to a backend until its last byte arrived",
            ["backend"],
            buckets=_UPSTREAM_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "kvgate_backend_in_flight", "In-flight requests per backend", ["backend"], registry=self.registry
        )
        self.healthy = Gauge(
            "kvgate_backend_healthy",
            "1 when the backend is in the rotation",
            ["backend"],
            registry=self.registry,
        )
        self.retries = Counter(
            "kvgate_retries",
            "Attempts retried on another backend, by the backend that failed and why",
            ["backend", "reason"],
            registry=self.registry,
        )
        self.panic_routed = Counter(
            "kvgate_panic_routed",
            "Attempts sent to a backend marked down because no backend for the model was healthy",
            ["backend"],
            registry=self.registry,
        )
        self.health_transitions = Counter(
            "kvgate_health_transitions",
            "Backend health changes, by backend and new state (up or down)",
            ["backend", "to"],
            registry=self.registry,
        )
        self.client_connections_refused = Counter(
            "kvgate_client_connections_refused",
            "Client connections accepted past limits.max_client_connections (answered 503, except "
            "GET /health and /metrics)",
            registry=self.registry,
        )
        self.loop_stalls = Histogram(
            "kvgate_event_loop_stall_seconds",
            "Times the gateway's event loop ran nothing for over 0.1 s (a blocking call on it), by how long",
            buckets=_STALL_BUCKETS,
            registry=self.registry,
        )
        # kvgate_missed_reuse_tokens_total (router/missed_reuse.py); the wiring sets its switch.
        self.missed_reuse = MissedReuse(self.registry)
        self._request_children: dict[tuple[str, int], Counter] = {}
        self._upstream_children: dict[str, Histogram] = {}

    def track_backend(self, backend: BackendState) -> None:
        """Export the backend's live gauges (read at scrape time, nothing on the request path)."""
        self.in_flight.labels(backend.name).set_function(lambda: backend.in_flight)
        self.healthy.labels(backend.name).set_function(lambda: 1.0 if backend.accepting else 0.0)

    def untrack_backend(self, name: str) -> None:
        for gauge in (self.in_flight, self.healthy):
            with contextlib.suppress(KeyError):
                gauge.remove(name)

    def count_request(self, backend: str, status: int) -> None:
        key = (backend, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(backend, str(status))
        child.inc()

    def count_tenant_request(self, tenant: str, status: int) -> None:
        self.tenant_requests.labels(tenant, str(status)).inc()

    def observe_upstream(self, backend: str, seconds: float) -> None:
        child = self._upstream_children.get(backend)
        if child is None:
            child = self._upstream_children[backend] = self.upstream.labels(backend)
        child.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
