"""The gateway: its state (`Gateway`) and its HTTP application (`create_app`).

`Gateway` owns the configuration, the backend registry (name -> BackendState), the routing policy,
the one pooled upstream client, the health checker, the metrics and the extensions (see
router/extensions.py). `create_app` wires them into a Starlette app whose generation endpoints are
raw ASGI (router/forward.py) so the hot path pays no framework cost it does not need.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from router import config as config_schema
from router.admin import admin_routes
from router.auth import OPEN_PATHS, UNAUTHORIZED_HEADERS, UNAUTHORIZED_MESSAGE, ClientKeys
from router.backends import BackendState
from router.errors import decode_json_body, error_body, log_unexpected, send_error
from router.extensions import Extension, load_extensions
from router.forward import FORWARDED_ROUTES, ProxyEndpoint
from router.health import HealthChecker
from router.metrics import GatewayMetrics
from router.policies import make_policy
from router.policies.base import RouteRequest
from router.upstream import UpstreamError, UpstreamPool

if TYPE_CHECKING:
    from router.cluster import ClusterSync

log = logging.getLogger("kvgate")

# How long a /v1/models answer assembled from the backends is reused.
MODELS_CACHE_S = 2.0
# Set in a request's scope once _internal_error has answered its 500.
_ANSWERED_500 = "kvgate.answered_500"
_json_decoder = msgspec.json.Decoder()


class Gateway:
    """Everything one gateway process knows; the app's endpoints and the extensions share it."""

    def __init__(self, config: config_schema.Config, extension_factories: list[str] | None = None):
        self.config = config
        self.metrics = GatewayMetrics()
        self.pool = UpstreamPool(config.limits.connect_timeout_s, config.limits.max_connections)
        self.backends: dict[str, BackendState] = {}
        self.admin_token = config.admin.resolved_token()
        # Client API keys (router/auth.py); the admin token opens what a client key opens.
        client_keys = config.auth.resolved_keys()
        if client_keys and self.admin_token:
            client_keys.append(self.admin_token)
        self.client_keys = ClientKeys(client_keys) if client_keys else None
        self.model_names = frozenset(m.name for m in config.models)
        self.served_names = {
            m.name: m.served_name for m in config.models if m.served_name not in (None, m.name)
        }
        # Models whose clients may send their own chat template (refused with a 400 for the others).
        self.request_template_models = frozenset(
            m.name for m in config.models if m.trust_request_chat_template
        )
        policy_config = config.policy
        header = (
            policy_config.header if isinstance(policy_config, config_schema.SessionPolicy) else "x-session-id"
        )
        self.session_header = header.lower().encode()
        # Seams for extensions: the KV index sets kv_index; a tokenizer appends a preparer.
        self.kv_index: Any = None
        self.request_preparers: list[Callable[[RouteRequest], Awaitable[None]]] = []
        for spec in config.backends:
            self._register(spec)
        self.extensions: list[Extension] = load_extensions(self, extension_factories)
        self.policy = make_policy(policy_config, self)
        # Replicas in front of the same engines share their loads and placements (`cluster:`).
        self.cluster: ClusterSync | None = None
        if config.cluster is not None:
            from router.cluster import ClusterSync

            self.cluster = ClusterSync(config.cluster, self.backends, self.policy, self.metrics.registry)
        self.health = HealthChecker(self)
        self._models_cache: tuple[float, bytes] | None = None

    # ---- backend registry ----

    def _register(self, spec: config_schema.Backend) -> BackendState:
        backend = BackendState(
            name=spec.name, url=spec.url, models=list(spec.models), kv_events=spec.kv_events
        )
        self.backends[spec.name] = backend
        self.metrics.track_backend(backend)
        return backend

    def add_backend(self, spec: config_schema.Backend) -> BackendState:
        """Add a backend at runtime (POST /backends); it takes traffic at once."""
        backend = self._register(spec)
        for extension in self.extensions:
            extension.backend_added(backend)
        log.info("backend %s added (%s)", backend.name, backend.url)
        return backend

    def remove_backend(self, name: str) -> BackendState:
        """Remove a backend at runtime (DELETE /backends/{name}, after draining)."""
        backend = self.backends.pop(name)
        self.metrics.untrack_backend(name)
        if self.cluster is not None:
            self.cluster.backend_removed(name)
        for extension in self.extensions:
            extension.backend_removed(backend)
        log.info("backend %s removed", name)
        return backend

    def candidates(self, model: str, exclude: list[BackendState] = ()) -> list[BackendState]:
        """Backends that may take a request for `model` now: healthy, not draining, serving it."""
        return [
            backend
            for backend in self.backends.values()
            if backend.healthy and not backend.draining and backend.serves(model) and backend not in exclude
        ]

    def panic_candidates(self, model: str, exclude: list[BackendState] = ()) -> list[BackendState]:
        """Backends serving `model` that are marked down (not draining), least recently failed first.

        Tried when no backend is a candidate, before answering 503 (as Envoy's panic threshold
        does): a backend may be back before its next probe says so.
        """
        down = [
            backend
            for backend in self.backends.values()
            if not (backend.healthy or backend.draining) and backend.serves(model) and backend not in exclude
        ]
        return sorted(down, key=lambda backend: backend.down_since)

    def mark_down(self, backend: BackendState, reason: str) -> None:
        backend.down_since = time.monotonic()
        backend.down_reason = reason
        if backend.healthy:
            backend.healthy = False
            self.metrics.health_transitions.labels(backend.name, "down").inc()
            log.warning("backend %s is down: %s", backend.name, reason)

    def mark_up(self, backend: BackendState) -> None:
        if not backend.healthy:
            backend.healthy = True
            self.metrics.health_transitions.labels(backend.name, "up").inc()
            log.info("backend %s is back up", backend.name)

    # ---- lifecycle ----

    async def start(self) -> None:
        self.health.start()
        for extension in self.extensions:
            await extension.start()
        for backend in self.backends.values():
            for extension in self.extensions:
                extension.backend_added(backend)
        if self.cluster is not None:
            await self.cluster.start()

    async def stop(self) -> None:
        if self.cluster is not None:
            await self.cluster.stop()
        for extension in reversed(self.extensions):
            try:
                await extension.stop()
            except Exception:
                log.exception("extension %r failed to stop", extension)
        await self.health.stop()
        self.pool.close()

    # ---- /v1/models ----

    async def models_body(self) -> bytes:
        """The configured models that at least one accepting backend reports, in vLLM's list shape."""
        now = time.monotonic()
        if self._models_cache is not None and now - self._models_cache[0] < MODELS_CACHE_S:
            return self._models_cache[1]
        backends = [backend for backend in self.backends.values() if backend.accepting]
        reports = await asyncio.gather(*(self._reported_models(backend) for backend in backends))
        cards: dict[str, dict] = {}
        for backend, reported in zip(backends, reports, strict=True):
            for model in self.config.models:
                engine_name = model.served_name or model.name
                if model.name not in cards and backend.serves(model.name) and engine_name in reported:
                    card = dict(reported[engine_name])
                    card["id"] = model.name
                    cards[model.name] = card
        data = [cards[model.name] for model in self.config.models if model.name in cards]
        body = msgspec.json.encode({"object": "list", "data": data})
        self._models_cache = (now, body)
        return body

    async def model_card(self, model: str) -> bytes | None:
        """GET /v1/models/{model}: its card from the list, None when the list does not hold it."""
        for card in msgspec.json.decode(await self.models_body())["data"]:
            if card.get("id") == model:
                return msgspec.json.encode(card)
        return None

    async def _reported_models(self, backend: BackendState) -> dict[str, dict]:
        try:
            status, body = await self.pool.get(backend.url + "/v1/models", self.config.health.timeout_s)
            if status != 200:
                return {}
            listed = decode_json_body(_json_decoder, body).get("data", [])
            return {card["id"]: card for card in listed if isinstance(card, dict) and "id" in card}
        except (UpstreamError, TimeoutError, msgspec.DecodeError, AttributeError, TypeError):
            return {}


