"""The ext_proc servicer (`envoy.service.ext_proc.v3.ExternalProcessor`): one bidirectional stream
per HTTP request, read in order (request headers, body, trailers, then the response's), answered in
the order Envoy expects.

Request side. BUFFERED: the headers are let through at once, the whole body arrives in one message,
and the answer to it carries the pick (header mutation + dynamic metadata): two round trips.
STREAMED with send_body_without_waiting_for_header_response: Envoy sends the headers and the body's
chunks at once and holds them, so the headers' answer waits for the body's end; then the pick goes
out on it and each chunk is answered, unchanged, in order: one round trip, nothing sent back but
the answers. FULL_DUPLEX_STREAMED: the same order, but Envoy holds no chunk, so every chunk is
re-emitted. The body changes where serve's does (router/request_routing.py, engine_body): a tenant's
request on a salted path (auth.tenants) gets its cache_salt, a model with a served_name that name.
The rewritten body replaces the buffered one (content-length set to match), or goes out whole in
place of the streamed chunks (STREAMED: in the first chunk's place, the others cleared,
content-length set on the headers' answer). In every mode a body over the limit is answered 413,
on the headers when its content-length says so, else at the chunk that crosses it, never held.

Response side: the status, the endpoint Envoy says served it, the time to the headers (a streamed
answer's time to first token) and, where Envoy sends the body, its `usage`; the pick's accounting
closes at the answer's end, when Envoy closes the stream, or after epp.response_timeout_s without
response headers. With the response body not sent (response_body_mode NONE), Envoy may end the
stream before the answer does (at the response headers, in some modes); a pick whose stream ended
then waits for the answer's end from Envoy's access log (router/epp/access_log.py), when one is
connected or epp.envoy_access_log says Envoy sends it. Each stream lives at most epp.stream_timeout_s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from router.config import Epp
from router.epp import protocol
from router.epp.grpc_server import ServicerContext
from router.epp.http2 import StatusCode
from router.epp.metrics import EppMetrics
from router.epp.picker import EndpointPicker, Pick, PickRefused, body_too_large
from router.epp.usage import UsageReader
from router.errors import error_body, log_unexpected
from router.forward import ForwardedRoute

log = logging.getLogger("kvgate.epp")


class ExtProcServicer:
    def __init__(self, picker: EndpointPicker, config: Epp, body_limit: int, metrics: EppMetrics) -> None:
        self.picker = picker
        self.config = config
        self.body_limit = body_limit
        self.metrics = metrics

    async def Process(
        self, requests: AsyncIterator[protocol.ProcessingRequest], context: ServicerContext
    ) -> AsyncIterator[protocol.ProcessingResponse]:
        exchange = _Exchange(self)
        task = asyncio.current_task()
        assert task is not None
        timed_out = False

        def expire() -> None:
            nonlocal timed_out
            timed_out = True
            task.cancel()

        # The stream's whole life is bounded: past it the task is cancelled, the RPC ends with
        # DEADLINE_EXCEEDED and the pick's accounting closes.
        deadline = asyncio.get_running_loop().call_later(self.config.stream_timeout_s, expire)
        try:
            async for message in requests:
                for response in await exchange.handle(message):
                    yield response
                if exchange.done:
                    return
        except asyncio.CancelledError:
            if not timed_out:
                raise  # Envoy (or the client behind it) reset the stream
            task.uncancel()
            await context.abort(
                StatusCode.DEADLINE_EXCEEDED,
                f"ext_proc stream open longer than epp.stream_timeout_s ({self.config.stream_timeout_s:g} s)",
            )
        finally:
            deadline.cancel()
            pick = exchange.pick
            # With the response body not sent to the picker, Envoy may end the stream before the
            # answer ends: Envoy's access log then tells the end (router/epp/access_log.py). A reset
            # (a client that left) waits for its entry too: Envoy logs every request, a reset one
            # with no status, and the entry tells when its upstream request ended.
            if pick is not None and (timed_out or not pick.wait_for_access_log()):
                pick.finish(None, "stream_closed")


class _Exchange:
    """One HTTP request's state across its stream's messages."""

    __slots__ = (
        "body_mode",
        "body_size",
        "done",
        "event_stream",
        "headers",
        "held",
        "pick",
        "response_streamed",
        "route",
        "servicer",
        "subset",
        "tenant",
        "usage",
    )

    def __init__(self, servicer: ExtProcServicer) -> None:
        self.servicer = servicer
        self.headers: list[tuple[bytes, bytes]] = []
        self.route: ForwardedRoute | None = None
        self.subset: frozenset[str] | None = None
        # The tenant of the client's key (auth.tenants): its requests on salted paths are salted.
        self.tenant: str | None = None
        # Request body chunks read so far, with their end_of_stream flags (streamed mode re-emits them).
        self.held: list[tuple[bytes, bool]] = []
        self.body_size = 0
        # How Envoy sends this request's body: protocol.BUFFERED, FULL_DUPLEX_STREAMED, or STREAMED
        # (only ever with send_body_without_waiting_for_header_response: the body comes right after
        # the headers, whose answer waits for the pick).
        self.body_mode = _CONFIGURED_BODY_MODES[servicer.config.request_body_mode]
        self.response_streamed = False
        self.pick: Pick | None = None
        self.event_stream = False
        self.usage: UsageReader | None = None
        # An immediate response went out: the stream is over.
        self.done = False

    async def handle(self, message: protocol.ProcessingRequest) -> list[protocol.ProcessingResponse]:
        """The answers to one message, in order (none while a streamed body is held)."""
        kind = message.WhichOneof("request")
        try:
            if kind == "request_headers":
                return await self._request_headers(message)
            if kind == "request_body":
                return await self._request_body(message.request_body)
            if kind == "request_trailers":
                return await self._request_trailers()
            if kind == "response_headers":
                return [await self._response_headers(message)]
            if kind == "response_body":
                return [self._response_body(message.response_body)]
            if kind == "response_trailers":
                if self.pick is not None:
                    self.pick.finish(None, "response_end")
                return [protocol.response_trailers_continue()]
            return []
        except PickRefused as refused:
            return [self._refuse(refused)]
        except Exception as exc:
            # A bug must not take Envoy's request down with a broken stream: answer 500, log it.
            log_unexpected(log, exc, "ext_proc stream failed inside the picker on %s", kind)
            body = error_body(500, "internal gateway error; see the picker's log")
            return [self._refuse(PickRefused(500, body, "internal"))]

    def _refuse(self, refused: PickRefused) -> protocol.ProcessingResponse:
        self.done = True
        if self.pick is not None:
            self.pick.finish(refused.status, "response_end")
            self.pick = None
        elif self.tenant is not None:
            self.servicer.picker.context.metrics.count_tenant_request(self.tenant, refused.status)
        self.servicer.metrics.immediate.labels(refused.reason, str(refused.status)).inc()
        return protocol.immediate(refused.status, refused.body, f"kvgate_epp_{refused.reason}")

    async def _request_headers(
        self, message: protocol.ProcessingRequest
    ) -> list[protocol.ProcessingResponse]:
        servicer = self.servicer
        announced, pickable = None, True
        if message.HasField("protocol_config"):
            modes = message.protocol_config
            announced = modes.request_body_mode
            # STREAMED only when the body comes without waiting for the headers' answer.
            pickable = announced in protocol.PICKABLE_BODY_MODES or (
                announced == protocol.STREAMED and modes.send_body_without_waiting_for_header_response
            )
            if servicer.config.request_body_mode == "auto":
                self.body_mode = announced
            self.response_streamed = modes.response_body_mode == protocol.FULL_DUPLEX_STREAMED
        self.headers = protocol.header_pairs(message.request_headers)
        self.subset = protocol.subset_hint(message)
        path = next((value for name, value in self.headers if name == b":path"), b"")
        self.route = servicer.picker.route_for(path)
        self.tenant = servicer.picker.check_admission(self.headers)
        if self.route is None:
            # Nothing to route by (GET /v1/models, /health, an unknown path): by load, now; a body
            # that follows passes through untouched.
            request_id = next((value for name, value in self.headers if name == b"x-request-id"), b"")
            self.pick = await servicer.picker.pick_by_load(self.subset, request_id)
            return [protocol.pick_on_headers(*await self._endpoints())]
        if not pickable:
            # Envoy would forward the request before the body could be read, without the header.
            message = (
                "the gateway's ext_proc filter sends request bodies in mode "
                f"{protocol.BodySendMode.Name(announced)}, where the picker cannot set the destination "
                "before the request leaves; set request_body_mode BUFFERED, STREAMED with "
                "send_body_without_waiting_for_header_response: true, or FULL_DUPLEX_STREAMED (with "
                "request_trailer_mode SEND)"
            )
            raise PickRefused(500, error_body(500, message), "body_mode_unsupported")
        declared = next((value for name, value in self.headers if name == b"content-length"), None)
        if declared is not None and declared.isdigit() and _over(declared, servicer.body_limit):
            # Said up front: refused before a byte of the body is read or held (in STREAMED mode
            # Envoy holds the chunks for their answers, so a body it cannot hold would otherwise
            # stall there until its message_timeout).
            raise body_too_large(servicer.body_limit)
        if message.request_headers.end_of_stream:
            raise PickRefused(
                400,
                error_body(400, f"{self.route.path} needs a JSON request body; none was sent", "body"),
                "missing_body",
            )
        # Streamed either way, the headers' answer carries the pick, after the body's end.
        return [_HEADERS_CONTINUE] if self.body_mode == protocol.BUFFERED else []

    async def _request_body(self, body: object) -> list[protocol.ProcessingResponse]:
        chunk, end = body.body, body.end_of_stream  # type: ignore[attr-defined]
        if self.pick is not None:
            # Routed already (by load, on the headers): pass the body on.
            if self.body_mode == protocol.FULL_DUPLEX_STREAMED:
                return [protocol.request_body_chunk(chunk, end)]
            return [_BODY_CONTINUE]
        self.body_size += len(chunk)
        if self.body_size > self.servicer.body_limit:
            self.held.clear()
            raise body_too_large(self.servicer.body_limit)
        self.held.append((chunk, end))
        # BUFFERED sends the whole body in one message (end_of_stream false when trailers follow),
        # and waits for its answer: pick on it, never wait for more.
        if end or self.body_mode == protocol.BUFFERED:
            return await self._pick_and_release()
        return []

    async def _request_trailers(self) -> list[protocol.ProcessingResponse]:
        responses = []
        if self.pick is None and self.route is not None:
            # The body ended with the trailers (Envoy's request_trailer_mode: SEND).
            responses = await self._pick_and_release()
        responses.append(protocol.request_trailers_continue())
        return responses

    async def _pick_and_release(self) -> list[protocol.ProcessingResponse]:
        picker = self.servicer.picker
        assert self.route is not None
        body = b"".join(chunk for chunk, _ in self.held)
        if not body:
            raise PickRefused(
                400,
                error_body(400, f"{self.route.path} needs a JSON request body; it was empty", "body"),
                "missing_body",
            )
        self.pick, rewritten = await picker.pick(self.route, body, self.headers, self.subset, self.tenant)
        endpoint, listed = await self._endpoints()
        if self.body_mode == protocol.STREAMED:
            # Envoy holds the chunks, each waiting for its own answer after the headers'.
            if rewritten is None:
                responses = [protocol.pick_on_headers(endpoint, listed)]
                responses += [_BODY_CONTINUE] * len(self.held)
            else:
                # The rewritten body takes the first chunk's place, the others are dropped.
                responses = [protocol.pick_on_headers_with_body(endpoint, listed, rewritten)]
                responses.append(protocol.request_body_replaced(rewritten))
                responses += [protocol.request_body_replaced(b"")] * (len(self.held) - 1)
        elif self.body_mode == protocol.FULL_DUPLEX_STREAMED:
            responses = [protocol.pick_on_headers(endpoint, listed)]
            if rewritten is None:
                responses += [protocol.request_body_chunk(chunk, end) for chunk, end in self.held]
            else:
                # The rewritten body (salted, renamed) goes out whole in place of the chunks held (its
                # end as theirs: false when trailers follow).
                responses.append(protocol.request_body_chunk(rewritten, self.held[-1][1]))
        else:
            responses = [protocol.pick_on_body(endpoint, listed, rewritten)]
        self.held = []
        return responses

    async def _endpoints(self) -> tuple[str, str]:
        """The picked endpoint (the header's value) and the list the metadata carries (it first)."""
        assert self.pick is not None
        try:
            endpoint = await self.pick.resolve()
        except OSError as exc:
            message = f"cannot resolve the address of backend {self.pick.backend.name}: {exc}"
            raise PickRefused(503, error_body(503, message), "no_endpoint") from None
        listed = await self.pick.endpoints()
        self.pick.start_response_timer()
        return endpoint, listed

    async def _response_headers(self, message: protocol.ProcessingRequest) -> protocol.ProcessingResponse:
        headers = protocol.header_pairs(message.response_headers)
        status = 0
        for name, value in headers:
            if name == b":status":
                with contextlib.suppress(ValueError):
                    status = int(value)
            elif name == b"content-type":
                self.event_stream = value.startswith(b"text/event-stream")
        pick = self.pick
        if pick is not None:
            await pick.response_started(status, protocol.served_endpoint(message), self.event_stream)
            if message.response_headers.end_of_stream:
                pick.finish(status, "response_end")
            elif self.servicer.config.usage_from_body and status == 200:
                self.usage = UsageReader(self.event_stream, self.servicer.metrics)
        return protocol.response_headers_continue()

    def _response_body(self, body: object) -> protocol.ProcessingResponse:
        chunk, end = body.body, body.end_of_stream  # type: ignore[attr-defined]
        if self.usage is not None:
            self.usage.feed(chunk, end)
            if self.pick is not None:
                self.pick.reported_cached_tokens = self.usage.cached_tokens
        if end and self.pick is not None:
            self.pick.finish(None, "response_end")
        if self.response_streamed:
            return protocol.response_body_chunk(chunk, end)
        return protocol.response_body_continue()


def _over(digits: bytes, limit: int) -> bool:
    """Whether a decimal length is over `limit`, compared by its digits first: int() of a header
    value of thousands of digits raises (Python's int_max_str_digits) and costs time."""
    digits = digits.lstrip(b"0") or b"0"
    limit_digits = len(str(limit))
    return len(digits) > limit_digits or (len(digits) == limit_digits and int(digits) > limit)


# Never changed after they are made: the same messages answer every BUFFERED request's headers, and
# every body chunk passed on as it came.
_HEADERS_CONTINUE = protocol.request_headers_continue()
_BODY_CONTINUE = protocol.request_body_continue()
_CONFIGURED_BODY_MODES = {
    "auto": protocol.BUFFERED,  # until Envoy announces its mode
    "buffered": protocol.BUFFERED,
    "streamed": protocol.STREAMED,
    "full_duplex_streamed": protocol.FULL_DUPLEX_STREAMED,
}
