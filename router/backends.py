"""The gateway's view of each backend (`BackendState`: health, draining, in-flight load) and the
registry of them all (`BackendRegistry`)."""

from __future__ import annotations

import logging
import time
from collections.abc import ItemsView, Iterator, Mapping, ValuesView
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

from router.config import Backend, CacheController, KVEvents

if TYPE_CHECKING:
    from router.metrics import GatewayMetrics

log = logging.getLogger("kvgate")


@dataclass(eq=False, slots=True)
class BackendState:
    name: str
    url: str
    # Models this backend serves; empty means every configured model.
    models: list[str] = field(default_factory=list)
    kv_events: KVEvents | None = None
    # The cache layer's controller its store registers with (proxy.yaml `cache_controller`).
    cache_controller: CacheController | None = None
    # `prefill`, `decode` or `both` (proxy.yaml `role`): which legs of a request it takes (`takes`).
    role: str = "both"
    healthy: bool = True
    # A draining backend finishes what it has but takes nothing new (DELETE /backends/{name}).
    draining: bool = False
    # Requests in flight there, this gateway's and (with a `cluster:`) its live peers' together:
    # what the policies weigh.
    in_flight: int = 0
    # Prompt tokens of in-flight requests that the backend still has to prefill (tracked by the gateway).
    in_flight_prefill_tokens: int = 0
    # The peers' part of the two counts above (router/cluster.py keeps it).
    peer_in_flight: int = 0
    peer_in_flight_prefill_tokens: int = 0
    # (host, port) the upstream client connects to; derived from url.
    origin: tuple[str, int] = ("", 0)
    # The name as the x-kvgate-backend header value, encoded once.
    name_bytes: bytes = b""
    # time.monotonic() when it was last marked down, and why (shown on GET /backends).
    down_since: float = 0.0
    down_reason: str = ""
    # Requests answered since it was added (any status), for GET /backends.
    requests_total: int = 0

    def __post_init__(self) -> None:
        self.name_bytes = self.name.encode()
        parts = urlsplit(self.url)
        self.origin = (parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80))

    def serves(self, model: str) -> bool:
        return not self.models or model in self.models

    def takes(self, leg: str) -> bool:
        """Whether it may be sent `leg`: "prefill" (a split request's prefill) or "decode" (a split
        request's decode, or a whole request, which decodes where it prefills)."""
        return self.role == "both" or self.role == leg

    @property
    def accepting(self) -> bool:
        return self.healthy and not self.draining

    def describe(self) -> dict:
        """The JSON shape of GET /backends."""
        return {
            "name": self.name,
            "url": self.url,
            "models": self.models,
            "role": self.role,
            "healthy": self.healthy,
            "draining": self.draining,
            "state": "draining" if self.draining else ("healthy" if self.healthy else "down"),
            "down_reason": None if self.healthy else self.down_reason,
            "in_flight": self.in_flight,
            "in_flight_prefill_tokens": self.in_flight_prefill_tokens,
            "in_flight_peers": self.peer_in_flight,
            "requests_total": self.requests_total,
            "kv_events": None if self.kv_events is None else self.kv_events.endpoint,
        }


class BackendListener(Protocol):
    """Told when a backend joins or leaves the registry (router/wiring.py registers the listeners)."""

    def backend_added(self, backend: BackendState) -> None: ...

    def backend_removed(self, backend: BackendState) -> None: ...


class BackendRegistry(Mapping[str, BackendState]):
    """The backends the gateway routes to (name -> BackendState): who may take a request now, their
    health marks, and the listeners told when one joins or leaves (POST/DELETE /backends)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._backends: dict[str, BackendState] = {}
        self._metrics = metrics
        self._listeners: list[BackendListener] = []

    # Mapping, over the dict itself (the request path iterates it).
    def __getitem__(self, name: str) -> BackendState:
        return self._backends[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._backends)

    def __len__(self) -> int:
        return len(self._backends)

    def __contains__(self, name: object) -> bool:
        return name in self._backends

    def get(self, name: str, default: BackendState | None = None) -> BackendState | None:
        return self._backends.get(name, default)

    def values(self) -> ValuesView[BackendState]:
        return self._backends.values()

    def items(self) -> ItemsView[str, BackendState]:
        return self._backends.items()

    # ---- membership ----

    def listen(self, listener: BackendListener) -> None:
        """Tell `listener` of every backend added or removed from now on (in registration order)."""
        self._listeners.append(listener)

    def announce(self) -> None:
        """Tell every listener of the backends registered so far (the configured ones, at start)."""
        for backend in self._backends.values():
            for listener in self._listeners:
                listener.backend_added(backend)

    def add(self, spec: Backend) -> BackendState:
        """Register a backend (from the configuration, or POST /backends); it takes traffic at once."""
        backend = BackendState(
            name=spec.name,
            url=spec.url,
            models=list(spec.models),
            kv_events=spec.kv_events,
            cache_controller=spec.cache_controller,
            role=spec.role,
        )
        self._backends[spec.name] = backend
        self._metrics.track_backend(backend)
        for listener in self._listeners:
            listener.backend_added(backend)
        return backend

    def remove(self, name: str) -> BackendState:
        """Unregister a backend (DELETE /backends/{name}, after draining)."""
        backend = self._backends.pop(name)
        self._metrics.untrack_backend(name)
        for listener in self._listeners:
            listener.backend_removed(backend)
        return backend

    # ---- routing ----

    def candidates(
        self, model: str, exclude: list[BackendState] = (), leg: str = "decode"
    ) -> list[BackendState]:
        """Backends that may take a request for `model` now: healthy, not draining, serving it, and
        taking `leg` (a whole request is a "decode": prefill-only engines never get one)."""
        return [
            backend
            for backend in self._backends.values()
            if backend.healthy
            and not backend.draining
            and backend.serves(model)
            and backend.takes(leg)
            and backend not in exclude
        ]

    def panic_candidates(
        self, model: str, exclude: list[BackendState] = (), leg: str = "decode"
    ) -> list[BackendState]:
        """Backends serving `model` that are marked down (not draining), least recently failed first.

        Tried when no backend is a candidate, before answering 503 (as Envoy's panic threshold
        does): a backend may be back before its next probe says so.
        """
        down = [
            backend
            for backend in self._backends.values()
            if not (backend.healthy or backend.draining)
            and backend.serves(model)
            and backend.takes(leg)
            and backend not in exclude
        ]
        return sorted(down, key=lambda backend: backend.down_since)

    # ---- health marks (router/health.py's probes, router/forward.py's failed requests) ----

    def mark_down(self, backend: BackendState, reason: str) -> None:
        backend.down_since = time.monotonic()
        backend.down_reason = reason
        if backend.healthy:
            backend.healthy = False
            self._metrics.health_transitions.labels(backend.name, "down").inc()
            log.warning("backend %s is down: %s", backend.name, reason)

    def mark_up(self, backend: BackendState) -> None:
        if not backend.healthy:
            backend.healthy = True
            self._metrics.health_transitions.labels(backend.name, "up").inc()
            log.info("backend %s is back up", backend.name)
