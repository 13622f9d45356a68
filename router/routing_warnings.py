"""Routing warnings: the ways kv_aware (and approximate) can go blind without failing.

- `no_tokenizer`: a model with no tokenizer, or one that failed to load (every decision `no_tokens`);
- `silent_events`: a subscribed backend that takes requests but whose events never arrive: a stream
  that never connected (both sides connect, or both bind: the message says which side to change)
  or one that reads connected (a topic mismatch);
- `socket_error`: an event socket that could not be bound or connected;
- `contract_mismatch`: a backend keying its cache otherwise than the gateway expects (block size,
  hash algorithm and seed, chunk size, tokens, salt), from the contract check (router/contract.py,
  which adds its findings as a `source`); the backend is routed by load only meanwhile.

They are shown on /debug/prefix-map (router/debug_page.py) and in its JSON and on /health (as the
last check found them), logged (each at most once every WARNING_LOG_EVERY_S while it lasts), and
counted in kvgate_routing_warnings{kind}.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from router.backends import BackendState
    from router.config import Model
    from router.index.service import KVIndexService
    from router.policies.base import Policy

logger = logging.getLogger("kvgate.debug")

# A subscribed backend is called silent when it took SILENT_MIN_REQUESTS requests with at least a
# block to prefill, routed SILENT_AFTER_S or more after its last event (or its subscription): an
# engine publishes a prefill's blocks within milliseconds, so none arriving means none reach us.
# A stream that has never delivered anything and is not even connected needs one such request:
# the engine answers, so it runs, and its publisher is not where the gateway's socket is.
SILENT_MIN_REQUESTS = 3
SILENT_UNCONNECTED_MIN_REQUESTS = 1
SILENT_AFTER_S = 5.0
SILENT_MIN_PREFILL_TOKENS = 16
WARNING_LOG_EVERY_S = 300.0
WARNING_CHECK_EVERY_S = 2.0
WARNING_KINDS = ("no_tokenizer", "silent_events", "socket_error", "contract_mismatch")


class RoutingWarnings:
    """Why the cache-aware policy routes (part of) the traffic blind now; none for the policies that
    do not route by the prompt (`enabled` false). A BackendListener: it times each subscription."""

    def __init__(
        self,
        models: Sequence[Model],
        index: KVIndexService,
        policy: Policy,
        metrics_registry: CollectorRegistry,
        *,
        enabled: bool,
    ) -> None:
        self.models = models
        self.index = index
        self.policy = policy
        self.enabled = enabled
        # model -> why its tokenizer failed to load (router/wiring.py fills it when loading them).
        self.tokenizer_errors: dict[str, str] = {}
        # backend -> when its events were first awaited.
        self._subscribed_at: dict[str, float] = {}
        self._logged_at: dict[tuple[str, str], float] = {}
        # What the background check found last (what /health shows without checking again).
        self.latest: list[dict[str, str]] = []
        # More warnings, from parts that find them on their own (the contract check).
        self.sources: list[Callable[[], list[dict[str, str]]]] = []
        self._watch_task: asyncio.Task | None = None
        metrics_registry.register(_WarningsCollector(self))

    def backend_added(self, backend: BackendState) -> None:
        self._subscribed_at[backend.name] = time.time()

    def backend_removed(self, backend: BackendState) -> None:
        self._subscribed_at.pop(backend.name, None)

    def current(self, status: dict[str, dict[str, Any]] | None = None) -> list[dict[str, str]]:
        """The warnings that hold now: [{kind, subject, message}]. `status`: the index's
        KVIndexService.status() when the caller has it already."""
        if not self.enabled:
            return []
        warnings = [warning for source in self.sources for warning in source()]
        for model in self.models:
            if model.name in self.tokenizer_errors:
                problem = f"its tokenizer failed to load ({self.tokenizer_errors[model.name]})"
            elif model.tokenize == "local" and model.tokenizer is None:
                problem = "it has no `tokenizer:`"
            else:
                continue
            warnings.append(
                {
                    "kind": "no_tokenizer",
                    "subject": model.name,
                    "message": f"model {model.name}: {problem}, so the gateway cannot read its prompts' "
                    "tokens and routes every request for it by load alone (decision `no_tokens`); give "
                    "`tokenizer:` a local tokenizer directory (or builtin:qwen3), or set `tokenize: engine`",
                }
            )
        status = self.index.status() if status is None else status
        decisions = list(self.policy.recent_decisions())
        for name, stream in status.items():
            if stream["socket_errors"]:
                warnings.append(
                    {
                        "kind": "socket_error",
                        "subject": name,
                        "message": f"backend {name}: its KV-event socket failed "
                        f"({'; '.join(stream['socket_errors'])}), so none of its events can arrive and "
                        "kv_aware treats its cache as empty; free the address or fix kv_events, then "
                        "restart the gateway (or DELETE and POST the backend)",
                    }
                )
                continue
            since = stream["last_message_at"] or self._subscribed_at.get(name, time.time())
            unconnected = not stream["connected"] and stream["last_message_at"] is None
            unannounced = [
                decision
                for decision in decisions
                if decision["backend"] == name
                and decision["at"] >= since + SILENT_AFTER_S
                and decision["prompt_tokens"] - decision["cached_tokens"] >= SILENT_MIN_PREFILL_TOKENS
            ]
            needed = SILENT_UNCONNECTED_MIN_REQUESTS if unconnected else SILENT_MIN_REQUESTS
            if len(unannounced) >= needed:
                warnings.append(
                    {
                        "kind": "silent_events",
                        "subject": name,
                        "message": _silent_message(name, stream, len(unannounced), time.time() - since),
                    }
                )
        return warnings

    def log(self, warnings: Iterable[dict[str, str]]) -> None:
        """Log each warning when it appears and again every WARNING_LOG_EVERY_S while it lasts."""
        now = time.monotonic()
        for warning in warnings:
            key = (warning["kind"], warning["subject"])
            logged = self._logged_at.get(key)
            if logged is None or now - logged >= WARNING_LOG_EVERY_S:
                self._logged_at[key] = now
                logger.warning("kv_aware routes blind: %s", warning["message"])

    def start(self) -> None:
        """Check for warnings every WARNING_CHECK_EVERY_S in the background and log them."""
        if self.enabled:
            self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
            self._watch_task = None

    async def _watch(self) -> None:
        while True:
            try:
                self.latest = await asyncio.to_thread(self.current)
                self.log(self.latest)
            except Exception:  # the watch must outlive a bug in one check
                logger.exception("checking for routing warnings failed")
            await asyncio.sleep(WARNING_CHECK_EVERY_S)


def _silent_message(name: str, stream: dict[str, Any], requests: int, waited_s: float) -> str:
    """What a silent backend's warning says: what was seen, and the likely cause first."""
    last = "no event yet" if stream["last_message_at"] is None else "no event since"
    took = f"{requests} request{'' if requests == 1 else 's'}"
    seen = f"backend {name}: took {took} with prompts to cache but {last} ({waited_s:.0f} s)"
    endpoint = stream.get("endpoint")
    if stream["connected"] or stream["last_message_at"] is not None:
        return (
            f"{seen}, though its stream reads {'connected' if stream['connected'] else 'disconnected'}: "
            "check that the engine publishes KV events (vLLM --kv-events-config, SGLang "
            "--kv-events-config), that kv_events.topic equals the engine's topic, and that endpoint "
            "and bind match who binds (docs/real-engines.md)"
        )
    if stream.get("bind"):
        return (
            f"{seen}, and its event stream never connected: the gateway binds {endpoint} "
            "(kv_events.bind: true) and no engine has connected to it. Likely cause: the engine binds "
            "too (its endpoint holds `*`, `::` or ipc://) or publishes to another address: set "
            "kv_events.bind: false with the engine's address, or give the engine this address "
            "(docs/real-engines.md, 'Who binds')"
        )
    return (
        f"{seen}, and its event stream never connected: the gateway connects to {endpoint} "
        "(kv_events.bind: false) and nothing there accepts. Likely cause: the engine connects too "
        "(vLLM and SGLang connect out when the endpoint is a host address such as tcp://127.0.0.1:PORT, "
        "and bind only for `*`): set kv_events.bind: true so the gateway binds it, or give the engine "
        "tcp://*:PORT (docs/real-engines.md, 'Who binds')"
    )


class _WarningsCollector:
    """kvgate_routing_warnings{kind}: how many routing warnings of each kind hold at scrape time."""

    def __init__(self, warnings: RoutingWarnings) -> None:
        self._warnings = warnings

    def describe(self) -> list:
        return []

    def collect(self) -> Iterable[Any]:
        gauge = GaugeMetricFamily(
            "kvgate_routing_warnings",
            "Reasons kv_aware routes part of the traffic blind now (see /debug/prefix-map), by kind",
            labels=["kind"],
        )
        counts = dict.fromkeys(WARNING_KINDS, 0)
        for warning in self._warnings.current():
            counts[warning["kind"]] += 1
        for kind, count in counts.items():
            gauge.add_metric([kind], count)
        yield gauge
