"""Backends found by label (`discovery:`): keep the registry's discovered backends in step with the
engine pods router/discovery.py's watcher sees.

A pod that is ready joins the registry the configuration and the admin API feed, under its pod name
(stable for the pod's life), with its KV-event subscription (and replay) as a configured backend
gets. A pod that is not ready, or terminating, is drained: it takes no new request, what it runs
finishes. A pod that vanishes is drained, then removed once its requests are done (or after
`drain_timeout_s`): the registry's listeners stop its subscription and drop its index entries.
Backends this module did not add (the file's, the admin API's) are never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from router.config import Backend, ConfigError, KVEvents
from router.discovery import SERVICE_ACCOUNT_DIR, DiscoveredEndpoint, EndpointSliceWatcher
from router.discovery_config import Discovery

if TYPE_CHECKING:
    from router.backends import BackendRegistry

log = logging.getLogger("kvgate.discovery")
ROLES = ("prefill", "decode", "both")


def watcher_for(
    discovery: Discovery,
    on_change: Callable[[dict[str, DiscoveredEndpoint]], None],
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    **watcher_options: float,
) -> EndpointSliceWatcher:
    """The watcher, with the credentials `discovery.kubernetes` names: an explicit API server and
    token file, or (in a pod) the service account's token and CA and KUBERNETES_SERVICE_HOST/PORT."""
    kube = discovery.kubernetes
    namespace = kube.namespace
    if kube.api_server is not None:
        api_url, verify = kube.api_server, kube.ca_file or True
        token_path = Path(kube.token_file or "")
    else:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        token_path = service_account_dir / "token"
        if not host or not port or not token_path.is_file():
            raise ConfigError(
                "invalid configuration at `discovery.kubernetes`: no in-cluster credentials "
                f"(KUBERNETES_SERVICE_HOST/PORT unset or no {token_path}): run in a pod whose service "
                "account token is mounted (automountServiceAccountToken: true), or set "
                "discovery.kubernetes.api_server and token_file"
            )
        api_url = f"https://{host}:{port}" if ":" not in host else f"https://[{host}]:{port}"
        verify = str(service_account_dir / "ca.crt")
        if namespace is None:
            namespace_file = service_account_dir / "namespace"
            if namespace_file.is_file():
                namespace = namespace_file.read_text().strip()
    if namespace is None:
        raise ConfigError(
            "invalid configuration at `discovery.kubernetes.namespace`: not given, and outside a pod "
            "there is no own namespace to default to; set it"
        )
    try:
        token = token_path.read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"invalid configuration at `discovery.kubernetes`: cannot read the token {str(token_path)!r}: "
            f"{exc.strerror}"
        ) from None
    return EndpointSliceWatcher(
        api_url, namespace, kube.label_selector, token, on_change, verify=verify, **watcher_options
    )


