"""The endpoint picker's gRPC server (`EppServer`): the ext_proc servicer, the access-log service
(Envoy's entries tell the answers' ends) and gRPC health (`grpc.health.v1`) on `epp.host:epp.port`,
bounded (message size, concurrent streams, each stream's life), with TLS or mutual TLS when
`epp.tls` says so. A face of router/app.py: it starts after the gateway's core and stops before it.

Health names the Gateway API Inference Extension reads: `liveness` (the process answers), and
`readiness`, `envoy.service.ext_proc.v3.ExternalProcessor` and "" (the server as a whole), SERVING
while at least one backend is accepting requests, NOT_SERVING otherwise and from the start of the
shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.epp.access_log import AccessLogServicer
from router.epp.metrics import EppMetrics
from router.epp.picker import EndpointPicker, format_endpoint
from router.epp.stream import ExtProcServicer

if TYPE_CHECKING:
    from router.config import Config
    from router.wiring import Gateway

log = logging.getLogger("kvgate.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("", "readiness", EXT_PROC_SERVICE)
# How often readiness follows the backends' health.
_READINESS_INTERVAL_S = 0.5
# Streams still open at shutdown get this long to end.
_STOP_GRACE_S = 5.0
# What a BUFFERED message carries beside the body (headers, metadata), on top of the body limit.
_MESSAGE_HEADROOM = 1024 * 1024


class EppServer:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.epp = config.epp
        self.body_limit = self.epp.max_body_bytes or config.limits.max_body_bytes
        self.max_message_bytes = self.epp.max_message_bytes or self.body_limit + _MESSAGE_HEADROOM
        self.picker: EndpointPicker | None = None
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._readiness: asyncio.Task | None = None
        self._readiness_status: int | None = None

    async def start(self, gateway: Gateway) -> None:
        picker = EndpointPicker(gateway, self.epp)
        picker.metrics = EppMetrics(gateway.metrics.registry, lambda: picker.in_flight)
        self.picker = picker
        limit = self.max_message_bytes
        server = grpc.aio.server(
            maximum_concurrent_rpcs=self.epp.max_streams,
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.max_concurrent_streams", self.epp.max_streams),
                # Envoy keeps its ext_proc connection open; pings keep dead peers from holding streams.
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.keepalive_timeout_ms", 10_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                ("grpc.so_reuseport", 0),
            ],
        )
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
            ExtProcServicer(picker, self.epp, self.body_limit, picker.metrics), server
        )
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogServicer(picker), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        address = format_endpoint(self.epp.host, self.epp.port)
        tls = self.epp.tls
        if tls is None:
            self.port = server.add_insecure_port(address)
        else:
            ca = Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None
            credentials = grpc.ssl_server_credentials(
                [(Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())],
                root_certificates=ca,
                require_client_auth=ca is not None,
            )
            self.port = server.add_secure_port(address, credentials)
        await server.start()
        self._server = server
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self._follow_backends_once(gateway)
        self._readiness = asyncio.get_running_loop().create_task(self._follow_backends(gateway))
        log.info("endpoint picker (ext_proc) listening on %s:%s", self.epp.host, self.port)

    async def _follow_backends_once(self, gateway: Gateway) -> None:
        ready = any(backend.accepting for backend in gateway.backends.values())
        serving = health_pb2.HealthCheckResponse
        status = serving.SERVING if ready else serving.NOT_SERVING
        if status == self._readiness_status:
            return  # unchanged: setting it again would wake every Watch stream for nothing
        self._readiness_status = status
        for service in READY_SERVICES:
            await self.health.set(service, status)

    async def _follow_backends(self, gateway: Gateway) -> None:
        while True:
            await asyncio.sleep(_READINESS_INTERVAL_S)
            await self._follow_backends_once(gateway)

    async def stop(self) -> None:
        if self._readiness is not None:
            self._readiness.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._readiness
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(_STOP_GRACE_S)
