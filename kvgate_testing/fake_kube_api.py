"""A fake Kubernetes API server for EndpointSlices: a real HTTP server on loopback speaking the API's
list and watch wire protocol, for the discovery tests (no real API server is packaged here).

What it speaks, as the real one does:
- `GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=k=v,...`: an
  `EndpointSliceList` whose `metadata.resourceVersion` is the store's version at that moment;
- the same with `watch=true&resourceVersion=RV`: a chunked stream of JSON lines `{"type": ADDED |
  MODIFIED | DELETED | BOOKMARK | ERROR, "object": ...}` for every change after RV; BOOKMARK only
  with `allowWatchBookmarks=true`; a RV older than the compacted history gets an ERROR event with a
  `Status` of code 410 (reason Expired), as the API server answers a watch it cannot resume;
  `timeoutSeconds` ends the stream;
- `Authorization: Bearer TOKEN` on every request, else 401 with a `Status`.
The test drives it: `apply` / `delete` slices, `bookmark`, `compact`, `drop_watches` (an API server
restart as clients see it: every open watch ends), `stop` and `start` (down, then back on the same port).
"""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

SLICES_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"


def endpoint_slice(
    name: str,
    service: str,
    pods: dict[str, dict[str, Any]],
    port: int,
    more_ports: dict[str, int] | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """An EndpointSlice of `service`: `pods` maps pod name -> {address, ready, terminating}; `port` is
    the one named `http`, `more_ports` more named ports, `labels` more labels (the Service's)."""
    named_ports = {"http": port, **(more_ports or {})}
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service, **(labels or {})}},
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [pod["address"]],
                "conditions": {
                    "ready": pod.get("ready", True) and not pod.get("terminating", False),
                    "serving": pod.get("ready", True),
                    "terminating": pod.get("terminating", False),
                },
                "targetRef": {"kind": "Pod", "name": pod_name},
            }
            for pod_name, pod in pods.items()
        ],
        "ports": [{"name": key, "port": number, "protocol": "TCP"} for key, number in named_ports.items()],
    }


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _matches(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors (`k=v,k2=v2`, `k==v`, `k!=v`): what discovery sends."""
    for term in filter(None, (part.strip() for part in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        else:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
    return True


class FakeKubeAPI:
    """The store (slices by name, a version counter, the event history) and its HTTP server."""

    def __init__(self, namespace: str, token: str, port: int = 0):
        self.namespace = namespace
        self.token = token
        self._port = port
        self._lock = threading.Condition()
        self._version = 100
        self._slices: dict[str, dict[str, Any]] = {}
        # (resourceVersion, event type, object): what a watch from an older version replays.
        self._history: list[tuple[int, str, dict[str, Any]]] = []
        self._oldest_version = self._version  # a watch from before this gets 410
        self._watch_generation = 0
        self._down = False  # stopped: a handler still running ends its watch
        self._server: ThreadingHTTPServer | None = None
        # Tokens that authenticate but whose account has no RBAC grant on endpointslices: 403.
        self.forbidden_tokens: set[str] = set()
        self.requests: list[str] = []  # "list" / "watch RV" / "unauthorized" / "forbidden", in order

    # ---- the test's side ----

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> FakeKubeAPI:
        api = self

        class Handler(_Handler):
            fake = api

        self._down = False
        self._server = ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        self._server.daemon_threads = True
        self._port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """The API server goes down: the listener closes and every open watch ends."""
        # The listener first, so that no watch starts after the open ones were told to end.
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            self._down = True
            self.drop_watches_locked()

    def apply(self, obj: dict[str, Any]) -> int:
        with self._lock:
            name = obj["metadata"]["name"]
            kind = "MODIFIED" if name in self._slices else "ADDED"
            return self._record(kind, copy.deepcopy(obj))

    def delete(self, name: str) -> int:
        with self._lock:
            obj = self._slices[name]
            return self._record("DELETED", obj)

    def bookmark(self) -> int:
        """A BOOKMARK event at a new version (the real server sends them on its own schedule)."""
        with self._lock:
            self._version += 1
            self._history.append((self._version, "BOOKMARK", {}))
            self._lock.notify_all()
            return self._version

    def compact(self) -> None:
        """Forget the history: a watch from any version before now gets 410 Gone."""
        with self._lock:
            self._history.clear()
            self._oldest_version = self._version
            self.drop_watches_locked()

    def drop_watches(self) -> None:
        with self._lock:
            self.drop_watches_locked()

    def drop_watches_locked(self) -> None:
        self._watch_generation += 1
        self._lock.notify_all()

    # ---- the store ----

    def _record(self, kind: str, obj: dict[str, Any]) -> int:
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)
        obj["metadata"]["namespace"] = self.namespace
        if kind == "DELETED":
            self._slices.pop(obj["metadata"]["name"], None)
        else:
            self._slices[obj["metadata"]["name"]] = obj
        self._history.append((self._version, kind, copy.deepcopy(obj)))
        self._lock.notify_all()
        return self._version


class _Handler(BaseHTTPRequestHandler):
    fake: FakeKubeAPI
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send_json(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        fake = self.fake
        parts = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
        if self.headers.get("Authorization") not in (
            f"Bearer {token}" for token in (fake.token, *fake.forbidden_tokens)
        ):
            fake.requests.append("unauthorized")
            self._send_json(401, _status(401, "Unauthorized", "Unauthorized"))
            return
        given = self.headers.get("Authorization", "").removeprefix("Bearer ")
        if given in fake.forbidden_tokens:
            fake.requests.append("forbidden")
            message = (
                'endpointslices.discovery.k8s.io is forbidden: User "system:serviceaccount:'
                f'{fake.namespace}:kvgate-gateway" cannot list resource "endpointslices" in API group '
                f'"discovery.k8s.io" in the namespace "{fake.namespace}"'
            )
            self._send_json(403, _status(403, "Forbidden", message))
            return
        if parts.path != SLICES_PATH.format(namespace=fake.namespace):
            self._send_json(404, _status(404, "NotFound", f"{parts.path} not found"))
            return
        selector = query.get("labelSelector", "")
        if query.get("watch") in ("true", "1"):
            self._watch(int(query.get("resourceVersion") or 0), selector, query)
            return
        fake.requests.append("list")
        with fake._lock:
            items = [
                {key: value for key, value in obj.items() if key not in ("kind", "apiVersion")}
                for obj in fake._slices.values()
                if _matches(obj["metadata"].get("labels", {}), selector)
            ]
            version = fake._version
        self._send_json(
            200,
            {
                "kind": "EndpointSliceList",
                "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": str(version)},
                "items": items,
            },
        )

    def _chunk(self, event: dict[str, Any]) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _watch(self, since: int, selector: str, query: dict[str, str]) -> None:
        fake = self.fake
        fake.requests.append(f"watch {since}")
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        timeout_s = float(query.get("timeoutSeconds") or 300)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with fake._lock:
            generation = fake._watch_generation
            if since < fake._oldest_version:
                message = f"too old resource version: {since} ({fake._oldest_version})"
                self._chunk({"type": "ERROR", "object": _status(410, "Expired", message)})
                self.wfile.write(b"0\r\n\r\n")
                return
        sent = since
        try:
            while True:
                with fake._lock:
                    pending = [entry for entry in fake._history if entry[0] > sent]
                    if fake._down:
                        break
                    if not pending:
                        if fake._watch_generation != generation:
                            break
                        if not fake._lock.wait(timeout=timeout_s):
                            break
                        continue
                for version, kind, obj in pending:
                    sent = version
                    if kind == "BOOKMARK":
                        if bookmarks:
                            meta = {"resourceVersion": str(version)}
                            self._chunk(
                                {"type": "BOOKMARK", "object": {"kind": "EndpointSlice", "metadata": meta}}
                            )
                    elif _matches(obj["metadata"].get("labels", {}), selector):
                        self._chunk({"type": kind, "object": obj})
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True