class GatewayApp(Starlette):
    """Starlette, plus a direct path to the forwarded endpoints: they are raw ASGI, handle their own
    errors, and skipping the middleware and router layers saves ~20% of the gateway's CPU per request.
    With client API keys configured, every path but OPEN_PATHS needs one (checked here for the ASGI
    path; ProxyEndpoint.serve checks the direct path)."""

    fast_endpoints: dict[str, ProxyEndpoint]
    client_keys: ClientKeys | None = None

    async def __call__(self, scope, receive, send) -> None:
        if (
            self.client_keys is not None
            and scope["type"] == "http"
            and scope["path"] not in OPEN_PATHS
            and not self.client_keys.allows_headers(scope["headers"])
        ):
            await send_error(send, 401, UNAUTHORIZED_MESSAGE, UNAUTHORIZED_HEADERS)
            return
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.fast_endpoints.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        try:
            await super().__call__(scope, receive, send)
        except Exception:
            # Starlette re-raises an error its handler has answered, for the server to log again
            # with its traceback; _internal_error has logged it already (throttled).
            if not scope.get(_ANSWERED_500):
                raise


def create_app(config: config_schema.Config, extension_factories: list[str] | None = None) -> Starlette:
    """The gateway's ASGI app for `config`; `app.state.gateway` is its Gateway."""
    gateway = Gateway(config, extension_factories)

    async def health(request: Request) -> Response:
        backends = {backend.name: backend.describe()["state"] for backend in gateway.backends.values()}
        accepting = sum(1 for backend in gateway.backends.values() if backend.accepting)
        status = "ok" if accepting else "unavailable"
        return JSONResponse({"status": status, "backends": backends}, status_code=200 if accepting else 503)

    async def metrics(request: Request) -> Response:
        return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(request: Request) -> Response:
        return Response(await gateway.models_body(), media_type="application/json")

    async def model(request: Request) -> Response:
        model_id = request.path_params["model_id"]
        card = await gateway.model_card(model_id)
        if card is None:
            known = ", ".join(m.name for m in gateway.config.models)
            return _error_response(
                404,
                f"the model `{model_id}` does not exist or no healthy backend serves it; "
                f"configured models: {known}",
            )
        return Response(card, media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    fast_endpoints = {route.path: ProxyEndpoint(gateway, route) for route in FORWARDED_ROUTES}
    routes = [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in fast_endpoints.items()),
        Route("/v1/models", models, methods=["GET"]),
        # Model ids may hold slashes (Qwen/Qwen3-8B).
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *admin_routes(gateway),
    ]
    for extension in gateway.extensions:
        routes.extend(extension.routes())
    app = GatewayApp(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: _not_found, 405: _not_allowed, Exception: _internal_error},
    )
    app.fast_endpoints = fast_endpoints
    app.client_keys = gateway.client_keys
    app.state.gateway = gateway
    return app


def _error_response(status: int, message: str) -> Response:
    return Response(error_body(status, message), status_code=status, media_type="application/json")


async def _not_found(request: Request, exc: Exception) -> Response:
    return _error_response(404, f"no route {request.url.path}")


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return _error_response(405, f"method {request.method} is not allowed on {request.url.path}")


async def _internal_error(request: Request, exc: Exception) -> Response:
    log_unexpected(log, exc, "unhandled error on %s %s", request.method, request.url.path)
    request.scope[_ANSWERED_500] = True
    return _error_response(500, "internal gateway error; see the gateway log")
