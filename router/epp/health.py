"""gRPC health (`grpc.health.v1.Health`) for the picker's server: Check, and Watch streaming each
change, as grpcio-health-checking's servicer serves them. A service with no status set is NOT_FOUND
to Check and SERVICE_UNKNOWN to Watch; after `enter_graceful_shutdown` every service reads
NOT_SERVING and later sets are ignored."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from grpc_health.v1 import health_pb2

from router.epp.grpc_server import ServicerContext
from router.epp.http2 import StatusCode

HealthCheckResponse = health_pb2.HealthCheckResponse


class HealthServicer:
    def __init__(self) -> None:
        self._statuses: dict[str, int] = {}
        self._watchers: dict[str, set[asyncio.Future]] = {}
        self._shutting_down = False

    def set(self, service: str, status: int) -> None:
        if self._shutting_down:
            return
        self._set(service, status)

    def _set(self, service: str, status: int) -> None:
        if self._statuses.get(service) == status:
            return
        self._statuses[service] = status
        for waiter in self._watchers.pop(service, ()):
            if not waiter.done():
                waiter.set_result(None)

    def enter_graceful_shutdown(self) -> None:
        for service in list(self._statuses):
            self._set(service, HealthCheckResponse.NOT_SERVING)
        self._shutting_down = True

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: ServicerContext
    ) -> HealthCheckResponse:
        status = self._statuses.get(request.service)
        if status is None:
            await context.abort(StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: ServicerContext
    ) -> AsyncIterator[HealthCheckResponse]:
        service, last = request.service, None
        while True:
            status = self._statuses.get(service, HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                last = status
                yield HealthCheckResponse(status=status)
            waiter = asyncio.get_running_loop().create_future()
            self._watchers.setdefault(service, set()).add(waiter)
            try:
                await waiter
            finally:
                watchers = self._watchers.get(service)
                if watchers is not None:
                    watchers.discard(waiter)
