"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol plus a direct path for the
generation routes.

POST /v1/completions and /v1/chat/completions carry all of the gateway's load, so they skip ASGI:
the request is parsed by the same httptools parser, handed to `ProxyEndpoint.serve`, and the answer
is written straight to the transport: no scope dict, no receive/send messages, no asyncio.Event
per request, head and body of a whole JSON answer in one write, and a client that disconnects
cancels its request at once (connection_lost) instead of through a watcher task.

Everything else, and anything unusual on those two routes (another method, a query string,
HTTP/1.0, `Connection: close`, `Expect: 100-continue`, an upgrade, a request pipelined behind an
ASGI one), goes through uvicorn's own ASGI path to the Starlette app, unchanged. Pipelined requests
are answered in order whichever path they take.

Slow and oversized clients are bounded here, on both paths, before a request reaches either: a
request head over `limits.max_header_bytes` is refused with 431 as its bytes arrive (the parser
never buffers more than the limit), a head or body that does not arrive within
`limits.header_timeout_s` / `limits.body_timeout_s` gets 408, and connections past
`limits.max_client_connections` first close the longest idle one, else are refused with 503 (a few
more are still read so that GET /health and /metrics answer while the gateway is full). Each answer
closes the connection. A client that does not read its answers is not read either (backpressure),
and is dropped after `limits.write_timeout_s`.