class DiscoveredBackends:
    """The registry's discovered backends, following the watcher's endpoint set (`apply`)."""

    def __init__(self, discovery: Discovery, registry: BackendRegistry, **watcher_options: float) -> None:
        """`watcher_options`: EndpointSliceWatcher's retry_s, max_retry_s (tests shorten them)."""
        self.discovery = discovery
        self.registry = registry
        self.watcher = watcher_for(discovery, self.apply, **watcher_options)  # ConfigError: no credentials
        # name -> URL of the backends this module added (and still owns).
        self._owned: dict[str, str] = {}
        # name -> the task draining, then removing, a vanished pod's backend.
        self._removals: dict[str, asyncio.Task] = {}
        # pod -> why it is not a backend (logged once per reason).
        self.skipped: dict[str, str] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.watcher.run(), name="kvgate-discovery")

    async def stop(self) -> None:
        tasks = [task for task in (self._task, *self._removals.values()) if task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def describe(self) -> dict[str, object]:
        """For /health: whether the API answers (else its last error: the last known set is kept),
        the discovered backends, and the pods that could not become backends, with why."""
        return {
            "api": "ok" if self.watcher.last_error is None else "failing",
            "error": self.watcher.last_error,
            "backends": sorted(self._owned),
            "skipped": dict(self.skipped),
        }

    # ---- following the endpoint set ----

    def apply(self, endpoints: dict[str, DiscoveredEndpoint]) -> None:
        """Add the ready pods, drain the others, remove (after draining) the vanished ones."""
        for pod, endpoint in endpoints.items():
            spec = self._spec(endpoint)
            if spec is None:
                backend = self.registry.get(pod) if pod in self._owned else None
                if backend is not None:
                    backend.draining = True  # it was a backend, and its slice no longer says how
                continue
            owned_url = self._owned.get(pod)
            if owned_url is None:
                if not endpoint.ready:
                    continue  # joins when ready
                if pod in self.registry:
                    self._skip(pod, f"a backend named {pod!r} exists already (proxy.yaml or the admin API)")
                    continue
                self._add(spec)
                continue
            if owned_url != spec.url:  # the same name at a new address: the old one is gone
                self._remove_now(pod)
                if endpoint.ready:
                    self._add(spec)
                continue
            removal = self._removals.pop(pod, None)
            if removal is not None:
                removal.cancel()  # back before its removal: keep it
            backend = self.registry.get(pod)
            if backend is None:  # removed by the admin API meanwhile: add it again when ready
                del self._owned[pod]
                if endpoint.ready:
                    self._add(spec)
                continue
            if backend.draining == endpoint.ready:
                backend.draining = not endpoint.ready
                state = (
                    "terminating"
                    if endpoint.terminating
                    else ("not ready" if not endpoint.ready else "ready")
                )
                log.info("discovery: backend %s is %s%s", pod, state, "" if endpoint.ready else ": draining")
        for name in list(self._owned):
            if name not in endpoints and name not in self._removals:
                backend = self.registry.get(name)
                if backend is not None:
                    backend.draining = True
                self._removals[name] = asyncio.get_running_loop().create_task(self._remove_when_drained(name))
        for pod in list(self.skipped):
            if pod not in endpoints:
                del self.skipped[pod]

    def _spec(self, endpoint: DiscoveredEndpoint) -> Backend | None:
        """The backend a pod is, or None (with the reason logged once) when it cannot be one."""
        ports = self.discovery.ports
        numbers = {}
        for key, ref in (("http", ports.http), ("kv_events", ports.kv_events), ("replay", ports.replay)):
            if ref is None:
                continue
            number = ref if isinstance(ref, int) else endpoint.port(ref)
            if number is None:
                listed = [name for name, _ in endpoint.ports]
                self._skip(
                    endpoint.pod,
                    f"its EndpointSlice has no port named {ref!r} (discovery.ports.{key}); it lists {listed}",
                )
                return None
            numbers[key] = number
        role = self.discovery.default_role
        if self.discovery.role_label is not None:
            role = endpoint.label(self.discovery.role_label) or role
            if role not in ROLES:
                self._skip(
                    endpoint.pod,
                    f"label {self.discovery.role_label}={role!r} is not a role; give prefill, decode or both",
                )
                return None
        host = f"[{endpoint.address}]" if ":" in endpoint.address else endpoint.address
        kv_events = None
        if "kv_events" in numbers:
            settings = self.discovery.kv_events
            kv_events = KVEvents(
                endpoint=f"tcp://{host}:{numbers['kv_events']}",
                replay_endpoint=f"tcp://{host}:{numbers['replay']}" if "replay" in numbers else None,
                topic=settings.topic,
                dp_ranks=settings.dp_ranks,
                snapshot=settings.snapshot,
                max_blocks=settings.max_blocks,
            )
        try:
            spec = Backend(
                name=endpoint.pod,
                url=f"http://{host}:{numbers['http']}",
                models=list(self.discovery.models),
                kv_events=kv_events,
                role=role,
            )
        except ValueError as exc:
            self._skip(endpoint.pod, str(exc))
            return None
        self.skipped.pop(endpoint.pod, None)
        return spec

    def _skip(self, pod: str, why: str) -> None:
        if self.skipped.get(pod) != why:
            log.warning("discovery: pod %s is not a backend: %s", pod, why)
        self.skipped[pod] = why

    def _add(self, spec: Backend) -> None:
        self.registry.add(spec)
        self._owned[spec.name] = spec.url
        log.info("discovery: backend %s added (%s, role %s)", spec.name, spec.url, spec.role)

    def _remove_now(self, name: str) -> None:
        removal = self._removals.pop(name, None)
        if removal is not None:
            removal.cancel()
        self._owned.pop(name, None)
        if name in self.registry:
            self.registry.remove(name)
            log.info("discovery: backend %s removed", name)

    async def _remove_when_drained(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.discovery.drain_timeout_s
        backend = self.registry.get(name)
        while backend is not None and backend.in_flight > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = 0 if backend is None else backend.in_flight
        if left:
            log.warning("discovery: backend %s removed with %d requests still in flight", name, left)
        self._removals.pop(name, None)
        self._remove_now(name)
