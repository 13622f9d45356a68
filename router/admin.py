"""Runtime backend management: GET /backends, POST /backends, DELETE /backends/{name}.

With `admin.token` (or `admin.token_env`) configured, every call needs `Authorization: Bearer <token>`.
An admin POST must say `Content-Type: application/json` (415 otherwise): a web page can send a
text/plain POST to any address without asking, an application/json one only with CORS consent,
which the gateway never gives.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from router import config as config_schema
from router.errors import error_body

if TYPE_CHECKING:
    from router.backends import BackendRegistry

log = logging.getLogger("kvgate")
# How long DELETE waits for in-flight requests to finish, unless ?drain_timeout_s= says otherwise.
DEFAULT_DRAIN_TIMEOUT_S = 60.0


def _error(status: int, message: str) -> Response:
    return Response(error_body(status, message), status_code=status, media_type="application/json")


def require_admin(token: str | None, request: Request) -> Response | None:
    """None when the caller may use admin endpoints (it presented `token`, the admin token, or none
    is configured), else the 401 response to send."""
    if token is None:
        return None
    given = request.headers.get("authorization", "")
    scheme, _, value = given.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode()):
        return None
    return _error(
        401, "this endpoint needs `Authorization: Bearer <admin token>` (admin.token in the config)"
    )


def require_json(request: Request) -> Response | None:
    """None when the request's body is declared JSON, else the 415 response to send."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type == "application/json":
        return None
    return _error(
        415,
        f"admin requests need `Content-Type: application/json`, got {media_type or 'none'!r}",
    )


def admin_routes(backends: BackendRegistry, admin_token: str | None, models: Sequence[str]) -> list[Route]:
    """GET/POST /backends and DELETE /backends/{name} over `backends`; a backend added may serve only
    the configured `models`."""
    known = list(models)

    async def list_backends(request: Request) -> Response:
        if (denied := require_admin(admin_token, request)) is not None:
            return denied
        return JSONResponse({"backends": [backend.describe() for backend in backends.values()]})

    async def add_backend(request: Request) -> Response:
        if (denied := require_admin(admin_token, request) or require_json(request)) is not None:
            return denied
        body = await request.body()
        try:
            spec = msgspec.json.decode(body, type=config_schema.Backend, strict=True)
        except msgspec.ValidationError as exc:
            return _error(400, f"invalid backend: {exc}; expected {{name, url, models?, kv_events?}}")
        except msgspec.DecodeError as exc:
            return _error(400, f"request body is not valid JSON: {exc}")
        if spec.name in backends:
            return _error(
                409, f"a backend named {spec.name!r} already exists; DELETE it first or pick another name"
            )
        unknown = [model for model in spec.models if model not in known]
        if unknown:
            return _error(400, f"unknown models {unknown}; configured models are {known}")
        backend = backends.add(spec)
        log.info("backend %s added (%s)", backend.name, backend.url)
        return JSONResponse(backend.describe(), status_code=201)

    async def remove_backend(request: Request) -> Response:
        if (denied := require_admin(admin_token, request)) is not None:
            return denied
        name = request.path_params["name"]
        backend = backends.get(name)
        if backend is None:
            return _error(404, f"no backend named {name!r}; GET /backends lists them")
        try:
            timeout_s = float(request.query_params.get("drain_timeout_s", DEFAULT_DRAIN_TIMEOUT_S))
        except ValueError:
            return _error(400, "drain_timeout_s must be a number of seconds")
        backend.draining = True
        deadline = time.monotonic() + timeout_s
        while backend.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = backend.in_flight
        backends.remove(name)
        log.info("backend %s removed", name)
        return JSONResponse({"removed": name, "drained": left == 0, "in_flight_at_removal": left})

    return [
        Route("/backends", list_backends, methods=["GET"]),
        Route("/backends", add_backend, methods=["POST"]),
        Route("/backends/{name}", remove_backend, methods=["DELETE"]),
    ]