Built on uvicorn 0.5x internals (`HttpToolsProtocol`'s parser callbacks, `cycle`, `pipeline`,
`flow`, `_start_asgi_task`); tests/test_gateway_*.py exercise both paths through the real process.
"""

from __future__ import annotations

import asyncio
import collections
import resource
from collections.abc import Callable, Coroutine, Iterable
from functools import partial
from time import perf_counter
from typing import TYPE_CHECKING, Any

import httptools
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from router.errors import GatewayError, KvgateError, error_body, gateway_error_body
from router.forward import body_too_large

if TYPE_CHECKING:
    from router.config import Limits
    from router.forward import ProxyEndpoint
    from router.wiring import Gateway

# Requests queued behind the one being answered before the connection stops reading; it also
# stops once their bodies together reach limits.max_body_bytes (16 bodies at the limit would be
# 512 MiB held for one connection).
_MAX_WAITING = 16
# Connections past limits.max_client_connections that are still read, so that GET /health and
# /metrics answer while the gateway is full; a connection past these is refused without being read.
OVER_CAPACITY_CONNECTIONS = 64
_MONITORING_PATHS = frozenset({b"/health", b"/metrics"})
# File descriptors left out of the default client-connection budget: listening and KV-event
# sockets, log and tokenizer files, and the over-capacity connections.
_RESERVED_FILE_DESCRIPTORS = 128 + OVER_CAPACITY_CONNECTIONS
# What a connection is reading: nothing (idle between requests), a request head, a request body.
_IDLE, _HEAD, _BODY = 0, 1, 2
# After an error answer that closes the connection: how long, and how many more bytes, the gateway
# keeps reading (and dropping) what the client still sends before it closes its side. Closing with
# unread bytes makes the kernel send a reset, and a reset can destroy the answer in the client's
# receive buffer before the client reads it (nginx's "lingering close" exists for the same reason).
_LINGER_S = 1.0
_LINGER_MAX_BYTES = 1 << 20


def default_max_client_connections() -> int:
    """The client-connection limit when limits.max_client_connections is unset: half of the open-file
    limit (RLIMIT_NOFILE) left after a fixed reserve, since each client request in flight also holds
    an upstream connection."""
    soft_limit, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft_limit == resource.RLIM_INFINITY:
        soft_limit = 1 << 20
    return max(16, (soft_limit - _RESERVED_FILE_DESCRIPTORS) // 2)


class _BackpressuredFlow(FlowControl):
    """uvicorn's FlowControl, except that a connection whose writes are paused is not read either.

    The transport pauses writing once the answers it holds for the client pass its high-water mark
    (the client reads them slower than it sends requests, or not at all); reading more requests then
    would only queue more answers in memory. Reading is on when the protocol wants it (`pause_reading`
    / `resume_reading`, as uvicorn and GatewayHttpProtocol call them) and writes are not paused."""

    def __init__(self, transport: asyncio.Transport, on_resumed: Callable[[], None]) -> None:
        super().__init__(transport)
        self.reading_wanted = True
        # Called instead of resuming the transport: the protocol parses what it holds unparsed
        # first, then resumes it (GatewayHttpProtocol._reading_resumed).
        self._on_resumed = on_resumed

    def pause_reading(self) -> None:
        self.reading_wanted = False
        self._apply()

    def resume_reading(self) -> None:
        self.reading_wanted = True
        self._apply()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._apply()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._apply()

    def _apply(self) -> None:
        paused = self.write_paused or not self.reading_wanted
        if paused == self.read_paused:
            return
        self.read_paused = paused
        transport = self._transport
        if transport.is_closing():
            return  # closing: nothing more is read either way (uvicorn wakes its drains on close)
        if paused:
            transport.pause_reading()
        else:
            self._on_resumed()


class _Answered(KvgateError):
    """Raised from a parser callback that has answered and closed the connection: stops the parser."""


class _Exchange:
    """One request on the direct path and the Responder its answer goes through."""

    __slots__ = (
        "body_parts",
        "body_size",
        "chunked",
        "client_gone",
        "complete",
        "endpoint",
        "forward_headers",
        "head",
        "protocol",
        "rejected",
        "request_id",
        "session_value",
        "started",
        "task",
    )

    def __init__(self, protocol: GatewayHttpProtocol, endpoint: ProxyEndpoint):
        self.protocol = protocol
        self.endpoint = endpoint
        self.started = perf_counter()
        self.body_parts: list[bytes] = []
        self.body_size = 0
        self.head = b""
        self.chunked = False
        self.complete = False
        self.client_gone = False
        self.rejected = False
        self.task: asyncio.Task | None = None

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        # Held until the first body piece so that a whole JSON answer leaves in one write. An event
        # stream's head leaves at once, as the engine sent it: its client reads the head while the
        # engine computes the first token, instead of after it (its first event's time otherwise
        # carries the client's work on the head; benchmarks/real_added_latency.py).
        parts = [STATUS_LINE[status]]
        chunked = True
        event_stream = False
        for name, value in headers:
            if name == b"content-length":
                chunked = False
            elif name == b"content-type" and value.startswith(b"text/event-stream"):
                event_stream = True
            parts += (name, b": ", value, b"\r\n")
        if chunked:
            parts.append(b"transfer-encoding: chunked\r\n")
        if self.protocol.closing:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        self.chunked = chunked
        protocol = self.protocol
        if event_stream and not protocol.ended and not protocol.transport.is_closing():
            protocol.transport.write(b"".join(parts))
        else:
            self.head = b"".join(parts)

    async def body(self, piece: bytes, more: bool) -> None:
        if self.chunked:
            data = b"%x\r\n%b\r\n" % (len(piece), piece) if piece else b""
            if not more:
                data += b"0\r\n\r\n"
        else:
            data = piece
        if self.head:
            data = self.head + data
            self.head = b""
        protocol = self.protocol
        # Closing: the client left (its task is cancelled); ended: the gateway ended the connection.
        if data and not protocol.ended and not protocol.transport.is_closing():
            protocol.transport.write(data)
        if not more:
            self.complete = True
        elif protocol.flow.write_paused:
            await protocol.flow.drain()


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's HttpToolsProtocol with the direct path and the client limits; gateway_http_protocol()
    sets the class attributes: `fast_endpoints` maps a path to its endpoint."""

    fast_endpoints: dict[bytes, ProxyEndpoint] = {}
    gateway: Gateway
    limits: Limits
    max_client_connections: int
    # The connections with no request to answer (idle between requests, or a head not complete
    # yet), longest so first: at the connection limit the first is closed to make room for a new
    # connection, so idle connections never keep probes (or anyone) out. One per server.
    unanswering: dict[GatewayHttpProtocol, None]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exchange: _Exchange | None = None  # the direct-path request being parsed
        # The gateway ended the connection itself (_drop_answers_in_progress): nothing more is written.
        self.ended = False
        self._running_cycle: Any = None  # the ASGI request being answered (_run_asgi)
        self.answering: _Exchange | None = None  # the direct-path request being answered
        # Requests parsed while `answering` runs, in order: a callable that starts each, a
        # direct-path request's coroutine (closed if the request never starts; None for ASGI ones),
        # and the size of the body it holds.
        self.waiting: collections.deque[tuple[Callable[[], None], Coroutine[Any, Any, None] | None, int]] = (
            collections.deque()
        )
        self._waiting_body_bytes = 0
        self.closing = False  # server shutdown: close once the current answer is out
        self.messages = 0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._messages_at_idle = 0
        # Past max_client_connections: only GET /health and /metrics are answered, then it closes.
        self.over_capacity = False
        # The read deadlines: one timer per connection, re-armed only when it fires (as the idle timer).
        self._read_phase = _HEAD
        self._phase_started = 0.0
        self._lingering_bytes: int | None = None  # bytes dropped since an error answer; None: not lingering
        self._linger_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._head_tail = b""  # the head's last bytes read (its empty line may span two reads)
        # Bytes of the body being read still to come, where its content-length tells; else None.
        self._body_left: int | None = None
        self._read_timer: asyncio.TimerHandle | None = None
        # An answer ended while writes were paused: the next request starts when they resume.
        self._next_when_writable = False
        # Armed while writes are paused: the client must read within limits.write_timeout_s.
        self._write_timer: asyncio.TimerHandle | None = None
        # What a read brought past the point where reading paused: parsed when it resumes. At most
        # one read's worth; without it, one read of small pipelined requests (256 KiB: thousands)
        # would all be parsed and queued at once, whatever the pause.
        self._unparsed = b""

    # ---- bytes in: the header limit is applied before the parser sees them ----

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return  # answered and closing: whatever else the client sends is dropped
        if self._lingering_bytes is not None:
            self._lingering_bytes += len(data)
            if self._lingering_bytes > _LINGER_MAX_BYTES:
                self._drop_answers_in_progress()
                self.transport.close()
            return
        self._unset_keepalive_if_required()
        if self._unparsed:
            data, self._unparsed = self._unparsed + data, b""
        # Fed to the parser a part of a request at a time, so that every head is counted against
        # max_header_bytes before the parser sees it, also a pipelined one that begins inside this
        # read: a head ends at its empty line, a body at its content-length. (A head that follows
        # a chunked body in the same read is counted from the next read on.)
        while data:
            if self._read_phase == _IDLE:
                self._start_reading(_HEAD)
            over_limit = False
            if self._read_phase == _HEAD:
                end = self._head_end(data)
                size = len(data) if end < 0 else end
                allowance = self.limits.max_header_bytes - self._head_bytes
                if size > allowance:
                    # Only what the limit allows: a head still incomplete then is refused before the
                    # parser buffers (and re-copies) more of it.
                    size, over_limit = allowance, True
                piece, data = (data, b"") if size == len(data) else (data[:size], data[size:])
                self._head_bytes += size
                self._head_tail = piece[-3:] if size >= 3 else (self._head_tail + piece)[-3:]
            elif self._read_phase == _BODY and 0 < (self._body_left or 0) < len(data):
                # (Never an empty piece: had the parser not ended the body where content-length
                # says, the rest goes to it whole below: each turn of the loop consumes bytes or returns.)
                piece, data = data[: self._body_left], data[self._body_left :]
                self._body_left = 0
            else:
                piece, data = data, b""
                if self._read_phase == _BODY and self._body_left is not None:
                    self._body_left -= len(piece)
            if not self._feed(piece) or self.transport.is_closing():
                return
            if over_limit and self._read_phase == _HEAD:
                self._refuse_head()
                return
            if self._lingering_bytes is not None:  # answered and lingering: the rest is dropped
                self._lingering_bytes += len(data)
                return
            if data and self.flow.read_paused:
                # Paused by what was just parsed (requests queued, an answer the client has not
                # read): the rest waits, as bytes not read yet would.
                self._unparsed = data
                return

    def _reading_resumed(self) -> None:
        """Reading may go on: what was left unparsed first (soon, not inside the caller), and only
        then new bytes, so the unparsed ones never pile up."""
        if self._unparsed:
            self.loop.call_soon(self._parse_unparsed)
        else:
            self.transport.resume_reading()

    def _parse_unparsed(self) -> None:
        if self.flow.read_paused or self.transport.is_closing():
            return  # paused again meanwhile: the next resume comes back here
        if self._unparsed:
            data, self._unparsed = self._unparsed, b""
            self.data_received(data)
        if not self._unparsed and not self.flow.read_paused and not self.transport.is_closing():
            self.transport.resume_reading()

    def _head_end(self, data: bytes) -> int:
        """Where in `data` the head being read ends (past its empty line), or -1."""
        tail = self._head_tail
        if tail:
            at = (tail + data[:3]).find(b"\r\n\r\n")
            if at >= 0:
                return at + 4 - len(tail)
        at = data.find(b"\r\n\r\n")
        return -1 if at < 0 else at + 4

    def _feed(self, data: bytes) -> bool:
        """Parse `data`; False when the connection was answered and closed on the way."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _Answered):
                return False
            self._invalid_request()
            return False
        except httptools.HttpParserError:
            self._invalid_request()
            return False
        except httptools.HttpParserUpgrade:
            # As uvicorn's data_received: the gateway serves no WebSocket route.
            if self._should_upgrade():
                self._read_phase = _IDLE  # the connection is the WebSocket protocol's from here
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return False
        return True

    def _invalid_request(self) -> None:
        message = "Invalid HTTP request received."
        self.logger.warning(message)
        self.send_400_response(message)

    def send_400_response(self, msg: str) -> None:
        # uvicorn's, which writes the 400 and closes: an ASGI answer still being made on the
        # connection (a valid request pipelined before the invalid one) is dropped first.
        self._drop_answers_in_progress()
        super().send_400_response(msg)

    def _drop_answers_in_progress(self) -> None:
        """The gateway ends the connection itself (closes it, or sends its FIN and lingers): an
        answer still being made on it is dropped, as if its client had left, and no request waiting
        behind it starts. Written, it would meet a transport that refuses writes (uvloop raises
        RuntimeError, logged as an unhandled error) before connection_lost tells uvicorn's cycle."""
        self.ended = True
        self._forget_queued_requests()

    def _forget_queued_requests(self) -> None:
        """No request queued on the connection starts, and the ASGI ones begun are told their client
        is gone: the running one (uvicorn tells only `cycle`, the last one parsed), and those queued
        behind it."""
        for _, coroutine, _ in self.waiting:
            if coroutine is not None:
                coroutine.close()  # a direct-path request's, never started
        self.waiting.clear()
        self._waiting_body_bytes = 0
        queued = [cycle for cycle, _ in self.pipeline]
        self.pipeline.clear()
        for cycle in (self._running_cycle, self.cycle, *queued):
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()

    def _refuse_head(self) -> None:
        limit = self.limits.max_header_bytes
        self._answer_and_close(
            431,
            f"request head (request line and headers) is over the limit of {limit} bytes "
            "(limits.max_header_bytes)",
        )

    def _answer_and_close(self, status: int, message: str, linger: bool = True) -> None:
        """Answer an error the gateway detected on the connection itself, then close it (lingering:
        see _LINGER_S). When an answer is already going out on it, or a head is refused behind a
        request not answered yet, the connection just closes: a second answer would garble the
        first, an early one would be read as the earlier request's."""
        self.gateway.metrics.gateway_errors.labels(str(status)).inc()
        pending = self._earlier_answer_pending() if self._read_phase == _HEAD else self._answer_in_progress()
        if not pending:
            body = error_body(status, message)
            head = b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            self.transport.write(STATUS_LINE[status] + head % len(body) + body)
        self._drop_answers_in_progress()
        if linger:
            self._close_lingering()
        else:
            self.transport.close()

    def _close_lingering(self) -> None:
        """Send what is queued and a FIN, then drop what the client still sends until it closes, for
        at most _LINGER_S and _LINGER_MAX_BYTES, and close (see _LINGER_S)."""
        transport = self.transport
        if transport.is_closing() or self._lingering_bytes is not None:
            return
        if not transport.can_write_eof():
            transport.close()
            return
        self._lingering_bytes = 0
        self._read_phase = _IDLE
        for timer in (self._read_timer, self._idle_timer):
            if timer is not None:
                timer.cancel()
        self._read_timer = self._idle_timer = None
        transport.write_eof()
        transport.resume_reading()
        self._linger_timer = self.loop.call_later(_LINGER_S, transport.close)

    def _answer_in_progress(self) -> bool:
        cycle = self.cycle
        return (
            self.answering is not None
            or bool(self.waiting)
            or bool(self.pipeline)  # ASGI requests parsed behind one whose answer is not out yet
            or (cycle is not None and cycle.response_started and not cycle.response_complete)
        )

    def _earlier_answer_pending(self) -> bool:
        """While a head is read: whether a request read before it is still unanswered (an ASGI one
        whose answer has not started counts too: an answer now would go out first, and the client
        would read it as that request's)."""
        cycle = self.cycle
        return self._answer_in_progress() or (cycle is not None and not cycle.response_complete)

    # ---- read deadlines: a head within header_timeout_s, a body within body_timeout_s ----

    def _start_reading(self, phase: int) -> None:
        self._read_phase = phase
        now = self._phase_started = self.loop.time()
        if phase == _HEAD:
            self._head_bytes = 0
            self._head_tail = b""
            self._body_left = None
        timeout_s = self.limits.header_timeout_s if phase == _HEAD else self.limits.body_timeout_s
        timer = self._read_timer
        if timer is not None:
            if timer.when() <= now + timeout_s:
                return  # it fires in time and re-arms itself for what is left
            timer.cancel()
        self._read_timer = self.loop.call_later(timeout_s, self._read_deadline)

    def _read_deadline(self) -> None:
        self._read_timer = None
        phase = self._read_phase
        if phase == _IDLE or self.transport.is_closing():
            return
        head = phase == _HEAD
        timeout_s = self.limits.header_timeout_s if head else self.limits.body_timeout_s
        now = self.loop.time()
        if self._answer_in_progress() or self.flow.read_paused:
            # Not the client's delay: the gateway is still answering on this connection, or not reading.
            self._phase_started = now
        remaining = self._phase_started + timeout_s - now
        if remaining > 0:
            self._read_timer = self.loop.call_later(remaining, self._read_deadline)
            return
        if head and self._head_bytes == 0:
            # Connected and never began a request: closed quietly, as an idle keep-alive connection is.
            self.transport.close()
            return
        if not head and self._request_answered():
            self.transport.close()  # answered early (413): only the rest of its body was awaited
            return
        what, key = ("head", "header_timeout_s") if head else ("body", "body_timeout_s")
        self._answer_and_close(408, f"request {what} not received within {timeout_s:g} s (limits.{key})")

    def _request_answered(self) -> bool:
        """While a body is read: whether its request was answered already (before its body ended)."""
        if self.exchange is not None:
            return self.exchange.rejected
        return self.cycle is not None and self.cycle.response_started

    # ---- parser callbacks ----

    def on_message_begin(self) -> None:
        if self._read_phase == _IDLE:  # a pipelined request: its head began inside the last read
            self._start_reading(_HEAD)
        # The ASGI scope is built only when the request turns out not to take the direct path.
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.exchange = None
        self.messages += 1

    def on_headers_complete(self) -> None:
        self.unanswering.pop(self, None)  # a request to answer: no longer closed to make room
        self._start_reading(_BODY)
        self._body_left = self._content_length()
        parser = self.parser
        if self.over_capacity:
            self._over_capacity_request()
            return
        endpoint = self.fast_endpoints.get(self.url)
        if (
            endpoint is not None
            and parser.get_method() == b"POST"
            and not self.expect_100_continue
            and parser.should_keep_alive()
            and parser.get_http_version() == "1.1"
            and not parser.should_upgrade()
            and not self.closing
            and (self.cycle is None or self.cycle.response_complete)
        ):
            self._begin_exchange(endpoint)
            return
        url, headers, expect_100_continue = self.url, self.headers, self.expect_100_continue
        super().on_message_begin()
        self.url, self.headers, self.expect_100_continue = url, headers, expect_100_continue
        self.scope["headers"] = headers
        super().on_headers_complete()

    def _content_length(self) -> int | None:
        """The body's length by the head's content-length; None for a chunked body (or none)."""
        length = None
        for name, value in self.headers:
            if name == b"transfer-encoding":
                return None
            if name == b"content-length":
                length = value
        try:
            return None if length is None else int(length)
        except ValueError:  # the parser refuses it before any body is read
            return None

    def on_body(self, body: bytes) -> None:
        exchange = self.exchange
        if exchange is None:
            super().on_body(body)
            return
        if exchange.rejected:
            return
        exchange.body_parts.append(body)
        exchange.body_size += len(body)
        if exchange.body_size > exchange.endpoint.limits.max_body_bytes:
            self._reject(exchange, body_too_large(exchange.endpoint.limits.max_body_bytes))

    def on_message_complete(self) -> None:
        self._read_phase = _IDLE
        exchange = self.exchange
        if exchange is None:
            super().on_message_complete()
            return
        self.exchange = None
        if not exchange.rejected:
            parts = exchange.body_parts
            body = parts[0] if len(parts) == 1 else b"".join(parts)
            exchange.body_parts = []
            coroutine = exchange.endpoint.serve(
                body,
                exchange.forward_headers,
                exchange.request_id,
                exchange.session_value,
                exchange,
                exchange.started,
            )
            self._submit(exchange, coroutine)

    # ---- past max_client_connections ----

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _BackpressuredFlow(transport, self._reading_resumed)
        self._start_reading(_HEAD)
        open_connections = len(self.connections)
        if open_connections > self.max_client_connections and self._close_longest_unanswering():
            open_connections -= 1
        self.unanswering[self] = None
        if open_connections <= self.max_client_connections:
            return
        self.gateway.metrics.client_connections_refused.inc()
        if open_connections > self.max_client_connections + OVER_CAPACITY_CONNECTIONS:
            # Closed at once, without lingering: the descriptor is what a flood of connections
            # would exhaust, and nothing was read from this one yet.
            self._answer_and_close(503, self._over_capacity_message(), linger=False)
            return
        self.over_capacity = True

    def _close_longest_unanswering(self) -> bool:
        """At the connection limit: close the connection that has had no request to answer for
        longest (idle, or its head still incomplete), if there is one. Nothing is lost but a
        keep-alive (clients reconnect) or a head that had not arrived yet; a connection answering
        a request is never closed for room."""
        unanswering = self.unanswering
        leaving, victim = [], None
        for candidate in unanswering:
            transport = candidate.transport
            if transport.is_closing():
                leaving.append(candidate)  # on its way out already
            elif transport.get_write_buffer_size() == 0:  # its last answer has all gone out
                victim = candidate
                break
        for candidate in leaving:
            del unanswering[candidate]
        if victim is None:
            return False
        del unanswering[victim]
        victim.transport.close()
        return True

    def _unanswering_again(self) -> None:
        """An answer is out and nothing else is in progress on the connection: it may be closed
        to make room from now on (longest unanswering last)."""
        if self._read_phase != _BODY and not self.transport.is_closing():
            self.unanswering.pop(self, None)
            self.unanswering[self] = None

    def _over_capacity_request(self) -> None:
        """GET /health and /metrics are answered (ASGI path, then the connection closes); the rest 503."""
        if self.parser.get_method() != b"GET" or self.url.partition(b"?")[0] not in _MONITORING_PATHS:
            self._answer_and_close(503, self._over_capacity_message())
            raise _Answered
        url, headers = self.url, self.headers
        super().on_message_begin()
        self.url, self.headers = url, headers
        self.scope["headers"] = headers
        super().on_headers_complete()
        if self.cycle is not None:
            self.cycle.keep_alive = False

    def _over_capacity_message(self) -> str:
        return (
            f"the gateway is serving its limit of {self.max_client_connections} client connections "
            "(limits.max_client_connections); retry shortly"
        )

    # ---- the direct path ----

    def _begin_exchange(self, endpoint: ProxyEndpoint) -> None:
        exchange = self.exchange = _Exchange(self, endpoint)
        forward_headers, request_id, session_value, declared_length = endpoint.split_headers(self.headers)
        exchange.forward_headers = forward_headers
        exchange.request_id = request_id
        exchange.session_value = session_value
        if declared_length is not None:
            limit = endpoint.limits.max_body_bytes
            # httptools has already refused a content-length that is not a number.
            length = int(declared_length)
            if length > limit:
                self._reject(exchange, body_too_large(limit, length))

    def _reject(self, exchange: _Exchange, error: GatewayError) -> None:
        """Answer the error now, without waiting for the rest of the body (which is then dropped)."""
        exchange.rejected = True
        exchange.body_parts = []
        exchange.endpoint.metrics.gateway_errors.labels(str(error.status)).inc()
        exchange.endpoint.log_refused(exchange.request_id, exchange.started, error)
        self._submit(exchange, _answer_error(exchange, error))

    def _submit(self, exchange: _Exchange, coroutine) -> None:
        if self.answering is not None or self.waiting or self._next_when_writable:
            held = 0 if exchange.rejected else exchange.body_size  # a rejected body was dropped
            self.waiting.append((partial(self._run, exchange, coroutine), coroutine, held))
            self._waiting_body_bytes += held
            if not self._room_to_wait():
                self.flow.pause_reading()
            return
        self._run(exchange, coroutine)

    def _run(self, exchange: _Exchange, coroutine) -> None:
        self.answering = exchange
        task = exchange.task = self.loop.create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self._answered)

    def _answered(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        exchange = self.answering
        self.answering = None
        self.server_state.total_requests += 1
        transport = self.transport
        if exchange is None or not exchange.complete or self.closing:
            # An answer cut short (the backend failed mid-body, or the client left) must not look
            # whole: close the connection, as uvicorn does for an unfinished ASGI response.
            if not transport.is_closing():
                transport.close()
            return
        if transport.is_closing():
            return
        if self.flow.write_paused:
            # The client has not read the answers written so far: the next one waits until it
            # does (resume_writing), and nothing more is read meanwhile (_BackpressuredFlow).
            self._next_when_writable = True
            return
        self._next_request()

    def _next_request(self) -> None:
        """The answer in progress is out: start the next request waiting, or wait for one."""
        if self.waiting:
            start, _, body_size = self.waiting.popleft()
            self._waiting_body_bytes -= body_size
            start()
            if self._room_to_wait():
                self.flow.resume_reading()
            return
        self.flow.resume_reading()
        self._arm_idle_timer()
        self._unanswering_again()

    def _room_to_wait(self) -> bool:
        """Whether another request may be read while those queued wait (see _MAX_WAITING)."""
        return len(self.waiting) < _MAX_WAITING and self._waiting_body_bytes < self.limits.max_body_bytes

    def on_response_complete(self) -> None:
        # uvicorn's (an ASGI answer is out), then: nothing queued behind it, nothing in progress.
        queued = bool(self.pipeline) or bool(self.waiting) or self.answering is not None
        super().on_response_complete()
        if not queued:
            self._unanswering_again()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s, self._write_stalled)

    def _write_stalled(self) -> None:
        """The client read nothing of what was written for limits.write_timeout_s: it is dropped,
        and the request being answered for it is cancelled (its upstream connection, and the
        engine's work, with it). Aborted, not closed: a close would wait for it to read."""
        self._write_timer = None
        self.logger.debug(
            "client read nothing for %g s (limits.write_timeout_s); dropped", self.limits.write_timeout_s
        )
        self._drop_answers_in_progress()
        self.transport.abort()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self._next_when_writable and not self.transport.is_closing():
            self._next_when_writable = False
            if self.closing:  # server shutdown: what was queued behind the answer is dropped
                self.transport.close()
                return
            self._next_request()

    def _start_asgi_task(self, cycle, app) -> None:
        if self.answering is not None or self.waiting or self._next_when_writable:
            # Pipelined behind a direct-path request: its turn comes when that answer is out.
            self.waiting.append((partial(self._run_asgi, cycle, app), None, 0))
            self.flow.pause_reading()
            return
        self._run_asgi(cycle, app)

    def _run_asgi(self, cycle, app) -> None:
        # The cycle whose answer is being made (uvicorn's `cycle` is the last one parsed, which
        # may be queued behind it): one at a time on a connection.
        self._running_cycle = cycle
        super()._start_asgi_task(cycle, app)

    # ---- keep-alive: one timer per idle period, not one per request ----

    def _arm_idle_timer(self) -> None:
        self._messages_at_idle = self.messages
        if self._idle_timer is None:
            self._idle_timer = self.loop.call_later(self.timeout_keep_alive, self._idle_expired)

    def _idle_expired(self) -> None:
        self._idle_timer = None
        if self.transport.is_closing() or self.answering is not None or self.waiting:
            return  # the answer in progress re-arms the timer when it ends
        if self.cycle is not None and not self.cycle.response_complete:
            return  # uvicorn arms its own timer when its ASGI answer ends
        if self.messages != self._messages_at_idle:
            self._arm_idle_timer()  # a request came and went meanwhile: idle counts from now
            return
        self.transport.close()

    # ---- connection events ----

    def connection_lost(self, exc: Exception | None) -> None:
        self.unanswering.pop(self, None)
        answering = self.answering
        if answering is not None and not answering.complete:
            answering.client_gone = True
            if answering.task is not None:
                answering.task.cancel()
        self._forget_queued_requests()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self.answering is not None or self.waiting or self.exchange is not None:
            self.closing = True
            return
        super().shutdown()


async def _answer_error(exchange: _Exchange, error: GatewayError) -> None:
    body = gateway_error_body(error)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"x-request-id", exchange.request_id),
    ]
    await exchange.start(error.status, headers)
    await exchange.body(body, False)


def gateway_http_protocol(gateway: Gateway, endpoints: Iterable[ProxyEndpoint]) -> type[GatewayHttpProtocol]:
    """The protocol class for uvicorn's `http=` option, with the direct path to `endpoints` and the
    client limits of `gateway.config.limits`."""
    limits = gateway.config.limits
    attributes = {
        "fast_endpoints": {endpoint.path: endpoint for endpoint in endpoints},
        "gateway": gateway,
        "limits": limits,
        "max_client_connections": limits.max_client_connections or default_max_client_connections(),
        "unanswering": {},
    }
    return type("GatewayHttpProtocol", (GatewayHttpProtocol,), attributes)
