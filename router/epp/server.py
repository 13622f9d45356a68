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
import ssl
from typing import TYPE_CHECKING

from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2
from grpc_health.v1 import health_pb2

from router.epp.access_log import AccessLogServicer
from router.epp.grpc_server import GrpcServer
from router.epp.health import HealthServicer
from router.epp.http2 import Method
from router.epp.metrics import EppMetrics
from router.epp.picker import EndpointPicker
from router.epp.stream import ExtProcServicer

if TYPE_CHECKING:
    from router.config import Config
    from router.epp_config import EppTls
    from router.wiring import Gateway

log = logging.getLogger("kvgate.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICE = "grpc.health.v1.Health"
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
        self.health = HealthServicer()
        self.port: int | None = None
        self._server: GrpcServer | None = None
        self._readiness: asyncio.Task | None = None

    async def start(self, gateway: Gateway) -> None:
        picker = EndpointPicker(gateway, self.epp)
        picker.metrics = EppMetrics(gateway.metrics.registry, lambda: picker.in_flight)
        self.picker = picker
        ext_proc = ExtProcServicer(picker, self.epp, self.body_limit, picker.metrics)
        access_log = AccessLogServicer(picker)
        methods = (
            Method(
                f"/{EXT_PROC_SERVICE}/Process",
                "stream_stream",
                external_processor_pb2.ProcessingRequest,
                ext_proc.Process,
            ),
            Method(
                "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs",
                "stream_unary",
                als_pb2.StreamAccessLogsMessage,
                access_log.StreamAccessLogs,
            ),
            Method(
                f"/{HEALTH_SERVICE}/Check", "unary_unary", health_pb2.HealthCheckRequest, self.health.Check
            ),
            Method(
                f"/{HEALTH_SERVICE}/Watch", "unary_stream", health_pb2.HealthCheckRequest, self.health.Watch
            ),
        )
        ssl_context = None if self.epp.tls is None else server_tls(self.epp.tls)
        server = GrpcServer(
            methods,
            max_streams=self.epp.max_streams,
            max_connections=self.epp.max_connections,
            handshake_timeout_s=self.epp.handshake_timeout_s,
            max_message_bytes=self.max_message_bytes,
            ssl_context=ssl_context,
        )
        self.port = await server.start(self.epp.host, self.epp.port)
        self._server = server
        self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self._follow_backends_once(gateway)
        self._readiness = asyncio.get_running_loop().create_task(self._follow_backends(gateway))
        log.info("endpoint picker (ext_proc) listening on %s:%s", self.epp.host, self.port)

    async def _follow_backends_once(self, gateway: Gateway) -> None:
        ready = any(backend.accepting for backend in gateway.backends.values())
        serving = health_pb2.HealthCheckResponse
        status = serving.SERVING if ready else serving.NOT_SERVING
        for service in READY_SERVICES:  # an unchanged status wakes no Watch stream (HealthServicer.set)
            self.health.set(service, status)

    async def _follow_backends(self, gateway: Gateway) -> None:
        while True:
            await asyncio.sleep(_READINESS_INTERVAL_S)
            await self._follow_backends_once(gateway)

    async def stop(self) -> None:
        if self._readiness is not None:
            self._readiness.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._readiness
        self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(_STOP_GRACE_S)


def server_tls(tls: EppTls) -> ssl.SSLContext:
    """The listener's TLS: its certificate, and with `client_ca_file` clients must show one it signed."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.client_ca_file:
        context.load_verify_locations(tls.client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
