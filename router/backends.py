"""The gateway's view of each backend: health, draining and in-flight load."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    in_flight: int = 0
    # Prompt tokens of in-flight requests that the backend still has to prefill (tracked by the gateway).
    in_flight_prefill_tokens: int = 0

    def serves(self, model: str) -> bool:
        return not self.models or model in self.models

    @property
    def accepting(self) -> bool:
        return self.healthy and not self.draining
