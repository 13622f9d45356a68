"""The endpoint picker's gRPC server: gRPC over HTTP/2 (RFC 9113) on the gateway's own asyncio loop,
the framing written here, HPACK decoding (RFC 7541) from `hpack`.

Why not grpc.aio: there each message crosses grpc's core threads, its completion queue and an
asyncio future before a servicer sees it. Behind the real Envoy (benchmarks/epp_floor.py, no-op
pickers answering a fixed pick), grpc.aio added +1.4-1.7 ms p50 and 1.2 ms of CPU per request, this
server +0.6-0.9 ms and 0.3 ms, a C++ grpc++ no-op +0.7-1.0 ms and 0.55 ms: docs/benchmarks.md, "The
picker on its own HTTP/2". A picker talks to few peers (Envoy's gRPC client, one connection per
worker) with small messages, so what it needs of HTTP/2 is small.

Served: gRPC's four call kinds (unary, client, server and bidirectional streaming) by path, status
and message in trailers (trailers-only for an error before any message), `grpc-timeout` deadlines,
RST_STREAM as the call's cancellation (its task is cancelled, as grpc.aio does), TLS with ALPN h2.
Bounded: connections (`max_connections`: one past it gets GOAWAY ENHANCE_YOUR_CALM; one without
its preface `handshake_timeout_s` after its accept is closed), frames (16 KiB, the default), header
lists (`MAX_HEADER_LIST_BYTES`), concurrent streams (`max_streams`: advertised to each connection,
past it refused; across connections, past it RESOURCE_EXHAUSTED), messages (`max_message_bytes`,
both ways: RESOURCE_EXHAUSTED), streams reset before their answer (`RESET_BURST`, `RESETS_PER_S`),
and the bytes a connection may hold unread (`connection_window`: flow control stops the peer). A
peer that breaks the protocol gets GOAWAY with the error and is closed. Not served: compressed
messages (UNIMPLEMENTED), server push, priorities (ignored, as RFC 9113 allows), h2c upgrade from
HTTP/1.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import struct
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, NoReturn

from google.protobuf.message import DecodeError
from hpack.exceptions import HPACKError

from router.epp.http2 import (
    ACK,
    CANCEL,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_HEADER,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_FRAME_BYTES,
    MAX_HEADER_LIST_BYTES,
    MAX_WINDOW,
    MESSAGE_PREFIX,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RESPONSE_HEADERS,
    RST_STREAM,
    SETTINGS,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    STREAM_CLOSED,
    TABLE_SIZE_ZERO,
    UINT32,
    WINDOW_UPDATE,
    HeaderBlockDecoder,
    Method,
    ProtocolBreach,
    RpcAbort,
    StatusCode,
    frame,
    literal,
    parse_timeout,
    trailers,
)
from router.errors import log_unexpected

log = logging.getLogger("kvgate.epp")

# Streams a peer may reset before any answer, at once, then per second: each costs the loop a task
# started and cancelled, so opening and resetting streams without end (the "rapid reset" attack)
# must not be free. Far above what Envoy resets for clients that leave (its usual reset, after the
# answers, is not counted); past it, GOAWAY ENHANCE_YOUR_CALM.
RESET_BURST = 2000
RESETS_PER_S = 1000.0


class ServicerContext:
    """What a servicer may ask of its call: the part of grpc.aio's context the picker's use (abort)."""

    __slots__ = ("_call",)

    def __init__(self, call: _Call) -> None:
        self._call = call

    async def abort(self, code: StatusCode, details: str = "") -> NoReturn:
        raise RpcAbort(code, details)


class _Call:
    """One stream: its requests as they arrive, its answers waiting for flow-control window."""

    __slots__ = (
        "connection",
        "deadline",
        "deadline_hit",
        "headers_sent",
        "held",
        "messages",
        "method",
        "partial",
        "peer_closed",
        "pending",
        "receive_window",
        "reset",
        "send_window",
        "stream_id",
        "task",
        "trailers",
        "waiter",
    )

    def __init__(self, connection: _Connection, stream_id: int, method: Method) -> None:
        self.connection = connection
        self.stream_id = stream_id
        self.method = method
        self.messages: deque[bytes] = deque()
        self.partial = bytearray()
        self.held = 0  # bytes of messages and the partial one, not yet read by the servicer
        self.waiter: asyncio.Future | None = None
        self.peer_closed = False
        self.reset = False
        self.receive_window = connection.server.stream_window
        self.send_window = connection.peer_initial_window
        self.pending: deque[bytes | memoryview] = deque()  # DATA not yet sent, for want of window
        self.headers_sent = False
        self.trailers: bytes | None = None  # set when the call has ended; sent after `pending`
        self.task: asyncio.Task | None = None
        self.deadline: asyncio.TimerHandle | None = None
        self.deadline_hit = False

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_message(self) -> bytes | None:
        """The next whole request message; None once the peer has half-closed the stream."""
        while not self.messages:
            if self.peer_closed:
                return None
            self.waiter = self.connection.loop.create_future()
            await self.waiter
        data = self.messages.popleft()
        self.connection.consumed(self, len(data))
        return data

    def decode(self, data: bytes) -> Any:
        try:
            return self.method.request_type.FromString(data)
        except DecodeError as exc:
            raise RpcAbort(
                StatusCode.INTERNAL, f"cannot parse the {self.method.path} request: {exc}"
            ) from None


class _Requests:
    """A call's request messages as an async iterator (what a streaming servicer reads)."""

    __slots__ = ("_call",)

    def __init__(self, call: _Call) -> None:
        self._call = call

    def __aiter__(self) -> _Requests:
        return self

    async def __anext__(self) -> Any:
        data = await self._call.next_message()
        if data is None:
            raise StopAsyncIteration
        return self._call.decode(data)


