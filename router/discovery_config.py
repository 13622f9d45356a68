"""The `discovery:` section of proxy.yaml: which engine pods the gateway finds by label through the
Kubernetes API, and how each becomes a backend (ports, role, KV events, models). Schema only; the
credentials are resolved when the gateway starts (router/discovered_backends.py), where the pod's
environment is known."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

import msgspec

from router.errors import KvgateError

# A label value or port name as Kubernetes allows it (a DNS-1123 label, or a name of 63 characters).
_PORT_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
PortRef = (
    Annotated[str, msgspec.Meta(pattern=_PORT_NAME, max_length=63)]
    | Annotated[int, msgspec.Meta(ge=1, le=65535)]
)


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class DiscoveryKubernetes(_Section):
    """Where the EndpointSlices are, and how to reach the API that holds them."""

    # Which EndpointSlices: an equality selector (`k=v,k2=v2`, `k!=v`). A Service's slices carry
    # `kubernetes.io/service-name=<service>`.
    label_selector: Annotated[str, msgspec.Meta(min_length=1)]
    # The namespace whose EndpointSlices are watched; null: the gateway pod's own (from its service
    # account), which needs running in a pod.
    namespace: Annotated[str, msgspec.Meta(min_length=1, max_length=63)] | None = None
    # null: in-cluster, the API at KUBERNETES_SERVICE_HOST/PORT with the pod's service-account token
    # and CA at their standard paths. Otherwise this URL, with token_file (and ca_file for https).
    api_server: str | None = None
    token_file: str | None = None
    ca_file: str | None = None


class DiscoveryPorts(_Section):
    """Each engine's ports, by the EndpointSlice's port name or by number."""

    http: PortRef = "http"
    # null: the engines publish no KV events (no subscription, routing by load only).
    kv_events: PortRef | None = None
    replay: PortRef | None = None


class DiscoveryKVEvents(_Section):
    """The KV-event settings every discovered engine shares (the address comes from its pod)."""

    topic: str = ""
    dp_ranks: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    snapshot: bool = False
    max_blocks: Annotated[int, msgspec.Meta(ge=1)] | None = None


class Discovery(_Section):
    kubernetes: DiscoveryKubernetes
    ports: DiscoveryPorts = msgspec.field(default_factory=DiscoveryPorts)
    kv_events: DiscoveryKVEvents = msgspec.field(default_factory=DiscoveryKVEvents)
    # The EndpointSlice label that gives an engine's role (slices copy their Service's labels, so
    # one Service per role); its value must be prefill, decode or both. null, or the label absent:
    # default_role.
    role_label: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    default_role: Literal["prefill", "decode", "both"] = "both"
    # Models the discovered engines serve; empty: every configured model.
    models: list[str] = []
    # A vanished pod's requests still in flight get this long to finish before it is removed.
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0

    def __post_init__(self) -> None:
        if self.ports.replay is not None and self.ports.kv_events is None:
            raise ValueError("ports.replay needs ports.kv_events (replay asks about an event stream)")
        if self.kv_events.snapshot and self.ports.replay is None:
            raise ValueError("kv_events.snapshot needs ports.replay (snapshots are asked for there)")
        api = self.kubernetes.api_server
        if api is not None:
            if not api.startswith(("http://", "https://")):
                raise ValueError(f"kubernetes.api_server {api!r} must look like https://host:port")
            if self.kubernetes.token_file is None:
                raise ValueError(
                    "kubernetes.api_server needs kubernetes.token_file (a file holding the bearer token)"
                )
        elif self.kubernetes.token_file is not None or self.kubernetes.ca_file is not None:
            raise ValueError(
                "kubernetes.token_file and ca_file go with kubernetes.api_server; in a pod, leave all "
                "three out and the service account's are used"
            )


def check_discovery(discovery: Discovery, model_names: list[str], base_dir: Path | None) -> None:
    """What the schema cannot check: models that exist, credential files that can be read (their
    paths resolved against the configuration's directory), no bearer token sent in clear beyond
    loopback. Raises DiscoveryConfigError(key, message)."""
    for model in discovery.models:
        if model not in model_names:
            raise DiscoveryConfigError(
                "discovery.models", f"unknown model {model!r}; configured models are {model_names}"
            )
    kube = discovery.kubernetes
    for field in ("token_file", "ca_file"):
        value = getattr(kube, field)
        if value is None:
            continue
        path = Path(value).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_file() or not os.access(path, os.R_OK):
            raise DiscoveryConfigError(
                f"discovery.kubernetes.{field}",
                f"cannot read {str(path)!r}; give a file the gateway may read",
            )
        setattr(kube, field, str(path.absolute()))
    if kube.api_server is not None:
        parts = urlsplit(kube.api_server)
        if parts.scheme == "http" and not _is_loopback(parts.hostname or ""):
            raise DiscoveryConfigError(
                "discovery.kubernetes.api_server",
                f"{kube.api_server!r} is plain http beyond loopback: the bearer token would cross the "
                "network in clear; use https (with ca_file)",
            )


class DiscoveryConfigError(KvgateError, ValueError):
    """A `discovery:` setting that cannot work, with the key it names (router/config.py words it)."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
