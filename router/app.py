"""The gateway's HTTP application (`create_app`): its endpoints over the parts router/wiring.py builds.

The generation endpoints are raw ASGI (router/forward.py), so the hot path pays no framework cost
it does not need; the others (/v1/models, /health, /metrics, /backends, /debug/prefix-map, /lookup)
are Starlette routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Protocol

import msgspec
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from router import config as config_schema
from router.admin import admin_routes
from router.auth import OPEN_PATHS, UNAUTHORIZED_HEADERS, UNAUTHORIZED_MESSAGE, ClientKeys
from router.backends import BackendRegistry, BackendState
from router.errors import NO_ROUTE_ERROR_TYPE, decode_json_body, error_body, log_unexpected, send_error
from router.forward import FORWARDED_ROUTES, ProxyEndpoint
from router.upstream import UpstreamError, UpstreamPool
from router.wiring import Gateway

log = logging.getLogger("kvgate")

# How long a /v1/models answer assembled from the backends is reused.
MODELS_CACHE_S = 2.0
# Set in a request's scope once _internal_error has answered its 500.
_ANSWERED_500 = "kvgate.answered_500"
_json_decoder = msgspec.json.Decoder()


class Face(Protocol):
    """Another front face over the same gateway (the endpoint picker's gRPC server, router/epp/)."""

    async def start(self, gateway: Gateway) -> None: ...

    async def stop(self) -> None: ...


class ModelList:
    """GET /v1/models: the configured models that at least one accepting backend reports, in vLLM's
    list shape (asked of the backends, reused for MODELS_CACHE_S)."""

    def __init__(
        self,
        models: list[config_schema.Model],
        backends: BackendRegistry,
        pool: UpstreamPool,
        timeout_s: float,
    ) -> None:
        self.models = models
        self.backends = backends
        self.pool = pool
        self.timeout_s = timeout_s
        self._cache: tuple[float, bytes] | None = None

    async def body(self) -> bytes:
        now = time.monotonic()
        if self._cache is not None and now - self._cache[0] < MODELS_CACHE_S:
            return self._cache[1]
        backends = [backend for backend in self.backends.values() if backend.accepting]
        reports = await asyncio.gather(*(self._reported_models(backend) for backend in backends))
        cards: dict[str, dict] = {}
        for backend, reported in zip(backends, reports, strict=True):
            for model in self.models:
                engine_name = model.served_name or model.name
                if model.name not in cards and backend.serves(model.name) and engine_name in reported:
                    card = dict(reported[engine_name])
                    card["id"] = model.name
                    cards[model.name] = card
        data = [cards[model.name] for model in self.models if model.name in cards]
        body = msgspec.json.encode({"object": "list", "data": data})
        self._cache = (now, body)
        return body

    async def card(self, model: str) -> bytes | None:
        """GET /v1/models/{model}: its card from the list, None when the list does not hold it."""
        for card in msgspec.json.decode(await self.body())["data"]:
            if card.get("id") == model:
                return msgspec.json.encode(card)
        return None

    async def _reported_models(self, backend: BackendState) -> dict[str, dict]:
        try:
            status, body = await self.pool.get(backend.url + "/v1/models", self.timeout_s)
            if status != 200:
                return {}
            listed = decode_json_body(_json_decoder, body).get("data", [])
            return {card["id"]: card for card in listed if isinstance(card, dict) and "id" in card}
        except (UpstreamError, TimeoutError, msgspec.DecodeError, AttributeError, TypeError):
            return {}


class GatewayApp(Starlette):
    """Starlette, plus a direct path to the forwarded endpoints: they are raw ASGI, handle their own
    errors, and the middleware and router layers would be a sizeable share of the gateway's CPU per
    request (docs/gateway.md, "Performance design").
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


def create_app(
    config: config_schema.Config,
    extension_factories: list[str] | None = None,
    *,
    proxy: bool = True,
    faces: Sequence[Face] = (),
) -> Starlette:
    """The gateway's ASGI app for `config`; `app.state.gateway` is its Gateway (router/wiring.py).
    `extension_factories` ("module:function") replace router/extensions.py's EXTENSION_FACTORIES.
    `proxy=False` leaves the forwarded POST paths out (`kvgate epp`: the picker relays no bytes);
    `faces` start after the gateway and stop before it, in the app's lifespan."""
    gateway = Gateway(config, extension_factories)
    model_list = ModelList(config.models, gateway.backends, gateway.pool, config.health.timeout_s)

    async def health(request: Request) -> Response:
        backends = {backend.name: backend.describe()["state"] for backend in gateway.backends.values()}
        accepting = sum(1 for backend in gateway.backends.values() if backend.accepting)
        status = "ok" if accepting else "unavailable"
        body: dict[str, object] = {"status": status, "backends": backends}
        # Routing blind spots (router/routing_warnings.py) as the last background check found them:
        # the gateway answers, but kv_aware routes part of its traffic without seeing the caches.
        if gateway.routing_warnings.latest:
            body["warnings"] = gateway.routing_warnings.latest
        if gateway.discovered is not None:  # `discovery:`: is the Kubernetes API answering?
            body["discovery"] = gateway.discovered.describe()
        return JSONResponse(body, status_code=200 if accepting else 503)

    async def metrics(request: Request) -> Response:
        return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(request: Request) -> Response:
        return Response(await model_list.body(), media_type="application/json")

    async def model(request: Request) -> Response:
        model_id = request.path_params["model_id"]
        card = await model_list.card(model_id)
        if card is None:
            known = ", ".join(m.name for m in gateway.config.models)
            return _error_response(
                404,
                f"the model `{model_id}` does not exist or no healthy backend serves it; "
                f"configured models: {known}",
                param="model",
            )
        return Response(card, media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await gateway.start()
        started: list[Face] = []
        try:
            for face in faces:
                await face.start(gateway)
                started.append(face)
            yield
        finally:
            for face in reversed(started):
                await face.stop()
            await gateway.stop()

    forwarded = FORWARDED_ROUTES if proxy else ()
    fast_endpoints = {route.path: ProxyEndpoint(gateway.forwarding, route) for route in forwarded}
    routes = [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in fast_endpoints.items()),
        Route("/v1/models", models, methods=["GET"]),
        # Model ids may hold slashes (Qwen/Qwen3-8B).
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *admin_routes(gateway.backends, gateway.admin_token, [model.name for model in config.models]),
        *gateway.debug_page.routes(),
        *gateway.lookup.routes(),
    ]
    for extension in gateway.extensions:
        routes.extend(extension.routes())
    app = GatewayApp(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            404: _not_found,
            405: _not_allowed,
            ClientDisconnect: _client_left,
            Exception: _internal_error,
        },
    )
    app.fast_endpoints = fast_endpoints
    app.client_keys = gateway.client_keys
    app.state.gateway = gateway
    return app


def _error_response(
    status: int, message: str, param: str | None = None, error_type: str | None = None
) -> Response:
    body = error_body(status, message, param, error_type)
    return Response(body, status_code=status, media_type="application/json")


async def _not_found(request: Request, exc: Exception) -> Response:
    return _error_response(404, f"no route {request.url.path}", error_type=NO_ROUTE_ERROR_TYPE)


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return _error_response(405, f"method {request.method} is not allowed on {request.url.path}")


async def _client_left(request: Request, exc: Exception) -> Response:
    # The client closed the connection while its body was read (/lookup, /backends): nobody is
    # left to answer, and it is no error of the gateway's (uvicorn sends nothing to a closed cycle).
    log.debug("client left during %s %s", request.method, request.url.path)
    return Response(status_code=499)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log_unexpected(log, exc, "unhandled error on %s %s", request.method, request.url.path)
    request.scope[_ANSWERED_500] = True
    return _error_response(500, "internal gateway error; see the gateway log")