class _Connection(asyncio.Protocol):
    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()  # made by the listener's loop, for it
        self.transport: asyncio.Transport | None = None
        self.peer = "unknown"
        self.buffer = bytearray()
        self.preface_seen = False
        self.decoder = HeaderBlockDecoder(MAX_HEADER_LIST_BYTES)
        self.calls: dict[int, _Call] = {}
        self.last_stream_id = 0
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = MAX_FRAME_BYTES
        self.send_window = DEFAULT_WINDOW
        self.blocked: dict[int, _Call] = {}  # calls with answers waiting for window
        self.unacknowledged = 0  # DATA received and not yet given back to the connection window
        self.held = 0  # request bytes received and not yet read by the servicers
        self.header_block: tuple[int, int, bytearray] | None = None  # stream, flags, fragments
        self.table_size_sent = False
        self.out: list[bytes] = []
        self.flush_scheduled = False
        self.going_away = False
        self.closed = False
        self.writable: asyncio.Future | None = None  # set while the transport is paused
        self.resets_allowed = float(RESET_BURST)
        self.resets_counted_at = time.monotonic()
        self.preface_timer: asyncio.TimerHandle | None = None

    # -- the transport --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport
        peername = transport.get_extra_info("peername")
        if isinstance(peername, tuple):
            self.peer = f"{'ipv6' if ':' in peername[0] else 'ipv4'}:{peername[0]}:{peername[1]}"
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                # A dead peer (no RST, a vanished host) must not hold streams: the kernel probes.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
        server = self.server
        if len(server.connections) >= server.max_connections:
            self._refuse_connection()
            return
        settings = b"".join(
            struct.pack(">HI", key, value)
            for key, value in (
                (SETTINGS_ENABLE_PUSH, 0),
                (SETTINGS_MAX_CONCURRENT_STREAMS, server.max_streams),
                (SETTINGS_INITIAL_WINDOW_SIZE, server.stream_window),
                (SETTINGS_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST_BYTES),
            )
        )
        self._emit(frame(SETTINGS, 0, 0, settings))
        self._emit(frame(WINDOW_UPDATE, 0, 0, UINT32.pack(server.connection_window - DEFAULT_WINDOW)))
        server.connections.add(self)
        # Past the handshake's time a connection still without its preface is closed: silent ones
        # would otherwise hold places of max_connections for ever. (TLS: the server's handshake
        # timeout bounds the time before this.)
        self.preface_timer = self.loop.call_later(server.handshake_timeout_s, self._preface_overdue)

    def _refuse_connection(self) -> None:
        server = self.server
        now = time.monotonic()
        if now - server.connections_refused_logged_at >= 10.0:  # a flood must not flood the log
            server.connections_refused_logged_at = now
            log.warning(
                "gRPC connection from %s refused: %d open already (epp.max_connections)",
                self.peer,
                server.max_connections,
            )
        # A server's preface is its SETTINGS; then the reason, so that the peer's log tells it.
        reason = f"{server.max_connections} connections open already (epp.max_connections)"
        self._emit(frame(SETTINGS, 0, 0, b""))
        self._emit(frame(GOAWAY, 0, 0, UINT32.pack(0) + UINT32.pack(ENHANCE_YOUR_CALM) + reason.encode()))
        self._close_transport()

    def _preface_overdue(self) -> None:
        if not self.preface_seen and not self.closed:
            self._fail(
                PROTOCOL_ERROR,
                f"no HTTP/2 preface within {self.server.handshake_timeout_s:g} s (epp.handshake_timeout_s)",
            )

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.preface_timer is not None:
            self.preface_timer.cancel()
        self.server.connections.discard(self)
        for call in list(self.calls.values()):
            self._drop(call)
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def pause_writing(self) -> None:
        # The peer reads slower than we answer: stop reading it too, so that pings and settings
        # acknowledgements cannot pile up, and let servicers wait on `writable`.
        self.writable = self.loop.create_future()
        assert self.transport is not None
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def _emit(self, data: bytes) -> None:
        self.out.append(data)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        if self.out and not self.closed and self.transport is not None and not self.transport.is_closing():
            out, self.out = self.out, []
            self.transport.write(b"".join(out))

    # -- reading --------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        buffer = self.buffer
        buffer += data
        try:
            if not self.preface_seen:
                if len(buffer) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buffer)):
                        raise ProtocolBreach(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return
                if buffer[: len(PREFACE)] != PREFACE:
                    raise ProtocolBreach(
                        PROTOCOL_ERROR,
                        "not an HTTP/2 connection preface (gRPC needs HTTP/2 with prior knowledge)",
                    )
                del buffer[: len(PREFACE)]
                self.preface_seen = True
                if self.preface_timer is not None:
                    self.preface_timer.cancel()
            position, size = 0, len(buffer)
            while size - position >= 9:
                high, low, kind, flags, stream_id = FRAME_HEADER.unpack_from(buffer, position)
                length = (high << 8) | low
                if length > MAX_FRAME_BYTES:
                    raise ProtocolBreach(
                        FRAME_SIZE_ERROR, f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})"
                    )
                end = position + 9 + length
                if end > size:
                    break
                payload = bytes(buffer[position + 9 : end])
                position = end
                self._frame(kind, flags, stream_id & 0x7FFFFFFF, payload)
                if self.closed:
                    return
            del buffer[:position]
        except ProtocolBreach as error:
            self._fail(error.code, error.reason)
            return
        self._give_back_window()

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self.header_block is not None and kind != CONTINUATION:
            raise ProtocolBreach(PROTOCOL_ERROR, "a header block interrupted before its end")
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._continuation(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == RST_STREAM:
            if len(payload) != 4:
                raise ProtocolBreach(FRAME_SIZE_ERROR, "RST_STREAM of other than 4 bytes")
            if stream_id == 0 or stream_id > self.last_stream_id:
                raise ProtocolBreach(PROTOCOL_ERROR, "RST_STREAM on an idle stream")
            call = self.calls.get(stream_id)
            if call is not None:
                # Only a reset before any answer counts: that is the attack, a peer resetting faster
                # than the servicers work. Envoy resets every ext_proc stream after its answers
                # (END_STREAM, then RST_STREAM), at whatever rate its requests come.
                if not call.headers_sent:
                    self._count_reset()
                self._drop(call)
        elif kind == SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == PING:
            if len(payload) != 8 or stream_id != 0:
                raise ProtocolBreach(FRAME_SIZE_ERROR, "a PING of other than 8 bytes, or on a stream")
            if not flags & ACK:
                self._emit(frame(PING, ACK, 0, payload))
        elif kind == GOAWAY:
            self.going_away = True  # the peer opens no more streams; those open go on
        elif kind == PUSH_PROMISE:
            raise ProtocolBreach(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        elif kind == PRIORITY and len(payload) != 5:
            raise ProtocolBreach(FRAME_SIZE_ERROR, "PRIORITY of other than 5 bytes")
        # Any other type is an extension this server does not know: ignored (RFC 9113 section 4.1).

    def _count_reset(self) -> None:
        now = time.monotonic()
        elapsed, self.resets_counted_at = now - self.resets_counted_at, now
        self.resets_allowed = min(float(RESET_BURST), self.resets_allowed + elapsed * RESETS_PER_S) - 1
        if self.resets_allowed < 0:
            reason = f"streams reset faster than {RESETS_PER_S:g} a second (after {RESET_BURST})"
            raise ProtocolBreach(ENHANCE_YOUR_CALM, reason)

    @staticmethod
    def _unpad(flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise ProtocolBreach(PROTOCOL_ERROR, "padding as long as the frame")
        return payload[1 : len(payload) - payload[0]]

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ProtocolBreach(PROTOCOL_ERROR, "DATA on stream 0")
        self.unacknowledged += len(payload)  # padding counts against the window too
        call = self.calls.get(stream_id)
        if call is None:
            if stream_id > self.last_stream_id:
                raise ProtocolBreach(PROTOCOL_ERROR, "DATA on an idle stream")
            return  # a stream already ended or reset: its late data is dropped
        if call.peer_closed:
            self._reset(call, STREAM_CLOSED)
            return
        call.receive_window -= len(payload)
        if call.receive_window < 0:
            self._reset(call, FLOW_CONTROL_ERROR)
            return
        data = self._unpad(flags, payload)
        if data:
            self._receive(call, data)
        if call.stream_id not in self.calls:
            return  # refused on what it sent
        if flags & END_STREAM:
            call.peer_closed = True
            call.wake()
        else:
            self._replenish(call)

    def _receive(self, call: _Call, data: bytes) -> None:
        """Cut a stream's DATA into gRPC messages (5-byte prefix: compressed flag, length)."""
        partial = call.partial
        if not partial and len(data) >= 5:
            # The common case, one whole message in one frame: no copy into the buffer.
            compressed, length = MESSAGE_PREFIX.unpack_from(data)
            if len(data) == 5 + length and not compressed and length <= self.server.max_message_bytes:
                call.messages.append(data[5:])
                self._hold(call, length)
                call.wake()
                return
        # What is held counts every byte a stream keeps, whole messages and the partial one.
        partial += data
        self._hold(call, len(data))
        while len(partial) >= 5:
            compressed, length = MESSAGE_PREFIX.unpack_from(partial)
            if compressed:
                self._refuse(call, StatusCode.UNIMPLEMENTED, "compressed messages are not supported")
                return
            if length > self.server.max_message_bytes:
                message = (
                    f"a request message of {length} bytes, over the limit of {self.server.max_message_bytes}"
                )
                self._refuse(call, StatusCode.RESOURCE_EXHAUSTED, message)
                return
            if len(partial) < 5 + length:
                break
            call.messages.append(bytes(partial[5 : 5 + length]))
            self._hold(call, -5)
            del partial[: 5 + length]
            call.wake()

    def _hold(self, call: _Call, size: int) -> None:
        call.held += size
        self.held += size

    def consumed(self, call: _Call, size: int) -> None:
        """A servicer read a message: its bytes are no longer held, and the windows may come back."""
        self._hold(call, -size)
        if call.stream_id in self.calls and not call.peer_closed:
            self._replenish(call)
        self._give_back_window()

    def _replenish(self, call: _Call) -> None:
        # A stream's window comes back once half spent, while what it holds unread is under one
        # window: a message longer than what is left gets through, a stream that is not read stalls.
        window = self.server.stream_window
        if call.receive_window < window // 2 and call.held < window:
            self._emit(frame(WINDOW_UPDATE, 0, call.stream_id, UINT32.pack(window - call.receive_window)))
            call.receive_window = window

    def _give_back_window(self) -> None:
        # The connection window comes back as data arrives while what is held unread stays under it:
        # past that the peer stalls until the servicers read.
        window = self.server.connection_window
        if self.unacknowledged >= window // 4 and self.held < window // 2 and not self.closed:
            self._emit(frame(WINDOW_UPDATE, 0, 0, UINT32.pack(self.unacknowledged)))
            self.unacknowledged = 0

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0 or stream_id % 2 == 0:
            raise ProtocolBreach(PROTOCOL_ERROR, f"HEADERS on stream {stream_id} (a client's are odd)")
        payload = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if flags & END_HEADERS:
            self._header_block(flags, stream_id, payload)
        else:
            self.header_block = (stream_id, flags, bytearray(payload))

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self.header_block is None or self.header_block[0] != stream_id:
            raise ProtocolBreach(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        block = self.header_block[2]
        block += payload
        if len(block) > MAX_HEADER_LIST_BYTES:
            raise ProtocolBreach(ENHANCE_YOUR_CALM, f"a header block over {MAX_HEADER_LIST_BYTES} bytes")
        if flags & END_HEADERS:
            first_flags = self.header_block[1]
            self.header_block = None
            self._header_block(first_flags, stream_id, bytes(block))

    def _header_block(self, flags: int, stream_id: int, block: bytes) -> None:
        try:
            # Decoded whatever becomes of the stream: the table is the connection's.
            headers = self.decoder.decode(block)
        except HPACKError as exc:
            raise ProtocolBreach(COMPRESSION_ERROR, f"cannot decode a header block: {exc}") from None
        call = self.calls.get(stream_id)
        if call is not None:  # trailers: a gRPC client sends none but may end its stream on them
            if not flags & END_STREAM:
                self._reset(call, PROTOCOL_ERROR)
                return
            call.peer_closed = True
            call.wake()
            return
        if stream_id <= self.last_stream_id:
            raise ProtocolBreach(STREAM_CLOSED, f"HEADERS on stream {stream_id}, already closed")
        self.last_stream_id = stream_id
        if self.going_away or self.server.stopping or len(self.calls) >= self.server.max_streams:
            self._emit(frame(RST_STREAM, 0, stream_id, UINT32.pack(REFUSED_STREAM)))
            return
        if self.server.open_calls >= self.server.max_streams:
            # The limit is the server's too (several Envoy workers, several connections).
            details = f"{self.server.max_streams} calls open already (epp.max_streams)"
            block = RESPONSE_HEADERS + trailers(StatusCode.RESOURCE_EXHAUSTED, details)
            self._answer_without_call(stream_id, block, bool(flags & END_STREAM))
            return
        self._open(stream_id, headers, bool(flags & END_STREAM))

    def _open(self, stream_id: int, headers: list, ended: bool) -> None:
        fields: dict[bytes, bytes] = {}
        for name, value in headers:
            fields.setdefault(name, value)
        if fields.get(b":method") != b"POST":
            self._answer_without_call(stream_id, literal(b":status", b"405"), ended)
            return
        if not fields.get(b"content-type", b"").startswith(b"application/grpc"):
            self._answer_without_call(stream_id, literal(b":status", b"415"), ended)
            return
        path = fields.get(b":path", b"").decode("latin-1")
        method = self.server.methods.get(path)
        if method is None:
            block = RESPONSE_HEADERS + trailers(StatusCode.UNIMPLEMENTED, f"no method {path} here")
            self._answer_without_call(stream_id, block, ended)
            return
        encoding = fields.get(b"grpc-encoding", b"identity")
        call = _Call(self, stream_id, method)
        call.peer_closed = ended
        self.calls[stream_id] = call
        self.server.open_calls += 1
        if encoding != b"identity":
            self._refuse(
                call, StatusCode.UNIMPLEMENTED, f"grpc-encoding {encoding.decode('latin-1')} is not supported"
            )
            return
        loop = self.loop
        timeout = fields.get(b"grpc-timeout")
        if timeout is not None:
            seconds = parse_timeout(timeout)
            if seconds is not None:
                call.deadline = loop.call_later(seconds, self._deadline, call)
        call.task = loop.create_task(self.server.run(call))

    def _deadline(self, call: _Call) -> None:
        call.deadline_hit = True
        if call.task is not None:
            call.task.cancel()

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise ProtocolBreach(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ProtocolBreach(FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a payload")
            return
        if len(payload) % 6:
            raise ProtocolBreach(FRAME_SIZE_ERROR, "SETTINGS not a multiple of 6 bytes")
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolBreach(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE over 2^31-1")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for call in self.calls.values():
                    call.send_window += delta
                    if delta > 0:
                        self._send_pending(call)
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not MAX_FRAME_BYTES <= value <= 16_777_215:
                    raise ProtocolBreach(PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self.peer_max_frame = value
            elif key == SETTINGS_ENABLE_PUSH and value > 1:
                raise ProtocolBreach(PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH other than 0 or 1")
            # HEADER_TABLE_SIZE: our table is empty and stays so. The rest bind the client side.
        self._emit(frame(SETTINGS, ACK, 0))

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolBreach(FRAME_SIZE_ERROR, "WINDOW_UPDATE of other than 4 bytes")
        increment = UINT32.unpack(payload)[0] & 0x7FFFFFFF
        if stream_id == 0:
            if increment == 0 or self.send_window + increment > MAX_WINDOW:
                raise ProtocolBreach(FLOW_CONTROL_ERROR, "a connection WINDOW_UPDATE of 0 or past 2^31-1")
            self.send_window += increment
            for call in list(self.blocked.values()):
                self._send_pending(call)
                if self.send_window <= 0:
                    break
            return
        call = self.calls.get(stream_id)
        if call is None:
            return
        if increment == 0 or call.send_window + increment > MAX_WINDOW:
            self._reset(call, FLOW_CONTROL_ERROR if increment else PROTOCOL_ERROR)
            return
        call.send_window += increment
        self._send_pending(call)

    # -- writing --------------------------------------------------------------------------------
    def _header_frame(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        if not self.table_size_sent:
            block = TABLE_SIZE_ZERO + block
            self.table_size_sent = True
        flags = END_HEADERS | (END_STREAM if end_stream else 0)
        if len(block) <= self.peer_max_frame:
            self._emit(frame(HEADERS, flags, stream_id, block))
            return
        limit = self.peer_max_frame
        self._emit(frame(HEADERS, flags & ~END_HEADERS, stream_id, block[:limit]))
        for start in range(limit, len(block), limit):
            last = start + limit >= len(block)
            self._emit(
                frame(CONTINUATION, END_HEADERS if last else 0, stream_id, block[start : start + limit])
            )

    def send_message(self, call: _Call, payload: bytes) -> None:
        if call.trailers is not None or call.stream_id not in self.calls:
            return
        if not call.headers_sent:
            call.headers_sent = True
            self._header_frame(call.stream_id, RESPONSE_HEADERS, False)
        call.pending.append(MESSAGE_PREFIX.pack(0, len(payload)) + payload)
        self._send_pending(call)

    def _send_pending(self, call: _Call) -> None:
        pending = call.pending
        while pending:
            room = min(call.send_window, self.send_window, self.peer_max_frame)
            if room <= 0:
                self.blocked[call.stream_id] = call
                return
            data = pending[0]
            if len(data) <= room:
                pending.popleft()
            else:
                # A view: a long answer is cut frame by frame without copying what is left each time.
                data = memoryview(data)
                pending[0] = data[room:]
                data = data[:room]
            call.send_window -= len(data)
            self.send_window -= len(data)
            self._emit(frame(DATA, 0, call.stream_id, data))
        self.blocked.pop(call.stream_id, None)
        if call.trailers is not None:
            self._header_frame(call.stream_id, call.trailers, True)
            call.trailers = b""  # sent
            if not call.peer_closed:
                # Done before the client: tell it to stop sending (RFC 9113 section 8.1).
                self._emit(frame(RST_STREAM, 0, call.stream_id, UINT32.pack(NO_ERROR)))
            self._close(call)

    def finish(self, call: _Call, code: StatusCode, details: str) -> None:
        if call.stream_id not in self.calls or call.trailers is not None:
            return
        if call.headers_sent:
            call.trailers = trailers(code, details)
        else:
            call.headers_sent = True
            call.trailers = RESPONSE_HEADERS + trailers(code, details)  # trailers-only
        self._send_pending(call)

    def _close(self, call: _Call) -> None:
        if self.calls.pop(call.stream_id, None) is not None:
            self.server.open_calls -= 1
        self.blocked.pop(call.stream_id, None)
        self.held -= call.held
        call.held = 0
        call.partial.clear()
        call.messages.clear()
        if call.deadline is not None:
            call.deadline.cancel()
        if self.going_away and not self.calls:
            self._close_transport()

    def _drop(self, call: _Call) -> None:
        """The stream was reset (or the connection lost): the call's task is cancelled."""
        call.reset = True
        self._close(call)
        if call.task is not None and not call.task.done():
            call.task.cancel()
        call.wake()

    def _reset(self, call: _Call, code: int) -> None:
        self._emit(frame(RST_STREAM, 0, call.stream_id, UINT32.pack(code)))
        self._drop(call)

    def _refuse(self, call: _Call, code: StatusCode, details: str) -> None:
        """End a call the peer broke (message too large, compressed): status, then RST_STREAM."""
        self._hold(call, -len(call.partial))
        call.partial.clear()
        call.pending.clear()
        self.finish(call, code, details)
        if call.stream_id in self.calls:  # trailers waiting for window: reset now instead
            self._reset(call, CANCEL)
        else:
            self._drop(call)  # closed with its trailers: only its task is left to cancel

    def _answer_without_call(self, stream_id: int, block: bytes, ended: bool) -> None:
        """A stream refused before any servicer: one header block ends it (and the client's half)."""
        self._header_frame(stream_id, block, True)
        if not ended:
            self._emit(frame(RST_STREAM, 0, stream_id, UINT32.pack(NO_ERROR)))

    def go_away(self) -> None:
        """Graceful: no new streams; the connection closes once those open have ended."""
        if self.closed or self.going_away:
            return
        self.going_away = True
        self._emit(frame(GOAWAY, 0, 0, UINT32.pack(self.last_stream_id) + UINT32.pack(NO_ERROR)))
        if not self.calls:
            self._close_transport()

    def _fail(self, code: int, reason: str) -> None:
        log.warning("gRPC connection from %s broke HTTP/2 (%s): closed", self.peer, reason)
        self._emit(
            frame(GOAWAY, 0, 0, UINT32.pack(self.last_stream_id) + UINT32.pack(code) + reason.encode()[:256])
        )
        for call in list(self.calls.values()):
            self._drop(call)
        self._close_transport()

    def _close_transport(self) -> None:
        self._flush()
        if self.transport is not None:
            self.transport.close()
        self.closed = True


class GrpcServer:
    """Serves `methods` on one listening socket; `start` binds, `stop` drains gracefully."""

    def __init__(
        self,
        methods: Iterable[Method],
        *,
        max_streams: int,
        max_message_bytes: int,
        max_connections: int = 1024,
        handshake_timeout_s: float = 10.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.methods = {method.path: method for method in methods}
        self.max_streams = max_streams
        self.max_connections = max_connections
        self.handshake_timeout_s = handshake_timeout_s
        self.connections_refused_logged_at = -1e9
        self.max_message_bytes = max_message_bytes
        # A whole message fits a stream's window: no window updates inside one message.
        self.stream_window = min(max_message_bytes + 5 + MAX_FRAME_BYTES, MAX_WINDOW)
        self.connection_window = min(max(4 * self.stream_window, 64 * 1024 * 1024), MAX_WINDOW)
        self.ssl_context = ssl_context
        self.connections: set[_Connection] = set()
        self.open_calls = 0  # across connections, bounded by max_streams
        self.stopping = False
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen; the port bound (the one asked, or the kernel's choice for 0)."""
        if self.ssl_context is not None:
            self.ssl_context.set_alpn_protocols(["h2"])
        loop = asyncio.get_running_loop()
        tls = {} if self.ssl_context is None else {"ssl_handshake_timeout": self.handshake_timeout_s}
        self._server = await loop.create_server(
            lambda: _Connection(self),
            host,
            port,
            ssl=self.ssl_context,
            reuse_address=True,
            backlog=1024,
            **tls,
        )
        return self._server.sockets[0].getsockname()[1]

    async def run(self, call: _Call) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        connection, method = call.connection, call.method
        context = ServicerContext(call)
        try:
            code, details = StatusCode.OK, ""
            try:
                if method.kind in ("unary_unary", "unary_stream"):
                    request = await self._single_request(call)
                    if method.kind == "unary_unary":
                        await self._send(call, await method.handler(request, context))
                    else:
                        await self._send_all(call, method.handler(request, context))
                elif method.kind == "stream_unary":
                    await self._send(call, await method.handler(_Requests(call), context))
                else:
                    await self._send_all(call, method.handler(_Requests(call), context))
            except RpcAbort as abort:
                code, details = abort.code, abort.details
            except asyncio.CancelledError:
                if not call.deadline_hit or call.reset:
                    return  # reset by the peer, the connection lost or the server stopped: no answer
                code, details = StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
            except Exception as exc:
                log_unexpected(log, exc, "gRPC method %s failed", method.path)
                code, details = StatusCode.UNKNOWN, f"unexpected {type(exc).__name__} in {method.path}"
            connection.finish(call, code, details)
        finally:
            self._tasks.discard(task)

    @staticmethod
    async def _single_request(call: _Call) -> Any:
        data = await call.next_message()
        if data is None:
            raise RpcAbort(StatusCode.INTERNAL, f"{call.method.path} takes one request message; none came")
        return call.decode(data)

    async def _send_all(self, call: _Call, responses: Any) -> None:
        # Closed here, not when collected: the servicer's `finally` runs as the call ends.
        async with contextlib.aclosing(responses):
            async for response in responses:
                await self._send(call, response)

    async def _send(self, call: _Call, response: Any) -> None:
        payload = response.SerializeToString()
        if len(payload) > self.max_message_bytes:
            message = f"an answer of {len(payload)} bytes, over the limit of {self.max_message_bytes}"
            raise RpcAbort(StatusCode.RESOURCE_EXHAUSTED, message)
        connection = call.connection
        connection.send_message(call, payload)
        writable = connection.writable
        if writable is not None:
            await writable

    async def stop(self, grace_s: float) -> None:
        """Refuse new streams (GOAWAY), give those open `grace_s` to end, then cancel them."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.go_away()
        deadline = time.monotonic() + grace_s
        while self._tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for task in list(self._tasks):
            task.cancel()
        for connection in list(self.connections):
            connection._close_transport()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
