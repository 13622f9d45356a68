"""Engines found by label: list and watch the EndpointSlices of one namespace through the Kubernetes
API and keep the set of engine pods they name, ready or terminating.

The API's wire protocol, as a client must handle it: a list gives the slices and a resourceVersion;
a watch from that version streams JSON lines (ADDED, MODIFIED, DELETED, BOOKMARK, ERROR); a watch
ends whenever the server likes (timeouts, restarts) and is resumed from the last version seen
(bookmarks move it on without changes); a version the server no longer holds is answered 410 Gone
(an ERROR event, or the HTTP status), and only a fresh list recovers from it. An API server that is
down leaves the last known set in place, with a warning, while the watcher retries.

Only the watching lives here: `EndpointSliceWatcher.run()` calls `on_change(endpoints)` with the
whole current set after every change. Turning that set into backends (adding, draining, removing,
subscribing to KV events) is the gateway's job, not this module's.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from router.errors import KvgateError

log = logging.getLogger("kvgate.discovery")

# In-cluster credentials, where Kubernetes mounts a pod's service-account token and CA.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# One watch event (one JSON line) larger than this is refused: a slice holds at most 1000 endpoints.
MAX_EVENT_BYTES = 4 << 20
# A list larger than this is refused rather than read into memory.
MAX_LIST_BYTES = 64 << 20
# Ask the server to end each watch after this long; the watcher resumes from the last version.
WATCH_TIMEOUT_S = 300


class Gone(KvgateError):
    """The server no longer holds the resourceVersion a watch asked for (410): re-list."""


class DiscoveryError(KvgateError):
    """The API answered something a client cannot use (not a transient failure)."""


@dataclass(frozen=True, slots=True)
class DiscoveredEndpoint:
    """One engine pod as its EndpointSlices name it."""

    pod: str
    address: str
    ports: tuple[tuple[str, int], ...]  # (port name, number), as the slice lists them
    ready: bool
    terminating: bool
    # The labels of the slice that lists it (a Service's slices copy its labels: the engine's role).
    labels: tuple[tuple[str, str], ...] = ()

    def port(self, name: str) -> int | None:
        return dict(self.ports).get(name)

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


def endpoints_of(slices: dict[str, dict[str, Any]]) -> dict[str, DiscoveredEndpoint]:
    """Every pod of `slices` (by slice name) keyed by pod name; a pod two slices list is ready if
    either says so (a slice being replaced and its successor overlap for a moment)."""
    found: dict[str, DiscoveredEndpoint] = {}
    for obj in slices.values():
        ports = tuple(
            (port.get("name") or "", int(port["port"])) for port in obj.get("ports") or [] if "port" in port
        )
        labels = tuple(sorted(((obj.get("metadata") or {}).get("labels") or {}).items()))
        for endpoint in obj.get("endpoints") or []:
            addresses = endpoint.get("addresses") or []
            target = endpoint.get("targetRef") or {}
            if not addresses or target.get("kind", "Pod") != "Pod" or not target.get("name"):
                continue
            conditions = endpoint.get("conditions") or {}
            terminating = bool(conditions.get("terminating", False))
            # `ready` unset means ready (the API's rule); a terminating endpoint is never ready.
            ready = conditions.get("ready") is not False and not terminating
            pod = DiscoveredEndpoint(target["name"], addresses[0], ports, ready, terminating, labels)
            earlier = found.get(pod.pod)
            if earlier is None or (pod.ready and not earlier.ready):
                found[pod.pod] = pod
    return found


class EndpointSliceWatcher:
    """List, then watch, the EndpointSlices matching `label_selector` in `namespace`."""

    def __init__(
        self,
        api_url: str,
        namespace: str,
        label_selector: str,
        token: str | None,
        on_change: Callable[[dict[str, DiscoveredEndpoint]], None],
        verify: str | bool = True,
        retry_s: float = 1.0,
        max_retry_s: float = 30.0,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
    ):
        self._url = f"{api_url.rstrip('/')}/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        self._selector = label_selector
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._on_change = on_change
        self._verify = verify
        self._retry_s = retry_s
        self._max_retry_s = max_retry_s
        self._watch_timeout_s = watch_timeout_s
        self._slices: dict[str, dict[str, Any]] = {}
        self._version: str | None = None
        self.endpoints: dict[str, DiscoveredEndpoint] = {}
        # What happened, for /metrics and the tests: lists, watches, gone (410), failures, bookmarks.
        self.counts = {"lists": 0, "watches": 0, "gone": 0, "failures": 0, "bookmarks": 0}
        # Why the API failed last, until a list succeeds again (a routing warning on /health).
        self.last_error: str | None = None

    async def run(self) -> None:
        """Forever: list, watch, resume; re-list on 410; on failures keep the last set and retry."""
        delay = self._retry_s
        async with httpx.AsyncClient(verify=self._verify, headers=self._headers, timeout=None) as client:
            while True:
                try:
                    if self._version is None:
                        await self._list(client)
                    await self._watch(client)
                    delay = self._retry_s  # a watch that ended normally: resume at once
                except Gone:
                    self.counts["gone"] += 1
                    log.info("discovery: resourceVersion %s expired (410); listing again", self._version)
                    self._version = None
                except (httpx.HTTPError, OSError, DiscoveryError) as exc:
                    self.counts["failures"] += 1
                    self.last_error = str(exc)
                    log.warning(
                        "discovery: the Kubernetes API failed (%s); keeping the last %d endpoints, "
                        "retrying in %.1f s",
                        exc,
                        len(self.endpoints),
                        delay,
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self._max_retry_s)

    async def _list(self, client: httpx.AsyncClient) -> None:
        self.counts["lists"] += 1
        async with client.stream(
            "GET", self._url, params={"labelSelector": self._selector}, timeout=30.0
        ) as response:
            body = await self._bounded_body(response, MAX_LIST_BYTES)
        self._check_status(response.status_code, body)
        listing = json.loads(body)
        self._slices = {obj["metadata"]["name"]: obj for obj in listing.get("items") or []}
        self._version = listing["metadata"]["resourceVersion"]
        self.last_error = None
        self._publish()

    async def _watch(self, client: httpx.AsyncClient) -> None:
        self.counts["watches"] += 1
        params = {
            "labelSelector": self._selector,
            "watch": "true",
            "resourceVersion": self._version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self._watch_timeout_s),
        }
        timeout = httpx.Timeout(10.0, read=self._watch_timeout_s + 30.0)
        async with client.stream("GET", self._url, params=params, timeout=timeout) as response:
            if response.status_code != 200:
                self._check_status(response.status_code, await self._bounded_body(response, MAX_EVENT_BYTES))
            self.last_error = None
            buffer = b""
            async for chunk in response.aiter_bytes():
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        self._apply(json.loads(line))
                if len(buffer) > MAX_EVENT_BYTES:
                    raise DiscoveryError(f"a watch event is larger than {MAX_EVENT_BYTES} bytes")

    def _apply(self, event: dict[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message", ""))
            raise DiscoveryError(f"watch error {obj.get('code')}: {obj.get('message')}")
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if kind == "BOOKMARK":
            self.counts["bookmarks"] += 1
        elif kind in ("ADDED", "MODIFIED"):
            self._slices[obj["metadata"]["name"]] = obj
        elif kind == "DELETED":
            self._slices.pop(obj["metadata"]["name"], None)
        else:
            raise DiscoveryError(f"unknown watch event type {kind!r}")
        if version:
            self._version = version
        if kind != "BOOKMARK":
            self._publish()

    def _publish(self) -> None:
        endpoints = endpoints_of(self._slices)
        if endpoints != self.endpoints:
            self.endpoints = endpoints
            self._on_change(dict(endpoints))

    @staticmethod
    async def _bounded_body(response: httpx.Response, limit: int) -> bytes:
        body = b""
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > limit:
                raise DiscoveryError(f"the API's answer is larger than {limit} bytes")
        return body

    @staticmethod
    def _check_status(status: int, body: bytes) -> None:
        if status == 200:
            return
        if status == 410:
            raise Gone(body[:200].decode(errors="replace"))
        message = body[:500].decode(errors="replace")
        if status in (401, 403):
            raise DiscoveryError(
                f"the Kubernetes API refused discovery ({status}): {message}; the service account needs "
                "get, list and watch on endpointslices (discovery.k8s.io) in this namespace"
            )
        raise DiscoveryError(f"the Kubernetes API answered {status}: {message}")
