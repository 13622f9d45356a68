"""The gateway's view of each backend: health, draining and in-flight load."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from router.config import KVEvents


@dataclass(eq=False, slots=True)
class BackendState:
    name: str
    url: str
    # Models this backend serves; empty means every configured model.
    models: list[str] = field(default_factory=list)
    kv_events: KVEvents | None = None
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

    @property
    def accepting(self) -> bool:
        return self.healthy and not self.draining

    def describe(self) -> dict:
        """The JSON shape of GET /backends."""
        return {
            "name": self.name,
            "url": self.url,
            "models": self.models,
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
